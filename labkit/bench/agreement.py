"""labkit's link probe against an independent probe of the same host link (a reference `pcie_probe.json`),
path by path: `pairs(reference_json, metrics)` gives the table the results docs show.

Both measure the same host link on the same machine, run back to back; the shared probe times each call
between its own events with a sync after each, labkit's probe as `triton.testing.do_bench` does (see
`probe.py`). Pairs: contiguous pinned H2D of 256 MiB, pageable 256 MiB, CPU gather + one DMA with 1, 4
and all threads (shared: 16), and the zero-copy gather (shared: its CUDA kernel; labkit: the engine's
`zero_copy` strategy at its default launch configuration).
"""
from __future__ import annotations

import pandas as pd

from ..targets import TARGETS


def pairs(shared: dict, m: pd.DataFrame) -> pd.DataFrame:
    ok = m[(m["experiment"] == "probe") & (m["status"] == "ok")]

    def lab(strategy, **where):
        p = ok[ok["strategy"] == strategy]
        for k, v in where.items():
            p = p[p[k] == v]
        return float(p["gbps"].iloc[0]) if len(p) else None

    threads = sorted(int(t) for t in ok.loc[ok["strategy"] == "host_gather", "threads"].dropna().unique())
    rows = [("contiguous pinned H2D 256 MiB", shared.get("h2d_256MiB_GBps"), lab("contiguous", size_mib=256, direction="h2d")),
            ("pageable H2D 256 MiB", shared.get("h2d_pageable_256MiB_GBps"), lab("pageable")),
            ("zero-copy gather (48 MiB step)", shared.get("uva_gather_GBps"),
             lab("zero_copy", rows_per_prog=4, num_warps=4))]
    for th in threads:
        rows.append((f"CPU gather + DMA, {th} thread(s)", shared.get(f"cpu_gather_threads{th}_GBps"), lab("host_gather", threads=th)))
    t = pd.DataFrame(rows, columns=["path", "shared_gbps", "labkit_gbps"])
    t["ratio"] = t["labkit_gbps"] / t["shared_gbps"]
    t["within"] = (t["ratio"] - 1).abs() <= TARGETS["probe_agreement"].threshold
    return t
