"""Do the published figures hold? One row per published headline of the four systems, each tested from
committed runs and given a verdict by a declared rule.

    labkit docs --write     # writes docs/claims.md (block `claims`) and the README's block `claims-summary`
    card()                  # the rows, as `Claim` objects (the notebook notebooks/claims.ipynb draws them)

Each row holds the published figure and its setup and up to three of ours:

- **in the published terms**: the same quantity with the same baseline and the same ratio definition, as close
  to the published setup as one H200 allows (what still differs is said);
- **against our strongest baseline**: what the lab measures today against the best it has (e.g. PulseInfer's
  switching against our own offload lane, which already coalesces its transfers);
- **the cost model's figure for the published hardware** (`labkit predict RUN --gpu rtx3090 --gpus 3`) where
  the published figure is an absolute one on hardware we do not have.

The verdict (`judge`) uses the first of these that exists: the published-terms figure, then the cost model's,
then a stand-in (a figure of ours in other terms, named in the row); a verdict from the last two is marked
provisional, and the row names the run that would settle it. Rows with none of the three cannot be tested here.

Runs that settle rows are picked up from `docs/runs.toml` (`[runs]`) by name, with no code change:

- `pulse_ladder_decode`, else `pulse_ladder`: PulseInfer's ladder on the trace windows (the first on a decode
  instance, `disaggregated: true`, the published regime); metrics rows with `rung`, `window`,
  `output_throughput` and `tpot_ms_p99` (`status == "ok"`). Rungs in order: `per_head` (per-head 8 KiB units, one
  copy each, no switching: the published baseline), `coalesced`, `retrieval_head`, `switching`, `adaptive` (full
  PulseInfer), and the arm `no_offload` (resident only, under the same device-memory cap). Integer rungs are read
  in their numeric order (lowest = baseline, highest = full).
- `link_rate`: decode at several host-link rates; rows with `link_gbps`, `predicted_step_ms` and
  `step_ms_median`. When every point is within `LINK_CHECK_TOLERANCE` at >= `LINK_CHECK_RATES` rates, the cost
  model's transfer term counts as checked and its worst error there is the spread of the 3x RTX 3090 rows.
- `prefill_throughput`: FlashOffloading's prefill throughput; rows with `config` in none / prefill / both and
  `prompts_per_s` (optional `prompts_per_s_min` / `_max`).
- `xfer_ttft_32k`: cross-model TTFT at 32K; rows as `labkit run crossmodel` writes them (`kind == "ttft"`, `strategy`
  large_prefill / mapped, `context_len`, `concurrency`, `ttft_ms_median/min/max`, `speedup`); rows at concurrency
  8 settle the concurrency row too.
- `xfer_modern_prose`: cross-model quality on modern English prose (`labkit run crossmodel` with `pydoc` among its
  corpora; its `quality_summary` table); the perplexity row shows it beside Shakespeare's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ..costmodel import gpu, gpu_for_name, predict_prefill, predict_table
from ..stats.intervals import text as interval_text
from ..report import summary as S
from ..report.units import tokens_label as _ctx
from ..results import REPO, load_run
from ..shapes import PRESETS, metrics_shape
from ..stats import bootstrap
from ..experiments.capacity.tables import capacity_rows
from ..experiments.decode.tables import decode_ratio_rows
from ..experiments.prefill.tables import prefill_rows
from .runs import RUNS

# ---- the verdict rule: every threshold in one place, written before the data ----------------------------------
TOLERANCE = 0.10          # ours within ±10% of the published figure: holds
APPROX_TOLERANCE = 0.20   # the same for a figure published as "~x" (the publication rounds it)
EFFECT_SHARE = 0.5        # ... but never more than this share of the effect the claim reports (its distance to
                          # the figure it contrasts with), so a band cannot reach what the claim sets itself against
PART_FACTOR = 2.0         # an absolute figure with nothing to contrast (tok/s, GB/s) within this factor: holds in part
NO_EFFECT = 1.0           # a ratio against a baseline: 1 means no effect (the contrast of every ratio)
MIN_EFFECT = 0.02         # ... and within ±2% of it is no effect either (below what two repeats can tell apart)
LINK_CHECK_TOLERANCE = 0.10   # predicted vs measured step time at every link rate, for the model to count as checked
LINK_CHECK_RATES = 3

HOLDS, PART, FAILS = "holds", "holds in part", "does not hold"
CONSTRUCTION, OUT_OF_REGIME, UNTESTED = "by construction", "not tested in the published regime", "not tested"
VERDICTS = (HOLDS, PART, FAILS, CONSTRUCTION, OUT_OF_REGIME, UNTESTED)
COLOURS = {HOLDS: "#2ca02c", PART: "#ff9f1c", FAILS: "#d62728", CONSTRUCTION: "#1f77b4", OUT_OF_REGIME: "#9467bd",
           UNTESTED: "#8c8c8c"}
SYSTEMS = {"sparse": "Sparse offload of Qwen3.8-Flash-Next", "flash": "FlashOffloading", "pulse": "PulseInfer",
           "xfer": "Cross-model KV transfer"}

# ---- the published setups (published values, typed as published) --------------------------------------------
BOX_GPU, BOX_GPUS = "rtx3090", 3          # sparse offload: 3× RTX 3090 (labkit/data/gpus.toml gives its rates)
PUBLISHED_CONTEXT = 1 << 20               # sparse offload: decode at 1M tokens of context
PUBLISHED_TPOT_MS = 30.0                  # FlashOffloading: the TPOT limit of its 1.91×
PUBLISHED_UNIT_BYTES = 8192               # PulseInfer: per-head transfers of ~8 KB
PUBLISHED_XFER_CONTEXT = 32768            # cross-model transfer: TTFT at 32K
PUBLISHED_XFER_CONCURRENCY = 8            # ... and per-request latency at concurrency 8


def rule_text() -> str:
    """The verdict rule in words, from the constants above: docs/claims.md renders it (block `claims-rule`)."""
    return (
        "Every row goes through one function, `labkit.docs.claims.decide`, in this order:\n\n"
        f"1. **{CONSTRUCTION}** — the figure follows from the model's shape (a byte count, a rate implied by two "
        "published figures): the shape's arithmetic is the row's figure. It agrees with the published figure within "
        f"the tolerance below: *{CONSTRUCTION}* (true of any implementation with that shape, so not a finding); "
        "otherwise the comparison below decides.\n"
        f"2. **{OUT_OF_REGIME}** — the lab has a figure, but its point lies outside the regime the published figure "
        "was measured in, read from the run itself (the lab's own model predicts no effect at that point, the limit "
        "the figure is defined by never binds, the setup the figure is about is absent). Such a point never makes a "
        "row *does not hold*; the row names the run that would reach the regime.\n"
        "3. The deciding figure is the first of: ours in the published terms, the cost model's figure for the "
        "published hardware, a stand-in (the last two mark the verdict *provisional*). It is compared with the "
        "published figure:\n"
        f"   - **tolerance**: ±{TOLERANCE:.0%} of the published figure, ±{APPROX_TOLERANCE:.0%} for one published as "
        f"\"~x\"; either way at most {EFFECT_SHARE:.0%} of the effect the claim reports (the distance from the "
        "published figure to the one it contrasts with: no effect (1×) for a ratio, the other side for \"~80 → ~60\"), "
        "so the band never reaches what the claim sets itself against.\n"
        "   - **\"up to x\"** is read as a best case: our best unit (window, repeat) against the published best, with "
        "the median over units and its 95% interval printed beside it. It holds when our best reaches the published "
        "figure less the tolerance (or goes past it).\n"
        "   - any other figure **holds** when the published figure lies inside our spread or within the tolerance of "
        "our value, and our spread clears the contrast (a ratio's spread must not reach no effect ± "
        f"{MIN_EFFECT:.0%}).\n"
        "   - **holds in part**: not that, but the direction holds: our spread (for \"up to\", our best) lies on the "
        f"published side of the contrast, beyond ±{MIN_EFFECT:.0%} of it; for an absolute figure with no contrast, "
        f"within {PART_FACTOR:g}× either way.\n"
        "   - a figure published over a range (a context range, \"then flat\") is judged at every point of the range "
        "the run covers: *holds* at every point, *holds in part* at some, *does not hold* at none.\n"
        "   - otherwise **does not hold**.\n"
        f"4. **{UNTESTED}** — no figure of ours measures it; the row says what would.")


@dataclass(frozen=True)
class Published:
    value: float
    text: str                 # the figure as published ("1.38× prefill throughput")
    setup: str
    kind: str = "ratio"       # "ratio": an effect against a baseline (NO_EFFECT = none); "absolute": a quantity
    approx: bool = False      # published as "~x"
    up_to: bool = False       # published as "up to x": a best case, compared with our best case
    unit: str = "×"
    contrast: float | None = None   # what the claim sets itself against (None: no effect for a ratio, else none)
    side: int = 0             # kind "direction": the claim is only that ours lies below (-1) or above (+1) the contrast


@dataclass(frozen=True)
class Figure:
    """One figure of ours: a value, the spread behind it (`lo`–`hi`, `how`), what was measured, the runs."""
    value: float
    lo: float
    hi: float
    how: str                  # "min–max across 3 processes", "95% interval over 16 sequences", "one measurement"
    what: str                 # the measurement in words
    runs: tuple[str, ...] = ()
    differs: str = ""         # what differs from the published setup
    unit: str = "×"
    points: tuple = ()        # a figure over a range: (label, value, lo, hi) per point, each judged by the rule

    def text(self) -> str:
        if self.points:
            vals = [p[1] for p in self.points]
            return (f"{_range(min(vals), max(vals))} {self.unit} over {len(vals)} points "
                    f"({self.points[0][0]}–{self.points[-1][0]}), {self.how}").replace(" × over", "× over")
        v = _num(self.value, self.unit)
        if self.lo == self.hi == self.value or math.isnan(self.lo):
            return f"{v} ({self.how})"
        return f"{v} ({_range(self.lo, self.hi)}, {self.how})"


@dataclass(frozen=True)
class Verdict:
    verdict: str
    reason: str
    basis: str                # which figure decided: "published terms", "cost model (checked)", "stand-in", ...
    provisional: bool

    def label(self) -> str:
        return self.verdict + (" (provisional)" if self.provisional else "")


@dataclass
class Claim:
    key: str
    system: str
    published: Published
    terms: Figure | None = None       # ours in the published terms
    strongest: Figure | None = None   # ours against our strongest baseline
    model: Figure | None = None       # the cost model's figure for the published hardware
    stand_in: Figure | None = None    # what decides while the published-terms run is missing
    model_checked: bool = False
    model_basis: str = ""             # what the cost model's figure rests on, when not the decode transfer term
    settle: str = ""                  # the run that would settle the row
    untestable: str = ""              # why no figure of ours can test it here
    construction: Figure | None = None   # the shape's arithmetic, for a figure that follows from the model's shape
    regime: str = ""                  # why our points lie outside the published regime (read from the runs), or ""
    caveat: str = ""                  # what the verdict holds only for, said beside it
    verdict: Verdict = field(init=False)

    def __post_init__(self):
        self.verdict = decide(self)

    def ratio(self) -> Figure | None:
        """The deciding figure over the published one (our / published), for the card's plot."""
        f = self.construction or self.terms or self.model or self.stand_in
        if f is None or not self.published.value or math.isnan(self.published.value):
            return None
        p = self.published.value
        return Figure(f.value / p, f.lo / p, f.hi / p, f.how, f.what, f.runs, f.differs)

    def runs(self) -> list[str]:
        out: list[str] = []
        for f in (self.construction, self.terms, self.strongest, self.model, self.stand_in):
            for r in (f.runs if f else ()):
                if r not in out:
                    out.append(r)
        return out


def _num(v: float, unit: str, with_unit: bool = True) -> str:
    if math.isnan(v):
        return "–"
    a = abs(v)
    s = f"{v:,.0f}" if a >= 100 or (a >= 10 and float(v).is_integer()) else f"{v:.1f}" if a >= 10 else f"{v:.2f}"
    if not with_unit:
        return s
    return f"{s}×" if unit == "×" else f"{s} {unit}" if unit else s


def _range(lo: float, hi: float) -> str:
    """lo–hi with the digits of `_num`, one or two more where those would print the same small number twice (a
    count of hundreds or more equal to its last digit is shown as it is)."""
    a, b = _num(lo, "", False), _num(hi, "", False)
    if a == b and lo != hi and max(abs(lo), abs(hi)) < 100:
        a, b = f"{lo:.3f}", f"{hi:.3f}"
    return f"{a}–{b}"


# ---- the rule -----------------------------------------------------------------------------------------------
def contrast(pub: Published) -> float | None:
    """The figure the claim sets itself against: no effect for a ratio, else what the row declares (or none)."""
    if pub.contrast is not None:
        return pub.contrast
    return NO_EFFECT if pub.kind in ("ratio", "direction") else None


def tolerance(pub: Published) -> float:
    """±TOLERANCE (±APPROX_TOLERANCE for "~x"), never more than EFFECT_SHARE of the effect the claim reports."""
    base = APPROX_TOLERANCE if pub.approx else TOLERANCE
    c = contrast(pub)
    if c is None or c == 0 or pub.value == c:
        return base
    return min(base, abs(pub.value / c - 1) * EFFECT_SHARE)


def judge(pub: Published, ours: Figure) -> tuple[str, str]:
    """The comparison step of the rule (`decide`, step 3): one figure of ours against the published one, and its
    one-line reason. A figure with `points` is judged at each and the outcomes counted."""
    if ours.points:
        got = [(label, *judge(pub, Figure(v, lo, hi, ours.how, ours.what, unit=ours.unit)))
               for label, v, lo, hi in ours.points]
        held = [g[0] for g in got if g[1] == HOLDS]
        part = [g[0] for g in got if g[1] == PART]
        vals = _range(min(p[1] for p in ours.points), max(p[1] for p in ours.points))
        where = f"over {len(got)} points ({got[0][0]}–{got[-1][0]}) ours ranges {vals} {pub.unit}".rstrip()
        if len(held) == len(got):
            return HOLDS, f"holds at every point: {where}"
        if held or part:
            return PART, (f"holds at {len(held)} of {len(got)} points" + (f" ({', '.join(held)})" if held else "")
                          + (f", in part at {', '.join(part)}" if part else "") + f": {where}")
        return FAILS, f"holds at none of the points: {where}"
    p, v, lo, hi = pub.value, ours.value, ours.lo, ours.hi
    tol, c = tolerance(pub), contrast(pub)
    P = _num(p, pub.unit)
    if pub.kind == "direction":          # a claim of direction only: ours below (side -1) or above (+1) the contrast
        edge = c * (1 + MIN_EFFECT) ** pub.side
        if all(pub.side * (x - edge) > 0 for x in (lo, hi)):
            return HOLDS, (f"ours {_num(v, ours.unit)} ({_range(lo, hi)}) lies {'below' if pub.side < 0 else 'above'} "
                           f"{_num(c, ours.unit)} by more than {MIN_EFFECT:.0%}")
        return FAILS, f"ours {_num(v, ours.unit)} ({_range(lo, hi)}) is not {'below' if pub.side < 0 else 'above'} {_num(c, ours.unit)}"
    if p == 0:                           # a count published as zero
        return (HOLDS, "ours is zero too") if lo == hi == 0 else (FAILS, f"ours is {_num(v, pub.unit)}, not zero")
    side = (1 if p > c else -1) if c is not None else 1
    clear = c is None or all(side * (x - c * (1 + MIN_EFFECT) ** side) > 0 for x in ((v,) if pub.up_to else (lo, hi)))
    if pub.up_to:
        if side * (v / p - 1) >= -tol:
            return HOLDS, f"our best {_num(v, pub.unit)} reaches the published {P} (within {tol:.0%} or past it)"
    elif clear:
        if lo == hi == p:
            return HOLDS, f"ours equals the published {P}"
        if lo <= p <= hi:
            return HOLDS, f"the published {P} lies inside ours ({_range(lo, hi)})"
        if abs(v / p - 1) <= tol:
            return HOLDS, f"ours is within {tol:.0%} of the published {P} ({v / p - 1:+.0%})"
    if c is not None:
        if clear:
            return PART, (f"the direction holds, the size does not: ours {'(best) ' if pub.up_to else ''}"
                          f"{_num(v, pub.unit)} ({'larger' if side * (v - p) > 0 else 'smaller'}) against the "
                          f"published {P}, tolerance {tol:.0%}")
        return FAILS, (f"ours {_num(v, pub.unit)} does not clear {_num(c, pub.unit)} in the published direction "
                       f"({'best' if pub.up_to else 'spread'} {_range(lo, hi) if not pub.up_to else _num(v, pub.unit)} "
                       f"against {_num(c, pub.unit)} ± {MIN_EFFECT:.0%})")
    if 1 / PART_FACTOR <= v / p <= PART_FACTOR:
        return PART, f"ours is {v / p - 1:+.0%} from the published {P}: same order, outside {tol:.0%}"
    return FAILS, f"ours is {v / p:.2g}× the published {P}: beyond a factor of {PART_FACTOR:g}"


def decide(c: Claim) -> Verdict:
    """The verdict rule (`rule_text`), the one function every row goes through."""
    if c.construction is not None:
        v, why = judge(c.published, c.construction)
        if v == HOLDS:
            return Verdict(CONSTRUCTION, f"{c.construction.what}: {why}", "the model's shape", False)
        return Verdict(v, f"{c.construction.what}: {why}", "the model's shape", False)
    deciding = [(fig, basis, provisional) for fig, basis, provisional in (
        (c.terms, "published terms", False),
        (c.model, "cost model" + (f" ({c.model_basis})" if c.model_basis else
                                  " (checked)" if c.model_checked else " (transfer term unchecked)"), not c.model_checked),
        (c.stand_in, "stand-in", True)) if fig is not None]
    if c.regime:
        return Verdict(OUT_OF_REGIME, c.regime, deciding[0][1] if deciding else "none", False)
    if deciding:
        fig, basis, provisional = deciding[0]
        v, why = judge(c.published, fig)
        return Verdict(v, why + (f"; {c.caveat}" if c.caveat else ""), basis, provisional)
    return Verdict(UNTESTED, c.untestable or "no figure of ours measures it", "none", False)


# ---- figures from committed runs ----------------------------------------------------------------------------
def _run(key: str) -> str:
    """The run docs/runs.toml names under `key` ("" when none is committed yet)."""
    v = RUNS.get(key, "")
    return v if isinstance(v, str) and v and (REPO / v / "manifest.json").is_file() else ""


def _metrics(run: str) -> pd.DataFrame:
    m = load_run(REPO / run).metrics
    return m[m["status"] == "ok"] if "status" in m else m


def _across(values: list[float], runs: list[str], what: str, unit: str = "×", differs: str = "") -> Figure:
    s = pd.Series(values, dtype=float)
    how = f"min–max across {len(s)} processes" if len(s) > 1 else "one process"
    return Figure(float(s.median()), float(s.min()), float(s.max()), how, what, tuple(runs), differs, unit)


def _one(v: float, what: str, runs, unit: str = "×", differs: str = "", how: str = "one measurement") -> Figure:
    return Figure(float(v), float(v), float(v), how, what, tuple(runs), differs, unit)


def _best_of(values: pd.Series, side: int) -> float:
    return float(values.max() if side > 0 else values.min())


def _window_figure(ratios: pd.Series, what: str, runs, up_to: bool, side: int, differs: str = "") -> Figure | None:
    """Per-window ratios -> our figure: for an "up to" claim the best window with the min–max over windows;
    otherwise the median with its 95% bootstrap interval over windows. None when no window has both arms."""
    r = ratios.dropna().astype(float)
    if r.empty:
        return None
    iv = bootstrap(r, np.median)
    if up_to:
        return Figure(_best_of(r, side), float(r.min()), float(r.max()),
                      f"best of {len(r)} windows; median {iv.text(2)}", what, tuple(runs), differs)
    return Figure(iv.value, iv.lo, iv.hi, f"median, 95% interval over {len(r)} windows", what, tuple(runs), differs)


# -- the cost model for the published box ---------------------------------------------------------------------
def link_check() -> dict | None:
    """The link-rate run's predicted vs measured step times: rates, worst error, whether the model is checked."""
    run = _run("link_rate")
    if not run:
        return None
    d = _metrics(run)
    need = ["link_gbps", "predicted_step_ms", "step_ms_median"]
    if not set(need) <= set(d.columns):
        return None
    d = d.dropna(subset=need)
    if d.empty:
        return None
    err = (d["predicted_step_ms"] / d["step_ms_median"] - 1).abs()
    rates = sorted(float(x) for x in d["link_gbps"].unique())
    return {"run": run, "rates": rates, "worst": float(err.max()),
            "checked": len(rates) >= LINK_CHECK_RATES and bool((err <= LINK_CHECK_TOLERANCE).all())}


def _box_name() -> str:
    return f"{BOX_GPUS}× {gpu(BOX_GPU).name.replace('NVIDIA GeForce ', '')}"


def _box() -> str:
    """The published box in words, its link from labkit/data/gpus.toml."""
    g = gpu(BOX_GPU)
    return f"{_box_name()} (PCIe {g.pcie_gen}.0 x{g.pcie_width})"




def box_prediction(concurrency: int, context_len: int = PUBLISHED_CONTEXT, strategy: str = "zero_copy",
                   over: tuple[int, ...] = ()) -> tuple[Figure, bool]:
    """The cost model's tok/s on the published box (fitted on today's decode run), with its error band: the worst
    error at the link-rate run's points when one is committed, else the worst on the H200's own points. `over`:
    contexts to predict at as well; the figure then carries one point each (its value stays `context_len`'s)."""
    run = RUNS["decode_now"]
    m = load_run(REPO / run).metrics
    contexts = sorted({int(context_len), *map(int, over)})
    tab = predict_table(m, metrics_shape(m), gpu_for_name(str(m["gpu_name"].dropna().iloc[0])), gpu(BOX_GPU),
                        BOX_GPUS, contexts=contexts, concurrency=[concurrency])
    tab = tab[tab["strategy"] == strategy].set_index("context_len")["predicted_tok_s"].astype(float)
    chk = link_check()
    if chk:
        e, how, runs = chk["worst"], (f"± the model's worst error at {len(chk['rates'])} link rates "
                                      f"({', '.join(f'{r:g}' for r in chk['rates'])} GB/s)"), (run, chk["run"])
    else:
        err = S.cost_model_errors(m)
        e = float(err[err["strategy"] == strategy]["error"].abs().max())
        how, runs = f"± the model's worst {strategy} error on the H200's own points ({e:.0%})", (run,)
    band = lambda p: (p, p / (1 + e), p / max(1 - e, 1e-9))  # noqa: E731
    p = float(tab.loc[int(context_len)])
    points = tuple((_ctx(x), *band(float(tab.loc[x]))) for x in sorted(map(int, over)))
    fig = Figure(*band(p), how,
                 f"cost model: {strategy}, c = {concurrency}, layers split over {_box()}, fitted on one "
                 f"{str(m['gpu_name'].dropna().iloc[0]).replace('NVIDIA ', '')}", runs, "", "tok/s", points)
    return fig, bool(chk and chk["checked"])


def _prefill_predicted(run: str) -> tuple[dict, dict]:
    """The fastest prefill row of a committed run with its FLOPs from the anatomy, and the cost model's prediction
    from it for 3x RTX 3090 (`costmodel.predict_prefill`: compute phases by the datasheets' dense bf16 rates;
    `dense_bound_tok_s`: the prompt's FLOPs at their rate, whatever attention the run used)."""
    lr = load_run(REPO / run)
    m, a = lr.metrics, lr.table("anatomy")
    m = m[(m["experiment"] == "prefill") & (m["status"] == "ok")]
    best = m.loc[m["tok_s"].idxmax()].to_dict()
    keys = [k for k in ("engine_variant", "mode", "prefill_attention") if k in a and isinstance(best.get(k), str)]
    sel = a[(a[keys] == pd.Series({k: best[k] for k in keys})).all(axis=1)] if keys else a
    work = [c for c in ("weights_flops", "attention_flops", "deltanet_flops", "index_score_flops") if c in sel]
    best["prefill_flops"] = float(sel[work].sum().sum())
    return best, predict_prefill(best, gpu_for_name(str(best["gpu_name"])), gpu(BOX_GPU), BOX_GPUS)


def prefill_prediction(run: str | None = None) -> Figure:
    """The cost model's 248K prefill on 3x RTX 3090 from the fastest variant of a committed prefill run with its
    anatomy (default: the dense prompt with today's kernels), with the bound."""
    run = run or RUNS["prefill_now"]
    return _prediction_figure(run, *_prefill_predicted(run))


def _prediction_figure(run: str, best: dict, p: dict) -> Figure:
    sparse = best.get("prefill_attention") == "sparse"
    how = f"sparse attention (top {int(best['budget']):,} rows a query)" if sparse else "dense attention"
    what = (f"cost model: {_ctx(int(best['context_len']))} prompt, {how}, layers split over {_box()} with the "
            f"chunks pipelined, from the H200's anatomy at {best['tok_s']:,.0f} tok/s ({best.get('engine_variant') or best['mode']}); "
            f"the bound there (the prompt's FLOPs at {BOX_GPUS} × {_rate(BOX_GPU):g} TFLOPS, bf16 with FP32 accumulation) is "
            f"{p['dense_bound_tok_s']:,.0f} tok/s"
            + ("" if sparse or p["dense_bound_tok_s"] >= PREFILL_248K.value else ", below the published figure: it implies sparse "
               "prefill or FP16 accumulation"))
    return Figure(p["tok_s"], p["tok_s"], p["tok_s"], f"one anatomy scaled by datasheet rates; the {'sparse' if sparse else 'dense'} "
                  f"bound on {_box_name()} {p['dense_bound_tok_s']:,.0f} tok/s", what, (run,), "", "tok/s")


def _rate(key: str) -> float:
    """A GPU's dense bf16 tensor rate (FP32 accumulation), TFLOPS, as `data/gpus.toml` gives it with its source."""
    return gpu(key).bf16_tflops


def _with_sparse(dense: Figure, run: str) -> Figure:
    """The dense prediction with QSA's sparse prefill (the committed run `run`) scaled the same way beside it: the
    sparse bound, unlike the dense one, leaves room for the published figure."""
    best, p = _prefill_predicted(run)
    sparse, bound = _prediction_figure(run, best, p), p["dense_bound_tok_s"]
    return Figure(**{**dense.__dict__, "how": f"{dense.how}; sparse prefill scaled the same way {sparse.value:,.0f} "
                     f"tok/s, its bound {bound:,.0f} tok/s", "what": f"{dense.what}; {sparse.what}",
                     "runs": tuple(dense.runs) + tuple(sparse.runs)})


LINK_SETTLE = ("a link-rate decode run (`link_gbps` at ≥ 3 rates including PCIe 4.0 x16's, `predicted_step_ms` beside "
               "`step_ms_median`, zero_copy at 1M, c = 1 and 4), named `link_rate` in docs/runs.toml")


def _decode_now() -> pd.DataFrame:
    d = S.decode_table(load_run(REPO / RUNS["decode_now"]).metrics)
    return d.set_index(["strategy", "concurrency", "context_len"])


# -- sparse offload of Qwen3.8-Flash-Next ---------------------------------------------------------------------
DECODE_BELOW = Published(80, "~80 tok/s below the budget", "decode, c = 1, context below the 2048-token budget, "
                         "3× RTX 3090 (PCIe 4.0 x16), vLLM", "absolute", approx=True, unit="tok/s", contrast=60)
DECODE_PAST = Published(60, "~80 → ~60 tok/s once past the budget, to 1M", "decode, c = 1, budget 2048, contexts "
                        "from the budget to 1M, 3× RTX 3090 (PCIe 4.0 x16), vLLM", "absolute", approx=True,
                        unit="tok/s", contrast=80)
DECODE_FLAT = Published(1.0, "then flat as the context keeps growing", "decode, c = 1: tok/s at 1M over tok/s just "
                        "past the budget (flat = 1×, against the 60 / 80 drop the budget causes)", contrast=60 / 80)
DECODE_C4 = Published(150, "~150 tok/s aggregate at 4 requests", "decode, 4 concurrent requests (context not stated: "
                      "judged over 2K–1M), 3× RTX 3090", "absolute", approx=True, unit="tok/s")
PREFILL_248K = Published(3701, "3,701 tok/s prefill at 248K", "one 248K-token prompt, 3× RTX 3090", "absolute",
                         unit="tok/s")
BYTES_STEP = Published(48, "48 MiB per step", "12 layers × 2048 rows × 2048 B, c = 1", "absolute", unit="MiB")
LINK_AT_80 = Published(3.9, "~3.9 GB/s at 80 tok/s", "the 48 MiB per step at 80 steps a second over PCIe 4.0 x16",
                       "absolute", approx=True, unit="GB/s")
INDEX_BYTES = Published(66, "66 B per token and layer", "the indexer's compressed index keys on the device, against "
                        "2048 B of K+V", "absolute", unit="B")
ONE_M_BOX = Published(1 << 20, "1M context on 3× RTX 3090 without KV quantization", "decode at 1M tokens, bf16 KV in "
                      "host RAM, 24 GB a GPU", "absolute", unit="tokens")
BELOW_BUDGET = (4, 2)     # "below the budget": the cost model read at a quarter and a half of the run's budget


def _sparse_shape_claims(sys, shape, budget: int, d, top: int, gpu_name: str) -> list[Claim]:
    """The sparse-offload figures that follow from the shape (bytes a step, the link at ~80 tok/s, index bytes),
    each beside what the engine counted."""
    out = []
    z1 = d.loc[("zero_copy", 1, top)]
    step = shape.h2d_bytes_per_step(budget, [budget])
    arithmetic = (f"{shape.attn_layers} QSA layers × {budget:,} rows × {shape.row_bytes:,} B")
    rows = d.xs(("zero_copy", 1), level=("strategy", "concurrency"))
    mib = rows["h2d_bytes_per_step"] / 2**20
    hot = d.loc[("hot_cache", 1, top)]
    out.append(Claim("sparse-bytes-step", sys, BYTES_STEP,
                     construction=_one(step / 2**20, f"the shape's arithmetic, {arithmetic}", [RUNS["decode_now"]],
                                       "MiB", how="arithmetic"),
                     terms=Figure(float(mib.median()), float(mib.min()), float(mib.max()),
                                  f"min–max over {len(mib)} contexts ({_ctx(rows.index.min())}–{_ctx(rows.index.max())})",
                                  f"host-to-device bytes per decode step counted by the engine, zero_copy, c = 1, budget "
                                  f"{budget:,}", (RUNS["decode_now"],), f"the same layout and budget; one {gpu_name}", "MiB"),
                     strongest=_one(hot["h2d_bytes_per_step"] / 2**20, f"the hot cache's bytes per step at {_ctx(top)}, "
                                    "c = 1 (only misses cross)", [RUNS["decode_now"]], "MiB", how="one process")))
    rate = DECODE_BELOW.value     # the published ~80 tok/s the ~3.9 GB/s is quoted at
    out.append(Claim("sparse-link-at-80", sys, LINK_AT_80,
                     construction=_one(step * rate / 1e9, f"the shape's arithmetic, ({arithmetic}) × {rate:g} steps a "
                                       "second", [RUNS["decode_now"]], "GB/s", how="arithmetic"),
                     strongest=_one(z1["h2d_bytes_per_step"] * z1["tok_s"] / 1e9, f"what the link carried at "
                                    f"{_ctx(top)}, c = 1 on one {gpu_name}: bytes per step × {z1['tok_s']:.0f} tok/s",
                                    [RUNS["decode_now"]], "GB/s", how="one process")))
    out.append(Claim("sparse-index-bytes", sys, INDEX_BYTES,
                     construction=_one(shape.index_key_bytes, f"the shape's arithmetic, {shape.index_dim} fp8 values + an "
                                       "fp16 scale a token and QSA layer (the public config's indexer, which compresses "
                                       f"{PRESETS['qwen3.8-flash-next'].index_compress} tokens into one entry, would take "
                                       "half: the shape's note)",
                                       [RUNS["decode_now"]], "B", how="arithmetic")))
    return out


def sparse_claims() -> list[Claim]:
    sys = SYSTEMS["sparse"]
    d, top = _decode_now(), PUBLISHED_CONTEXT
    now = load_run(REPO / RUNS["decode_now"]).metrics
    # figures that follow from the shape are read off the shape the run was made with
    shape, budget = metrics_shape(now), int(now["budget"].dropna().iloc[0])
    measured = sorted(int(x) for x in d.xs(("zero_copy", 1), level=("strategy", "concurrency")).index)
    published_range = tuple([budget] + [x for x in measured if budget < x <= top])
    out = []
    rep = decode_ratio_rows(RUNS["repeats_hot1m"])
    zc = rep[rep["figure"].str.startswith("zero_copy")]
    gpu_name = str(now["gpu_name"].dropna().iloc[0]).replace("NVIDIA ", "")
    # ~80 below the budget, ~60 past it to 1M, flat, ~150 at c = 4: the cost model over the published range
    below, below_chk = box_prediction(1, context_len=budget // BELOW_BUDGET[-1],
                                      over=tuple(budget // k for k in BELOW_BUDGET))
    out.append(Claim("sparse-decode-below-budget", sys, DECODE_BELOW, model=below, model_checked=below_chk,
                     settle=LINK_SETTLE))
    z1, r1 = d.loc[("zero_copy", 1, top)], d.loc[("resident", 1, top)]
    strongest = _across(list(zc["value"]), RUNS["repeats_hot1m"],
                        f"zero_copy / resident tok/s at {_ctx(top)}, c = 1, one {gpu_name}, the indexer's selections "
                        f"(on the decode table's recorded trace: {z1['tok_s']:.0f} vs {r1['tok_s']:.0f} tok/s, "
                        f"{z1['tok_s'] / r1['tok_s']:.2f}×)")
    past, past_chk = box_prediction(1, over=published_range)
    out.append(Claim("sparse-decode-c1", sys, DECODE_PAST, strongest=strongest, model=past, model_checked=past_chk,
                     settle=LINK_SETTLE))
    lo_pt, hi_pt = past.points[0], past.points[-1]
    flat_model = Figure(hi_pt[1] / lo_pt[1], hi_pt[1] / lo_pt[1], hi_pt[1] / lo_pt[1],
                        "a ratio of two predictions of one fitted model", f"cost model: tok/s at {hi_pt[0]} / at "
                        f"{lo_pt[0]} on {_box()} ({hi_pt[1]:.1f} vs {lo_pt[1]:.1f} tok/s)", past.runs)
    zrows = d.xs(("zero_copy", 1), level=("strategy", "concurrency"))["tok_s"]
    flat_ours = _one(zrows.loc[top] / zrows.loc[min(zrows.index)],
                     f"zero_copy tok/s at {_ctx(top)} / at {_ctx(min(zrows.index))}, c = 1, measured on one {gpu_name} "
                     f"({zrows.loc[top]:.0f} vs {zrows.loc[min(zrows.index)]:.0f} tok/s)", [RUNS["decode_now"]],
                     how="one process")
    out.append(Claim("sparse-decode-flat", sys, DECODE_FLAT, strongest=flat_ours, model=flat_model,
                     model_checked=past_chk, settle=LINK_SETTLE))
    z4, r4 = d.loc[("zero_copy", 4, top)], d.loc[("resident", 4, top)]
    c4, c4_chk = box_prediction(4, over=published_range)
    out.append(Claim("sparse-decode-c4", sys, DECODE_C4,
                     strongest=_one(z4["tok_s"] / r4["tok_s"], f"zero_copy / resident aggregate tok/s at {_ctx(top)}, "
                                    f"c = 4, one {gpu_name} ({z4['tok_s']:.0f} vs {r4['tok_s']:.0f} tok/s)",
                                    [RUNS["decode_now"]], how="one process"),
                     model=c4, model_checked=c4_chk, settle=LINK_SETTLE))
    pre = prefill_rows(RUNS["repeats_prefill"])
    toks = [float(_metrics(r).set_index("mode").loc["rotating", "tok_s"]) for r in RUNS["repeats_prefill"]]
    ctx = int(_metrics(RUNS["repeats_prefill"][0])["context_len"].max())
    out.append(Claim("sparse-prefill-248k", sys, PREFILL_248K,
                     strongest=_across(toks, RUNS["repeats_prefill"],
                                       f"prefill tok/s of a {_ctx(ctx)} prompt on one {gpu_name}, KV to host RAM through "
                                       f"rotating buffers ({pre['value'].median():.2f}× resident prefill)", unit="tok/s"),
                     model=_with_sparse(prefill_prediction(), RUNS["prefill_sparse"][0]),
                     model_basis="prefill phases scaled by datasheet bf16 rates, unchecked on another GPU",
                     settle=f"a prefill run on {_box_name()}"))
    out += _sparse_shape_claims(sys, shape, budget, d, top, gpu_name)
    out.append(Claim("sparse-1m-box", sys, ONE_M_BOX,
                     untestable=f"the lab has no {_box_name()}; its 1M runs are on one {gpu_name}",
                     settle=f"a 1M-token decode on {_box()} with bf16 KV in host RAM (`labkit run decode` there)"))
    return out


# -- FlashOffloading ------------------------------------------------------------------------------------------
FLASH_PREFILL = Published(1.38, "1.38× prefill throughput", "prefill-only offload vs no offload, GLM-5.2 (MTP3), "
                          "Ascend 910C, prefill/decode disaggregated, up to 1M tokens")
FLASH_DENSE = Published(1.38, "the prefill gain holds for dense attention too", "prefill offload with dense attention "
                        "(the decode gain needs a built-in sparse indexer; the prefill gain does not)")
FLASH_DECODE = Published(1.91, "1.91× decode throughput at a 30 ms TPOT limit", "offload in both stages vs none, same "
                         "accelerator memory, GLM-5.2 (MTP3), Ascend 910C")

_PREFILL_SETTLE = ("a FlashOffloading prefill-throughput run at a point where the device cap squeezes `none`'s chunk below "
                   "`prefill`'s, or where `none` cannot hold one prompt (docs/prefill-capacity.md names such points), "
                   "or an engine that batches several requests' chunks in one forward, named `prefill_throughput` in "
                   "docs/runs.toml")


def _prefill_regime(m: pd.DataFrame | None) -> str:
    """Why a prefill-throughput point cannot show the published gain, read from its rows ("" when it can): the cap
    leaves `none` chunks as large as `prefill`'s, and the engine prefills one request's chunk per forward, so what
    the freed memory buys (prompts held) adds no throughput (the lab's byte model predicts ~1.0× there). With no
    run, the stand-in is one prompt with no device cap: nothing for freed memory to buy."""
    if m is None:
        return ("the stand-in prefills one prompt with no device cap, so there is no freed memory to buy anything: "
                "the lab's own model predicts ~1.0× there")
    if not {"config", "chunk"} <= set(m.columns):
        return ""
    g = m.groupby("config").median(numeric_only=True)
    if not {"none", "prefill"} <= set(g.index) or g.loc["none", "chunk"] < g.loc["prefill", "chunk"]:
        return ""
    held = (f" ({g.loc['none', 'in_flight']:.0f} vs {g.loc['prefill', 'in_flight']:.0f} prompts held)"
            if "in_flight" in g else "")
    return (f"at this point the device cap leaves `none` the same {g.loc['none', 'chunk']:,.0f}-token chunks as "
            f"`prefill`{held}, and the engine prefills one request's chunk per forward, so the lab's own byte model "
            "predicts ~1.0× here: the point cannot show the published effect")


def _goodput_regime(runs: list[str], limit: float) -> str:
    """Why capacity runs cannot test a throughput at a TPOT limit ("" when they can): the limit never binds, memory
    sets every batch (each configuration's batch is every request it holds, its TPOT under the limit)."""
    rows = pd.concat([_metrics(r) for r in runs])
    if not {"batch", "requests", "tpot_ms", "config"} <= set(rows.columns):
        return ""
    if not ((rows["batch"] >= rows["requests"]) & (rows["tpot_ms"] < limit)).all():
        return ""
    g = rows.groupby("config")[["batch", "tpot_ms"]].median()
    return (f"the {limit:g} ms TPOT limit never binds: memory sets every batch (" + ", ".join(
        f"{k}: {v['batch']:.0f} requests at {v['tpot_ms']:.1f} ms" for k, v in g.iterrows())
        + "); the published figure is throughput where the limit decides the batch")


def flash_claims() -> list[Claim]:
    HOT_DECODE_RUNS = [tuple(x) for x in RUNS["hot_decode"]]
    sys = SYSTEMS["flash"]
    out = []
    pre = prefill_rows(RUNS["repeats_prefill"])
    gpu_name = str(_metrics(RUNS["repeats_prefill"][0])["gpu_name"].dropna().iloc[0]).replace("NVIDIA ", "")
    one_prompt = _across(list(pre["value"]), RUNS["repeats_prefill"],
                         f"one {_ctx(int(_metrics(RUNS['repeats_prefill'][0])['context_len'].max()))} prompt's prefill "
                         f"speed, rotating buffers (KV to host RAM) / resident, one {gpu_name}")
    terms, m = None, None
    run = _run("prefill_throughput")
    if run:
        m = _metrics(run)
        g = m.groupby("config").median(numeric_only=True)
        num, den = g.loc["prefill" if "prefill" in g.index else "both"], g.loc["none"]
        lo = num.get("prompts_per_s_min", num["prompts_per_s"]) / den.get("prompts_per_s_max", den["prompts_per_s"])
        hi = num.get("prompts_per_s_max", num["prompts_per_s"]) / den.get("prompts_per_s_min", den["prompts_per_s"])
        both = f"; both stages {g.loc['both', 'prompts_per_s'] / den['prompts_per_s']:.2f}×" if "both" in g.index else ""
        shape = f"{m['shape'].dropna().iloc[0]}'s shape" if "shape" in m and m["shape"].notna().any() else "our shape"
        dev = str(m["gpu_name"].dropna().iloc[0]).replace("NVIDIA ", "") if "gpu_name" in m and m["gpu_name"].notna().any() else "our GPU"
        terms = Figure(float(num["prompts_per_s"] / den["prompts_per_s"]), float(lo), float(hi),
                       "slowest–fastest repeat" if "prompts_per_s_min" in g else "one measurement",
                       f"prompts prefilled per second, prefill-only offload / none, under a device cap{both}", (run,),
                       f"{shape} on one {dev} (dense attention), not GLM-5.2 on Ascend 910C")
    regime = _prefill_regime(m)
    for key, pub in (("flash-prefill-throughput", FLASH_PREFILL), ("flash-prefill-dense", FLASH_DENSE)):
        out.append(Claim(key, sys, pub, terms=terms, strongest=one_prompt, stand_in=one_prompt, regime=regime,
                         settle=_PREFILL_SETTLE))
    cap = capacity_rows(RUNS["repeats_capacity"])
    good = cap[cap["figure"].str.startswith("goodput")]
    prm = load_run(REPO / RUNS["repeats_capacity"][0]).manifest["parameters"]
    limit = float(prm.get("tpot_ms", float("nan")))
    hot = []
    for r, how in HOT_DECODE_RUNS:
        if how == HOT_DECODE_RUNS[-1][1]:
            mm = _metrics(r).set_index("strategy")
            hot.append((r, mm.loc["resident", "step_ms_median"] / mm.loc["hot_cache", "step_ms_median"]))
    cap_gpu = str(_metrics(RUNS["repeats_capacity"][0])["gpu_name"].dropna().iloc[0]).replace("NVIDIA ", "")
    out.append(Claim("flash-decode-goodput", sys, FLASH_DECODE,
                     terms=_across(list(good["value"]), RUNS["repeats_capacity"],
                                   f"decode goodput (tok/s of the largest batch within a {limit:g} ms TPOT limit), offload "
                                   f"in both stages / none, requests of {_ctx(prm['context_len'])} tokens",
                                   differs=f"Qwen3.8-Flash-Next's shape under a {prm['mem_cap_gib']:g} GiB device cap on one "
                                           f"{cap_gpu}; no speculative decoding"
                                           + ("" if limit == PUBLISHED_TPOT_MS else f"; TPOT limit {limit:g} ms")),
                     strongest=_across([v for _, v in hot], [r for r, _ in hot],
                                       f"the hot cache's decode speed / resident at {_ctx(PUBLISHED_CONTEXT)}, c = 1, "
                                       "recorded selections (one process per selection trace)"),
                     regime=_goodput_regime(RUNS["repeats_capacity"], limit),
                     settle="a capacity run where the TPOT limit binds: a device cap and request length at which none's "
                            "and both's largest batches within the limit are smaller than the batches memory allows"))
    return out


# -- PulseInfer -----------------------------------------------------------------------------------------------
def _ladder() -> tuple[str, pd.DataFrame, str | None] | None:
    """(run, metrics, the PulseInfer rung to compare): a run that chose its strongest arm on its calibration
    windows (`strongest_rung` in its manifest) is read at that rung; one from before that choice at its last
    rung, the full system."""
    run = _run("pulse_ladder_decode") or _run("pulse_ladder")      # the published regime's run where there is one
    if not run:
        return None
    return run, _metrics(run), load_run(REPO / run).manifest.get("strongest_rung")


LADDER = ("per_head", "coalesced", "retrieval_head", "switching", "adaptive")
NO_OFFLOAD_ARM = "no_offload"


def ladder_ratios(m: pd.DataFrame, column: str, against: str = "first", rung: str | None = None) -> pd.Series:
    """Per window: the full rung's `column` (or `rung`'s, chosen on the calibration windows) over the first
    rung's (or over the no-offload arm's)."""
    rungs = m["rung"]
    numeric = pd.to_numeric(rungs, errors="coerce")
    on = m[rungs.astype(str) != NO_OFFLOAD_ARM]
    if numeric[on.index].notna().all():
        order = sorted(numeric[on.index].unique())
        first, full = m[numeric == order[0]], m[numeric == order[-1]]
    else:
        present = [r for r in LADDER if r in set(on["rung"])]
        first, full = m[m["rung"] == present[0]], m[m["rung"] == present[-1]]
    if rung is not None:
        full = m[m["rung"].astype(str) == rung]
    base = m[m["rung"].astype(str) == NO_OFFLOAD_ARM] if against == NO_OFFLOAD_ARM else first
    a = full.groupby("window")[column].median()
    b = base.groupby("window")[column].median()
    return (a / b).dropna()


_PULSE_LADDER_SETTLE = ("PulseInfer's ladder on ≥ 8 trace windows (per-head 8 KiB units without switching → + coalesced → "
                        "+ retrieval-head blocks → + batch switching → + adaptive admission, and no offload under the same "
                        "cap), named `pulse_ladder` in docs/runs.toml")
_PULSE_DIFFERS = "one H100/H200 and Qwen3.8-Flash-Next's shape; 14B–230B models and the ServeGen trace not replayed"
_PULSE_REGIME_SETTLE = ("PulseInfer's ladder on a decode instance of a disaggregated deployment (prompts prefilled "
                        "elsewhere, their KV handed over; the run's manifest says `disaggregated: true`), named "
                        "`pulse_ladder_decode` in docs/runs.toml")


def _pulse_regime(run: str) -> str:
    """Why a trace run's windows are outside PulseInfer's published regime ("" when they are not): the published
    figures are decode instances of a disaggregated deployment; a run whose manifest does not say
    `disaggregated: true` prefilled and decoded on one GPU. Its windows' prompt and generated tokens are said."""
    lr = load_run(REPO / run)
    if lr.manifest.get("parameters", {}).get("disaggregated"):
        return ""
    m = _metrics(run)
    mix = ""
    if {"total_input_tokens", "total_output_tokens", "window"} <= set(m.columns):
        w = m.groupby("window")[["total_input_tokens", "total_output_tokens"]].median()
        i, o = float(w["total_input_tokens"].median()), float(w["total_output_tokens"].median())
        mix = (f", and its windows are prefill-dominated ({i:,.0f} prompt tokens against {o:,.0f} generated a window, "
               f"median: {i / max(o, 1):,.0f} to 1)")
    return (f"the run (`{Path(run).name}`) prefills and decodes on one GPU{mix}; the published figures are decode "
            "instances of a disaggregated deployment, where switching hides transfers behind other requests' decode")


def pulse_claims() -> list[Claim]:
    sys = SYSTEMS["pulse"]
    lad = _ladder()
    regime = _pulse_regime(lad[0] if lad else RUNS["pulse_trace_windows"])
    rows = [*_pulse_trace_claims(sys, lad), _pulse_vs_no_offload_claim(sys, lad)]
    for c in rows:
        c.regime, c.settle = regime, (_PULSE_REGIME_SETTLE if regime else c.settle)
        c.verdict = decide(c)
    return [*rows, _pulse_small_transfers_claim(sys), *_pulse_untested_claims(sys)]


def _calibration_best(win, arms: pd.DataFrame) -> str:
    """The fitted arm to show: of the candidates chosen on the calibration windows (the run's selection table),
    the one with the best calibration median throughput ratio, so the arm is not picked on the held-out
    windows its figures come from. Without a selection table: the first arm."""
    sel = win.table("selection")
    if sel.empty or not {"arm", "chosen", "throughput_ratio"} <= set(sel.columns):
        return arms.index[0]
    c = sel[sel["chosen"].astype(bool) & sel["arm"].isin(arms.index)]
    return c.sort_values("throughput_ratio", ascending=False, kind="stable")["arm"].iloc[0] if len(c) else arms.index[0]


def _full_what(rung: str | None) -> str:
    """How the ladder's PulseInfer arm is named: the full system, or the rung chosen on calibration windows."""
    return "full PulseInfer" if rung is None else f"PulseInfer's arm chosen on the calibration windows (`{rung}`)"


def _pulse_trace_claims(sys, lad) -> list[Claim]:
    """Throughput and p99 TPOT on held-out trace windows, switching against our offload lane without it."""
    win = load_run(REPO / RUNS["pulse_trace_windows"])
    ws = win.table("window_summary").set_index("arm")
    arms = ws[ws.index != "reference"]
    best_arm = _calibration_best(win, arms)
    a = arms.loc[best_arm]
    ref = win.manifest["parameters"]["reference"]
    n = int(a["throughput_ratio_n"])
    ours_lane = (f"PulseInfer ({best_arm}: `{a['policy']}`) / our offload lane without switching (`{ref}`, "
                 f"{win.manifest['parameters']['strategy']}, which already moves retrieval-head blocks in batched calls)")
    windows = f"{n} held-out windows of {win.manifest['parameters']['window_size']} Mooncake requests"

    def trace_fig(col: str, side: int, what: str) -> Figure:
        best = a[f"{col}_max"] if side > 0 else a[f"{col}_min"]
        return Figure(float(best), float(a[f"{col}_min"]), float(a[f"{col}_max"]),
                      f"best of {n} windows; median {a[col]:.2f} [{a[f'{col}_lo']:.2f}, {a[f'{col}_hi']:.2f}]",
                      f"{what}, {ours_lane}, {windows}", (RUNS["pulse_trace_windows"],))

    out = []
    for key, col, pub, side in (
            ("pulse-throughput", "output_throughput",
             Published(2.6, "up to 2.6× throughput vs the best offload system", "PulseInfer vs ArkVale / InfiniGen / "
                       "PQCache (per-head ~8 KB transfers), SGLang, ServeGen and Mooncake traces, 14B–230B models",
                       up_to=True), 1),
            ("pulse-tpot", "tpot_ms_p99",
             Published(0.24, "up to 76% lower TPOT vs the best offload system (0.24×)", "the same comparison; the TPOT "
                       "statistic is not stated (ours: p99)", up_to=True), -1)):
        col_w = "throughput_ratio" if col == "output_throughput" else "tpot_p99_ratio"
        what = "output tok/s" if side > 0 else "p99 TPOT"
        strongest = trace_fig(col_w, side, what)
        terms = None
        if lad:
            run, m, rung = lad
            terms = _window_figure(ladder_ratios(m, col, rung=rung), f"{what}, {_full_what(rung)} / the per-head "
                                   "8 KiB baseline rung (no switching), per window", (run,), True, side, _PULSE_DIFFERS)
        out.append(Claim(key, sys, pub, terms=terms, strongest=strongest, stand_in=strongest, settle=_PULSE_LADDER_SETTLE))
    return out


def _pulse_vs_no_offload_claim(sys, lad) -> Claim:
    """Offload with switching against no offload under the same device-memory cap."""
    cap = capacity_rows(RUNS["repeats_capacity"])
    good = cap[cap["figure"].str.startswith("goodput")]
    prm = load_run(REPO / RUNS["repeats_capacity"][0]).manifest["parameters"]
    stand = Figure(float(good["value"].max()), float(good["value"].min()), float(good["value"].max()),
                   f"best of {len(good)} processes", f"offload (hot cache, no switching) / no offload under the same "
                   f"{prm['mem_cap_gib']:g} GiB device cap, decode goodput at {_ctx(prm['context_len'])}",
                   tuple(RUNS["repeats_capacity"]))
    sc = []
    for r in RUNS["repeats_pulse_scaling"]:
        piv = _metrics(r).pivot_table(index="concurrency", columns="mode", values="tok_s")
        top = piv.index.max()
        sc.append(piv.loc[top, "switched"] / piv.loc[top, "resident"])
    strongest = _across(sc, RUNS["repeats_pulse_scaling"], f"two switched batches, every request offloaded / resident "
                        f"(no cap), {int(top)} requests at 1M")
    terms = None
    if lad:
        run, m, rung = lad
        terms = _window_figure(ladder_ratios(m, "output_throughput", NO_OFFLOAD_ARM, rung), f"output tok/s, "
                               f"{_full_what(rung)} / no offload under the same device-memory cap, per window", (run,),
                               True, 1, _PULSE_DIFFERS)
    return Claim("pulse-vs-no-offload", sys,
                     Published(4.7, "up to 4.7× vs SGLang without offload", "decode, SGLang keeping all KV on the GPU "
                               "(fewer requests fit)", up_to=True),
                 terms=terms, strongest=strongest, stand_in=stand, settle=_PULSE_LADDER_SETTLE)


def _pulse_small_transfers_claim(sys) -> Claim:
    """8 KiB per-head units moved one copy each (the published ~6 GB/s), and gathered into one copy."""
    dma = ("per_unit_copy", "batched_dma", "batched_dma_default")
    rows = []
    for r in [RUNS["pulse_blocks"], *RUNS["pulse_coalesced"]]:
        m = _metrics(r)
        m = m[(m["unit_bytes"] == PUBLISHED_UNIT_BYTES) & (m["selection"] == "per_head")]
        for x in m.itertuples():
            if x.strategy in dma or x.strategy.startswith("batched_dma_per") or x.strategy in ("coalesced_copy", "contiguous"):
                rows.append({"run": r, "strategy": x.strategy, "gbps": x.gbps})
    t = pd.DataFrame(rows)
    per_unit = t[~t["strategy"].isin(["coalesced_copy", "contiguous"])]
    best = per_unit.groupby("strategy")["gbps"].median().idxmax()
    b = per_unit[per_unit["strategy"] == best]
    cc = t[t["strategy"] == "coalesced_copy"]["gbps"]
    ct = t[t["strategy"] == "contiguous"]["gbps"]
    worst = per_unit.groupby("strategy")["gbps"].median()
    others = worst.drop(best)
    dev = gpu_for_name(str(_metrics(RUNS["pulse_blocks"])["gpu_name"].dropna().iloc[0]))
    link = f"one {dev.name.replace('NVIDIA ', '')}'s PCIe Gen{dev.pcie_gen} x{dev.pcie_width} link" if dev else "our link"
    return Claim("pulse-small-transfers", sys,
                     Published(6, "~8 KB transfers at ~6 GB/s on PCIe 5.0 x16", "per-head block selections moved as "
                               "~8 KB units against a 64 GB/s limit", "absolute", approx=True, unit="GB/s"),
                     terms=Figure(float(b["gbps"].median()), float(b["gbps"].min()), float(b["gbps"].max()),
                                  f"min–max over {len(b)} measurements" + (f" in {b['run'].nunique()} runs" if b['run'].nunique() > 1 else ""),
                                  f"{PUBLISHED_UNIT_BYTES // 1024} KiB per-head units, one DMA copy each, issued the fastest way we have (`{best}`); "
                                  f"one copy call per unit: {worst.min():.2f} GB/s",
                                  tuple(sorted(set(b["run"]))), f"{link}; a contiguous copy "
                                  f"reaches {ct.min():.0f}–{ct.max():.0f} GB/s here", "GB/s"),
                     strongest=Figure(float(cc.median()), float(cc.min()), float(cc.max()),
                                      f"min–max over {len(cc)} measurements", "the same 8 KiB units gathered on the CPU and "
                                      "moved in one copy (coalesced)", tuple(sorted(set(t["run"]))), "", "GB/s"),
                     caveat=(f"only for the fastest of {len(worst)} ways of issuing the copies (`{best}`); the other "
                             f"{len(others)} reach {_range(others.min(), others.max())} GB/s") if len(others) else "")


def _pulse_untested_claims(sys) -> list[Claim]:
    """LongBench near full attention with one retrieval head per layer; the static threshold's best value per trace."""
    q = load_run(REPO / RUNS["quality"]).table("quality_summary")
    rh = q[(q["policy"] == "retrieval_head") & (q["block"] > 1)]
    near = None
    if not rh.empty:
        blk, bud = int(rh["block"].iloc[0]), int(rh["budget"].iloc[0])
        near = Figure(float(rh["ppl_ratio"].median()), float(rh["ppl_ratio_lo"].min()), float(rh["ppl_ratio_hi"].max()),
                      f"95% intervals over {int(rh['ppl_ratio_n'].min())} sequences a corpus, {len(rh)} corpora",
                      f"perplexity with one retrieval head's blocks of {blk} at budget {bud:,} / full attention, "
                      f"{', '.join(f'{r.corpus} {r.ppl_ratio:.3f}' for r in rh.itertuples())} (a different measure on "
                      "a small model, not used for the verdict)", (RUNS["quality"],))
    win = load_run(REPO / RUNS["pulse_trace_windows"])
    ws = win.table("window_summary").set_index("arm")
    fitted = ", ".join(f"{a}: `{ws.loc[a, 'policy']}`" for a in ws.index if a != "reference")
    return [Claim("pulse-longbench", sys,
                  Published(NO_EFFECT, "LongBench average close to full attention", "one retrieval head per layer, "
                            "its blocks serving every head of the layer"),
                  strongest=near, untestable="the lab has no LongBench data offline",
                  settle="LongBench with one retrieval head per layer against full attention, where the data set can "
                         "be installed"),
            Claim("pulse-threshold", sys,
                  Published(float("nan"), "a static length threshold is best at different values on the two traces",
                            "ServeGen and Mooncake, the threshold that decides which requests are offloaded", unit=""),
                  untestable=f"the lab replays one trace (Mooncake; fitted on its calibration windows: {fitted})",
                  settle="the threshold sweep on ServeGen windows beside Mooncake's")]


# -- cross-model KV transfer ----------------------------------------------------------------------------------
def _ttft_speedup(run: str, concurrency: int | None = None, near: int = 32768, backend: str | None = None) -> Figure | None:
    """The mapped path's TTFT speedup at the prompt length nearest `near` (lowest concurrency unless given), with the
    range its repeats allow (own prefill's slowest / mapped's fastest and back)."""
    m = _metrics(run)
    m = m[m["kind"] == "ttft"] if "kind" in m else m
    if backend and "backend" in m:
        m = m[m["backend"] == backend]
    if "rank" in m:
        m = m[m["rank"].fillna(0) == 0]
    if m.empty:
        return None
    c = concurrency or int(m["concurrency"].min())
    m = m[m["concurrency"] == c]
    if m.empty:
        return None
    ctx = min(m["context_len"].unique(), key=lambda x: abs(int(x) - near))
    g = m[m["context_len"] == ctx].set_index("strategy")
    if not {"large_prefill", "mapped"} <= set(g.index):
        return None
    base, mp = g.loc["large_prefill"], g.loc["mapped"]
    v = float(base["ttft_ms_median"] / mp["ttft_ms_median"])
    if c > 1:     # requests queue behind each other: their slowest and fastest are not a spread of the ratio
        lo = hi = v
        how = f"medians over {int(mp.get('requests', c) or c)} concurrent requests, one process"
    else:
        lo = float(base.get("ttft_ms_min", base["ttft_ms_median"]) / mp.get("ttft_ms_max", mp["ttft_ms_median"]))
        hi = float(base.get("ttft_ms_max", base["ttft_ms_median"]) / mp.get("ttft_ms_min", mp["ttft_ms_median"]))
        how = "one measurement" if lo == hi else "slowest–fastest repeat"
    what = (f"TTFT, the large model's own prefill / small prefill + mapping, {int(ctx):,} tokens, concurrency {c}"
            + (f", {g['backend'].iloc[0]}" if "backend" in g else "")
            + f" ({base['ttft_ms_median']:,.0f} vs {mp['ttft_ms_median']:,.0f} ms)")
    return Figure(v, min(lo, v), max(hi, v), how, what, (run,))


def _modern_prose() -> tuple[str, tuple[str, ...]]:
    """The perplexity ratio on modern English prose (Python's documentation topics) beside Shakespeare's of the
    same run, as words for the perplexity row, and that run; nothing while `xfer_modern_prose` names no run."""

    run = _run("xfer_modern_prose")
    if not run:
        return "", ()
    lr = load_run(REPO / run)
    s = lr.table("quality_summary")
    s = s[s["mode"] == "mapped"].set_index("corpus")
    if "pydoc" not in s.index:
        return "", ()
    p = lr.manifest.get("parameters", {})
    small = str(p.get("small", ""))
    layers = lr.manifest.get("pair", {}).get("large", {}).get("layers")
    depth = (f"first {small.split(':', 1)[1]} of {layers} layers" if small.startswith("first:") and layers else small)
    d, n = s.loc["pydoc"], int(s.loc["pydoc", "ppl_ratio_n"])
    words = (f"; modern English prose (Python's documentation topics): {interval_text(d, 'ppl_ratio')} over {n} sequences, "
             f"small model = {depth} (the published pair's compute ratio)")
    if "prose" in s.index:
        words += f", Shakespeare in the same run {interval_text(s.loc['prose'], 'ppl_ratio')}"
    return words + f" (mapper on {int(p.get('calib_tokens', 0)):,} calibration tokens per corpus)", (run,)


XFER_PPL = Published(1.10, "perplexity ~10% worse (1.10×)", "the large model decoding from mapped KV vs from its own, "
                     "ridge mapper fitted for 15 minutes on FineWeb", approx=True)


def _large_layers() -> int | None:
    run = _run("xfer_modern_prose")
    return load_run(REPO / run).manifest.get("pair", {}).get("large", {}).get("layers") if run else None


def _failures(run: str, backend: str | None = None) -> tuple[int, int, int]:
    """Failed rows, requests and the highest concurrency among a cross-model run's TTFT rows (every status)."""
    m = load_run(REPO / run).metrics
    m = m[m["kind"] == "ttft"] if "kind" in m else m
    if backend and "backend" in m:
        m = m[m["backend"] == backend]
    req = m["requests"].fillna(1) if "requests" in m else pd.Series(1, index=m.index)
    return int((m["status"] != "ok").sum()), int(req.sum()), int(m["concurrency"].max())


def _xfer_serving_claims(sys, run32, dev32: str, pair: str, vllm) -> list[Claim]:
    """Cross-model transfer's serving figures: zero failures through the connector, short prompts losing."""
    out = []
    failed, requests, conc = _failures(RUNS["xfer_full"], backend="vllm")
    out.append(Claim("xfer-zero-failures", sys,
                     Published(0, "zero failures over all runs", "the vLLM KV connector over /dev/shm, up to "
                               "concurrency 8", "absolute", unit="failures"),
                     stand_in=_one(failed, f"failed TTFT rows among {requests} requests through our vLLM connector path, "
                                   f"up to concurrency {conc}", [RUNS["xfer_full"]], "failures", pair, "one run"),
                     regime=(f"our vLLM connector runs reach concurrency {conc}, not {PUBLISHED_XFER_CONCURRENCY}; the "
                             f"concurrency-{PUBLISHED_XFER_CONCURRENCY} run is in-process transformers, with no connector "
                             "to fail") if conc < PUBLISHED_XFER_CONCURRENCY else "",
                     settle=f"the vLLM connector path at concurrency {PUBLISHED_XFER_CONCURRENCY} over repeated runs, "
                            "failures counted"))
    short = None
    if run32:
        ctxs = sorted(int(x) for x in _metrics(run32).query("kind == 'ttft'")["context_len"].unique())
        short = _ttft_speedup(run32, near=ctxs[0])
        longest = _ttft_speedup(run32, near=ctxs[-1])
        if short is not None and len(ctxs) > 1:
            short = Figure(**{**short.__dict__, "differs": f"the published pair's shapes with seeded weights on one {dev32}; "
                              f"at {_ctx(ctxs[-1])} the same ratio is {longest.value:.2f}×"})
    out.append(Claim("xfer-short-prompts", sys,
                     Published(NO_EFFECT, "short prompts lose to the transfer overhead", "the mapped path's TTFT "
                               "speedup below 1× on a short prompt (it pays off on long context)", "direction", side=-1),
                     terms=short, strongest=vllm,
                     caveat=(f"the other half, that it pays off on long context, does not hold here: at "
                             f"{_ctx(ctxs[-1])} ours is {longest.value:.2f}×") if short is not None and longest.value < NO_EFFECT else "",
                     settle="the 32K cross-model run with a short prompt (`xfer_ttft_32k`)"))
    return out


def xfer_claims() -> list[Claim]:
    sys = SYSTEMS["xfer"]
    prm = load_run(REPO / RUNS["xfer_frontier"]).manifest.get("parameters", {})
    small = str(prm.get("small", ""))
    n_small = int(small.split(":", 1)[1]) if small.startswith("first:") else None
    large = str(prm.get("large", "the large model"))
    layers = _large_layers()
    depth = f"first {n_small} of {layers} layers" if n_small and layers else small
    pair = f"{large} and its first {n_small} layers on a CPU, not Qwen3-0.6B → 1.7B on two RTX 3090s"
    out = []
    run32 = _run("xfer_ttft_32k")
    dev32 = (str(_metrics(run32)["gpu_name"].dropna().iloc[0]).replace("NVIDIA ", "") if run32 and "gpu_name" in
             _metrics(run32) else "one GPU")
    terms = _ttft_speedup(run32, near=PUBLISHED_XFER_CONTEXT) if run32 else None
    if terms is not None:
        terms = Figure(**{**terms.__dict__, "differs": f"the published pair's shapes with seeded weights on one {dev32} "
                          "(both models on one GPU: no cache transfer)"})
    vllm = _ttft_speedup(RUNS["xfer_vllm_rank"], backend="vllm")
    vllm = Figure(**{**vllm.__dict__, "differs": pair})
    out.append(Claim("xfer-ttft-32k", sys,
                     Published(2.22, "TTFT 3,657 → 1,645 ms (2.22×) at 32K", "Qwen3-0.6B prefills, Qwen3-1.7B decodes, "
                               "two RTX 3090, vLLM KV connector over /dev/shm"),
                     terms=terms, strongest=vllm, stand_in=vllm,
                     settle="cross-model TTFT at 32K for the Qwen3-0.6B / 1.7B shapes (seeded weights, on the GPU), "
                            "named `xfer_ttft_32k` in docs/runs.toml"))
    fr = load_run(REPO / RUNS["xfer_frontier"]).table("frontier")
    fr = fr[fr["stage"] == "frontier"].set_index("small_layers")
    nN, deep = fr.loc[n_small if n_small in fr.index else int(fr.index.min())], fr.loc[int(fr.index.max())]
    iv = lambda r, c: (float(r[c]), float(r[f"{c}_lo"]), float(r[f"{c}_hi"]))  # noqa: E731
    corpora = sorted(c[len("ppl_ratio_"):-len("_n")] for c in fr.columns
                     if c.startswith("ppl_ratio_") and c.endswith("_n") and c != "ppl_ratio_n")
    per = "; ".join(f"{c} {nN[f'ppl_ratio_{c}']:.3f} [{nN[f'ppl_ratio_{c}_lo']:.3f}, {nN[f'ppl_ratio_{c}_hi']:.3f}]"
                    for c in corpora)
    modern, modern_runs = _modern_prose()
    out.append(Claim("xfer-perplexity", sys, XFER_PPL,
                     terms=Figure(*iv(nN, "ppl_ratio"), f"95% interval over {int(nN['ppl_ratio_n'])} sequences",
                                  f"perplexity from the mapped cache / from the true cache, held-out text, {' and '.join(corpora)} "
                                  f"pooled (per corpus: {per}), small model = {depth}" + modern,
                                  (RUNS["xfer_frontier"], *modern_runs), pair + "; code and Shakespeare, not web text"),
                     strongest=Figure(*iv(deep, "ppl_ratio"), f"95% interval over {int(deep['ppl_ratio_n'])} sequences",
                                      f"the same, our deepest small model (first {int(fr.index.max())} layers), "
                                      f"{' and '.join(corpora)} pooled", (RUNS["xfer_frontier"],))))
    c8 = _ttft_speedup(run32, concurrency=PUBLISHED_XFER_CONCURRENCY, near=PUBLISHED_XFER_CONTEXT) if run32 else None
    if c8 is not None:
        c8 = Figure(**{**c8.__dict__, "differs": f"the published pair's shapes with seeded weights on one {dev32}; "
                       f"{PUBLISHED_XFER_CONCURRENCY} requests arriving together, served in order"})
    full_c = int(_metrics(RUNS["xfer_full"]).query("backend == 'vllm'")["concurrency"].max())
    full = _ttft_speedup(RUNS["xfer_full"], concurrency=full_c, near=PUBLISHED_XFER_CONTEXT, backend="vllm")
    full = Figure(**{**full.__dict__, "differs": pair + f"; concurrency {full_c}, not {PUBLISHED_XFER_CONCURRENCY}"})
    out.append(Claim("xfer-concurrency-8", sys,
                     Published(3928 / 2393, "concurrency 8: 2,393 vs 3,928 ms per request (warm path)",
                               "per-request latency at concurrency 8, mapped path vs the large model's own prefill "
                               "(prompt length not stated)"),
                     terms=c8, strongest=full, stand_in=full,
                     settle="the 32K cross-model run with a concurrency-8 point (`xfer_ttft_32k`)"))
    out += _xfer_serving_claims(sys, run32, dev32, pair, vllm)
    out.append(Claim("xfer-hellaswag", sys,
                     Published(0.94, "HellaSwag at 94% of the large model's score", "the mapped path against the large "
                               "model alone"),
                     strongest=Figure(*iv(nN, "top1_agree_prose"), f"95% interval over {int(nN['top1_agree_prose_n'])} "
                                      "sequences", "next-token top-1 agreement with the true cache (a different measure, "
                                      "not used for the verdict)", (RUNS["xfer_frontier"],)),
                     untestable="the lab has no HellaSwag data offline; top-1 agreement is shown instead and is not the "
                                "same measure",
                     settle="a HellaSwag evaluation of the mapped path where the data set can be installed"))
    out.append(Claim("xfer-nvidia-pair", sys,
                     Published(17, "17–25× on a 14B/32B pair (the NVIDIA paper the post follows)", "a small model reads "
                               "the prompt, a large one answers from its cache through a linear mapping, NVLink, 8× H100"),
                     untestable="the lab has neither the 14B/32B pair's weights nor 8 GPUs on NVLink",
                     settle="the cross-model path on a 14B/32B pair over NVLink"))
    return out


BUILDERS = {"sparse": sparse_claims, "flash": flash_claims, "pulse": pulse_claims, "xfer": xfer_claims}


def card(systems=None) -> list[Claim]:
    """Every row of the card (or those of the named systems: keys of SYSTEMS), in the order of BUILDERS: sparse offload, FlashOffloading, PulseInfer, cross-model transfer."""
    names = list(BUILDERS) if not systems else [s for s in BUILDERS if s in set(systems)]
    unknown = set(systems or ()) - set(BUILDERS)
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(sorted(unknown))}: choose from {', '.join(BUILDERS)}")
    return [c for s in names for c in BUILDERS[s]()]


# ---- the generated blocks -----------------------------------------------------------------------------------
def _link(run: str, prefix: str) -> str:
    name = run.split("/")[-1]
    target = f"{prefix}{run}/report.html" if (REPO / run / "report.html").is_file() else f"{prefix}{run}"
    return f"[`{name}`]({target})"


def table(claims: list[Claim], prefix: str = "../") -> pd.DataFrame:
    rows = []
    for c in claims:
        pub = c.published
        rows.append({"system": c.system, "published": f"**{pub.text}** — {pub.setup}",
                     "ours in the published terms": (c.terms.text() + f"; {c.terms.what}"
                                                     + (f" (differs: {c.terms.differs})" if c.terms.differs else ""))
                     if c.terms else "not measured yet",
                     "ours against our strongest baseline": (f"{c.strongest.text()}; {c.strongest.what}"
                                                             + (f" (differs: {c.strongest.differs})" if c.strongest.differs else ""))
                     if c.strongest else "–",
                     "cost model, published hardware": f"{c.model.text()}" if c.model else
                     f"{c.construction.text()} ({c.construction.what})" if c.construction else "–",
                     "verdict": f"**{c.verdict.label()}**",
                     "why": c.verdict.reason + _basis(c)
                            + (f". Settled by: {c.settle}" if c.settle and (c.verdict.provisional or c.verdict.verdict
                                                                            in (UNTESTED, OUT_OF_REGIME)) else ""),
                     "runs": ", ".join(_link(r, prefix) for r in c.runs()) or "–"})
    return pd.DataFrame(rows)


def _basis(c: Claim) -> str:
    b = c.verdict.basis
    if b == "none":
        return ""
    if b != "stand-in":
        return f" (from: {b})"
    if c.stand_in is c.strongest:
        return " (from: the stand-in in the column of our strongest baseline)"
    return f" (from: a stand-in, {c.stand_in.text()}; {c.stand_in.what})"


def tallies(claims: list[Claim]) -> str:
    counts = pd.Series([c.verdict.verdict for c in claims], dtype=object).value_counts()
    return (f"{len(claims)} published figures; " + ", ".join(f"{int(counts.get(v, 0))} {v}" for v in VERDICTS)
            + f" ({sum(c.verdict.provisional for c in claims)} of them provisional: decided by a stand-in or an "
            "unchecked cost model until the run named in the row is committed).")


def claims_block(claims: list[Claim]) -> str:
    return (tallies(claims) + " The rule: [above](#the-verdict-rule) (`labkit.docs.claims.decide`).\n\n"
            + S.md_table(table(claims)))


def summary_block(claims: list[Claim]) -> str:
    lines = []
    for c in claims:
        b = c.verdict.basis
        ours = (c.verdict.reason if c.verdict.verdict in (CONSTRUCTION, OUT_OF_REGIME, UNTESTED) else
                f"ours {c.terms.text()}" if b == "published terms" else
                f"the cost model's {c.model.text()}" if b.startswith("cost model") else
                f"a stand-in until the run that settles it: {c.stand_in.what}, {c.stand_in.text()}" if b == "stand-in" else
                c.verdict.reason)
        lines.append(f"- {c.system}: {c.published.text} — **{c.verdict.label()}**; {ours}.")
    return ("Each published figure tested in its own terms from committed runs, the verdict by one declared rule "
            "([the claims card](docs/claims.md), [notebook](notebooks/claims.ipynb)). " + tallies(claims) + "\n\n"
            + "\n".join(lines))


def link_rate_block() -> str:
    """The cost model's transfer term at emulated link rates: predicted against measured zero_copy steps, per
    rate (worst and median error over the points), and the 1M points at the PCIe 4.0 rate when committed."""
    lines = ["| run | link (target → measured) | points | measured step (ms) | predicted / measured: median | worst | within 10% |",
             "|---|---|---|---|---|---|---|"]
    for key in ("link_rate", "link_1m"):
        run = _run(key)
        if not run:
            continue
        d = _metrics(run)
        if "predicted_step_ms" not in d:
            continue
        d = d.dropna(subset=["predicted_step_ms"])
        for rate, g in d.groupby("link_gbps"):
            err = g["predicted_step_ms"] / g["step_ms_median"] - 1
            meas = g["link_gbps_at_load"] if "link_gbps_at_load" in g else g["link_gbps_measured"]
            pts = ", ".join(f"{int(c)}×{_ctx(x)}/b{int(b)}" for c, x, b in zip(g["concurrency"], g["context_len"], g["budget"]))
            lines.append(f"| [`{Path(run).name}`](../{run}) | {rate:g} → {meas.min():.1f}–{meas.max():.1f} GB/s | "
                         f"{len(g)} ({pts}) | {g['step_ms_median'].min():.2f}–{g['step_ms_median'].max():.2f} | "
                         f"{err.median():+.1%} | {err.loc[err.abs().idxmax()]:+.1%} | {int((err.abs() <= LINK_CHECK_TOLERANCE).sum())} of {len(g)} |")
    return "\n".join(lines) if len(lines) > 2 else "(no link-rate run committed: `link_rate` in docs/runs.toml)"


def blocks() -> dict[str, str]:
    claims = card()
    return {"claims": claims_block(claims), "claims-summary": summary_block(claims), "claims-rule": rule_text(),
            "link-rate": link_rate_block()}


# ---- the card, drawn ----------------------------------------------------------------------------------------
def figure(claims: list[Claim]):
    """Each row's deciding figure over the published one (1 = the published figure), with its spread as error
    bars and the verdict's colour; rows with no figure of ours sit at 1 as open grey markers. Log scale: 0.5× and
    2× are the same distance from the published figure."""
    fig = go.Figure()
    labels = [f"{c.system}: {c.published.text}" for c in claims]
    for v in VERDICTS:
        idx = [i for i, c in enumerate(claims) if c.verdict.verdict == v]
        if not idx:
            continue
        xs, lo, hi, hover, symbols = [], [], [], [], []
        for i in idx:
            c, r = claims[i], claims[i].ratio()
            if r is None:
                xs.append(1.0), lo.append(0.0), hi.append(0.0), symbols.append("circle-open")
                hover.append(f"{c.verdict.label()}: {c.verdict.reason}")
                continue
            xs.append(r.value), lo.append(max(r.value - r.lo, 0.0)), hi.append(max(r.hi - r.value, 0.0))
            symbols.append("diamond" if c.verdict.provisional else "circle")
            hover.append(f"{c.verdict.label()} ({c.verdict.basis}): {c.verdict.reason}")
        fig.add_trace(go.Scatter(
            x=xs, y=[labels[i] for i in idx], mode="markers", name=v,
            marker=dict(color=COLOURS[v], size=12, symbol=symbols, line=dict(width=2, color=COLOURS[v])),
            error_x=dict(type="data", symmetric=False, array=hi, arrayminus=lo, color=COLOURS[v], thickness=2),
            hovertext=hover, hoverinfo="text+x"))
    fig.add_vline(x=1.0, line_dash="dash", line_color="#444")
    fig.add_vrect(x0=1 - TOLERANCE, x1=1 + TOLERANCE, fillcolor="#2ca02c", opacity=0.08, line_width=0)
    fig.update_xaxes(type="log", title="ours / published (1 = the published figure; shaded: ±"
                                       f"{TOLERANCE:.0%}; diamonds: provisional)")
    fig.update_yaxes(autorange="reversed", categoryorder="array", categoryarray=labels)
    fig.update_layout(title="Do the published figures hold?", height=120 + 38 * len(claims), legend_title="verdict",
                      margin=dict(l=20, r=20, t=60, b=60))
    return fig
