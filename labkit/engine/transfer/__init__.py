"""How selected rows reach the attention: one module per mechanism, each registered by name.

| name        | module         | pool   | load of the selected rows                                        |
|-------------|----------------|--------|------------------------------------------------------------------|
| resident    | resident.py    | device | gather kernel over device memory (the no-offload baseline)       |
| per_row     | per_row.py     | host   | one `copy_` per selected row (the naive reference)               |
| host_gather | host_gather.py | host   | CPU threads gather into pinned staging, then one DMA             |
| zero_copy   | zero_copy.py   | host   | gather kernel reading mapped pinned host memory over PCIe        |
| hot_cache   | hot_cache.py   | host   | FlashOffloading: device slots per request; only misses cross      |
| coalesced   | coalesced.py   | host   | PulseInfer: chunked threaded gather, each chunk's DMA as it is ready |
| block_dma   | block_dma.py   | host   | batched DMA, a copy per run of consecutive rows                  |

`base.py` holds the interface and the registry. A strategy defined outside the package registers itself
with `@register`; naming its file in `LABKIT_STRATEGIES` (a variable of the shell, paths separated by
`os.pathsep`) loads it in every process that imports this package, so it reaches a notebook's kernel too.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ... import envs
from ...params import BadInput, Param
# registration order is the order users see them in (the glossary's): the baseline first
from . import resident, per_row, host_gather, zero_copy, hot_cache, coalesced, block_dma  # noqa: F401,I001
from .base import STRATEGIES, LoadResult, Setting, TransferStrategy, get_strategy, register, settings_of
from .block_dma import BlockDMA
from .coalesced import Coalesced
from .host_gather import HostGather
from .hot_cache import HotCache
from .per_row import PerRow
from .resident import Resident
from .zero_copy import ZeroCopy

__all__ = ["BlockDMA", "Coalesced", "HostGather", "HotCache", "PerRow", "Resident", "ZeroCopy", "STRATEGIES", "LoadResult", "Setting", "TransferStrategy", "get_strategy", "register", "settings_of",
           "setting_names", "strategy_params", "load_plugins"]


def setting_names() -> list[str]:
    """Every registered strategy's settings by their sweep names, in registration order."""
    out: list[str] = []
    for cls in STRATEGIES.values():
        out += [s.param for s in cls.SETTINGS if s.param not in out]
    return out


def check_host_strategy(name: str, why: str) -> None:
    """`name` keeps its rows in host RAM, else one BadInput line: `why` it must, and the strategies that do."""
    if name not in STRATEGIES or STRATEGIES[name].medium != "host":
        raise BadInput(f"strategy {name!r}: {why}, choose a host strategy "
                       f"({', '.join(n for n, c in STRATEGIES.items() if c.medium == 'host')})")


def strategy_params(of=None) -> list:
    """The sweep parameters of the registered strategies' settings (`labkit.params.Param`; `of`: only these
    strategies'), help text prefixed with the strategies each applies to: what an experiment that takes
    strategies adds to its SPEC."""
    by_name: dict[str, tuple[Setting, list[str]]] = {}
    for cls in (STRATEGIES[n] for n in of) if of is not None else STRATEGIES.values():
        for s in cls.SETTINGS:
            by_name.setdefault(s.param, (s, []))[1].append(cls.name)
    return [Param(s.param, s.kind, s.default, f"{'/'.join(names)}: {s.help}") for s, names in by_name.values()]


def load_plugins(paths: str | None = None) -> list[str]:
    """Import the strategy files named in `LABKIT_STRATEGIES` (once each); returns their paths."""
    raw = envs.get("LABKIT_STRATEGIES") if paths is None else paths
    done = []
    for p in filter(None, raw.split(os.pathsep)):
        path = Path(p).resolve()
        name = f"labkit_strategy_{path.stem}"
        if name in _loaded:
            continue
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None or not path.is_file():
            raise BadInput(f"LABKIT_STRATEGIES names {p}, which is not a Python file")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _loaded[name] = mod
        done.append(str(path))
    return done


_loaded: dict = {}
load_plugins()
