"""KV placement strategies: how the selected rows of a QSA layer reach the attention.

One interface (`TransferStrategy`), four media/mechanisms (DESIGN.md):

| name        | pool medium | load of the selected rows                                         | graphable |
|-------------|-------------|-------------------------------------------------------------------|-----------|
| resident    | device      | gather kernel over device memory (the no-offload baseline)        | yes       |
| per_row     | host        | one `copy_` per selected row (the naive reference)                | no        |
| host_gather | host        | CPU threads gather into pinned staging, then one DMA              | no        |
| zero_copy   | host        | gather kernel reading mapped pinned host memory over PCIe         | yes       |

`load(pool, layer, rows, out)` fills `out [M, W]` (device, int64 words) with `pool[layer][rows]`;
`store(pool, layer, rows, values)` writes a decode step's new rows. A *graphable* strategy does only
device work, so a whole decode step can be captured in one CUDA graph; the others need the selected
indices on the host, so the step runs as CUDA-graph segments with the load between them.
Every strategy must produce the same bytes as `resident` for the same rows (tests check it).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .gather import gather_rows, scatter_rows
from .kv import KVPool


class TransferStrategy(ABC):
    name: str
    medium: str          # where the KV pool lives: "device" or "host"
    graphable: bool

    @abstractmethod
    def load(self, pool: KVPool, layer: int, rows: torch.Tensor, out: torch.Tensor) -> None: ...

    def store(self, pool: KVPool, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write the step's new rows (one per request, 2 KiB each for the reference shape). Every
        strategy does it with the scatter kernel: on CUDA the GPU writes straight into mapped host
        memory (or device memory for `resident`), so the write stays inside the captured graph and
        needs no host sync; it is D2H traffic and not counted in `h2d_bytes`."""
        scatter_rows(values, rows, pool.data[layer])

    def h2d_bytes(self, n_rows: int, row_bytes: int) -> int:
        """Bytes this strategy moves host->device to load `n_rows` rows (engine-counted)."""
        return 0 if self.medium == "device" else n_rows * row_bytes


class Resident(TransferStrategy):
    name, medium, graphable = "resident", "device", True

    def load(self, pool, layer, rows, out):
        gather_rows(pool.data[layer], rows, out)


class ZeroCopy(TransferStrategy):
    name, medium, graphable = "zero_copy", "host", True

    def load(self, pool, layer, rows, out):
        gather_rows(pool.data[layer], rows, out)      # GPU threads read mapped pinned host memory


class PerRow(TransferStrategy):
    name, medium, graphable = "per_row", "host", False

    def load(self, pool, layer, rows, out):
        src = pool.data[layer]
        for j, r in enumerate(rows.tolist()):       # one copy per row: what per-block transfers do
            out[j].copy_(src[r], non_blocking=True)


class HostGather(TransferStrategy):
    name, medium, graphable = "host_gather", "host", False

    def __init__(self, threads: int | None = None):
        self.threads = threads
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
        if self.threads:
            torch.set_num_threads(self.threads)
        idx = rows.to("cpu")
        stage, turn = self._staging(tuple(out.shape), out.dtype)
        if out.device.type == "cuda":
            ev = self._events[turn]
            if ev is not None:
                ev.synchronize()        # the previous DMA from this buffer has finished
        torch.index_select(pool.data[layer], 0, idx, out=stage)
        out.copy_(stage, non_blocking=True)
        if out.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._events[turn] = ev


STRATEGIES: dict[str, type[TransferStrategy]] = {
    "resident": Resident, "per_row": PerRow, "host_gather": HostGather, "zero_copy": ZeroCopy}


def get_strategy(name: str) -> TransferStrategy:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}: choose from {', '.join(STRATEGIES)}")
    return STRATEGIES[name]()
