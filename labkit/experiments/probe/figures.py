"""Figures of the link probe (`labkit run probe`, and the probe rows a decode run measures first): the link's GB/s per
path under the contiguous pinned copy, the weight products under the device's read bandwidth, host RAM and the link
under a host-memory load."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from ...report.figures import COLORS, TEMPLATE, empty_figure, log_axis
from ...report.summary import link_gbps, ok_rows


def probe_bars(m: pd.DataFrame) -> go.Figure:
    p = ok_rows(m[m["experiment"] == "probe"]) if "experiment" in m else m.iloc[0:0]
    if p.empty:
        return empty_figure("Host link limits", "no probe rows")
    if "direction" in p:
        p = p[p["direction"].isna() | (p["direction"] == "h2d")]
    p = p[p["strategy"].isin(["contiguous", "pageable", "per_row", "host_gather", "zero_copy", "hbm_gather"])]
    if p.empty:      # probe=false: the sweep still times the HBM read (the weights' bound), not the link
        return empty_figure("Host link limits", "no link probe in this run (probe=false); `labkit probe` measures it")
    labels = []
    for _, r in p.iterrows():
        extra = ""
        if r["strategy"] in ("contiguous", "pageable") and "size_mib" in r and pd.notna(r.get("size_mib")):
            extra = f" {int(r['size_mib'])} MiB"
        elif r["strategy"] == "host_gather" and pd.notna(r.get("threads")):
            extra = f" {int(r['threads'])} thr"
        elif r["strategy"] == "zero_copy" and pd.notna(r.get("rows_per_prog")):
            extra = f" {int(r['rows_per_prog'])}r/{int(r['num_warps'])}w"
        labels.append(r["strategy"] + extra)
    fig = go.Figure(go.Bar(x=labels, y=p["gbps"], marker_color=[COLORS.get(s, "#444") for s in p["strategy"]],
                           text=[f"{v:.1f}" for v in p["gbps"]], textposition="outside"))
    link = link_gbps(m)
    if link:
        fig.add_hline(y=link, line_dash="dash", annotation_text=f"contiguous pinned H2D {link:.1f} GB/s")
    # fitted to the bars (and the dashed line) with room for the labels above them: plotly's autorange
    # of a log axis with outside text ran to 1M GB/s
    vals = list(p["gbps"]) + ([link] if link else [])
    fig.update_yaxes(title="GB/s (host → device)", **log_axis(vals, pad=2.5))
    fig.update_layout(title="Host link limits for sparse KV gathers (48 MiB decode step of the reference shape)",
                      template=TEMPLATE, height=430)
    return fig


def weight_product_bars(m: pd.DataFrame) -> go.Figure:
    """The probe's `weight_product` rows: GB/s per weight matrix at each activation-row count, cuBLAS
    beside the lab's GEMV, under the contiguous HBM read (the bound a step's weights phase cannot beat)."""
    p = ok_rows(m[(m["experiment"] == "probe") & (m["strategy"] == "weight_product")]) if "strategy" in m else m.iloc[0:0]
    if p.empty or "matrix" not in p:
        return empty_figure("Weight products", "no weight products in this run (a CPU run, or a probe before they were timed)")
    fig = go.Figure()
    for (path, M), g in p.groupby(["path", "M"], sort=True):
        fig.add_bar(x=g["matrix"], y=g["gbps"], name=f"{path}, M = {int(M)}",
                    text=[f"{v:.0f}" for v in g["gbps"]], textposition="outside")
    read = m[(m["experiment"] == "probe") & (m["strategy"] == "hbm_read")]["gbps"].dropna()
    if len(read):
        fig.add_hline(y=float(read.median()), line_dash="dash",
                      annotation_text=f"contiguous HBM read {float(read.median()):.0f} GB/s")
    fig.update_yaxes(title="GB/s (weight bytes / product time)", rangemode="tozero")
    fig.update_layout(title="Weight products at decode batch sizes, each matrix streamed once", barmode="group",
                      template=TEMPLATE, height=430)
    return fig


def host_memory_bars(m: pd.DataFrame) -> go.Figure:
    """Host RAM bandwidth (STREAM's kernels, one core and all) and, on a GPU host, the link idle and under a
    host-memory load: what bounds the CPU-staged strategies, and what the link keeps when the host is busy."""
    p = ok_rows(m[m["experiment"] == "probe"]) if "experiment" in m else m.iloc[0:0]
    host = p[p["strategy"].isin(["host_read", "host_write", "host_copy", "host_triad"])] if not p.empty else p
    if host.empty:
        return empty_figure("Host memory", "no host-memory rows in this run (`labkit run probe` measures them)")
    fig = go.Figure()
    for th, g in host.groupby("threads"):
        fig.add_trace(go.Bar(x=g["strategy"].str.replace("host_", "", regex=False), y=g["gbps"],
                             name=f"{int(th)} core{'s' if th != 1 else ''}", text=[f"{v:.1f}" for v in g["gbps"]],
                             textposition="outside"))
    loaded = p[p["strategy"].isin(["contiguous_under_host_load", "zero_copy_under_host_load"])]
    if not loaded.empty:
        idle = p[((p["strategy"] == "contiguous") & (p.get("direction") == "h2d") & (p.get("size_mib") == 256))
                 | ((p["strategy"] == "zero_copy") & (p.get("rows_per_prog") == 4) & (p.get("num_warps") == 4))]
        fig.add_trace(go.Bar(x=["link H2D 256 MiB", "link zero_copy step"], name="link idle",
                             y=[idle.loc[idle["strategy"] == s, "gbps"].max() for s in ("contiguous", "zero_copy")]))
        fig.add_trace(go.Bar(x=["link H2D 256 MiB", "link zero_copy step"], name="link, host RAM busy",
                             y=[loaded.loc[loaded["strategy"] == s, "gbps"].max()
                                for s in ("contiguous_under_host_load", "zero_copy_under_host_load")]))
    reps = host["repeats"].max() if "repeats" in host else None
    fig.update_layout(barmode="group", title="Host memory (STREAM kernels, median of "
                      f"{int(reps) if reps == reps and reps else '?'} repeats) and the link under a host-memory load",
                      yaxis_title="GB/s", template=TEMPLATE, height=400)
    return fig
