"""PulseInfer's trace replay per window (`labkit.experiments.trace_windows`): one point per window and policy,
calibration windows drawn open (their policies were chosen on them), test windows filled, and a one-window
replay of the past (thresholds read off its own window) as a cross on its window."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

REFERENCE = "reference"
PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


def ratio_figure(ratios: pd.DataFrame, reference: str, system: str = "labkit",
                 single: pd.DataFrame | None = None, single_label: str = "") -> go.Figure:
    """Throughput and p99 TPOT per window as ratios to `reference` on the same window (1 = the reference).
    `ratios`: `window_ratios` rows (window, role, arm, policy, throughput_ratio, tpot_p99_ratio);
    `single`: a one-window run's rows in the same form (`pulse_windows.single_window`)."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=(f"output throughput / {reference}",
                                                        f"p99 TPOT / {reference} (below 1: lower)"))
    arms = [a for a in dict.fromkeys(ratios["arm"]) if a != REFERENCE]
    for i, arm in enumerate(arms):
        color = PALETTE[i % len(PALETTE)]
        for role, symbol in (("calibration", "circle-open"), ("test", "circle")):
            g = ratios[(ratios["arm"] == arm) & (ratios["role"] == role)]
            if g.empty:
                continue
            name = f"{arm}, {role} windows"
            text = g["policy"].tolist()
            for col, y in ((1, "throughput_ratio"), (2, "tpot_p99_ratio")):
                fig.add_scatter(x=g["window"], y=g[y], mode="markers", name=name, legendgroup=name,
                                showlegend=col == 1, text=text, marker=dict(color=color, symbol=symbol, size=10,
                                                                            line=dict(width=2, color=color)),
                                hovertemplate="window %{x}: %{y:.3f} (%{text})", row=1, col=col)
    if single is not None and len(single):
        s = single[single["arm"] != REFERENCE]
        for col, y in ((1, "throughput_ratio"), (2, "tpot_p99_ratio")):
            fig.add_scatter(x=s["window"], y=s[y], mode="markers", name=single_label or "one-window run",
                            legendgroup="single", showlegend=col == 1, text=s["policy"],
                            marker=dict(color="black", symbol="x", size=9),
                            hovertemplate="window %{x}: %{y:.3f} (%{text})", row=1, col=col)
    for col in (1, 2):
        fig.add_hline(y=1.0, line=dict(color="grey", dash="dash"), row=1, col=col)
        fig.update_xaxes(title_text="trace window", tickmode="linear", dtick=1, row=1, col=col)
    fig.update_yaxes(title_text="ratio to the reference, same window", row=1, col=1)
    fig.update_layout(title=f"PulseInfer's placement per trace window ({system}): open = calibration windows "
                            f"(thresholds chosen there), filled = test windows", height=440)
    return fig


def window_table(ratios: pd.DataFrame) -> pd.DataFrame:
    """Windows down, policies across: `throughput ratio / p99 TPOT ratio` per cell."""
    t = ratios[ratios["arm"] != REFERENCE].copy()
    t["cell"] = [f"{a:.2f} / {b:.2f}" if pd.notna(a) and pd.notna(b) else "-"
                 for a, b in zip(t["throughput_ratio"], t["tpot_p99_ratio"])]
    t["window"] = [f"{int(w)} ({r})" for w, r in zip(t["window"], t["role"])]
    return t.pivot_table(index="window", columns="arm", values="cell", aggfunc="first", sort=False)
