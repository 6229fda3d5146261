"""Figures of a prefill run: tok/s per mode beside the bound (every phase at its own bound), and the anatomy
of a chunk by its position in the prompt (phases stacked, the bound of each beside it).

    tok_s_figure(metrics)          # bars: measured tok/s; diamonds: the bound at the same point
    anatomy_figure(anatomy)        # per position and mode: ms per chunk by phase, and the phases' bounds
"""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

PHASE_COLOURS = {"weights": "#1f77b4", "deltanet": "#9467bd", "kv_write": "#8c564b", "kv_load": "#e377c2",
                 "index_score": "#bcbd22", "selection": "#17becf", "attention": "#d62728", "other": "#7f7f7f"}
POSITIONS = ("early", "middle", "last")


def _label(r) -> str:
    ev = r.get("engine_variant")
    return r["mode"] + (f" [{ev}]" if isinstance(ev, str) and ev else "")


def tok_s_figure(m: pd.DataFrame) -> go.Figure:
    ok = m[(m["status"] == "ok") & (m["experiment"] == "prefill")].copy()
    ok["what"] = ok.apply(_label, axis=1)
    ok["prompt"] = ok["context_len"].map(lambda n: f"{int(n):,} tokens")
    fig = go.Figure()
    for what, g in ok.groupby("what", sort=False):
        fig.add_bar(x=g["prompt"], y=g["tok_s"], name=what)
    if "bound_tok_s" in ok and ok["bound_tok_s"].notna().any():
        b = ok.groupby("prompt", sort=False)["bound_tok_s"].max()
        fig.add_scatter(x=list(b.index), y=list(b.values), mode="markers", name="bound (every phase at its bound)",
                        marker=dict(symbol="diamond", size=12, color="black"))
    fig.update_layout(barmode="group", title="Prefill tok/s by mode, and the bound",
                      yaxis_title="prompt tokens / s", xaxis_title="")
    return fig


def anatomy_summary(a: pd.DataFrame) -> pd.DataFrame:
    """Median ms per chunk of each phase and its bound, per mode (and engine variant) and chunk position."""
    a = a.copy()
    a["what"] = a.apply(_label, axis=1)
    phases = [p for p in PHASE_COLOURS if f"{p}_ms" in a]
    cols = [f"{p}_ms" for p in phases] + [c for c in a.columns if c.endswith("_bound_ms")] + ["chunk_ms"]
    g = a.groupby(["what", "context_len", "position"], sort=False)[cols].median().reset_index()
    g["position"] = pd.Categorical(g["position"], POSITIONS, ordered=True)
    return g.sort_values(["context_len", "what", "position"])


def anatomy_figure(a: pd.DataFrame) -> go.Figure:
    s = anatomy_summary(a)
    s["x"] = s["what"] + " · " + s["position"].astype(str) + " · " + s["context_len"].map(lambda n: f"{int(n):,}")
    fig = go.Figure()
    for ph, colour in PHASE_COLOURS.items():
        if f"{ph}_ms" in s and s[f"{ph}_ms"].abs().sum() > 0:
            fig.add_bar(x=s["x"], y=s[f"{ph}_ms"], name=ph, marker_color=colour)
    bounds = [c for c in s.columns if c.endswith("_bound_ms")]
    if bounds:
        fig.add_scatter(x=s["x"], y=s[bounds].sum(axis=1), mode="markers", name="sum of the phases' bounds",
                        marker=dict(symbol="line-ew-open", size=28, color="black", line=dict(width=3)))
    fig.update_layout(barmode="stack", title="A chunk's time by phase (median per position in the prompt)",
                      yaxis_title="ms per chunk", xaxis_title="")
    return fig
