"""Figures of `labkit run multigpu` (the layer split over several GPUs of one host): one function per
figure, data in, plotly out. Every speed plot carries its bound: N x one GPU's gather bandwidth."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ...report.units import tokens_label as _ctx

LAYOUT_ORDER = ["1gpu", "split", "pipelined"]
COLORS = {"1gpu": "#4c78a8", "split": "#bab0ac", "pipelined": "#f58518"}




def _ok(m: pd.DataFrame, experiment: str) -> pd.DataFrame:
    return m[(m["experiment"] == experiment) & (m["status"] == "ok")]


def gather_scaling(m: pd.DataFrame) -> go.Figure:
    """One decode step's zero-copy gathers: each GPU alone, then all at once (per GPU and aggregate),
    against N x the best single GPU (what independent links would give)."""
    g = _ok(m, "gather")
    fig = go.Figure()
    if g.empty:
        return fig.update_layout(title="gather scaling: not measured")
    alone, together = g[g["mode"] == "alone"], g[g["mode"] == "together"]
    fig.add_bar(x=[f"{d} alone" for d in alone["device"]], y=alone["gbps"], name="alone", marker_color="#4c78a8")
    fig.add_bar(x=[f"{d} together" for d in together["device"]], y=together["gbps"], name="together, per GPU",
                marker_color="#72b7b2")
    agg = float(together["gbps_aggregate"].iloc[0])
    fig.add_bar(x=["aggregate"], y=[agg], name="together, aggregate", marker_color="#f58518")
    bound = len(alone) * float(alone["gbps"].max())
    fig.add_hline(y=bound, line_dash="dash", annotation_text=f"{len(alone)} x one GPU = {bound:.1f} GB/s")
    fig.update_layout(title=f"Zero-copy gather, one GPU vs all at once: {agg / float(alone['gbps'].max()):.2f}x",
                      yaxis_title="GB/s", height=380)
    return fig


def _bound_tok_s(m: pd.DataFrame, row) -> float | None:
    """The link bound of a zero_copy point: its rows over the links it uses, each at one GPU's measured
    gather bandwidth (1gpu: one link; split/pipelined: every link)."""
    g = _ok(m, "gather")
    if row["strategy"] != "zero_copy" or g.empty or not row.get("h2d_bytes_per_step"):
        return None
    one = float(g[g["mode"] == "alone"]["gbps"].max()) * 1e9
    links = 1 if row["layout"] == "1gpu" else g["device"].nunique()
    return row["concurrency"] / (row["h2d_bytes_per_step"] / (links * one))


def tok_s_by_layout(m: pd.DataFrame) -> go.Figure:
    """Aggregate decode tok/s per layout, a panel per (strategy, context); the best micro-batch count
    for `pipelined`; diamonds: the link bound of zero_copy points."""
    d = _ok(m, "decode").copy()
    if d.empty:
        return go.Figure().update_layout(title="decode: nothing measured")
    d = d.sort_values("tok_s").groupby(["strategy", "context_len", "concurrency", "layout"], as_index=False).last()
    panels = sorted({(s, int(c)) for s, c in zip(d["strategy"], d["context_len"])})
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[f"{s} @ {_ctx(c)}" for s, c in panels],
                        shared_yaxes=False)
    for j, (s, c) in enumerate(panels, 1):
        p = d[(d["strategy"] == s) & (d["context_len"] == c)]
        for lay in LAYOUT_ORDER:
            q = p[p["layout"] == lay].sort_values("concurrency")
            if q.empty:
                continue
            text = [f"mb={int(mb)}" if lay == "pipelined" else "" for mb in q["micro_batches"]]
            fig.add_bar(x=q["concurrency"].astype(int).astype(str), y=q["tok_s"], name=lay, legendgroup=lay,
                        marker_color=COLORS[lay], showlegend=j == 1, text=text, row=1, col=j)
            b = [(_bound_tok_s(m, r)) for _, r in q.iterrows()]
            if any(v is not None for v in b):
                fig.add_scatter(x=q["concurrency"].astype(int).astype(str), y=b, mode="markers",
                                marker_symbol="diamond", marker_color=COLORS[lay], name=f"{lay} link bound",
                                legendgroup=f"{lay}b", showlegend=j == 1, row=1, col=j)
        fig.update_xaxes(title_text="concurrency", row=1, col=j)
    fig.update_yaxes(title_text="tok/s (all requests)", row=1, col=1)
    fig.update_layout(barmode="group", height=420, title="Decode on one GPU vs the layers split over all")
    return fig


def link_bytes_per_gpu(m: pd.DataFrame) -> go.Figure:
    """Each GPU's PCIe RX per step (NVML) beside its stage's engine-counted bytes, split points only."""
    d = _ok(m, "decode")
    d = d[d["layout"] != "1gpu"]
    stages = sorted(int(c.rsplit("stage", 1)[1]) for c in d.columns if c.startswith("h2d_bytes_per_step_stage"))
    if d.empty or not stages:
        return go.Figure().update_layout(title="per-GPU bytes: no split points")
    d = d[d["strategy"] != "resident"]
    label = [f"{s} {_ctx(int(c))} c={int(n)} {lay}" + (f" mb={int(mb)}" if lay == "pipelined" else "")
             for s, c, n, lay, mb in zip(d["strategy"], d["context_len"], d["concurrency"], d["layout"], d["micro_batches"])]
    fig = go.Figure()
    for k in stages:
        fig.add_bar(x=label, y=d[f"h2d_bytes_per_step_stage{k}"] / 2**20, name=f"stage {k}: engine-counted")
        col = f"nvml_rx_bytes_per_step_gpu{k}"
        if col in d:
            fig.add_bar(x=label, y=d[col] / 2**20, name=f"GPU {k}: NVML PCIe RX")
    fig.update_layout(barmode="group", yaxis_title="MiB per step", height=420,
                      title="Each GPU's link carries its own stage's rows")
    return fig


def bubbles(m: pd.DataFrame) -> go.Figure:
    """Idle share of the stages per split point: the stages taking turns vs micro-batches in flight."""
    d = _ok(m, "decode")
    d = d[(d["layout"] != "1gpu") & d["bubble_share"].notna()] if "bubble_share" in d else d.iloc[0:0]
    if d.empty:
        return go.Figure().update_layout(title="bubbles: no timeline")
    fig = go.Figure()
    for mb, q in d.groupby("micro_batches"):
        lab = [f"{s} {_ctx(int(c))} c={int(n)}" for s, c, n in zip(q["strategy"], q["context_len"], q["concurrency"])]
        fig.add_bar(x=lab, y=q["bubble_share"], name="stages take turns" if mb == 1 else f"{int(mb)} micro-batches")
    fig.add_hline(y=0.5, line_dash="dot", annotation_text="2 stages taking turns: 1/2")
    fig.update_layout(barmode="group", yaxis_title="idle share of the stages", yaxis_range=[0, 1], height=380,
                      title="Bubbles per step (from the sampled steps' timeline)")
    return fig


def stage_timeline(tl: pd.DataFrame, strategy: str, context_len: int, concurrency: int) -> go.Figure:
    """The sampled steps of one point, a row per stage, a bar per micro-batch: the stages taking turns
    (top) and the best-pipelined micro-batch count (bottom)."""
    t = tl[(tl["strategy"] == strategy) & (tl["context_len"] == context_len) & (tl["concurrency"] == concurrency)]
    if t.empty:
        return go.Figure().update_layout(title="timeline: point not sampled")
    mbs = sorted(t["micro_batches"].unique())
    shown = [mbs[0]] + ([mbs[1]] if len(mbs) > 1 else [])
    fig = make_subplots(rows=len(shown), cols=1, shared_xaxes=False,
                        subplot_titles=[f"micro_batches={int(mb)}" for mb in shown])
    palette = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2"]
    for i, mb in enumerate(shown, 1):
        q = t[t["micro_batches"] == mb]
        q = q.assign(start_ms=q["start_ms"] - q["start_ms"].min(), end_ms=q["end_ms"] - q["start_ms"].min())
        for m_i, g in q.groupby("micro_batch"):
            fig.add_bar(y=[f"stage {int(s)}" for s in g["stage"]], x=g["end_ms"] - g["start_ms"], base=g["start_ms"],
                        orientation="h", name=f"micro-batch {int(m_i)}", legendgroup=str(m_i),
                        marker_color=palette[int(m_i) % len(palette)], showlegend=i == len(shown),
                        hovertext=[f"step {int(s)}" for s in g["step"]], row=i, col=1)
        fig.update_xaxes(title_text="ms", row=i, col=1)
    fig.update_layout(height=220 * len(shown) + 80, barmode="overlay",
                      title=f"Stage timeline: {strategy}, {_ctx(context_len)}, {concurrency} requests")
    return fig
