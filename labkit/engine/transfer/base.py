"""What a transfer strategy is: how the selected rows of a QSA layer reach the attention.

Primitives (after vLLM's `kv_offload/abstract.py`):
- `load(pool, layer, rows, out) -> LoadResult`: fill `out [M, W]` (device, int64 words) with
  `pool[layer][rows]` and say what crossed the link to do it. Byte counts in run folders are sums of
  these results, never a formula applied from outside.
- `load_async(pool, layer, rows, out, stream) -> (LoadResult, Future of an event)`: the same, queued
  from a background thread on a side stream (strategies with `async_load`).
- `store(pool, layer, rows, values)`: write a decode step's new rows.
- `bind(cache, batch, k)`: called once per decode batch before any load; strategies with device state
  (slots, indices) allocate it here. The stateless ones need nothing.

What a strategy can do is declared, never guessed from its name or its methods:
- `medium`: where its KV pool lives, "device" or "host";
- `graphable`: only device work, so a whole decode step can be captured in one CUDA graph (the others
  need the selected indices on the host: the step runs as graph segments with the load between them);
- `async_load`: has `load_async` (copy-engine work issued from a background thread, what lets a
  switched batch's transfer hide behind the other batch's compute);
- `counts`: its traffic depends on data the host does not see (a cache's misses), so its
  `LoadResult.h2d_bytes` is a device tensor and `counters()` are read after the timed steps;
- `attends`: it reads rows inside its own attention kernel (`attend`), not through the staging rows;
- `mirrors`: it keeps copies of pool rows (device slots), so every write must go through its `store`;
- `mirrors_until_bind`: its copies are dropped by `bind` (the next batch starts with none), so a write that
  bypasses `store` is safe when a bind follows it before the next step (a scheduler's handover, which rebuilds
  the batch);
- `slow`: a step takes of the order of a second (per_row): sweeps time it over fewer steps, no anatomy;
- `counter_prefix`: the prefix of its counters' columns in a run's metrics (hot_cache: `hot_hit_rate`);
- `moved_by`: who moves the selected rows — "gpu" (a kernel's threads), "cpu" (host threads or one host-issued
  copy per row: time grows with the rows, no fixed part), "dma" (copy engines, queued in batches).

`copies`: the host-to-device copies a strategy has issued so far (one per row, per unit, per staging
chunk); a kernel reading host memory issues none. Bytes per copy is what per-transfer costs scale with
(PulseInfer's ~8 KiB per-head units against its coalesced copies), so it is counted where copies are made.

A strategy's own settings are `Setting`s declared on its class (`SETTINGS`): the sweep parameter's name,
type, default and help, and the constructor argument it feeds. Every experiment that takes strategies
pulls these in (`transfer.strategy_params()`), so a setting is written once, here beside its strategy.
Every strategy must produce the same bytes as `resident` for the same rows (tests check it).

Adding a mechanism: one module with a `TransferStrategy` subclass decorated with `@register`, and its
import in `transfer/__init__.py` (or, outside the package, a file named in `LABKIT_STRATEGIES`).
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ... import lazy

if TYPE_CHECKING:
    import torch

    from ..model.kv import KVPool

# imported on first use: declaring strategies (names, settings) costs no torch import
torch = lazy.module("torch")            # noqa: F811
gather = lazy.module("labkit.engine.model.gather")


@contextlib.contextmanager
def host_threads(n: int):
    """torch's CPU threads set to `n` for a host-side gather and put back after: the count is process-wide, and
    left changed it would change how the rest of the process computes (on a CPU run, the model's own products:
    another strategy's step then differs from resident's in its last bits)."""
    saved = torch.get_num_threads()
    if saved != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if saved != n:
            torch.set_num_threads(saved)


@dataclass(frozen=True)
class LoadResult:
    """What one `load` moved: rows delivered to the attention, and the bytes of them that crossed the
    host link (0 for device-resident rows). `h2d_bytes` may be a 0-d device tensor when it depends on
    data the host does not see (a cache's misses); it is then read after the timed steps."""
    rows: int
    h2d_bytes: int | torch.Tensor


@dataclass(frozen=True)
class Setting:
    """One strategy setting as a sweep parameter: `param` (the name users type), its `kind` and `default`
    (as in `labkit.params.Param`), `help`, and `arg`, the constructor argument it feeds."""
    param: str
    kind: str
    default: Any
    help: str
    arg: str


class TransferStrategy(ABC):
    name: str
    medium: str                  # "device" or "host"
    graphable: bool
    async_load: bool = False
    counts: bool = False
    attends: bool = False
    mirrors: bool = False
    mirrors_until_bind: bool = False
    slow: bool = False
    counter_prefix: str = ""
    moved_by: str = "gpu"
    SETTINGS: tuple[Setting, ...] = ()
    # what it stands for, one line (the glossary, `labkit run decode --help`)
    summary: str = ""
    copies: int = 0              # host-issued H2D copies so far (an instance's count; see the module docstring)

    def bind(self, cache, batch: int, k: int) -> None:
        """Per decode batch, before the first load (device state is allocated here)."""

    @abstractmethod
    def load(self, pool: KVPool, layer: int, rows: torch.Tensor, out: torch.Tensor) -> LoadResult: ...

    def store(self, pool: KVPool, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Write the step's new rows (one per request, 2 KiB each for the reference shape). Every
        strategy does it with the scatter kernel: on CUDA the GPU writes straight into mapped host
        memory (or device memory for `resident`), so the write stays inside the captured graph and
        needs no host sync; it is D2H traffic, not part of a `LoadResult`."""
        gather.scatter_rows(values, rows, pool.data[layer])

    def settings(self) -> dict:
        """This strategy's settings by their sweep names, as recorded beside each measured point."""
        return {s.param: getattr(self, s.arg) for s in self.SETTINGS}

    def end_step(self) -> None:
        """After the last block of a decode step (inside the step's graph): a strategy that left work
        on a side stream joins it here, so a captured step ends with every stream joined."""

    def counters(self) -> dict[str, int]:
        """Cumulative device-side counts (hits, misses, bytes...) of strategies that `count`; read
        outside timed regions, differenced over a measured window."""
        return {}

    def _moved(self, pool: KVPool, rows: torch.Tensor) -> LoadResult:
        n = rows.numel()
        return LoadResult(n, 0 if pool.medium == "device" else n * pool.row_bytes)


STRATEGIES: dict[str, type[TransferStrategy]] = {}


def register(cls: type[TransferStrategy]) -> type[TransferStrategy]:
    """Make a strategy known by its name to every experiment (decorator). Its settings' names must not
    clash with another strategy's setting of a different meaning (same name = same kind and default)."""
    for s in cls.SETTINGS:
        for other in STRATEGIES.values():
            for t in other.SETTINGS:
                if t.param == s.param and (t.kind, t.default) != (s.kind, s.default):
                    raise ValueError(f"strategy {cls.name}: setting {s.param} clashes with {other.name}'s")
    STRATEGIES[cls.name] = cls
    return cls


def settings_of(name: str) -> tuple[Setting, ...]:
    return STRATEGIES[name].SETTINGS


def get_strategy(name: str, **settings) -> TransferStrategy:
    """A strategy by name; `settings` uses the sweep's names, those that do not apply to this strategy are
    ignored, so one dict of sweep settings serves every strategy of a sweep."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}: choose from {', '.join(STRATEGIES)}")
    known = {s.param for cls in STRATEGIES.values() for s in cls.SETTINGS}
    unknown = set(settings) - known
    if unknown:
        raise ValueError(f"unknown strategy setting {sorted(unknown)[0]!r}: choose from {', '.join(sorted(known))}")
    kw = {s.arg: settings[s.param] for s in STRATEGIES[name].SETTINGS if s.param in settings}
    return STRATEGIES[name](**kw)


class KernelGather(TransferStrategy):
    """The Triton gather kernel; its launch configuration is this strategy's setting."""
    graphable = True
    SETTINGS = (Setting("gather_rows_per_prog", "int", 4, "gather kernel: rows per program", "rows_per_prog"),
                Setting("gather_num_warps", "int", 4, "gather kernel: warps per program", "num_warps"),
                Setting("gather_programs", "int", 0, "gather kernel over the host link: programs per load (0: "
                        "rows / rows_per_prog); fewer programs read the link slower (decode's link_gbps)", "programs"))

    def __init__(self, rows_per_prog: int = 4, num_warps: int = 4, programs: int = 0):
        if rows_per_prog <= 0 or num_warps <= 0 or num_warps & (num_warps - 1) or programs < 0:
            raise ValueError(f"{self.name}: rows_per_prog must be > 0, num_warps a power of two and programs >= 0, "
                             f"got {rows_per_prog}, {num_warps}, {programs}")
        self.rows_per_prog, self.num_warps, self.programs = rows_per_prog, num_warps, programs

    def load(self, pool, layer, rows, out):
        if self.programs and self.medium == "host":
            # A slower link, emulated: a zero-copy gather's rate follows the programs that read (each one row
            # at a time, latency-bound), so a fixed number of programs caps the load's GB/s. The device's
            # own gathers (`resident`) are never slowed.
            gather.gather_rows_paced(pool.data[layer], rows, out, self.programs)
        else:
            gather.gather_rows(pool.data[layer], rows, out, rows_per_prog=self.rows_per_prog, num_warps=self.num_warps)
        return self._moved(pool, rows)


class HostDMA(TransferStrategy):
    """A host strategy whose load is copy-engine work issued from the host with the indices in host
    memory: `load_async` does the whole load (indices to the host, then `_load_ids`) from a background
    thread on a side stream, so the caller's thread goes on launching other work and learns of
    completion from an event (`drive.switching.Pending` takes the future of that event)."""
    medium, graphable, async_load = "host", False, True
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
