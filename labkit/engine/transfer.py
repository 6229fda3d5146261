"""KV placement strategies: how the selected rows of a QSA layer reach the attention.

One interface (`TransferStrategy`), four media/mechanisms (DESIGN.md):

| name        | pool medium | load of the selected rows                                         | graphable |
|-------------|-------------|-------------------------------------------------------------------|-----------|
| resident    | device      | gather kernel over device memory (the no-offload baseline)        | yes       |
| per_row     | host        | one `copy_` per selected row (the naive reference)                | no        |
| host_gather | host        | CPU threads gather into pinned staging, then one DMA              | no        |
| zero_copy   | host        | gather kernel reading mapped pinned host memory over PCIe         | yes       |
| coalesced   | host        | chunked threaded gather into pinned staging, each chunk's DMA     | no        |
|             |             | issued as it is ready (`coalesced.py`); `load_async` for switching |           |
| block_dma   | host        | one batched DMA call, a copy per run of consecutive rows (a block  | no        |
|             |             | of a block-granular selection); `load_async` for switching         |           |
| hot_cache   | host        | device slots per request; only the misses cross (`hot_cache.py`)  | yes       |

Primitives (after vLLM's `kv_offload/abstract.py`):
- `load(pool, layer, rows, out) -> LoadResult`: fill `out [M, W]` (device, int64 words) with
  `pool[layer][rows]` and say what crossed the link to do it. Byte counts in run folders are sums of
  these results, never a formula applied from outside.
- `store(pool, layer, rows, values)`: write a decode step's new rows.
- `bind(cache, batch, k)`: called once per decode batch before any load; strategies with device state
  (slots, indices) allocate it here. The stateless ones need nothing.

A *graphable* strategy does only device work, so a whole decode step can be captured in one CUDA graph;
the others need the selected indices on the host, so the step runs as CUDA-graph segments with the load
between them. A strategy's own settings (gather launch configuration, host threads) are constructor
arguments, named in `SETTINGS`, and sweep parameters (`labkit run decode -p gather_rows_per_prog=8`).
Every strategy must produce the same bytes as `resident` for the same rows (tests check it).
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .gather import gather_rows, scatter_rows
from .kv import KVPool


@dataclass(frozen=True)
class LoadResult:
    """What one `load` moved: rows delivered to the attention, and the bytes of them that crossed the
    host link (0 for device-resident rows). `h2d_bytes` may be a 0-d device tensor when it depends on
    data the host does not see (a cache's misses); it is then read after the timed steps."""
    rows: int
    h2d_bytes: int | torch.Tensor


class TransferStrategy(ABC):
    name: str
    medium: str          # where the KV pool lives: "device" or "host"
    graphable: bool

    def bind(self, cache, batch: int, k: int) -> None:
        """Per decode batch, before the first load (device state is allocated here)."""

    @abstractmethod
    def load(self, pool: KVPool, layer: int, rows: torch.Tensor, out: torch.Tensor) -> LoadResult: ...

    def store(self, pool: KVPool, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write the step's new rows (one per request, 2 KiB each for the reference shape). Every
        strategy does it with the scatter kernel: on CUDA the GPU writes straight into mapped host
        memory (or device memory for `resident`), so the write stays inside the captured graph and
        needs no host sync; it is D2H traffic, not part of a `LoadResult`."""
        scatter_rows(values, rows, pool.data[layer])

    def settings(self) -> dict:
        """This strategy's own settings, as recorded beside each measured point."""
        return {}

    # A strategy that loads rows inside its own attention kernel (hot_cache, fused) sets `attends`; the
    # engine then calls `attend(pool, layer, q, valid, n_kv)` after the step's `load` instead of
    # attending over the staging rows itself.
    attends = False

    def end_step(self) -> None:
        """After the last block of a decode step (inside the step's graph): a strategy that left work
        on a side stream joins it here, so a captured step ends with every stream joined."""

    def counters(self) -> dict[str, int]:
        """Cumulative device-side counts (hits, misses, bytes...) of strategies whose per-step traffic
        depends on data; read outside timed regions, differenced over a measured window."""
        return {}

    def _moved(self, pool: KVPool, rows: torch.Tensor) -> LoadResult:
        n = rows.numel()
        return LoadResult(n, 0 if pool.medium == "device" else n * pool.row_bytes)


class KernelGather(TransferStrategy):
    """The Triton gather kernel; its launch configuration is this strategy's setting."""
    graphable = True

    def __init__(self, rows_per_prog: int = 4, num_warps: int = 4):
        if rows_per_prog <= 0 or num_warps <= 0 or num_warps & (num_warps - 1):
            raise ValueError(f"{self.name}: rows_per_prog must be > 0 and num_warps a power of two, "
                             f"got {rows_per_prog}, {num_warps}")
        self.rows_per_prog, self.num_warps = rows_per_prog, num_warps

    def load(self, pool, layer, rows, out):
        gather_rows(pool.data[layer], rows, out, rows_per_prog=self.rows_per_prog, num_warps=self.num_warps)
        return self._moved(pool, rows)

    def settings(self):
        return {"gather_rows_per_prog": self.rows_per_prog, "gather_num_warps": self.num_warps}


class Resident(KernelGather):
    name, medium = "resident", "device"


class ZeroCopy(KernelGather):
    name, medium = "zero_copy", "host"     # GPU threads read mapped pinned host memory


class PerRow(TransferStrategy):
    name, medium, graphable = "per_row", "host", False

    def load(self, pool, layer, rows, out):
        src = pool.data[layer]
        for j, r in enumerate(rows.tolist()):       # one copy per row: what per-block transfers do
            out[j].copy_(src[r], non_blocking=True)
        return self._moved(pool, rows)


class HostGather(TransferStrategy):
    """CPU threads gather the rows into one of two pinned staging buffers, then one DMA."""
    name, medium, graphable = "host_gather", "host", False

    def __init__(self, threads: int = 0):
        if threads < 0:
            raise ValueError(f"host_gather: threads must be >= 0 (0: all cores), got {threads}")
        self.threads = threads or os.cpu_count() or 1
        self._stage: dict[tuple, list[torch.Tensor]] = {}
        self._turn = 0
        self._events: list = [None, None]

    def settings(self):
        return {"host_threads": self.threads}

    def _staging(self, shape, dtype) -> tuple[torch.Tensor, int]:
        bufs = self._stage.get((shape, dtype))
        if bufs is None:   # two pinned buffers: gather into one while the other's DMA drains
            pin = torch.cuda.is_available()
            bufs = self._stage[(shape, dtype)] = [torch.empty(shape, dtype=dtype, pin_memory=pin) for _ in range(2)]
        self._turn ^= 1
        return bufs[self._turn], self._turn

    def load(self, pool, layer, rows, out):
        if torch.get_num_threads() != self.threads:
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
        return self._moved(pool, rows)


class HostDMA(TransferStrategy):
    """A host strategy whose load is copy-engine work issued from the host with the indices in host
    memory: `load_async` does the whole load (indices to the host, then `_load_ids`) from a background
    thread on a side stream, so the caller's thread goes on launching other work and learns of
    completion from an event (`switching.Pending` takes the future of that event)."""
    medium, graphable = "host", False
    _bg = None

    def _load_ids(self, src: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, stream) -> None:
        raise NotImplementedError

    def load(self, pool, layer, rows, out):
        self._load_ids(pool.data[layer], rows.to("cpu"), out, None)
        return self._moved(pool, rows)

    def load_async(self, pool, layer, rows, out, stream: torch.cuda.Stream):
        """Queue the load on `stream` from a background thread (CUDA only; `stream` must already be
        ordered after the work that wrote `rows`). Returns (LoadResult, Future of the CUDA event
        recorded on `stream` after the last copy)."""
        from concurrent.futures import ThreadPoolExecutor
        if self._bg is None:
            self._bg = ThreadPoolExecutor(1, thread_name_prefix=f"labkit-{self.name}")
        dev = out.device

        def run() -> torch.cuda.Event:
            # inference_mode: `out` is the decode state's staging, an inference tensor (a thread does not
            # inherit the caller's mode, and an in-place copy into one outside it is refused)
            with torch.inference_mode(), torch.cuda.device(dev), torch.cuda.stream(stream):
                ids = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
                ids.copy_(rows, non_blocking=True)
                got = torch.cuda.Event()
                got.record(stream)
                got.synchronize()                      # this thread waits for the indices, not the caller
                self._load_ids(pool.data[layer], ids, out, stream)
                done = torch.cuda.Event(enable_timing=True)
                done.record(stream)
                return done
        return self._moved(pool, rows), self._bg.submit(run)


class Coalesced(HostDMA):
    """`host_gather` pipelined: `coalesced.CoalescedLoader` gathers chunk by chunk (torch's CPU threads)
    and issues each chunk's copy as soon as it is gathered. The copies are DMA (copy engine, no SMs),
    which is what lets a switched batch's transfer hide behind the other batch's compute."""
    name = "coalesced"

    def __init__(self, threads: int = 0, chunk_bytes: int = 8 << 20):
        from .coalesced import CoalescedLoader
        self.loader = CoalescedLoader(threads, chunk_bytes)

    def settings(self):
        return {"host_threads": self.loader.threads}

    def _load_ids(self, src, ids, out, stream):
        self.loader.load(src, ids, out, stream=stream)


class BlockDMA(HostDMA):
    """One `cuMemcpyBatchAsync` per load, a copy per run of consecutive rows straight from the pinned
    pool (`batched_dma.py`): no CPU gather, no SMs. Built for block-granular selections (`Engine(...,
    select_block=16)`: 16 consecutive 2 KiB rows, one 32 KiB copy); over scattered token rows it
    degrades to one 2 KiB copy per row (4.5 GB/s on the H200 host). Without CUDA each run is one
    `copy_` (the same units, the CPU standing in for the copy engine)."""
    name = "block_dma"
    _dma = None

    def __init__(self, prefer_overlap: bool = True, units_per_call: int = 0):
        if units_per_call < 0:
            raise ValueError(f"block_dma: dma_units_per_call must be >= 0 (0: one call), got {units_per_call}")
        self.prefer_overlap, self.units_per_call = bool(prefer_overlap), int(units_per_call)

    def settings(self):
        return {"dma_prefer_overlap": self.prefer_overlap, "dma_units_per_call": self.units_per_call}

    def _load_ids(self, src, ids, out, stream):
        if out.device.type != "cuda":
            from .batched_dma import runs
            for j, r, n in zip(*(t.tolist() for t in runs(ids))):
                out[j:j + n].copy_(src[r:r + n])
            return
        if self._dma is None:
            from .batched_dma import BatchedDMA
            self._dma = BatchedDMA(self.prefer_overlap, self.units_per_call)
        self._dma.copy_runs(src, ids, out, stream)


from .hot_cache import HotCache  # noqa: E402  (it subclasses TransferStrategy)

STRATEGIES: dict[str, type[TransferStrategy]] = {
    "resident": Resident, "per_row": PerRow, "host_gather": HostGather, "zero_copy": ZeroCopy,
    "hot_cache": HotCache, "coalesced": Coalesced, "block_dma": BlockDMA}

# Sweep parameter -> (strategies it applies to, constructor argument).
SETTINGS: dict[str, tuple[tuple[str, ...], str]] = {
    "gather_rows_per_prog": (("resident", "zero_copy"), "rows_per_prog"),
    "gather_num_warps": (("resident", "zero_copy"), "num_warps"),
    "host_threads": (("host_gather", "coalesced"), "threads"),
    "hot_capacity": (("hot_cache",), "capacity"),
    "hot_policy": (("hot_cache",), "policy"),
    "hot_fused": (("hot_cache",), "fused"),
    "hot_defer": (("hot_cache",), "defer"),
    "dma_prefer_overlap": (("block_dma",), "prefer_overlap"),
    "dma_units_per_call": (("block_dma",), "units_per_call"),
}


def get_strategy(name: str, **settings) -> TransferStrategy:
    """A strategy by name; `settings` uses the sweep's names (`SETTINGS`), those that do not apply to
    this strategy are ignored, so one dict of sweep settings serves every strategy of a sweep."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}: choose from {', '.join(STRATEGIES)}")
    unknown = set(settings) - set(SETTINGS)
    if unknown:
        raise ValueError(f"unknown strategy setting {sorted(unknown)[0]!r}: choose from {', '.join(SETTINGS)}")
    kw = {arg: settings[key] for key, (names, arg) in SETTINGS.items() if key in settings and name in names}
    return STRATEGIES[name](**kw)
