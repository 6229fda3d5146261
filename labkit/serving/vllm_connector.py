"""labkit's host-RAM KV tier for vLLM, as a vLLM KV connector (`KVConnectorBase_V1` + `SupportsHMA`).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "LabkitHostConnector",
        "kv_connector_module_path": "labkit.serving.vllm_connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_gib": 2, "stats_dir": "/path"}}'

What it does. Every full block of a prompt is saved, layer by layer as vLLM computes it (`save_kv_layer`),
into a pool of host-RAM slots (pinned where CUDA exists). A later request whose prompt starts with saved
blocks gets them back: `get_num_new_matched_tokens` reports the hit, `start_load_kv` copies the slots into
the paged cache blocks vLLM allocated for them. Bytes are counted both ways, on the worker, where they move.

Where blocks are is kept apart from how bytes move (vLLM's kv_offload layout):
- the scheduler side (`HostIndex`) owns the index: chained hash of a prompt block -> slot, LRU over a
  fixed number of slots (`host_gib` / bytes per block over all layers); it plans each step's loads and
  saves as (group, block ids, slots) in the connector metadata;
- the worker side (`HostPool`) owns the slots: one tensor per layer, `[slots, *block_shape]`, and only
  copies what the metadata says.

Counters: the worker writes `worker-<pid>.json` (bytes/blocks saved and loaded), the scheduler
`scheduler.json` (queries, hit tokens) and one line per finished request to `requests.jsonl` in
`stats_dir`; labkit's /metrics scraper reads them beside vLLM's own series.

Hybrid models (Qwen3-Next: full attention + gated DeltaNet): with `SupportsHMA` vLLM accepts the connector
and calls `save_kv_layer` for the attention layers only; their blocks are saved and counted, but no hit is
reported, because a hit would also need the recurrent state at that position, which this connector does
not keep. The save path is still measurable there; prefix hits need a pure-attention model.
"""
from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, SupportsHMA)

from labkit.atomic import write_text, open_append

try:    # per-source cached-token metrics (vllm:prompt_tokens_cached_by_source_total{source="host"})
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    _HOST_SOURCE = CacheHitSource.HOST
except ImportError:      # older vLLM
    _HOST_SOURCE = None

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

GiB = 1 << 30


# ---------------------------------------------------------------------------------------------- metadata
@dataclass
class Transfer:
    """Copies for one KV cache group: paged block `block_ids[i]` <-> host slot `slots[i]`."""
    group: int
    block_ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


@dataclass
class LabkitHostMetadata(KVConnectorMetadata):
    capacity: int = 0
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


def block_hashes(tokens: list[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks: block i's hash covers tokens [0, (i+1)*block_size)."""
    out, h = [], 0x1AB5
    for i in range(len(tokens) // block_size):
        h = hash((h, tuple(tokens[i * block_size:(i + 1) * block_size])))
        out.append(h)
    return out


def _groups(kv_cache_config) -> tuple[list[int], bool, dict[int, int], dict[str, int]]:
    """(attention groups we move, hybrid?, block size per group, layer -> group)."""
    # vLLM lives in its own venv, not labkit's: imported only inside its process
    from vllm.v1.kv_cache_interface import AttentionSpec
    attn, hybrid, sizes, layers = [], False, {}, {}
    for g, grp in enumerate(kv_cache_config.kv_cache_groups):
        if isinstance(grp.kv_cache_spec, AttentionSpec):
            attn.append(g)
            sizes[g] = grp.kv_cache_spec.block_size
            for name in grp.layer_names:
                layers[name] = g
        else:
            hybrid = True
    if len(set(sizes.values())) > 1:      # one index: keep the groups of the first block size
        first = sizes[attn[0]]
        attn = [g for g in attn if sizes[g] == first]
        layers = {k: v for k, v in layers.items() if v in attn}
    return attn, hybrid, sizes, layers


def _write_json(path: Path, obj: dict) -> None:
    # whole, never through a link planted at the name; rewritten several times a second, so not synced
    write_text(path, json.dumps(obj), sync=False)


# ------------------------------------------------------------------------------------ scheduler side
@dataclass
class _Req:
    hashes: list[int]
    prompt_len: int
    local_tokens: int = 0          # device prefix-cache hit when asked
    hit_tokens: int = 0            # host hit reported
    block_ids: dict[int, list[int]] = field(default_factory=dict)
    saved_upto: int = 0            # prompt blocks already planned for saving (or loaded)
    loaded_blocks: int = 0
    saved_blocks: int = 0
    pending_load: list[Transfer] | None = None


class HostIndex:
    """Which prompt blocks sit in which host slot (LRU), and what each step must load and save."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.slots: OrderedDict[int, int] = OrderedDict()     # hash -> slot, least recently used first
        self.free = list(range(capacity - 1, -1, -1))

    def lookup(self, hashes: list[int], limit: int) -> int:
        n = 0
        while n < min(limit, len(hashes)) and hashes[n] in self.slots:
            n += 1
        return n

    def touch(self, h: int) -> int:
        self.slots.move_to_end(h)
        return self.slots[h]

    def put(self, h: int, protected: set[int]) -> int | None:
        """A slot for a new block (evicting the least recently used unprotected one), None if full of protected."""
        if self.free:
            slot = self.free.pop()
        else:
            victim = next((k for k in self.slots if k not in protected), None)
            if victim is None:
                return None
            slot = self.slots.pop(victim)
        self.slots[h] = slot
        return slot


class _Scheduler:
    def __init__(self, vllm_config, kv_cache_config, extra: dict):
        self.attn_groups, self.hybrid, sizes, _ = _groups(kv_cache_config)
        self.block_size = sizes[self.attn_groups[0]] if self.attn_groups else vllm_config.cache_config.block_size
        per_block = sum(kv_cache_config.kv_cache_groups[g].kv_cache_spec.page_size_bytes *
                        len(kv_cache_config.kv_cache_groups[g].layer_names) for g in self.attn_groups)
        self.bytes_per_block = max(per_block, 1)
        self.capacity = max(1, int(float(extra.get("host_gib", 1.0)) * GiB // self.bytes_per_block))
        self.index = HostIndex(self.capacity)
        self.reqs: dict[str, _Req] = {}
        self.stats_dir = Path(extra["stats_dir"]) if extra.get("stats_dir") else None
        self.counters = {"queries": 0, "query_tokens": 0, "hit_tokens": 0, "hit_requests": 0,
                         "planned_load_blocks": 0, "planned_save_blocks": 0, "evictions": 0,
                         "capacity_blocks": self.capacity, "bytes_per_block": self.bytes_per_block,
                         "block_size": self.block_size, "hybrid": self.hybrid}
        self._last_write = 0.0
        self._write()

    def _state(self, request) -> _Req:
        st = self.reqs.get(request.request_id)
        if st is None:
            prompt = list(request.prompt_token_ids or [])
            st = _Req(block_hashes(prompt, self.block_size), len(prompt))
            self.reqs[request.request_id] = st
        return st

    def matched(self, request, num_computed_tokens: int) -> int:
        st = self._state(request)
        st.local_tokens = num_computed_tokens
        if self.hybrid or not self.attn_groups:
            return 0
        # leave at least one prompt token to compute (vLLM needs logits for it)
        hit_blocks = self.index.lookup(st.hashes, (st.prompt_len - 1) // self.block_size)
        return max(0, hit_blocks * self.block_size - num_computed_tokens)

    def after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        st = self._state(request)
        ids = blocks.get_block_ids()
        for g in self.attn_groups:
            st.block_ids[g] = list(ids[g])
        if num_external_tokens <= 0:
            return
        first = st.local_tokens // self.block_size
        last = (st.local_tokens + num_external_tokens) // self.block_size
        loads = []
        for g in self.attn_groups:
            loads.append(Transfer(g, [st.block_ids[g][j] for j in range(first, last)],
                                  [self.index.touch(st.hashes[j]) for j in range(first, last)]))
        st.pending_load = loads
        st.hit_tokens += num_external_tokens
        st.loaded_blocks += last - first
        st.saved_upto = max(st.saved_upto, last)
        self.counters["hit_tokens"] += num_external_tokens
        self.counters["hit_requests"] += 1
        self.counters["planned_load_blocks"] += last - first

    def build(self, out) -> LabkitHostMetadata:
        meta = LabkitHostMetadata(capacity=self.capacity)
        protected: set[int] = set()
        loads: dict[int, Transfer] = {}
        for st in self.reqs.values():
            if st.pending_load:
                for t in st.pending_load:
                    acc = loads.setdefault(t.group, Transfer(t.group))
                    acc.block_ids += t.block_ids
                    acc.slots += t.slots
                st.pending_load = None
        protected |= {h for h, s in self.index.slots.items() if any(s in t.slots for t in loads.values())}
        # block tables of running requests grow: new blocks are appended (replaced after a preemption)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self.reqs.get(rid)
            new = cached.new_block_ids[i]
            if st is None or new is None:
                continue
            for g in self.attn_groups:
                if rid in getattr(cached, "resumed_req_ids", set()):
                    st.block_ids[g] = list(new[g])
                else:
                    st.block_ids.setdefault(g, []).extend(new[g])
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        computed.update(dict(zip(cached.req_ids, cached.num_computed_tokens)))
        saves: dict[int, Transfer] = {}
        for rid, n_sched in out.num_scheduled_tokens.items():
            st = self.reqs.get(rid)
            if st is None or not self.attn_groups:
                continue
            done = min(computed.get(rid, 0) + n_sched, st.prompt_len) // self.block_size
            for j in range(st.saved_upto, min(done, len(st.hashes))):
                h = st.hashes[j]
                if h in self.index.slots:          # already held (another request saved it)
                    self.index.touch(h)
                    continue
                evicting = not self.index.free
                slot = self.index.put(h, protected)
                if slot is None:
                    break
                self.counters["evictions"] += int(evicting)
                protected.add(h)
                for g in self.attn_groups:
                    acc = saves.setdefault(g, Transfer(g))
                    acc.block_ids.append(st.block_ids[g][j])
                    acc.slots.append(slot)
                st.saved_blocks += 1
                self.counters["planned_save_blocks"] += 1
            st.saved_upto = max(st.saved_upto, done)
        meta.loads, meta.saves = list(loads.values()), list(saves.values())
        self._write()
        return meta

    def finished(self, request) -> None:
        st = self.reqs.pop(request.request_id, None)
        if st is None:
            return
        self.counters["queries"] += 1
        self.counters["query_tokens"] += st.prompt_len
        if self.stats_dir is not None:
            rec = {"request_id": request.request_id, "prompt_len": st.prompt_len, "device_hit_tokens": st.local_tokens,
                   "host_hit_tokens": st.hit_tokens, "loaded_blocks": st.loaded_blocks, "saved_blocks": st.saved_blocks,
                   "bytes_loaded": st.loaded_blocks * self.bytes_per_block,
                   "bytes_saved": st.saved_blocks * self.bytes_per_block, "time": time.time()}
            with open_append(self.stats_dir / "requests.jsonl") as f:
                f.write(json.dumps(rec) + "\n")
        self._write(force=True)

    def _write(self, force: bool = False) -> None:
        if self.stats_dir is None or (not force and time.monotonic() - self._last_write < 0.25):
            return
        self._last_write = time.monotonic()
        self.stats_dir.mkdir(parents=True, exist_ok=True)
        _write_json(self.stats_dir / "scheduler.json", {**self.counters, "held_blocks": len(self.index.slots),
                                                        "time": time.time()})


# ---------------------------------------------------------------------------------------- worker side
class HostPool:
    """Host-RAM slots, one tensor per layer `[capacity, *block_shape]`; copies in and out of the paged cache."""

    def __init__(self, layer_group: dict[str, int], stats_dir: Path | None):
        self.layer_group = layer_group
        self.kv: dict[str, torch.Tensor] = {}
        self.block_dim: dict[str, int] = {}
        self.pool: dict[str, torch.Tensor] = {}
        self.stats_dir = stats_dir
        self.counters = {"bytes_saved": 0, "bytes_loaded": 0, "blocks_saved": 0, "blocks_loaded": 0,
                         "save_s": 0.0, "load_s": 0.0, "pool_bytes": 0}
        self._last_write = None

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name, t in kv_caches.items():
            if name not in self.layer_group:
                continue
            self.kv[name] = t
            # FlashAttention's raw layout is (2, num_blocks, ...); the standardized views and the CPU
            # backend put blocks first
            self.block_dim[name] = 1 if (t.dim() == 5 and t.shape[0] == 2) else 0

    def _slots(self, name: str, kv: torch.Tensor, capacity: int) -> torch.Tensor:
        p = self.pool.get(name)
        if p is None:
            bdim = self.block_dim.get(name, 0)
            shape = list(kv.shape)
            shape.pop(bdim)
            shape = ([capacity, shape[0]] + shape[1:]) if bdim == 1 else [capacity] + shape
            p = torch.empty(shape, dtype=kv.dtype, device="cpu", pin_memory=kv.is_cuda)
            self.pool[name] = p
            self.counters["pool_bytes"] += p.numel() * p.element_size()
        return p

    def _blocks_first(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return t.transpose(0, 1) if self.block_dim.get(name, 0) == 1 else t

    def load(self, meta: LabkitHostMetadata) -> None:
        if not meta.loads:
            return
        t0 = time.perf_counter()
        by_group = {t.group: t for t in meta.loads}
        for name, kv in self.kv.items():
            t = by_group.get(self.layer_group[name])
            if t is None or not t.block_ids:
                continue
            pool = self._slots(name, kv, meta.capacity)
            src = pool[torch.tensor(t.slots)]
            if kv.is_cuda:
                src = src.to(kv.device, non_blocking=True)
            ids = torch.tensor(t.block_ids, device=kv.device)
            kv.index_copy_(self.block_dim[name], ids, self._blocks_first(name, src))
            self.counters["bytes_loaded"] += src.numel() * src.element_size()
            self.counters["blocks_loaded"] += len(t.block_ids)
        if any(k.is_cuda for k in self.kv.values()):
            torch.cuda.current_stream().synchronize()
        self.counters["load_s"] += time.perf_counter() - t0

    def save(self, name: str, kv: torch.Tensor, meta: LabkitHostMetadata) -> None:
        if name not in self.layer_group or not meta.saves:
            return
        t = next((s for s in meta.saves if s.group == self.layer_group[name]), None)
        if t is None or not t.block_ids:
            return
        t0 = time.perf_counter()
        if name not in self.block_dim:
            self.block_dim[name] = 1 if (kv.dim() == 5 and kv.shape[0] == 2) else 0
        pool = self._slots(name, kv, meta.capacity)
        ids = torch.tensor(t.block_ids, device=kv.device)
        blocks = self._blocks_first(name, kv.index_select(self.block_dim[name], ids))
        pool[torch.tensor(t.slots)] = blocks.to("cpu", non_blocking=kv.is_cuda)
        self.counters["bytes_saved"] += blocks.numel() * blocks.element_size()
        self.counters["blocks_saved"] += len(t.block_ids)
        self.counters["save_s"] += time.perf_counter() - t0

    def flush(self) -> None:
        if any(k.is_cuda for k in self.kv.values()):
            torch.cuda.current_stream().synchronize()
        self.write()

    def write(self, force: bool = False) -> None:
        # written after every step that moved bytes (a small file; readers want final counts)
        snapshot = (self.counters["blocks_saved"], self.counters["blocks_loaded"])
        if self.stats_dir is None or (not force and snapshot == self._last_write):
            return
        self._last_write = snapshot
        self.stats_dir.mkdir(parents=True, exist_ok=True)
        _write_json(self.stats_dir / f"worker-{os.getpid()}.json", {**self.counters, "time": time.time()})


# ------------------------------------------------------------------------------------------ connector
class LabkitHostConnector(KVConnectorBase_V1, SupportsHMA):
    if _HOST_SOURCE is not None:
        _cache_hit_source = _HOST_SOURCE

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        stats = extra.get("stats_dir")
        self.stats_dir = Path(stats) if stats else None
        if role == KVConnectorRole.SCHEDULER:
            self.sched, self.worker = _Scheduler(vllm_config, kv_cache_config, extra), None
        else:
            _, _, _, layers = _groups(kv_cache_config)
            self.sched, self.worker = None, HostPool(layers, self.stats_dir)

    # ---- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self.worker.register(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LabkitHostMetadata)
        self.worker.load(meta)      # synchronous: every layer's blocks are in place before the forward

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, LabkitHostMetadata)
        self.worker.save(layer_name, kv_layer, meta)

    def wait_for_save(self):
        self.worker.flush()

    def shutdown(self):
        if self.worker is not None:
            self.worker.write(force=True)

    # ---- scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.sched.matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        self.sched.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.sched.build(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict | None]:
        self.sched.finished(request)
        return False, None

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        self.sched.finished(request)
        return False, None
