"""The offload engine, one module per concern:

- `shapes` (package level) -> `model.py`: weights and the block pieces (HybridModel, block_fns)
- `kv.py`: where bytes live (KV pool, page table, index keys); `cache.py`: OffloadCache and its one write path
- `transfer.py`: how selected rows reach the attention (strategies, `LoadResult`); `hot_cache.py` the
  strategy with device slots (its kernels: `hot_plan.py`, `hot_gather.py`, `fused_attention.py`)
- `indexer.py` (scores), `select.py` (top-k), `attention.py`, `layers.py`, `gather.py` (kernels)
- `engine.py`: Engine, the one block forward shared by prefill and decode
- `runner.py`: DecodeRunner, CUDA graphs, what moved per step and the step anatomy
- `pipeline.py`: layers split over several devices
- `scheduler.py`: requests, continuous batching over a resident and an offload lane, placement policies
- `switching.py`: two decode batches switched at layer boundaries (side-stream loads, event queries)
"""
from .cache import OffloadCache
from .engine import Engine
from .model import HybridModel
from .transfer import STRATEGIES, LoadResult, get_strategy

__all__ = ["Engine", "HybridModel", "LoadResult", "OffloadCache", "STRATEGIES", "get_strategy"]
