"""`host_gather`: CPU threads gather the selected rows into one of two pinned staging buffers, then one
DMA crosses the link (the link sees one large copy; the gather sits in front of it)."""
from __future__ import annotations

import os

from ... import lazy
from .base import Setting, TransferStrategy, host_threads, register

torch = lazy.module("torch")


@register
class HostGather(TransferStrategy):
    name, medium, graphable, moved_by = "host_gather", "host", False, "cpu"
    summary = "CPU threads gather rows into pinned staging, then one DMA"
    SETTINGS = (Setting("host_threads", "int", 0, "CPU threads gathering rows (0: all cores)", "threads"),)

    def __init__(self, threads: int = 0):
        if threads < 0:
            raise ValueError(f"host_gather: threads must be >= 0 (0: all cores), got {threads}")
        self.threads = threads or os.cpu_count() or 1
        self._stage: dict[tuple, list[torch.Tensor]] = {}
        self._turn = 0
        self._events: list = [None, None]

    def _staging(self, shape, dtype) -> tuple[torch.Tensor, int]:
        bufs = self._stage.get((shape, dtype))
        if bufs is None:   # two pinned buffers: gather into one while the other's DMA drains
            pin = torch.cuda.is_available()
            bufs = self._stage[(shape, dtype)] = [torch.empty(shape, dtype=dtype, pin_memory=pin) for _ in range(2)]
        self._turn ^= 1
        return bufs[self._turn], self._turn

    def load(self, pool, layer, rows, out):
        idx = rows.to("cpu")
        stage, turn = self._staging(tuple(out.shape), out.dtype)
        if out.device.type == "cuda":
            ev = self._events[turn]
            if ev is not None:
                ev.synchronize()        # the previous DMA from this buffer has finished
        with host_threads(self.threads):
            torch.index_select(pool.data[layer], 0, idx, out=stage)
        out.copy_(stage, non_blocking=True)
        self.copies += 1
        if out.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._events[turn] = ev
        return self._moved(pool, rows)
