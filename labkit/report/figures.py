"""What every run's figures draw with: a colour per strategy, the plotly template, logarithmic axes labelled once,
error bars from a step's spread, a figure that says why it has nothing to draw (and `show`, which prints that line
instead of empty axes), the telemetry of a run. An experiment's own figures are `labkit/experiments/NAME/figures.py`
(decode's speed plots with their link bound, the probe's bars...), drawn with these."""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .units import tokens_label
from ..engine.transfer import STRATEGIES


class _Colors:
    """A colour per strategy, by its place in the strategy registry (the baseline first, a newly registered one
    gets the next), so no figure names a strategy; the probe's reference paths have their own."""
    PALETTE = ("#1f77b4", "#d62728", "#ff7f0e", "#2ca02c", "#9467bd", "#e377c2", "#bcbd22", "#aec7e8", "#ffbb78",
               "#98df8a", "#ff9896", "#c5b0d5")
    PROBE = {"contiguous": "#7f7f7f", "pageable": "#8c564b", "hbm_gather": "#17becf"}

    def get(self, name, default=None):
        if name in self.PROBE:
            return self.PROBE[name]
        names = list(STRATEGIES)
        return self.PALETTE[names.index(name) % len(self.PALETTE)] if name in names else default


COLORS = _Colors()
TEMPLATE = "plotly_white"


def ctx_ticks(values) -> dict:
    """Ticks of a context axis at the values drawn, labelled as sizes are written (8K, 1M)."""
    vals = sorted(set(int(v) for v in values))
    return {"tickvals": vals, "ticktext": [tokens_label(v) for v in vals]}


def log_ticks(lo: float, hi: float) -> dict:
    """Ticks of a logarithmic axis at 1, 2, 5 x 10^k inside [lo, hi] (only powers of ten when the range
    spans more than three decades), labelled once each: plotly's own minor labels overlap on short axes."""
    lo, hi = float(lo), float(hi)
    if not (lo > 0 and hi > 0) or lo != lo or hi != hi:
        return {}
    k0, k1 = int(np.floor(np.log10(lo))), int(np.ceil(np.log10(hi)))
    steps = (1,) if k1 - k0 > 3 else (1, 2, 5)
    vals = [m * 10.0 ** k for k in range(k0, k1 + 1) for m in steps if lo <= m * 10.0 ** k <= hi]
    if len(vals) < 2:
        vals = [m * 10.0 ** k for k in range(k0, k1 + 1) for m in (1, 1.5, 2, 3, 5, 7) if lo <= m * 10.0 ** k <= hi]
    if len(vals) < 2:     # less than a factor of ~1.5: evenly spaced round values
        step = 10.0 ** np.floor(np.log10((hi - lo) / 2))
        vals = list(np.arange(np.ceil(lo / step) * step, hi + step / 2, step))[:8]
    return {"tickvals": vals, "ticktext": [f"{v:,.0f}" if v >= 1 else f"{v:g}" for v in vals]}


def log_axis(values, pad: float = 1.3) -> dict:
    """A log axis fitted to `values` (padded by `pad` either side) with `log_ticks`."""
    v = pd.to_numeric(pd.Series(list(values)), errors="coerce")
    v = v[v > 0]
    if v.empty:
        return {"type": "log"}
    lo, hi = float(v.min()) / pad, float(v.max()) * pad
    return {"type": "log", "range": [np.log10(lo), np.log10(hi)], **log_ticks(lo, hi)}


def step_error_bars(d: pd.DataFrame, col: str = "tok_s") -> dict:
    """Error bars from the step-time spread (min/max), mapped onto tok/s."""
    if col == "tok_s":
        hi = d["concurrency"] / (d["step_ms_min"] / 1e3) - d["tok_s"]
        lo = d["tok_s"] - d["concurrency"] / (d["step_ms_max"] / 1e3)
    else:
        hi, lo = d["step_ms_max"] - d[col], d[col] - d["step_ms_min"]
    return {"type": "data", "symmetric": False, "array": hi.clip(lower=0), "arrayminus": lo.clip(lower=0), "thickness": 1}


def empty_figure(title: str, why: str) -> go.Figure:
    """A figure with nothing to draw: `show` prints its one line of text instead of empty axes."""
    fig = go.Figure()
    fig.update_layout(title=title, template=TEMPLATE, meta={"labkit_empty": why},
                      annotations=[{"text": why, "showarrow": False, "x": 0.5, "y": 0.5, "xref": "paper", "yref": "paper"}],
                      xaxis={"visible": False}, yaxis={"visible": False})
    return fig


def empty_reason(fig: go.Figure | None) -> str | None:
    """Why a figure has nothing to draw (None: it has data)."""
    if fig is None:
        return "nothing to draw"
    meta = fig.layout.meta
    return meta.get("labkit_empty") if isinstance(meta, dict) else None


def show(fig: go.Figure | None) -> None:
    """A report cell's figure: the chart when it has data, else one line of text saying why not (no empty
    axes under a sentence that says there is no data)."""
    # IPython is there only inside a notebook (the optional `lab` extra)
    from IPython.display import Markdown, display
    if empty_reason(fig) is None:
        fig.show()
    else:
        display(Markdown(f"_{empty_text(fig)}_"))


def empty_text(fig: go.Figure | None) -> str:
    """The sentence that stands for a figure with nothing to draw: its title and why."""
    title = fig.layout.title.text if fig is not None and fig.layout.title.text else ""
    return f"{title + ': ' if title else ''}{empty_reason(fig)}."


def fmt_tok_s(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def telemetry_timeline(t: pd.DataFrame, m: pd.DataFrame | None = None, max_points: int = 3000) -> go.Figure:
    if t is None or t.empty or "pcie_rx_gbps" not in t:
        return empty_figure("Telemetry", "no NVML telemetry in this run (NVML missing or CPU run)")
    t = t.sort_values("timestamp")
    if len(t) > max_points:
        t = t.iloc[:: len(t) // max_points + 1]
    x = pd.to_datetime(t["timestamp"], unit="s")
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, subplot_titles=["PCIe GB/s", "GPU utilization %", "power W / memory GiB"])
    fig.add_trace(go.Scattergl(x=x, y=t["pcie_rx_gbps"].astype("float32"), name="PCIe RX (to GPU)", mode="lines"), 1, 1)
    fig.add_trace(go.Scattergl(x=x, y=t["pcie_tx_gbps"].astype("float32"), name="PCIe TX", mode="lines"), 1, 1)
    if "util_gpu" in t:
        fig.add_trace(go.Scattergl(x=x, y=t["util_gpu"].astype("float32"), name="util", mode="lines"), 2, 1)
    if "power_w" in t:
        fig.add_trace(go.Scattergl(x=x, y=t["power_w"].astype("float32"), name="power W", mode="lines"), 3, 1)
    if "mem_used_bytes" in t:
        fig.add_trace(go.Scattergl(x=x, y=(t["mem_used_bytes"] / 2**30).astype("float32"), name="GPU memory GiB", mode="lines"), 3, 1)
    fig.update_layout(title="Telemetry over the run (NVML, unwrapped PCIe byte counters)", template=TEMPLATE, height=620)
    return fig
