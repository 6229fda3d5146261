"""Plotly figures for the quality lab, each from one table of a quality run folder."""

from __future__ import annotations

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

POLICY_ORDER = ["oracle_qhead", "oracle", "oracle_shared", "indexer", "retrieval_head"]


PROTOCOL_TEXT = {"dense_prefill": "dense prefill", "sparse_prefill": "sparse prefill"}


def _sparse(summary: pd.DataFrame) -> pd.DataFrame:
    s = summary[summary["policy"] != "dense"].copy()
    if "selection" not in s.columns:     # runs from before block variants: one granularity
        s["selection"] = "token"
    if "protocol" not in s.columns:      # runs from before sparse prefill: dense prefill only
        s["protocol"] = "dense_prefill"
    s["protocol"] = s["protocol"].fillna("dense_prefill")
    # one line style per granularity and prefill protocol (the protocol named only where the run has two)
    s["variant"] = s["selection"] + (", " + s["protocol"].map(PROTOCOL_TEXT) if s["protocol"].nunique() > 1 else "")
    return s.sort_values(["corpus", "policy", "protocol", "selection", "budget"])


def _protocol_text(s: pd.DataFrame) -> str:
    return " or ".join(PROTOCOL_TEXT[p] for p in sorted(s["protocol"].unique())) + ", sparse decode"


def _error_bars(s: pd.DataFrame, col: str) -> dict:
    """px keyword arguments for asymmetric error bars from `col_lo` / `col_hi` (none when the run has none)."""
    if f"{col}_lo" not in s.columns:
        return {}
    s[f"{col}_plus"] = (s[f"{col}_hi"] - s[col]).clip(lower=0)
    s[f"{col}_minus"] = (s[col] - s[f"{col}_lo"]).clip(lower=0)
    return {"error_y": f"{col}_plus", "error_y_minus": f"{col}_minus"}


def _n_text(s: pd.DataFrame) -> str:
    n = s["ppl_ratio_n"] if "ppl_ratio_n" in s.columns else s["n_sequences"]
    return f"n = {int(n.min())}" if n.min() == n.max() else f"n = {int(n.min())}-{int(n.max())}"


def ppl_vs_budget(summary: pd.DataFrame) -> go.Figure:
    """Perplexity ratio to dense against budget, one line per policy (dashed: blocks of 16, or sparse prefill
    where the run has both protocols), one panel per corpus; error bars: 95% bootstrap intervals over sequences."""
    s = _sparse(summary)
    fig = px.line(s, x="budget", y="ppl_ratio", color="policy", line_dash="variant", facet_col="corpus",
                  markers=True, log_x=True, category_orders={"policy": POLICY_ORDER},
                  hover_data=["ppl", "n_tokens", "n_sequences"], **_error_bars(s, "ppl_ratio"),
                  title=f"Perplexity / dense perplexity vs top-k budget ({_protocol_text(s)}; "
                        f"95% bootstrap intervals over sequences, {_n_text(s)} per corpus)")
    fig.add_hline(y=1.0, line_dash="dot", annotation_text="dense (full)")
    fig.update_yaxes(type="log", title="ppl ratio")
    return fig


def recall_vs_budget(summary: pd.DataFrame) -> go.Figure:
    """Attention-mass recall (solid) and recall@budget against oracle_shared (dashed), single-token
    selection, over the decoded block of the dense-prefill protocol where the run has it; error bars: 95%
    bootstrap intervals over sequences."""
    s = _sparse(summary)
    s = s[s["selection"] == "token"]
    if (s["protocol"] == "dense_prefill").any():
        s = s[s["protocol"] == "dense_prefill"]
    mass = s.assign(metric="mass recall", value=s["mass_recall"])
    over = s[s["policy"].isin(["indexer", "retrieval_head"])].assign(metric="recall@budget vs oracle_shared",
                                                                      value=lambda d: d["oracle_overlap"])
    for d, col in ((mass, "mass_recall"), (over, "oracle_overlap")):
        if f"{col}_lo" in d.columns:
            d["value_lo"], d["value_hi"] = d[f"{col}_lo"], d[f"{col}_hi"]
    long = pd.concat([mass, over], ignore_index=True)
    fig = px.line(long, x="budget", y="value", color="policy", line_dash="metric", facet_col="corpus", markers=True,
                  log_x=True, category_orders={"policy": POLICY_ORDER}, **_error_bars(long, "value"),
                  title="Attention-mass recall and selection recall vs budget (95% bootstrap intervals over sequences)")
    fig.update_yaxes(range=[0, 1.02], title="recall")
    return fig


def head_map(share: pd.DataFrame, heads: pd.DataFrame | None = None, split: str = "eval") -> go.Figure:
    """Layer x head heatmap of mid-context attention share (mean over corpora); chosen heads marked."""
    d = share[share["split"] == split].groupby(["layer", "head"])["mid_share"].mean().unstack("head")
    fig = go.Figure(go.Heatmap(z=d.values, x=[f"h{h}" for h in d.columns], y=d.index, colorscale="Viridis",
                               colorbar={"title": "mid share"}))
    if heads is not None and not heads.empty:
        fig.add_trace(go.Scatter(x=[f"h{h}" for h in heads["head"]], y=heads["layer"], mode="markers",
                                 marker={"symbol": "x", "color": "red", "size": 9}, name="retrieval head (calibration)"))
    fig.update_layout(title=f"Mid-context attention share per layer x head ({split} text)",
                      yaxis_title="layer", xaxis_title="query head", height=650)
    return fig


def overlap_vs_step(loc: pd.DataFrame) -> go.Figure:
    """Mean (over layers) overlap of consecutive steps' selected sets."""
    d = loc.dropna(subset=["overlap_prev"]).groupby(["corpus", "policy", "budget", "step"], as_index=False)["overlap_prev"].mean()
    d["policy@budget"] = d["policy"] + "@" + d["budget"].astype(str)
    fig = px.line(d, x="step", y="overlap_prev", color="policy@budget", facet_col="corpus",
                  title="Temporal locality: |S_t ∩ S_t-1| / |S_t| per decode step (mean over layers)")
    fig.update_yaxes(range=[0, 1.02])
    return fig


def overlap_by_layer(loc: pd.DataFrame) -> go.Figure:
    d = loc.dropna(subset=["overlap_prev"]).groupby(["policy", "budget", "layer"], as_index=False)["overlap_prev"].mean()
    d["policy@budget"] = d["policy"] + "@" + d["budget"].astype(str)
    return px.line(d, x="layer", y="overlap_prev", color="policy@budget", markers=True,
                   title="Consecutive-step overlap per layer (mean over steps and corpora)")


def reuse_hist(rd: pd.DataFrame) -> go.Figure:
    d = rd.groupby(["policy", "budget", "reuse_distance"], as_index=False)["count"].sum()
    d["share"] = d["count"] / d.groupby(["policy", "budget"])["count"].transform("sum")
    d["policy@budget"] = d["policy"] + "@" + d["budget"].astype(str)
    order = ["1", "2", "3-4", "5-8", "9-16", ">16", "new"]
    return px.bar(d, x="reuse_distance", y="share", color="policy@budget", barmode="group",
                  category_orders={"reuse_distance": order},
                  title="Reuse distance of selected positions (steps since the layer last selected them)")


def window_shares(summ: pd.DataFrame) -> go.Figure:
    d = summ.melt(id_vars=["corpus", "policy", "budget"], value_vars=["sink_share", "middle_share", "recent_share"],
                  var_name="where", value_name="share")
    d["policy@budget"] = d["policy"] + "@" + d["budget"].astype(str)
    return px.bar(d, x="policy@budget", y="share", color="where", facet_col="corpus",
                  title="Where selected positions lie: sink window / middle / recent window")
