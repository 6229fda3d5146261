"""`per_row`: one copy per selected row, what per-block transfers of a few KiB each do (the naive
reference: every copy pays the driver's and the link's per-transfer cost)."""
from __future__ import annotations

from .base import TransferStrategy, register


@register
class PerRow(TransferStrategy):
    name, medium, graphable = "per_row", "host", False
    summary = "one copy per selected row: the naive reference (what per-head 8 KB transfers do)"
    slow = True          # ~0.4 s a step per request on the reference shape
    moved_by = "cpu"

    def load(self, pool, layer, rows, out):
        src = pool.data[layer]
        for j, r in enumerate(rows.tolist()):
            out[j].copy_(src[r], non_blocking=True)
        self.copies += rows.numel()
        return self._moved(pool, rows)
