"""The offload engine, laid out by concept:

- `model/`: what a model is — `hybrid.py` (weights, block pieces), `layers.py`, `kv.py` (where bytes live:
  KV pool, page table, index keys), `cache.py` (OffloadCache, its one write path), `indexer.py` (scores),
  `select.py` (top-k), `attention.py`, `deltanet_step.py` (the DeltaNet mixer's kernels), `qsa_step.py`
  (a QSA layer's head norms and RoPE in one kernel), `gemv.py` (small-batch products), `gather.py` (row
  kernels), `forward.py`
  (`Engine`: the one block forward shared by prefill and decode, a generator yielding `LoadRequest`s),
  `prefill_buffers.py` (rotating layer buffers), `trace_replay.py` (recorded selections).
- `transfer/`: how selected rows reach the attention — `base.py` (the interface, declared capabilities
  and settings, the registry) and one module per mechanism.
- `drive/`: who runs the block generator — `runner.py` (one batch, CUDA graphs, anatomy), `pipeline.py`
  (layers over several devices), `switching.py` (two batches at layer boundaries), `scheduler.py`
  (requests, continuous batching), all through `dispatch.py` (loads, graph capture, warm-up).

The names below are imported on first use, so `import labkit.engine.transfer` (what the command line
reads to list strategy settings) does not import torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {"Engine": "model.forward", "HybridModel": "model.hybrid", "OffloadCache": "model.cache",
            "LoadResult": "transfer", "STRATEGIES": "transfer", "get_strategy": "transfer",
            "DecodeRunner": "drive.runner"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
