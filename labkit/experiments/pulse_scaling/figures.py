"""Figures of `labkit run pulse_scaling` (PulseInfer at long context, every request offloaded): aggregate tok/s
against requests, one batch against two switched, with the bounds and the crossover where switching pays."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go


def scaling(m: pd.DataFrame) -> go.Figure:
    """Aggregate tok/s vs requests (all offloaded): one batch vs two switched, measured, against the
    two-batch bound from the measured compute and link (`experiments.pulse_scaling.measure.two_batch_bound`), the
    compute-only (rows in HBM) line, and the crossover where switching starts to pay."""
    ok = m[m["status"] == "ok"].sort_values("concurrency")
    fig = go.Figure()
    style = {"no_switch": ("one batch, no switching", "#e45756"), "switched": ("two batches switched", "#4c78a8"),
             "resident": ("rows in HBM (compute only)", "#bab0ac")}
    for mode, (name, color) in style.items():
        g = ok[ok["mode"] == mode]
        if len(g):
            fig.add_scatter(x=g["concurrency"], y=g["tok_s"], mode="lines+markers", name=name,
                            line=dict(color=color, dash="dot" if mode == "resident" else "solid"))
    b = ok[ok["mode"] == "no_switch"].dropna(subset=["no_switch_model_ms"]) if "no_switch_model_ms" in ok else ok[:0]
    if len(b):
        fig.add_scatter(x=b["concurrency"], y=b["concurrency"] / b["no_switch_model_ms"] * 1e3, mode="lines",
                        name="model: compute + transfer", line=dict(color="#e45756", dash="dash", width=1))
        s = ok[ok["mode"] == "switched"].dropna(subset=["switched_floor_ms"])
        fig.add_scatter(x=s["concurrency"], y=s["concurrency"] / s["switched_floor_ms"] * 1e3, mode="lines",
                        name="bound: two batches switched", line=dict(color="#4c78a8", dash="dash", width=1))
    if "crossover_physics" in ok and ok["crossover_physics"].notna().any():
        x = float(ok["crossover_physics"].dropna().iloc[0])
        fig.add_vline(x=x, line_dash="dot", annotation_text=f"weights/HBM = N x rows/link: N = {x:.1f}")
    x2 = measured_crossover(ok)
    if x2 is not None:
        fig.add_vline(x=x2, line_dash="dash", line_color="#4c78a8",
                      annotation_text=f"measured compute: extra weight read = transfer at N = {x2:.1f}",
                      annotation_position="bottom right")
    ctx = int(ok["context_len"].iloc[0]) if len(ok) else 0
    fig.update_layout(title=f"Concurrency scaling, every request offloaded ({ctx // 1024}K context)",
                      xaxis_title="requests", yaxis_title="aggregate tok/s", height=420)
    return fig


def measured_crossover(m: pd.DataFrame):
    """N where the measured extra weight read of switching (C(a) + C(b) - C(N)) equals the merged batch's
    transfer time (interpolated between measured N); None when it is not crossed in the range."""
    if not {"extra_weight_ms", "transfer_ms"} <= set(m.columns):      # no link measured (CPU)
        return None
    s = m[(m["mode"] == "switched")].dropna(subset=["extra_weight_ms", "transfer_ms"]).sort_values("concurrency")
    if s.empty:
        return None
    d = (s["transfer_ms"] - s["extra_weight_ms"]).to_numpy()
    n = s["concurrency"].to_numpy()
    for i in range(1, len(d)):
        if d[i - 1] < 0 <= d[i]:
            return float(n[i - 1] + (n[i] - n[i - 1]) * (-d[i - 1]) / (d[i] - d[i - 1]))
    return None
