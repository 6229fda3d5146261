"""PulseInfer's concurrency-scaling experiment's generated tables in docs/pulseinfer.md (`labkit docs`): one batch
against two switched per request count (eager and compiled steps) beside the bound, and the headline ratios per
process. Each reads the committed run folders it is given: docs/runs.toml names them, labkit/docs binds each
block to its function and runs."""
from __future__ import annotations

import pandas as pd

from ...report.summary import md_table as _md
from ...results import REPO, load_run


def pulse_scaling_table(run: str) -> str:
    """One offloaded batch against two switched and resident per request count, beside the bound's terms."""
    m = load_run(REPO / run).metrics
    m = m[m.status == "ok"]
    piv = m.pivot_table(index="concurrency", columns="mode", values="tok_s")
    b = m[m["mode"] == "no_switch"].set_index("concurrency")
    rows = [{"requests": int(n), "one batch tok/s": f"{piv.loc[n, 'no_switch']:.1f}",
             "two switched tok/s": f"{piv.loc[n, 'switched']:.1f}" if pd.notna(piv.loc[n].get("switched")) else "–",
             "resident tok/s": f"{piv.loc[n, 'resident']:.1f}", "bound: one batch ms": f"{b.loc[n, 'no_switch_model_ms']:.2f}",
             "bound: switched ≥ ms": f"{b.loc[n, 'switched_floor_ms']:.2f}", "transfer ms": f"{b.loc[n, 'transfer_ms']:.2f}",
             "2nd weight pass ms": f"{b.loc[n, 'extra_weight_ms']:.2f}"} for n in piv.index]
    first = m.iloc[0]
    lead = (f"Link {first.link_gbps:.1f} GB/s and HBM {first.hbm_gbps:.0f} GB/s measured in the run; the physics crossover "
            f"(weights / HBM vs one request's rows / link) is {first.crossover_physics:.1f} requests; steps are CUDA graphs "
            f"without torch.compile (launch-bound).")
    return lead + "\n\n" + _md(pd.DataFrame(rows))


def pulse_scaling_compiled_table(labelled: list[tuple[str, str]]) -> str:
    """Aggregate tok/s at 1M with every request offloaded, compiled steps: per request count and offload
    transfer, one batch vs two switched, switched against the best one-batch transfer (zero_copy, the
    last run) and the bound's two floors (the same for every transfer: they use the contiguous link).
    `labelled` = [(run folder, its offload transfer)]."""
    runs = []
    for run, label in labelled:
        m = load_run(REPO / run).metrics
        runs.append((m[m.status == "ok"].pivot_table(index="concurrency", columns="mode", values="tok_s"), m, label))
    ref_piv, ref, _ = runs[-1]
    b = ref[ref["mode"] == "no_switch"].set_index("concurrency")
    rows = []
    for n in sorted(set().union(*(p.index for p, _, _ in runs))):
        for p, _, label in runs:
            if n not in p.index:
                continue
            one, two = p.loc[n, "no_switch"], p.loc[n].get("switched")
            best = ref_piv.loc[n, "no_switch"] if n in ref_piv.index else float("nan")
            rows.append({"requests": int(n), "offload transfer": label, "one batch tok/s": f"{one:.0f}",
                         "two switched tok/s": f"{two:.0f}" if pd.notna(two) else "–",
                         "switched / one batch": f"{two / one:.2f}" if pd.notna(two) else "–",
                         "switched / zero_copy one batch": f"{two / best:.2f}" if pd.notna(two) and pd.notna(best) else "–",
                         "resident tok/s": f"{p.loc[n, 'resident']:.0f}",
                         "bound: one batch ms": f"{b.loc[n, 'no_switch_model_ms']:.2f}" if n in b.index else "–",
                         "bound: switched ≥ ms": f"{b.loc[n, 'switched_floor_ms']:.2f}" if n in b.index else "–"})
    first = ref.iloc[0]
    lead = (f"Link {first.link_gbps:.1f} GB/s and HBM {first.hbm_gbps:.0f} GB/s measured in the zero_copy run; the "
            f"physics crossover (weights / HBM vs one request's rows / link) is {first.crossover_physics:.1f} requests; "
            "steps are CUDA graphs of torch.compile'd pieces; block_dma selects blocks of 16, zero_copy single "
            "positions; the bounds are the zero_copy run's.")
    return lead + "\n\n" + _md(pd.DataFrame(rows))



def crossover(m: pd.DataFrame) -> float:
    """Fewest requests from which two switched batches beat one offloaded batch at every larger count (nan: never)."""
    piv = m[m["status"] == "ok"].pivot_table(index="concurrency", columns="mode", values="tok_s")
    r = (piv["switched"] / piv["no_switch"]).dropna()
    wins = r > 1.0
    for n in r.index:
        if wins.loc[n:].all():
            return float(n)
    return float("nan")


def pulse_rows(runs: list[str]) -> pd.DataFrame:
    """Two switched batches against one offloaded batch at the most requests, and the crossover, one row per
    process (docs/spreads.md and the README's headlines take the spread across processes)."""
    out = []
    for i, run in enumerate(runs, 1):
        m = load_run(REPO / run).metrics
        piv = m[m["status"] == "ok"].pivot_table(index="concurrency", columns="mode", values="tok_s")
        top = int(piv.index.max())
        out.append({"figure": f"PulseInfer: two switched / one offloaded batch, {top} requests at 1M", "process": i,
                    "value": piv.loc[top, "switched"] / piv.loc[top, "no_switch"]})
        out.append({"figure": "PulseInfer: crossover (fewest requests from which switching wins)", "process": i,
                    "value": crossover(m)})
    return pd.DataFrame(out)
