"""Figures of `labkit run pulse` (PulseInfer trace replay): one function per figure, data in, plotly out."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

ROWS = [("normal", "compute"), ("offloaded", "compute"), ("offloaded", "transfer"), ("offloaded", "wait"),
        ("offloaded", "stall")]
COLORS = {"compute": "#4c78a8", "transfer": "#f58518", "wait": "#bab0ac", "stall": "#e45756"}


def policy_bars(m: pd.DataFrame) -> go.Figure:
    """Output throughput and p99 TPOT (vLLM's per-request TPOT) per policy."""
    ok = m[m["status"] != "failed"]
    fig = make_subplots(rows=1, cols=3, subplot_titles=("output tok/s", "p99 TPOT (ms)", "share offloaded"))
    fig.add_bar(x=ok["policy"], y=ok["output_throughput"], row=1, col=1, showlegend=False)
    fig.add_bar(x=ok["policy"], y=ok["tpot_ms_p99"], row=1, col=2, showlegend=False)
    fig.add_bar(x=ok["policy"], y=ok["share_offloaded"], row=1, col=3, showlegend=False)
    fig.update_layout(title="Placement policies on the trace", height=380)
    return fig


def latency_percentiles(m: pd.DataFrame) -> go.Figure:
    """TTFT, TPOT and ITL (vLLM's definitions) at p50/p90/p99 per policy."""
    ok = m[m["status"] != "failed"]
    fig = make_subplots(rows=1, cols=3, subplot_titles=("TTFT (ms)", "TPOT (ms)", "ITL (ms)"))
    for j, metric in enumerate(("ttft", "tpot", "itl"), 1):
        for p in ("p50", "p90", "p99"):
            fig.add_bar(x=ok["policy"], y=ok[f"{metric}_ms_{p}"], name=p, legendgroup=p, showlegend=j == 1,
                        row=1, col=j)
    fig.update_layout(barmode="group", height=380, title="Latency percentiles")
    return fig


def timeline(spans: pd.DataFrame, policy: str | None = None, iteration: int | None = None) -> go.Figure:
    """One sampled decode round: which batch ran each layer, when each transfer started and finished."""
    sp = spans
    if policy is not None:
        sp = sp[sp["policy"] == policy]
    if "mode" in sp and (sp["mode"] == "switched").any():
        sp = sp[sp["mode"] == "switched"]
    if sp.empty:
        return go.Figure().update_layout(title="no sampled round")
    it = iteration if iteration is not None else int(sp["iteration"].iloc[len(sp) // 2])
    sp = sp[sp["iteration"] == it]
    fig = go.Figure()
    for batch, kind in ROWS:
        s = sp[(sp["batch"] == batch) & (sp["kind"] == kind)]
        if s.empty:
            continue
        fig.add_bar(y=[f"{batch} {kind}"] * len(s), x=s["end_ms"] - s["start_ms"], base=s["start_ms"],
                    orientation="h", marker_color=COLORS[kind], text=s["label"], name=f"{batch} {kind}",
                    hovertemplate="%{text}: %{base:.3f} -> %{x:.3f} ms<extra></extra>")
    fig.update_layout(title=f"Switching timeline, round {it}" + (f" ({policy})" if policy else ""),
                      xaxis_title="ms from the round's start", barmode="overlay", height=320)
    return fig


def load_sizes(loads: pd.DataFrame) -> go.Figure:
    """Loads (one QSA layer of the offloaded batch each) per size, per policy. A load's size is the batch
    times one request's selection, so the sizes are few and the bars are exact counts per size: the
    figure carries a handful of numbers, not one per load (25K loads in a 32-request replay)."""
    counts = loads.groupby(["policy", "bytes"]).size().rename("loads").reset_index()
    fig = go.Figure()
    for pol, g in counts.groupby("policy"):
        fig.add_bar(x=g["bytes"] / 2**20, y=g["loads"], name=pol)
    fig.update_layout(barmode="group", title="Transfer sizes (loads per size)", xaxis_title="MiB per load",
                      yaxis_title="loads", height=340)
    return fig


# ------------------------------------------------------------------ the session's companion runs
def companions(run_dir) -> dict:
    """Run folders of the same device session as `run_dir` (manifest `session`, set by
    `scripts/device.sh`), by experiment: {"pulse_scaling": path, "pulse_blocks": path}.
    A manifest's own `companions` ({experiment: folder name beside it}) come first: a replay made in
    another device call than its transfer and scaling runs names them there."""
    run_dir = Path(run_dir)
    mf = json.loads((run_dir / "manifest.json").read_text())
    mine = mf.get("session")
    named = {k: run_dir.parent / v for k, v in (mf.get("companions") or {}).items()}
    out = {k: d for k, d in named.items() if (d / "manifest.json").is_file()}
    if not mine:
        return out
    for d in sorted(run_dir.parent.iterdir()):
        f = d / "manifest.json"
        if d != run_dir and f.is_file():
            m = json.loads(f.read_text())
            if m.get("session") == mine and m.get("experiment") not in named:
                out[m.get("experiment")] = d
    return out


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


def block_bars(m: pd.DataFrame) -> go.Figure:
    """GB/s of each transfer variant, per-head units vs retrieval-head blocks, with the contiguous copy."""
    ok = m[m["status"] == "ok"]
    fig = go.Figure()
    for (sel, blk), g in ok.groupby(["selection", "block"]):
        ub = int(g["unit_bytes"].iloc[0])
        fig.add_bar(x=g["strategy"], y=g["gbps"], name=f"{sel}, block {blk} ({ub // 1024} KB units)",
                    text=[f"{r:.2f}x" for r in g["ratio_to_contiguous"]], textposition="outside")
    fig.update_layout(barmode="group", title="One QSA layer's selection over the link: GB/s (ratio to contiguous)",
                      yaxis_title="GB/s (bytes counted from the units moved)", height=420)
    return fig


# the quality lab's policy for each transfer selection: per-KV-head selection is its per-head oracle
QUALITY_POLICY = {"per_head": "oracle", "retrieval_head": "retrieval_head"}
# the transfer variants a selection table shows when the block run measured them (batched DMA only in the runs that had it)
SELECTION_VARIANTS = ("per_unit_copy", "coalesced", "coalesced_pipelined", "batched_dma", "batched_dma_per512", "zero_copy")


def selection_table(blocks: pd.DataFrame, quality: pd.DataFrame | None, compute_ms: float | None,
                    attn_layers: int, block: int | None = None, variants=SELECTION_VARIANTS,
                    requests: int | None = None) -> pd.DataFrame:
    """Per-head vs retrieval-head selection side by side: link bytes per step, transfer ms (per unit
    copies, coalesced, zero_copy; measured per layer x QSA layers), the step time that gives with the
    measured compute (`compute_ms`: the resident step at the same point), and quality from the quality
    lab (`quality_summary`: per-KV-head oracle vs the layer's retrieval head, mean over corpora, at the
    blocks' budget)."""
    ok = blocks[blocks["status"] == "ok"]
    block = block or int(ok["block"].min())
    ok = ok[ok["block"] == block]
    if "requests" in ok:           # one batch size: the fewest requests' selections moved at once unless named
        ok = ok[ok["requests"] == (requests or int(ok["requests"].min()))]
    rows = []
    for sel, g in ok.groupby("selection"):
        by = g.set_index("strategy")
        r = {"selection": sel, "block": block, "unit_bytes": int(by["unit_bytes"].iloc[0]),
             "units_per_layer": int(by["units"].iloc[0]),
             "link_bytes_per_step": int(by["bytes"].iloc[0]) * attn_layers}
        for v in variants:
            if v in by.index:
                ms = float(by.loc[v, "ms_median"]) * attn_layers
                r[f"{v}_ms_per_step"] = ms
                r[f"{v}_gbps"] = float(by.loc[v, "gbps"])
                if compute_ms:
                    r[f"step_ms_{v}"] = compute_ms + ms
        if quality is not None and len(quality):
            budget = int(g["budget"].iloc[0])
            q = quality[(quality["policy"] == QUALITY_POLICY[sel]) & (quality["budget"] == budget)]
            if len(q):
                r.update(quality_policy=QUALITY_POLICY[sel], quality_budget=budget, mass_recall=float(q["mass_recall"].mean()),
                         ppl_ratio=float(q["ppl_ratio"].mean()))
        rows.append(r)
    return pd.DataFrame(rows)


def selection_figure(t: pd.DataFrame) -> go.Figure:
    """The selection table as three panels: transfer per step, step time, quality."""
    fig = make_subplots(rows=1, cols=3, subplot_titles=("transfer ms per step", "step ms (compute + transfer)",
                                                        "quality: recall / ppl ratio"))
    colors = dict(zip(SELECTION_VARIANTS, ("#e45756", "#4c78a8", "#72b7b2", "#f58518", "#b279a2", "#54a24b")))
    for v in [c[:-len("_ms_per_step")] for c in t.columns if c.endswith("_ms_per_step")]:
        color = colors.get(v)
        fig.add_bar(x=t["selection"], y=t[f"{v}_ms_per_step"], name=v, marker_color=color, row=1, col=1,
                    legendgroup=v)
        if f"step_ms_{v}" in t:
            fig.add_bar(x=t["selection"], y=t[f"step_ms_{v}"], name=v, marker_color=color, row=1, col=2,
                        legendgroup=v, showlegend=False)
    if "mass_recall" in t:
        fig.add_bar(x=t["selection"], y=t["mass_recall"], name="attention-mass recall", row=1, col=3)
        fig.add_bar(x=t["selection"], y=t["ppl_ratio"], name="perplexity / dense", row=1, col=3)
    fig.update_layout(barmode="group", height=400, title="Per-head vs retrieval-head selection")
    return fig


def latest_quality_summary(root, block: int | None = None, budget: int | None = None) -> tuple:
    """(path, quality_summary) of the newest quality run under `root` that measured both the per-KV-head
    oracle and the retrieval head (at `budget` rows, when given: a run on shorter sequences has no such
    budget), selecting in blocks of `block` tokens when such a run exists (runs from before the `block`
    parameter selected single tokens); (None, None) if there is none."""
    found = []
    for d in sorted(Path(root).iterdir(), reverse=True):
        f, q = d / "manifest.json", d / "quality_summary.parquet"
        if not (f.is_file() and q.is_file()):
            continue
        mf = json.loads(f.read_text())
        if mf.get("experiment") != "quality":
            continue
        s = pd.read_parquet(q)
        at = s if budget is None else s[s["budget"] == budget]
        if {"oracle", "retrieval_head"} <= set(at["policy"]):
            found.append((int(mf.get("parameters", {}).get("block") or 1), d, s))
    for b, d, s in found:
        if block is None or b == block:
            return d, s
    return (found[0][1], found[0][2]) if found else (None, None)
