"""Figures of a decode sweep (`labkit run decode`): tok/s against context, budget and concurrency, step time, bytes
moved (the engine's count against NVML's), memory held, the hot cache's hit rate and anatomy. Every speed plot
carries its physical bound where one exists: the link bound (bytes per step / the contiguous pinned H2D GB/s
measured in the same run). The step anatomy and the cost model's reading of it: `anatomy.py` beside this."""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ...report.figures import (COLORS, TEMPLATE, ctx_ticks, empty_figure, empty_reason, fmt_tok_s, log_axis, log_ticks,
                               step_error_bars)
from ...report.summary import decode_table, is_cpu, link_gbps, ok_rows
from ...report.units import tokens_label


def tok_s_vs_context(m: pd.DataFrame) -> go.Figure:
    """Aggregate tok/s per strategy, one facet per concurrency. The y axis is logarithmic and fitted to the
    strategies (per_row sits two decades below the rest); the link bound is drawn when it lies near the
    data and otherwise named in each facet with its value, so it never squashes the strategies together."""
    d = decode_table(m)
    if d.empty:
        return empty_figure("Decode tok/s vs context", "no decode points")
    concs = sorted(int(c) for c in d["concurrency"].unique())
    # each facet its own range: aggregate tok/s grows with concurrency, a shared axis would flatten both
    fig = make_subplots(rows=1, cols=len(concs), subplot_titles=[f"concurrency {c}" for c in concs])
    link = link_gbps(m)
    bounds: dict[int, pd.Series] = {}
    for c in concs:
        off = d[(d["concurrency"] == c) & (d["h2d_bytes_per_step"] > 0)].groupby("context_len")["h2d_bytes_per_step"].max()
        if link and not off.empty:
            bounds[c] = (c / (off.sort_index() / (link * 1e9))).astype(float)
    bound_in_legend = False
    for j, c in enumerate(concs, start=1):
        dc = d[d["concurrency"] == c]
        for s, g in dc.groupby("strategy", sort=False):
            g = g.sort_values("context_len")
            fig.add_trace(go.Scatter(x=g["context_len"], y=g["tok_s"], mode="lines+markers", name=s,
                                     legendgroup=s, showlegend=j == 1, line={"color": COLORS.get(s)},
                                     error_y=step_error_bars(g), customdata=np.stack([g["step_ms_median"], g["h2d_bytes_per_step"] / 2**20], -1),
                                     hovertemplate="%{x} tokens<br>%{y:.1f} tok/s<br>step %{customdata[0]:.2f} ms"
                                                   "<br>H2D %{customdata[1]:.1f} MiB/step<extra>" + s + "</extra>"), row=1, col=j)
        lo_err = dc["concurrency"] / (dc["step_ms_max"] / 1e3)
        hi_err = dc["concurrency"] / (dc["step_ms_min"] / 1e3)
        y_lo = float(np.nanmin(np.minimum(lo_err, dc["tok_s"])))
        y_hi = float(np.nanmax(np.maximum(hi_err, dc["tok_s"])))
        bound = bounds.get(c)
        near = bound is not None and bound.max() <= 3 * y_hi     # drawn only where it does not flatten the data
        if near:
            y_hi = max(y_hi, float(bound.max()))
        if bound is not None and near:
            fig.add_trace(go.Scatter(x=bound.index, y=bound.values, mode="lines", name=f"link bound ({link:.1f} GB/s)",
                                     legendgroup="bound", showlegend=not bound_in_legend, line={"dash": "dash", "color": "black"},
                                     hovertemplate="transfer alone: %{y:.0f} tok/s<extra>link bound</extra>"), row=1, col=j)
            bound_in_legend = True
        elif bound is not None:
            lo_b, hi_b = fmt_tok_s(bound.min()), fmt_tok_s(bound.max())
            fig.add_annotation(text=f"▲ link bound {lo_b if lo_b == hi_b else f'{lo_b}–{hi_b}'} tok/s "
                                    f"(H2D alone at {link:.1f} GB/s), above this axis",
                               xref=f"x{'' if j == 1 else j} domain", yref=f"y{'' if j == 1 else j} domain", x=0.02, y=0.98,
                               xanchor="left", yanchor="top", showarrow=False, font={"size": 11},
                               bgcolor="rgba(255,255,255,0.8)", bordercolor="black", borderwidth=1)
        fig.update_xaxes(type="log", title="context (tokens)", row=1, col=j, **ctx_ticks(dc["context_len"]))
        # a named bound needs an empty band at the top for its label: more headroom there
        lo_r, hi_r = y_lo / 1.25, y_hi * (1.6 if near or bound is None else 4.0)
        fig.update_yaxes(title="decode tok/s (aggregate, log)" if j == 1 else None, type="log", row=1, col=j,
                         range=[np.log10(lo_r), np.log10(hi_r)], **log_ticks(lo_r, hi_r))
    fig.update_layout(title="Decode speed vs context length (budget {})".format(int(d["budget"].iloc[0])),
                      template=TEMPLATE, height=430)
    return fig


def tok_s_vs_context_caption(m: pd.DataFrame, fig: go.Figure) -> str:
    """The words under `tok_s_vs_context`, saying only what that figure draws: the dashed link bound where it is
    drawn, the bound named in each facet where it lies far above the data, and why there is none where the run
    measured no host link (a CPU has none)."""
    text = "Aggregate tok/s (error bars: fastest and slowest step)."
    bound = ("the link bound, tokens/s if only the selected rows' transfer took time at the contiguous pinned H2D "
             "bandwidth measured in this run")
    if any("link bound" in (t.name or "") for t in fig.data):
        return f"{text} Dashed: {bound}."
    if any("link bound" in (a.text or "") for a in fig.layout.annotations):
        return f"{text} The boxed note in each facet names {bound}; it lies far above the strategies, so it is not drawn."
    if empty_reason(fig):
        return text
    why = "a CPU run has no host link to bound it" if is_cpu(m) else \
        "this run measured no contiguous pinned H2D copy (no probe rows) to bound it"
    return f"{text} No link bound: {why}."


def step_ms_vs_context(m: pd.DataFrame) -> go.Figure:
    d = decode_table(m)
    if d.empty:
        return empty_figure("Decode step time", "no decode points")
    fig = go.Figure()
    for (s, c), g in d.groupby(["strategy", "concurrency"], sort=False):
        g = g.sort_values("context_len")
        fig.add_trace(go.Scatter(x=g["context_len"], y=g["step_ms_median"], mode="lines+markers", name=f"{s} c={int(c)}",
                                 line={"color": COLORS.get(s), "dash": "solid" if c == d["concurrency"].min() else "dot"},
                                 error_y=step_error_bars(g, "step_ms_median")))
    fig.update_xaxes(type="log", title="context (tokens)", **ctx_ticks(d["context_len"]))
    fig.update_yaxes(title="step time (ms), median with min/max",
                     **log_axis(pd.concat([d["step_ms_min"], d["step_ms_max"], d["step_ms_median"]])))
    fig.update_layout(title="Decode step time vs context", template=TEMPLATE, height=420)
    return fig


def tok_s_vs_budget(m: pd.DataFrame) -> go.Figure:
    d = ok_rows(m[m["experiment"] == "decode"])
    if d.empty or "axis" not in d:
        return empty_figure("Decode tok/s vs budget", "no budget axis in this run")
    ctx = d[d["axis"] == "budget"]["context_len"]
    if ctx.empty:
        return empty_figure("Decode tok/s vs budget", "no budget axis in this run (one budget)")
    ctx, c = int(ctx.iloc[0]), int(d[d["axis"] == "budget"]["concurrency"].iloc[0])
    d = d[(d["context_len"] == ctx) & (d["concurrency"] == c)]
    fig = go.Figure()
    for s, g in d.groupby("strategy", sort=False):
        g = g.sort_values("budget")
        fig.add_trace(go.Scatter(x=g["budget"], y=g["tok_s"], mode="lines+markers", name=s, line={"color": COLORS.get(s)},
                                 error_y=step_error_bars(g)))
    link = link_gbps(m)
    off = d[d["h2d_bytes_per_step"] > 0].groupby("budget")["h2d_bytes_per_step"].max().sort_index()
    ys = pd.concat([d["tok_s"], c / (d["step_ms_max"] / 1e3), c / (d["step_ms_min"] / 1e3)])
    if link and not off.empty:
        bound = c / (off / (link * 1e9))
        if bound.max() <= 3 * ys.max():       # drawn only where it does not flatten the data, else named
            fig.add_trace(go.Scatter(x=bound.index, y=bound.values, mode="lines", name=f"link bound ({link:.1f} GB/s)",
                                     line={"dash": "dash", "color": "black"}))
            ys = pd.concat([ys, bound])
        else:
            fig.add_annotation(text=f"▲ link bound {fmt_tok_s(bound.min())}–{fmt_tok_s(bound.max())} tok/s "
                                    f"(H2D alone at {link:.1f} GB/s), far above this axis",
                               xref="paper", yref="paper", x=0.02, y=0.98, xanchor="left", yanchor="top", showarrow=False,
                               font={"size": 11}, bgcolor="rgba(255,255,255,0.8)", bordercolor="black", borderwidth=1)
    budgets = sorted(int(b) for b in d["budget"].unique())
    fig.update_xaxes(type="log", title="indexer budget (selected tokens per QSA layer)", tickvals=budgets,
                     ticktext=[tokens_label(b) for b in budgets])
    fig.update_yaxes(title="decode tok/s", **log_axis(ys, pad=1.6))
    fig.update_layout(title=f"Decode speed vs budget (context {tokens_label(ctx)}, concurrency {c})", template=TEMPLATE, height=420)
    return fig


def tok_s_vs_concurrency(m: pd.DataFrame) -> go.Figure:
    d = decode_table(m)
    if d.empty or d["concurrency"].nunique() < 2:
        return empty_figure("Aggregate tok/s vs concurrency", "one concurrency value in this run")
    fig = go.Figure()
    for s, g in d.groupby("strategy", sort=False):
        for ctx, gc in g.groupby("context_len"):
            if ctx not in (d["context_len"].min(), d["context_len"].max()):
                continue
            gc = gc.sort_values("concurrency")
            fig.add_trace(go.Scatter(x=gc["concurrency"], y=gc["tok_s"], mode="lines+markers",
                                     name=f"{s} @ {tokens_label(ctx)}", error_y=step_error_bars(gc),
                                     line={"color": COLORS.get(s), "dash": "solid" if ctx == d["context_len"].max() else "dot"}))
    fig.update_xaxes(title="concurrent requests", tickvals=sorted(d["concurrency"].unique()))
    fig.update_yaxes(title="aggregate decode tok/s", rangemode="tozero")
    fig.update_layout(title="Aggregate decode speed vs concurrency (smallest and largest context)", template=TEMPLATE, height=420)
    return fig


def bytes_engine_vs_nvml(m: pd.DataFrame) -> go.Figure:
    d = decode_table(m)
    if d.empty or "nvml_rx_bytes_per_step" not in d or d["nvml_rx_bytes_per_step"].isna().all():
        return empty_figure("H2D bytes per step: engine vs NVML", "NVML PCIe counters not available on this machine (CPU run)")
    d = d.dropna(subset=["nvml_rx_bytes_per_step"])
    fig = go.Figure()
    for s, g in d.groupby("strategy", sort=False):
        fig.add_trace(go.Scatter(x=g["h2d_bytes_per_step"] / 2**20, y=g["nvml_rx_bytes_per_step"] / 2**20, mode="markers",
                                 name=s, marker={"color": COLORS.get(s), "size": 9},
                                 text=[f"ctx {int(a)} c={int(b)}" for a, b in zip(g["context_len"], g["concurrency"])],
                                 hovertemplate="%{text}<br>engine %{x:.1f} MiB<br>NVML RX %{y:.1f} MiB<extra>" + s + "</extra>"))
    top = float(max(d["h2d_bytes_per_step"].max(), d["nvml_rx_bytes_per_step"].max())) / 2**20 * 1.1 + 1
    xs = np.array([0, top])
    fig.add_trace(go.Scatter(x=xs, y=xs, mode="lines", name="equal", line={"dash": "dash", "color": "gray"}))
    fig.add_trace(go.Scatter(x=np.r_[xs, xs[::-1]], y=np.r_[xs * 0.85, xs[::-1] * 1.15], fill="toself", mode="none",
                             name="±15%", fillcolor="rgba(0,0,0,0.07)"))
    fig.update_xaxes(title="engine-counted H2D MiB per step")
    fig.update_yaxes(title="NVML PCIe RX MiB per step")
    fig.update_layout(title="Bytes moved per step: engine count vs NVML PCIe RX counter", template=TEMPLATE, height=430)
    return fig


def memory_held(m: pd.DataFrame) -> go.Figure:
    d = decode_table(m)
    if d.empty:
        return empty_figure("Memory held", "no decode points")
    d = d[d["concurrency"] == d["concurrency"].min()]
    fig = go.Figure()
    for s, g in d.groupby("strategy", sort=False):
        g = g.sort_values("context_len")
        for col, dash, label in (("device_kv_bytes", "solid", "device KV"), ("device_index_bytes", "dot", "device index keys"),
                                 ("host_kv_bytes", "dash", "host KV")):
            if g[col].fillna(0).sum() == 0:
                continue
            fig.add_trace(go.Scatter(x=g["context_len"], y=g[col] / 2**30, mode="lines+markers", name=f"{s}: {label}",
                                     line={"color": COLORS.get(s), "dash": dash}))
    fig.update_xaxes(type="log", title="context (tokens)", **ctx_ticks(d["context_len"]))
    held = pd.concat([d[c] for c in ("device_kv_bytes", "device_index_bytes", "host_kv_bytes") if c in d]) / 2**30
    fig.update_yaxes(title="GiB held (one request)", **log_axis(held[held > 0]))
    fig.update_layout(title="KV and index-key memory held per request", template=TEMPLATE, height=420)
    return fig


def hot_cache_figures(metrics: pd.DataFrame) -> list[go.Figure]:
    """From a decode sweep with hot_cache rows: hit rate and misses per step per point, and the step
    anatomy (transfer = lookup + miss loads, attention) per strategy."""
    m = metrics[(metrics.get("experiment") == "decode") & (metrics.get("status") == "ok")] if "experiment" in metrics else metrics
    figs = []
    if "hot_hit_rate" in m:
        h = m[m["strategy"] == "hot_cache"]
        if not h.empty:
            figs.append(px.bar(h, x="context_len", y="hot_hit_rate", color="hot_policy" if "hot_policy" in h else None,
                               barmode="group", facet_col="concurrency", title="hot_cache hit rate per point"))
    phases = [c for c in ("anat_weights_ms", "anat_index_score_ms", "anat_selection_ms", "anat_transfer_ms",
                          "anat_attention_ms", "anat_other_ms") if c in m]
    if phases:
        a = m.groupby(["strategy", "context_len"], as_index=False)[phases].median()
        a = a.melt(id_vars=["strategy", "context_len"], value_vars=phases, var_name="phase", value_name="ms")
        figs.append(px.bar(a, x="strategy", y="ms", color="phase", facet_col="context_len",
                           title="step anatomy per strategy (transfer: hot_cache lookup + misses; fused: in attention)"))
    return figs
