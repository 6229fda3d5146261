"""The producer: small-model prefill + mapping, written to /dev/shm for the vLLM connector.

A `Producer` holds both models (the large one for its rotary embedding, its shapes and the K/V of the
first `exact_prefix` tokens, a k-token forward) and the mapper; `produce(prompt_ids)` builds the large model's KV for the first `cover` prompt tokens
(default: all but the last, which the engine computes itself) and writes `shm.path_for(prompt_ids)`.
Before anything is computed it checks that /dev/shm can hold the file (one line otherwise).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from labkit.crossmodel import shm
from labkit.crossmodel.mapper import Mapper
from labkit.crossmodel.pair import plan_pair
from labkit.crossmodel.mapped_cache import EXACT_PREFIX, Models, load_models, mapped_kv


class Producer:
    def __init__(self, models: Models, mapper: Mapper | None, root: Path | None = None, mode: str = "mapped",
                 dtype=torch.bfloat16, exact_prefix: int = EXACT_PREFIX):
        self.models, self.mapper, self.mode, self.dtype = models, mapper, mode, dtype
        self.exact_prefix = exact_prefix
        self.root = Path(root) if root else shm.default_root()
        p = models.pair.large
        self.fingerprint, self.name = p.fingerprint, p.name

    @classmethod
    def open(cls, large: str, small: str, mapper_path: str, root=None, table=None) -> "Producer":
        pair = plan_pair(large, small, table)
        mp = Mapper.load(mapper_path, expect=pair)
        return cls(load_models(pair), mp, root)

    def bytes_for(self, n_tokens: int) -> int:
        p = self.models.pair.large
        return shm.expected_bytes(p.layers, n_tokens, p.kv_heads, p.head_dim, self.dtype)

    @torch.no_grad()
    def produce(self, prompt_ids, cover: int | None = None) -> dict:
        ids = [int(x) for x in (prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else prompt_ids)]
        cover = len(ids) - 1 if cover is None else int(cover)
        if not 1 <= cover < len(ids):
            raise shm.ShmError(f"cover must be in [1, {len(ids) - 1}] for a {len(ids)}-token prompt, got {cover}")
        os.close(shm.open_root(self.root, create=True))    # ours, 0700: one line before any compute if not
        shm.check_space(self.root, self.bytes_for(cover))
        t0 = time.perf_counter()
        tm: dict = {}
        kv = mapped_kv(self.models, self.mapper, torch.tensor(ids[:cover]).view(1, -1), self.mode, timings=tm,
                       exact_prefix=self.exact_prefix)
        t1 = time.perf_counter()
        path = shm.path_for(ids, self.root)
        shm.write(path, kv, ids[:cover], self.fingerprint, self.name, dtype=self.dtype)
        t2 = time.perf_counter()
        return {"path": str(path), "tokens": cover, "bytes": self.bytes_for(cover),
                "small_prefill_s": tm["small_prefill_s"], "mapping_s": tm["mapping_s"], "prefix_s": tm["prefix_s"],
                "write_s": t2 - t1,
                "produce_s": t2 - t0}
