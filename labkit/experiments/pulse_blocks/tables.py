"""PulseInfer's block-transfer experiment's generated tables in docs/pulseinfer.md (`labkit docs`): GB/s per
selection, block and variant; the variants against the contiguous copy per run and number of requests; per-head
against retrieval-head selection with its transfer, step and quality. Each reads the committed run folders it is
given: docs/runs.toml names them, labkit/docs binds each block to its function and runs."""
from __future__ import annotations

import pandas as pd

from .figures import QUALITY_POLICY, selection_table as selection_rows
from ...report.summary import md_table as _md
from ...results import REPO, load_run
from ...shapes import metrics_shape


def pulse_blocks_table(run: str) -> str:
    """GB/s per selection, block and transfer variant, against the contiguous copy of the same bytes."""
    m = load_run(REPO / run).metrics
    m = m[m.status == "ok"]
    rows = [{"selection": r.selection, "block": int(r.block), "unit": f"{int(r.unit_bytes) // 1024} KiB", "units": int(r.units),
             "variant": r.strategy, "GB/s": f"{r.gbps:.2f}", "vs contiguous": f"{r.ratio_to_contiguous:.3f}"}
            for r in m.itertuples()]
    return _md(pd.DataFrame(rows))


def pulse_coalesced_table(runs: list[str]) -> str:
    """Each variant's GB/s as a ratio to the contiguous copy of the same bytes in the same run, per
    run, selection, block and number of requests' selections moved at once."""
    cols = ["coalesced", "coalesced_pipelined", "gather_only", "coalesced_copy", "zero_copy", "batched_dma",
            "batched_dma_default"]
    rows = []
    for run in runs:
        m = load_run(REPO / run).metrics
        m = m[m.status == "ok"]
        split = sorted({x for x in m.strategy if x.startswith("batched_dma_per")}, key=lambda x: int(x[15:]))
        for (req, sel, blk), g in m.groupby(["requests", "selection", "block"], sort=True):
            r = g.set_index("strategy")
            row = {"run": run.split("-")[1], "requests": int(req), "MiB": f"{r['bytes'].iloc[0] / 2**20:.0f}",
                   "selection": sel, "block": int(blk), "unit": f"{int(r['unit_bytes'].iloc[0]) // 1024} KiB",
                   "contiguous GB/s": f"{r.loc['contiguous', 'gbps']:.1f}"}
            row.update({c: f"{r.loc[c, 'ratio_to_contiguous']:.2f}" if c in r.index else "–" for c in cols + split})
            rows.append(row)
    return _md(pd.DataFrame(rows).fillna("–"))


def pulse_selection_table(blocks_run: str, scaling_run: str, quality_run: str, requests: int = 4,
                          budgets=(256, 2048)) -> str:
    """Per-head vs retrieval-head selection side by side: link bytes per step, transfer and
    step time per mechanism (per layer measured x QSA layers; step = the measured resident step of the
    same batch + the transfer), quality from the quality lab at blocks of 16 (per-KV-head oracle vs the
    layer's retrieval head, mean over corpora). `blocks_run`: this experiment's run with every variant;
    `scaling_run`: a compiled pulse_scaling run (the resident step); `quality_run`: a quality run at blocks of 16."""
    bl = load_run(REPO / blocks_run).metrics
    sc = load_run(REPO / scaling_run).metrics
    comp = float(sc[(sc["mode"] == "resident") & (sc["concurrency"] == requests)]["step_ms_median"].iloc[0])
    variants = ("coalesced_pipelined", "batched_dma", "batched_dma_per512", "zero_copy")
    t = selection_rows(bl, None, comp, metrics_shape(bl).attn_layers, block=16,
                        variants=variants, requests=requests)
    q = load_run(REPO / quality_run).table("quality_summary")
    rows = []
    for r in t.itertuples():
        row = {"selection": r.selection, "unit": f"{r.unit_bytes // 1024} KiB", "units per layer": r.units_per_layer,
               "link MiB per step": f"{r.link_bytes_per_step / 2**20:.0f}"}
        for v in variants:
            row[f"{v} ms/step"] = f"{getattr(r, f'{v}_ms_per_step'):.2f}"
        row["step ms (zero_copy)"] = f"{r.step_ms_zero_copy:.2f}"
        row["step ms (batched_dma_per512)"] = f"{r.step_ms_batched_dma_per512:.2f}"
        for b in budgets:
            g = q[(q.policy == QUALITY_POLICY[r.selection]) & (q.budget == b)]
            row[f"ppl ratio @{b}"] = f"{g.ppl_ratio.mean():.3f}"
            row[f"mass recall @{b}"] = f"{g.mass_recall.mean():.3f}"
        rows.append(row)
    lead = (f"{requests} requests' selections at once (budget {int(bl.budget.iloc[0])} at 64K, blocks of 16), "
            f"run `{blocks_run.split('/')[-1]}`; resident step of {requests} requests at 1M "
            f"{comp:.2f} ms (`{scaling_run.split('/')[-1]}`); quality: SmolLM2-135M, 4K-token "
            f"sequences, `{quality_run.split('/')[-1]}` (per-head = the per-KV-head oracle).")
    return lead + "\n\n" + _md(pd.DataFrame(rows))
