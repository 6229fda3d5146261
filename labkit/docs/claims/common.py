"""What the four systems' rows share beyond the rule: the published setups they are compared at (published
values, typed as published) and the figures of ours read from committed runs (the run `docs/runs.toml` names, its
`ok` rows, a figure across processes, one measurement, a figure over trace windows)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ...results import REPO, load_run
from ...stats import bootstrap
from ..runs import RUNS
from .rule import Figure

# ---- the published setups (published values, typed as published) --------------------------------------------
BOX_GPU, BOX_GPUS = "rtx3090", 3          # sparse offload: 3× RTX 3090 (labkit/data/gpus.toml gives its rates)
PUBLISHED_SHAPE = "qwen3.8-flash-next"     # sparse offload: the published model's shape (its public config)
PUBLISHED_CONTEXT = 1 << 20               # sparse offload: decode at 1M tokens of context
PUBLISHED_TPOT_MS = 30.0                  # FlashOffloading: the TPOT limit of its 1.91×
PUBLISHED_UNIT_BYTES = 8192               # PulseInfer: per-head transfers of ~8 KB
PUBLISHED_XFER_CONTEXT = 32768            # cross-model transfer: TTFT at 32K
PUBLISHED_XFER_CONCURRENCY = 8            # ... and per-request latency at concurrency 8


# ---- figures from committed runs ----------------------------------------------------------------------------
def named_run(key: str) -> str:
    """The run docs/runs.toml names under `key` ("" when none is committed yet)."""
    v = RUNS.get(key, "")
    return v if isinstance(v, str) and v and (REPO / v / "manifest.json").is_file() else ""


def ok_metrics(run: str) -> pd.DataFrame:
    """A committed run's metrics rows, only those with `status == "ok"` where the run has a status."""
    m = load_run(REPO / run).metrics
    return m[m["status"] == "ok"] if "status" in m else m


def across(values: list[float], runs: list[str], what: str, unit: str = "×", differs: str = "") -> Figure:
    """One value per process -> our figure: the median, with the min–max across processes as its spread."""
    s = pd.Series(values, dtype=float)
    how = f"min–max across {len(s)} processes" if len(s) > 1 else "one process"
    return Figure(float(s.median()), float(s.min()), float(s.max()), how, what, tuple(runs), differs, unit)


def one(v: float, what: str, runs, unit: str = "×", differs: str = "", how: str = "one measurement") -> Figure:
    """A figure measured (or computed) once: no spread."""
    return Figure(float(v), float(v), float(v), how, what, tuple(runs), differs, unit)


def _best_of(values: pd.Series, side: int) -> float:
    return float(values.max() if side > 0 else values.min())


def window_figure(ratios: pd.Series, what: str, runs, up_to: bool, side: int, differs: str = "",
                  noise: float | None = None) -> Figure | None:
    """Per-window ratios -> our figure: for an "up to" claim the best window with the min–max over windows (and
    `noise`, the window-to-window noise repeats measured, where there are repeats); otherwise the median with its
    95% bootstrap interval over windows. None when no window has both arms."""
    r = ratios.dropna().astype(float)
    if r.empty:
        return None
    iv = bootstrap(r, np.median)
    if up_to:
        return Figure(_best_of(r, side), float(r.min()), float(r.max()),
                      f"best of {len(r)} windows; median {iv.text(2)}"
                      + (f"; repeat noise ±{noise:.0%}" if noise is not None else ""), what, tuple(runs), differs,
                      median=(iv.value, iv.lo, iv.hi), noise=noise)
    return Figure(iv.value, iv.lo, iv.hi, f"median, 95% interval over {len(r)} windows", what, tuple(runs), differs)
