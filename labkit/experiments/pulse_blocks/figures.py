"""Figures of `labkit run pulse_blocks` (block transfers: per-unit copies, coalesced, batched DMA, zero-copy): GB/s per
transfer variant, and per-head against retrieval-head selection beside the quality lab's measure of each (the
selection table, which the README's PulseInfer table reads too)."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots


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
