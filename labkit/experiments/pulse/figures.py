"""Figures of `labkit run pulse` (PulseInfer's trace replay): one function per figure, data in, plotly out; and the
runs of the same device session the notebook draws beside it (`companions`: pulse_scaling's and pulse_blocks',
drawn by their own figures). The replay per window: `window_figures.py` beside this."""
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
