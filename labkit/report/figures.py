"""Plotly figures over a run's tidy tables. Every speed plot carries its physical bound where one exists:
the link bound (bytes per step / contiguous pinned H2D GB/s measured in the same run) and the resident
(no-offload) baseline."""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .summary import ok_rows, decode_table, is_cpu, link_gbps
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


def _ctx_ticks(values) -> dict:
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


def _err(d: pd.DataFrame, col: str = "tok_s") -> dict:
    """Error bars from the step-time spread (min/max), mapped onto tok/s."""
    if col == "tok_s":
        hi = d["concurrency"] / (d["step_ms_min"] / 1e3) - d["tok_s"]
        lo = d["tok_s"] - d["concurrency"] / (d["step_ms_max"] / 1e3)
    else:
        hi, lo = d["step_ms_max"] - d[col], d[col] - d["step_ms_min"]
    return {"type": "data", "symmetric": False, "array": hi.clip(lower=0), "arrayminus": lo.clip(lower=0), "thickness": 1}


def _empty(title: str, why: str) -> go.Figure:
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


def _fmt_tok_s(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def tok_s_vs_context(m: pd.DataFrame) -> go.Figure:
    """Aggregate tok/s per strategy, one facet per concurrency. The y axis is logarithmic and fitted to the
    strategies (per_row sits two decades below the rest); the link bound is drawn when it lies near the
    data and otherwise named in each facet with its value, so it never squashes the strategies together."""
    d = decode_table(m)
    if d.empty:
        return _empty("Decode tok/s vs context", "no decode points")
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
                                     error_y=_err(g), customdata=np.stack([g["step_ms_median"], g["h2d_bytes_per_step"] / 2**20], -1),
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
            lo_b, hi_b = _fmt_tok_s(bound.min()), _fmt_tok_s(bound.max())
            fig.add_annotation(text=f"▲ link bound {lo_b if lo_b == hi_b else f'{lo_b}–{hi_b}'} tok/s "
                                    f"(H2D alone at {link:.1f} GB/s), above this axis",
                               xref=f"x{'' if j == 1 else j} domain", yref=f"y{'' if j == 1 else j} domain", x=0.02, y=0.98,
                               xanchor="left", yanchor="top", showarrow=False, font={"size": 11},
                               bgcolor="rgba(255,255,255,0.8)", bordercolor="black", borderwidth=1)
        fig.update_xaxes(type="log", title="context (tokens)", row=1, col=j, **_ctx_ticks(dc["context_len"]))
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
        return _empty("Decode step time", "no decode points")
    fig = go.Figure()
    for (s, c), g in d.groupby(["strategy", "concurrency"], sort=False):
        g = g.sort_values("context_len")
        fig.add_trace(go.Scatter(x=g["context_len"], y=g["step_ms_median"], mode="lines+markers", name=f"{s} c={int(c)}",
                                 line={"color": COLORS.get(s), "dash": "solid" if c == d["concurrency"].min() else "dot"},
                                 error_y=_err(g, "step_ms_median")))
    fig.update_xaxes(type="log", title="context (tokens)", **_ctx_ticks(d["context_len"]))
    fig.update_yaxes(title="step time (ms), median with min/max",
                     **log_axis(pd.concat([d["step_ms_min"], d["step_ms_max"], d["step_ms_median"]])))
    fig.update_layout(title="Decode step time vs context", template=TEMPLATE, height=420)
    return fig


def tok_s_vs_budget(m: pd.DataFrame) -> go.Figure:
    d = ok_rows(m[m["experiment"] == "decode"])
    if d.empty or "axis" not in d:
        return _empty("Decode tok/s vs budget", "no budget axis in this run")
    ctx = d[d["axis"] == "budget"]["context_len"]
    if ctx.empty:
        return _empty("Decode tok/s vs budget", "no budget axis in this run (one budget)")
    ctx, c = int(ctx.iloc[0]), int(d[d["axis"] == "budget"]["concurrency"].iloc[0])
    d = d[(d["context_len"] == ctx) & (d["concurrency"] == c)]
    fig = go.Figure()
    for s, g in d.groupby("strategy", sort=False):
        g = g.sort_values("budget")
        fig.add_trace(go.Scatter(x=g["budget"], y=g["tok_s"], mode="lines+markers", name=s, line={"color": COLORS.get(s)},
                                 error_y=_err(g)))
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
            fig.add_annotation(text=f"▲ link bound {_fmt_tok_s(bound.min())}–{_fmt_tok_s(bound.max())} tok/s "
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
        return _empty("Aggregate tok/s vs concurrency", "one concurrency value in this run")
    fig = go.Figure()
    for s, g in d.groupby("strategy", sort=False):
        for ctx, gc in g.groupby("context_len"):
            if ctx not in (d["context_len"].min(), d["context_len"].max()):
                continue
            gc = gc.sort_values("concurrency")
            fig.add_trace(go.Scatter(x=gc["concurrency"], y=gc["tok_s"], mode="lines+markers",
                                     name=f"{s} @ {tokens_label(ctx)}", error_y=_err(gc),
                                     line={"color": COLORS.get(s), "dash": "solid" if ctx == d["context_len"].max() else "dot"}))
    fig.update_xaxes(title="concurrent requests", tickvals=sorted(d["concurrency"].unique()))
    fig.update_yaxes(title="aggregate decode tok/s", rangemode="tozero")
    fig.update_layout(title="Aggregate decode speed vs concurrency (smallest and largest context)", template=TEMPLATE, height=420)
    return fig


def bytes_engine_vs_nvml(m: pd.DataFrame) -> go.Figure:
    d = decode_table(m)
    if d.empty or "nvml_rx_bytes_per_step" not in d or d["nvml_rx_bytes_per_step"].isna().all():
        return _empty("H2D bytes per step: engine vs NVML", "NVML PCIe counters not available on this machine (CPU run)")
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
        return _empty("Memory held", "no decode points")
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
    fig.update_xaxes(type="log", title="context (tokens)", **_ctx_ticks(d["context_len"]))
    held = pd.concat([d[c] for c in ("device_kv_bytes", "device_index_bytes", "host_kv_bytes") if c in d]) / 2**30
    fig.update_yaxes(title="GiB held (one request)", **log_axis(held[held > 0]))
    fig.update_layout(title="KV and index-key memory held per request", template=TEMPLATE, height=420)
    return fig


def probe_bars(m: pd.DataFrame) -> go.Figure:
    p = ok_rows(m[m["experiment"] == "probe"]) if "experiment" in m else m.iloc[0:0]
    if p.empty:
        return _empty("Host link limits", "no probe rows")
    if "direction" in p:
        p = p[p["direction"].isna() | (p["direction"] == "h2d")]
    p = p[p["strategy"].isin(["contiguous", "pageable", "per_row", "host_gather", "zero_copy", "hbm_gather"])]
    if p.empty:      # probe=false: the sweep still times the HBM read (the weights' bound), not the link
        return _empty("Host link limits", "no link probe in this run (probe=false); `labkit probe` measures it")
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
        return _empty("Weight products", "no weight products in this run (a CPU run, or a probe before they were timed)")
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


def telemetry_timeline(t: pd.DataFrame, m: pd.DataFrame | None = None, max_points: int = 3000) -> go.Figure:
    if t is None or t.empty or "pcie_rx_gbps" not in t:
        return _empty("Telemetry", "no NVML telemetry in this run (NVML missing or CPU run)")
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


def host_memory_bars(m: pd.DataFrame) -> go.Figure:
    """Host RAM bandwidth (STREAM's kernels, one core and all) and, on a GPU host, the link idle and under a
    host-memory load: what bounds the CPU-staged strategies, and what the link keeps when the host is busy."""
    p = ok_rows(m[m["experiment"] == "probe"]) if "experiment" in m else m.iloc[0:0]
    host = p[p["strategy"].isin(["host_read", "host_write", "host_copy", "host_triad"])] if not p.empty else p
    if host.empty:
        return _empty("Host memory", "no host-memory rows in this run (`labkit run probe` measures them)")
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
    fig.update_layout(barmode="group", title="Host memory (STREAM kernels) and the link under a host-memory load",
                      yaxis_title="GB/s", template=TEMPLATE, height=400)
    return fig
