"""The vLLM sweep's generated table in docs/serving-vllm.md (`labkit docs`): labkit's load generator against
`vllm bench serve` on one server and load. It reads the committed run folder it is given: docs/runs.toml names
it, labkit/docs binds the block to its function and run."""
from __future__ import annotations

import pandas as pd

from ...report.summary import md_table as _md
from ...results import REPO, load_run
from .figures import crosscheck_table


def crosscheck_block(run: str) -> str:
    """labkit's load generator against `vllm bench serve` on one server and load, interleaved rounds."""
    t = crosscheck_table(load_run(REPO / run).metrics)
    rows = [{"input / conc.": f"{int(r.input_len)} / {int(r.concurrency)}",
             "TTFT labkit / vLLM (ms)": f"{r.ttft_labkit_ms:,.0f} / {r.ttft_vllm_ms:,.0f}", "TTFT ratio": f"{r.ttft_ratio:.2f}",
             "TPOT labkit / vLLM (ms)": f"{r.tpot_labkit_ms:,.1f} / {r.tpot_vllm_ms:,.1f}", "TPOT ratio": f"{r.tpot_ratio:.2f}",
             "rounds": int(r.rounds)} for r in t.itertuples()]
    within = lambda col: int(((t[col] - 1).abs() <= 0.10).sum())
    lead = (f"Within 10%: TTFT at {within('ttft_ratio')} of {len(t)} points, TPOT at {within('tpot_ratio')} of {len(t)} "
            f"(medians over rounds of each round's median).")
    return lead + "\n\n" + _md(pd.DataFrame(rows))
