"""The capacity experiment's generated tables (`labkit docs`): goodput per offload configuration
(docs/prefill-capacity.md) and its headline ratios per process. Each reads the committed run folders it is given:
docs/runs.toml names them, labkit/docs binds each block to its function and runs."""
from __future__ import annotations

import pandas as pd

from ...report.summary import md_table as _md
from ...results import REPO, load_run


def capacity_table(run: str) -> str:
    """Per configuration (offload in no stage, prefill, decode, both): requests held, the batch under the TPOT
    limit, and goodput against none."""
    g = load_run(REPO / run).table("goodput")
    rows = [{"configuration": r.config, "requests held": int(r.requests), "batch under TPOT limit": int(r.good_batch),
             "TPOT ms": f"{r.tpot_ms:.2f}", "goodput tok/s": f"{r.goodput_tok_s:.0f}", "vs none": f"{r.goodput_vs_none:.2f}"}
            for r in g.itertuples()]
    return _md(pd.DataFrame(rows))


def capacity_rows(runs: list[str]) -> pd.DataFrame:
    """Offload in both stages against none (goodput, requests held), one row per process (docs/spreads.md, the
    README's headlines and the claims card take the spread across processes)."""
    out = []
    for i, run in enumerate(runs, 1):
        g = load_run(REPO / run).table("goodput").set_index("config")
        out.append({"figure": "goodput, offload in both stages / none (24 GiB cap, 32K)", "process": i,
                    "value": g.loc["both", "goodput_vs_none"]})
        out.append({"figure": "requests held, offload in both stages / none", "process": i,
                    "value": g.loc["both", "requests"] / g.loc["none", "requests"]})
    return pd.DataFrame(out)
