"""The probe's generated tables in docs/results-h200.md (`labkit docs`): selection against torch.topk per batch
and context, and labkit's link probe beside the reference probe. Each reads the committed run folder it is given
(docs/runs.toml names it; labkit/docs binds each block to its function and run)."""
from __future__ import annotations

import pandas as pd

from ...report.summary import md_table as _md
from ...report.units import tokens_label as _ctx
from ...results import REPO, load_run


def selection_table(run: str) -> str:
    """One QSA layer's index score and selection per batch and context (the run's probe rows), in µs."""
    m = load_run(REPO / run).metrics
    p = m[(m["experiment"] == "probe") & (m["strategy"].isin(["index_score", "select", "topk_sort", "score_select"]))]
    rows = []
    for (b, ctx), g in p.groupby(["concurrency", "context_len"]):
        ms = g.set_index("strategy")["step_ms_median"] * 1e3
        rows.append({"batch": int(b), "context": _ctx(ctx), "index score µs": f"{ms['index_score']:.0f}",
                     "radix select µs": f"{ms['select']:.0f}", "torch.topk + sort µs": f"{ms['topk_sort']:.0f}",
                     "score + select µs": f"{ms['score_select']:.0f}"})
    return _md(pd.DataFrame(rows))


def agreement_table(run: str) -> str:
    """labkit's probe beside the reference probe per path (the run's agreement.csv)."""
    t = pd.read_csv(REPO / run / "agreement.csv")
    rows = [{"path": r["path"], "reference probe GB/s": f"{r['shared_gbps']:.1f}", "labkit probe GB/s": f"{r['labkit_gbps']:.1f}",
             "ratio": f"{r['ratio']:.3f}", "within 5%": "yes" if r["within"] else "no"} for _, r in t.iterrows()]
    return _md(pd.DataFrame(rows))
