"""Figures of a capacity run (`labkit run capacity`, FlashOffloading's comparison under a device-memory cap): the
goodput of each configuration beside the requests the cap holds. The notebook draws the companions' figures from
their own experiments (hot_replay's hit rates, decode's hot-cache anatomy)."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go


def goodput_bars(goodput: pd.DataFrame, tpot_ms: float | None = None) -> go.Figure:
    """FlashOffloading's comparison (a capacity run's `goodput` table): per configuration, decode goodput
    (tok/s of requests under the TPOT limit, left axis) beside the requests the cap holds (right axis),
    labelled with the ratio to no offload and the batch that kept the limit."""
    g = goodput.copy()
    base = g.loc[g["config"] == "none", "goodput_tok_s"]
    ref = float(base.iloc[0]) if len(base) and base.iloc[0] else None
    fig = go.Figure()
    fig.add_bar(x=g["config"], y=g["goodput_tok_s"], name="goodput tok/s (left)", marker_color="#4c78a8",
                offsetgroup=0, textposition="outside", cliponaxis=False,
                text=[f"{v:,.0f}" + (f" ({v / ref:.2f}x)" if ref else "") for v in g["goodput_tok_s"]])
    fig.add_bar(x=g["config"], y=g["requests"], name="requests held (right)", marker_color="#f58518", yaxis="y2",
                offsetgroup=1, textposition="outside", cliponaxis=False,
                text=[f"{int(r)} held, {int(b)} under the limit" for r, b in zip(g["requests"], g["good_batch"])])
    limit = f" {tpot_ms:g} ms" if tpot_ms else ""
    fig.update_layout(title=f"Goodput under a TPOT limit of{limit}: no offload, prefill-only, both stages",
                      barmode="group", legend={"orientation": "h", "y": -0.15},
                      yaxis={"title": "goodput (tok/s of requests under the limit)", "range": [0, 1.2 * g["goodput_tok_s"].max()]},
                      yaxis2={"title": "requests the cap holds", "overlaying": "y", "side": "right",
                              "range": [0, 1.2 * g["requests"].max()], "showgrid": False, "tickformat": "d"})
    return fig
