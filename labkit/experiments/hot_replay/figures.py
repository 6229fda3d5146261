"""Figures of a hot-cache replay (`labkit run hot_replay`, FlashOffloading's hot cache on recorded selections): hit
rate and link bytes per step against capacity, policy and the traces' recording density, from the run's
`hot_replay` table, and the headline table (the capacity notebook draws them).
"""
from __future__ import annotations

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

HEADLINE_RATIO = 1 / 32     # the hot cache's headline holds for traces recorded at budget/context <= 1/32


def hit_rate_vs_capacity(df: pd.DataFrame) -> go.Figure:
    """Hit rate against capacity (x budget), one line per policy, a panel per recording density."""
    d = df[df["context_len"] == df["context_len"].max()].sort_values(["ratio_value", "capacity_x"])
    fig = px.line(d, x="capacity_x", y="hit_rate", color="policy", facet_col="ratio", line_dash="corpus",
                  markers=True, category_orders={"ratio": list(dict.fromkeys(d["ratio"]))},
                  labels={"capacity_x": "capacity (x budget)", "hit_rate": "hit rate (steady state)"},
                  title=f"Hot-cache hit rate vs capacity, per recording density (trace budget / context), "
                        f"replayed at {d['context_len'].max():,} tokens, budget {int(d['budget'].iloc[0])}")
    fig.update_yaxes(range=[0, 1.02])
    return fig


def bytes_vs_density(df: pd.DataFrame, policy: str = "lru") -> go.Figure:
    """Link bytes per step against the recording density, one line per capacity, zero_copy's bytes as bound."""
    d = df[(df["policy"] == policy) & (df["context_len"] == df["context_len"].max())]
    d = d.groupby(["ratio_value", "ratio", "capacity_x"], as_index=False)[["h2d_bytes_per_step", "zero_copy_bytes_per_step"]].mean()
    fig = go.Figure()
    for cx, g in d.groupby("capacity_x"):
        g = g.sort_values("ratio_value")
        fig.add_scatter(x=g["ratio_value"], y=g["h2d_bytes_per_step"] / 2**20, mode="lines+markers",
                        name=f"hot_cache {cx:g} x budget", text=g["ratio"])
    zc = d.groupby("ratio_value")["zero_copy_bytes_per_step"].first().sort_index()
    fig.add_scatter(x=zc.index, y=zc.values / 2**20, mode="lines", name="zero_copy (every selected row)",
                    line={"dash": "dash", "color": "black"})
    fig.add_vline(x=HEADLINE_RATIO, line_dash="dot", annotation_text="1/32")
    fig.update_xaxes(type="log", title="recording density (trace budget / trace context)")
    fig.update_yaxes(title="link MiB per step (steady state)")
    fig.update_layout(title=f"Link bytes per decode step vs recording density ({policy})")
    return fig


def headline_table(df: pd.DataFrame) -> pd.DataFrame:
    """Traces recorded at <= 1/32 (nominal density, the `ratio` label: 256 of an 8,001-token context counts as
    1/32, strictly 1/31.3): best policy at capacity <= 2 x budget, bytes against zero_copy."""
    nominal = 1 / df["ratio"].str.split("/").str[1].astype(float)    # to the nearest power of two: 256 of 8,001 is "1/32"
    d = df[(nominal <= HEADLINE_RATIO + 1e-12) & (df["capacity_x"] <= 2.0)]
    cols = ["trace", "ratio", "context_len", "capacity_x", "policy", "hit_rate", "bytes_vs_zero_copy",
            "overlap_trace", "overlap_replayed"] + (["trace_share"] if "trace_share" in df else [])
    return d.sort_values(["trace", "context_len", "capacity_x", "hit_rate"], ascending=[True, True, True, False])[cols]
