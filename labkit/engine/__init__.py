"""The offload engine: KV placement (kv.py), transfer strategies (transfer.py), indexer, attention,
layers and the hybrid decoder (model.py)."""
from .model import Engine, HybridModel, OffloadCache
from .transfer import STRATEGIES, get_strategy

__all__ = ["Engine", "HybridModel", "OffloadCache", "STRATEGIES", "get_strategy"]
