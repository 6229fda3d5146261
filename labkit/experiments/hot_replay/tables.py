"""The hot-cache replay's generated table in docs/hot-cache.md (`labkit docs`): hit rate and link bytes per
recording density, corpus and policy. It reads the committed run folder it is given: docs/runs.toml names it,
labkit/docs binds the block to its function and run."""
from __future__ import annotations

import pandas as pd

from ...report.summary import md_table as _md
from ...report.units import tokens_label as _ctx
from ...results import REPO


def hot_density_table(run: str, context_len: int = 1 << 20) -> str:
    """Hot-cache replay of recorded SmolLM2 selections per recording density x corpus x policy at one context:
    hit rate and link bytes against zero_copy's at capacity 1x and 2x budget, the smallest capacity of the
    run that reaches <= 1/3 of zero_copy's bytes, and the share of replayed rows that are the trace's own."""
    d = pd.read_parquet(REPO / run / "hot_replay.parquet")
    d = d[d["context_len"] == context_len]
    rows = []
    for (rv, corpus, pol), g in d.groupby(["ratio_value", "corpus", "policy"], sort=True):
        g = g.set_index("capacity_x").sort_index()
        ok = g.index[g["bytes_vs_zero_copy"] <= 1 / 3]
        r0 = g.iloc[0]
        rows.append({"density": f"{r0['ratio']} ({int(r0['trace_budget'])} of {int(r0['trace_context']):,})",
                     "corpus": corpus, "policy": pol,
                     "hit rate 1x": f"{g.loc[1.0, 'hit_rate']:.3f}", "bytes/zc 1x": f"{g.loc[1.0, 'bytes_vs_zero_copy']:.3f}",
                     "hit rate 2x": f"{g.loc[2.0, 'hit_rate']:.3f}", "bytes/zc 2x": f"{g.loc[2.0, 'bytes_vs_zero_copy']:.3f}",
                     "≤ 1/3 of zero_copy from": f"{ok.min():g}x" if len(ok) else f"no (≤ {g.index.max():g}x)",
                     "trace share": f"{r0['trace_share']:.2f}"})
    lead = (f"Replayed at {_ctx(context_len)} tokens, budget {int(d['budget'].iloc[0])}, 12 QSA layers, one request; "
            f"capacity in rows per layer as a multiple of the budget.")
    return lead + "\n\n" + _md(pd.DataFrame(rows))
