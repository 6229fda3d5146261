"""The multi-GPU experiment's generated table in docs/multi-gpu.md (`labkit docs`): one GPU against the layers
split over two and pipelined micro-batches, with gather scaling and the hand-off beside. It reads the committed run
folders it is given: docs/runs.toml names them, labkit/docs binds the block to its function and runs."""
from __future__ import annotations

import pandas as pd

from ...report.summary import md_table as _md
from ...report.units import tokens_label as _ctx
from ...results import REPO, load_run


def multigpu_table(first_run: str, rerun_run: str) -> str:
    """1 GPU vs the layers split over two (stages taking turns) vs pipelined micro-batches; the rerun's
    points where it has them, concurrency 1 from the first run; gather scaling and hand-off beside."""
    first, rerun = (load_run(REPO / r).metrics for r in (first_run, rerun_run))
    dec = lambda m: m[(m.experiment == "decode") & (m.status == "ok")]
    d = pd.concat([dec(first)[dec(first).concurrency == 1], dec(rerun)])
    best = d.sort_values("tok_s").groupby(["strategy", "context_len", "concurrency", "layout"]).last().reset_index()
    rows = []
    for (s, c, n), g in best.groupby(["strategy", "context_len", "concurrency"]):
        by = g.set_index("layout")
        one = by.tok_s.get("1gpu")
        r = {"strategy": s, "context": _ctx(c), "requests": int(n), "1 GPU tok/s": f"{one:.1f}" if one else "does not fit",
             "split tok/s (bubble)": f"{by.tok_s['split']:.1f} ({by.bubble_share['split']:.0%})"}
        if "pipelined" in by.index:
            pp = by.loc["pipelined"]
            r["pipelined tok/s (micro-batches, bubble)"] = f"{pp.tok_s:.1f} ({int(pp.micro_batches)}, {pp.bubble_share:.0%})"
            r["pipelined / 1 GPU"] = f"{pp.tok_s / one:.2f}" if one else "–"
        else:
            r["pipelined tok/s (micro-batches, bubble)"] = "–"
            r["pipelined / 1 GPU"] = "–"
        r["split / 1 GPU"] = f"{by.tok_s['split'] / one:.2f}" if one else "–"
        rows.append(r)
    g = rerun[(rerun.experiment == "gather") & (rerun.status == "ok")]
    alone = g[g["mode"] == "alone"].gbps.max()
    agg = g[g["mode"] == "together"].gbps_aggregate.iloc[0]
    h = first[(first.experiment == "handoff") & (first.status == "ok")]
    lead = (f"Zero-copy gather of one decode step (48 MiB), each GPU over its own link: one GPU {alone:.1f} GB/s, "
            f"both at once {agg:.1f} GB/s (**{agg / alone:.2f}x**). Hand-off of one step's activations "
            f"cuda:0 -> cuda:1 (NVLink): {h.us_median.median():.0f} µs.")
    return lead + "\n\n" + _md(pd.DataFrame(rows))
