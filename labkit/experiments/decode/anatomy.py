"""Where a decode step's time goes (the per-point anatomy) and what the cost model makes of it."""
from __future__ import annotations

import textwrap

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ...costmodel import gpu, gpu_for_name, predict_table
from ...engine.transfer import STRATEGIES
from ...report.figures import TEMPLATE
from ...report.summary import cost_model_errors, decode_table, is_cpu
from ...report.units import tokens_label as _ctx
from ...shapes import metrics_shape

PHASE_COLORS = {"weights": "#4c78a8", "deltanet": "#72b7b2", "index_score": "#f58518", "selection": "#e45756",
                "transfer": "#54a24b", "attention": "#b279a2", "head": "#9d755d", "other": "#bab0ac"}


def anatomy_text(m: pd.DataFrame) -> str:
    """What the anatomy section's bars mean in this run (markdown): on a GPU, phases timed inside one CUDA
    graph that should meet the measured step within 5%; on a CPU, what holds and what does not."""
    t = anatomy_frame(m)
    if t.empty:
        return "No step anatomy in this run (`anatomy=false`, or per_row only)."
    missing = without_anatomy(m, code=True)
    missing = f" {missing}" if missing else ""
    if not is_cpu(m):
        return ("Each decode point's step split into phases (weights/GEMMs, DeltaNet, index score, selection, transfer, "
                "attention, head, other), timed by events recorded inside one extra CUDA graph of the step; the cost of "
                "the marks themselves is measured (every mark doubled in a third graph) and taken off. The black tick is "
                "the measured, unmarked step: bar and tick should meet (within 5%)." + missing)
    total = t.groupby(["strategy", "context_len", "concurrency"]).agg(ms=("ms", "sum"), step=("step_ms_median", "first"))
    r = (total["ms"] / total["step"]).replace([float("inf")], float("nan")).dropna()
    spread = f" (here the bars are {r.min():.2g}× to {r.max():.2g}× the tick)" if len(r) else ""
    return ("**CPU run.** Each phase (weights/GEMMs, DeltaNet, index score, selection, transfer, attention, head, "
            "other) is timed by wall-clock marks around eager code on this CPU; there are no CUDA graphs. The marked "
            "steps and the unmarked ones (black tick) are different runs of the step on a shared CPU, so bar and tick "
            f"need not meet{spread}. What holds here: which phases each strategy runs and how they compare within one "
            "bar. The closure check (bar within 5% of the tick) and the cost model are a GPU run's." + missing)


def without_anatomy(m: pd.DataFrame, code: bool = False) -> str:
    """The strategies this run measured but drew no anatomy for, and why, in words ("" when none). A slow
    strategy (per_row: one copy per selected row, ~0.4 s a step per request on the reference shape) is timed over
    fewer steps and one repeat, without the extra marked runs of the step that an anatomy needs."""
    d = m[(m["experiment"] == "decode") & (m["status"] == "ok")] if "experiment" in m and "status" in m else m.iloc[0:0]
    if "axis" in d:
        d = d[d["axis"] == "context"]
    t = anatomy_frame(m)
    if d.empty or t.empty:
        return ""
    missing = [s for s in dict.fromkeys(d["strategy"]) if s not in set(t["strategy"])]
    if not missing:
        return ""
    name = (lambda s: f"`{s}`") if code else str        # markdown: a strategy as code, so it starts a sentence
    slow = [name(s) for s in missing if getattr(STRATEGIES.get(s), "slow", False)]
    other = [name(s) for s in missing if not getattr(STRATEGIES.get(s), "slow", False)]
    parts = []
    if slow:
        parts.append(f"{', '.join(slow)} {'has' if len(slow) == 1 else 'have'} no anatomy: a step that slow (one copy "
                     "per selected row) is timed over fewer steps and one repeat, without the extra marked runs an anatomy "
                     "needs; its step time is in the speed plots and the table")
    if other:
        parts.append(f"{', '.join(other)} {'was' if len(other) == 1 else 'were'} measured without an anatomy")
    return "; ".join(parts) + "."


def anatomy_frame(m: pd.DataFrame) -> pd.DataFrame:
    """Tidy anatomy: one row per (point, phase) with ms, and the measured step beside it."""
    d = m[(m["experiment"] == "decode") & (m["status"] == "ok")]
    if "axis" in d:
        d = d[d["axis"] == "context"]
    cols = [c for c in d.columns if c.startswith("anat_") and c.endswith("_ms") and c != "anat_marked_step_ms"]
    if d.empty or not cols:
        return pd.DataFrame()
    t = d.melt(id_vars=["strategy", "context_len", "concurrency", "step_ms_median"], value_vars=cols,
               var_name="phase", value_name="ms")
    t["phase"] = t["phase"].str[len("anat_"):-len("_ms")]
    return t.dropna(subset=["ms"])


def anatomy_bars(m: pd.DataFrame) -> go.Figure:
    """Stacked phases per strategy and context, one panel per concurrency; a black tick marks the
    measured (unmarked) step, so the gap between bar and tick is what the anatomy leaves unexplained."""
    t = anatomy_frame(m)
    if t.empty:
        fig = go.Figure()
        fig.update_layout(title="Step anatomy", template=TEMPLATE, annotations=[{
            "text": "no anatomy in this run (anatomy=false, or per_row only)", "showarrow": False,
            "x": 0.5, "y": 0.5, "xref": "paper", "yref": "paper"}], meta={"labkit_empty": "no anatomy in this run "
                                                                           "(anatomy=false, or per_row only)"})
        return fig
    concs = sorted(int(c) for c in t["concurrency"].unique())
    fig = make_subplots(rows=len(concs), cols=1, subplot_titles=[f"concurrency {c}" for c in concs], vertical_spacing=0.12)
    for i, c in enumerate(concs, start=1):
        tc = t[t["concurrency"] == c].sort_values(["strategy", "context_len"])
        for ph, color in PHASE_COLORS.items():
            g = tc[tc["phase"] == ph]
            if g.empty:
                continue
            fig.add_trace(go.Bar(x=[g["strategy"], g["context_len"].map(_ctx)], y=g["ms"], name=ph, marker_color=color,
                                 legendgroup=ph, showlegend=i == 1,
                                 hovertemplate="%{x}<br>" + ph + " %{y:.3f} ms<extra></extra>"), row=i, col=1)
        steps = tc.drop_duplicates(["strategy", "context_len"])
        fig.add_trace(go.Scatter(x=[steps["strategy"], steps["context_len"].map(_ctx)], y=steps["step_ms_median"],
                                 mode="markers", marker={"symbol": "line-ew-open", "size": 22, "color": "black",
                                                         "line": {"width": 2}},
                                 name="measured step", legendgroup="step", showlegend=i == 1,
                                 hovertemplate="%{x}<br>measured step %{y:.3f} ms<extra></extra>"), row=i, col=1)
    title = "Step anatomy: where each decode step's time goes (ms)"
    missing = without_anatomy(m)
    if missing:          # a strategy the run measured is not among the bars: the chart says why
        lines = textwrap.wrap(missing, 110)
        title += "".join(f"<br><sup>{ln}</sup>" for ln in lines)
    extra = 18 * len(textwrap.wrap(missing, 110)) if missing else 0
    fig.update_layout(barmode="stack", template=TEMPLATE, height=380 * len(concs) + extra,
                      title=title, margin={"t": 80 + 2 * extra})
    fig.update_yaxes(title="ms per step")
    return fig


def cost_model_check(m: pd.DataFrame) -> go.Figure | None:
    """Predicted (from one point per strategy) against measured step times of this run."""
    err = cost_model_errors(m)
    if err is None or err.empty:
        return None
    fig = go.Figure()
    for s, g in err.groupby("strategy"):
        fig.add_trace(go.Scatter(x=g["measured_ms"], y=g["predicted_ms"], mode="markers", name=s,
                                 customdata=g[["context_len", "concurrency", "error"]].to_numpy(),
                                 hovertemplate="context %{customdata[0]} c=%{customdata[1]}<br>measured %{x:.2f} ms"
                                               "<br>predicted %{y:.2f} ms (%{customdata[2]:+.1%})<extra>" + s + "</extra>"))
    top = float(max(err["measured_ms"].max(), err["predicted_ms"].max())) * 1.05
    fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", line={"dash": "dot", "color": "gray"}, name="exact"))
    fig.update_layout(template=TEMPLATE, title="Cost model on this GPU: predicted vs measured step (fit on one point per strategy)",
                      xaxis_title="measured step (ms)", yaxis_title="predicted step (ms)")
    return fig


def prediction_text(m: pd.DataFrame) -> str:
    """The heading and first line of the reference-box prediction section (markdown), or why there is none."""
    if is_cpu(m):
        return ("## Prediction for a GPU\n_Not from a CPU run: `labkit predict RUN_DIR` scales a GPU run's step anatomy "
                "by the specs of the GPU it ran on and of the target GPU (labkit/data/gpus.toml)._")
    return ("## Predicted on the reference box (3× RTX 3090, PCIe 4.0) — a prediction, not a measurement\n"
            "`labkit predict RUN_DIR --gpu rtx3090 --gpus 3`: each phase of this run's anatomy as fixed time + bytes / "
            "bandwidth, the bandwidths scaled to the RTX 3090's memory (936 GB/s) and PCIe 4.0 link, the layers in "
            "three stages one after another (no pipelining), memory checked per card. The plot above shows how well "
            "the same model predicts this run's own points.")


def reference_box_prediction(m: pd.DataFrame, gpu_key: str = "rtx3090", n_gpus: int = 3) -> pd.DataFrame | None:
    """PREDICTED tok/s on the reference box, from this run's anatomies (None when the run cannot say)."""
    d = decode_table(m)
    if d.empty or "anat_weights_ms" not in m or not m["gpu_name"].notna().any():
        return None
    src = gpu_for_name(str(m["gpu_name"].dropna().iloc[0]))
    if src is None:
        return None
    tab = predict_table(m, metrics_shape(m), src, gpu(gpu_key), n_gpus)
    tab = tab[["strategy", "concurrency", "context_len", "predicted_step_ms", "predicted_tok_s", "fits",
               "memory_gib_per_gpu"]].copy()
    tab["fits"] = tab["fits"].map({True: "fits", False: "does not fit"})     # words, not a raw bool
    return tab
