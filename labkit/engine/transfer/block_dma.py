"""`block_dma`: one `cuMemcpyBatchAsync` per load, a copy per run of consecutive rows straight from the
pinned pool (`batched_dma.py`): no CPU gather, no SMs. Built for block-granular selections (`Engine(...,
select_block=16)`: 16 consecutive 2 KiB rows, one 32 KiB copy); over scattered token rows it degrades
to one 2 KiB copy per row (4.5 GB/s on the H200 host). Without CUDA each run is one `copy_` (the same
units, the CPU standing in for the copy engine)."""
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
                        "units_per_call"))
    _dma = None

    def __init__(self, prefer_overlap: bool = True, units_per_call: int = 0):
        if units_per_call < 0:
            raise ValueError(f"block_dma: dma_units_per_call must be >= 0 (0: one call), got {units_per_call}")
        self.prefer_overlap, self.units_per_call = bool(prefer_overlap), int(units_per_call)

    def _load_ids(self, src, ids, out, stream):
        if out.device.type != "cuda":
            for j, r, n in zip(*(t.tolist() for t in batched_dma.runs(ids))):
                out[j:j + n].copy_(src[r:r + n])
            return
        if self._dma is None:
            self._dma = batched_dma.BatchedDMA(self.prefer_overlap, self.units_per_call)
        self._dma.copy_runs(src, ids, out, stream)
