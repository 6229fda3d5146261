"""PulseInfer's switched round's generated table in docs/pulseinfer.md (`labkit docs`): per transfer mechanism
and selection granularity, switched against sequential. It reads the committed run folders it is given:
docs/runs.toml names them, labkit/docs binds the block to its function and runs."""
from __future__ import annotations

import json

import pandas as pd

from ...report.summary import md_table as _md
from ...results import REPO


def pulse_switch_table(runs: list[tuple[str, list[str]]]) -> str:
    """The switched round (4 offloaded requests at 64K beside 4 normal at 8K) per transfer mechanism and
    selection granularity, every measurement of it: `runs` = [(run folder, the names of its JSON files)]."""
    rows = []
    for run, names in runs:
        for name in names:
            r = json.loads((REPO / run / f"{name}.json").read_text())[0]
            tr = [x["end_ms"] - x["start_ms"] for x in r["timeline"] if x["kind"] == "transfer"]
            hint, per = r.get("dma_prefer_overlap"), r.get("dma_units_per_call")
            rows.append({"run": run.split("-")[1], "offloaded batch's transfer": r["strategy"],
                         "select block": r.get("select_block", 1),
                         "DMA hint": "–" if hint is None else ("overlap" if hint else "default"),
                         "units per DMA call": "–" if per is None else (f"{per}" if per else "all"),
                         "sequential ms": f"{r['sequential_ms']:.2f}", "switched ms": f"{r['switched_ms']:.2f}",
                         "switched / sequential": f"{r['switched_ms'] / r['sequential_ms']:.3f}",
                         "bound ms": f"{r['bound_ms']:.2f}" if "bound_ms" in r else "–",
                         "offloaded step alone ms": f"{r['offload_only_ms']:.2f}",
                         "transfer per layer ms (median)": f"{sorted(tr)[len(tr) // 2]:.2f}",
                         "overlap ms": f"{r['overlap_ms']:.2f}", "switches / stalls": f"{r['switches']} / {r['stalls']}"})
    return _md(pd.DataFrame(rows))
