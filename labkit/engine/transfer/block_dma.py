"""`block_dma`: one `cuMemcpyBatchAsync` per load, a copy per run of consecutive rows straight from the
pinned pool (`batched_dma.py`): no CPU gather, no SMs. Built for block-granular selections (`Engine(...,
select_block=16)`: 16 consecutive 2 KiB rows, one 32 KiB copy); over scattered token rows it degrades
to one 2 KiB copy per row (4.5 GB/s on the H200 host). Without CUDA each run is one `copy_` (the same
units, the CPU standing in for the copy engine).

`dma_unit_rows` > 0 cuts every run into copies of at most that many rows: a block of 16 rows of the
reference shape in 4-row (8 KiB) copies moves as per-head selections move it (one copy per KV head's K or
V of the block, 2 heads x 2), the published baselines' transfer (`pulse_ladder`'s per_head rung)."""
from __future__ import annotations

from ... import lazy
from .base import HostDMA, Setting, register

batched_dma = lazy.module("labkit.engine.transfer.batched_dma")


@register
class BlockDMA(HostDMA):
    name, moved_by = "block_dma", "dma"
    summary = "PulseInfer's block transfers as batched DMA (cuMemcpyBatchAsync), a copy per run of consecutive rows"
    SETTINGS = (Setting("dma_prefer_overlap", "bool", True,
                        "hint the driver to keep the copies on the copy engines", "prefer_overlap"),
                Setting("dma_units_per_call", "int", 0, "units per batched DMA call (0: a load in one call)",
                        "units_per_call"),
                Setting("dma_unit_rows", "int", 0, "rows per copy at most: runs cut into units of this many "
                        "rows (0: a copy per whole run)", "unit_rows"))
    _dma = None

    def __init__(self, prefer_overlap: bool = True, units_per_call: int = 0, unit_rows: int = 0):
        if units_per_call < 0:
            raise ValueError(f"block_dma: dma_units_per_call must be >= 0 (0: one call), got {units_per_call}")
        if unit_rows < 0:
            raise ValueError(f"block_dma: dma_unit_rows must be >= 0 (0: whole runs), got {unit_rows}")
        self.prefer_overlap, self.units_per_call, self.unit_rows = bool(prefer_overlap), int(units_per_call), int(unit_rows)

    def _load_ids(self, src, ids, out, stream):
        if out.device.type != "cuda":
            units = batched_dma.runs(ids, self.unit_rows)
            for j, r, n in zip(*(t.tolist() for t in units)):
                out[j:j + n].copy_(src[r:r + n])
            self.copies += len(units[0])
            return
        if self._dma is None:
            self._dma = batched_dma.BatchedDMA(self.prefer_overlap, self.units_per_call)
        before = self._dma.copies
        self._dma.copy_runs(src, ids, out, stream, self.unit_rows)
        self.copies += self._dma.copies - before
