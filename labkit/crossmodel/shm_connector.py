"""labkit's cross-model KV connector for vLLM: load a producer's /dev/shm file instead of prefilling.

Configured as
    --kv-transfer-config '{"kv_connector": "LabkitXferConnector", "kv_connector_module_path":
        "labkit.crossmodel.shm_connector", "kv_role": "kv_consumer", "kv_connector_extra_config":
        {"shm_root": "/dev/shm/labkit-xfer", "fingerprint": "<large model fingerprint>"}}'

Scheduler side: `get_num_new_matched_tokens` looks for `shm.path_for(prompt)`, validates its header
(`shm.validate`: every header field against the file and the engine, and the payload's CRC-32 against the
producer's, once per file version); a file that fails is refused with one warning line and vLLM prefills
normally. The worker reads the file into private memory and checks the CRC-32 and the user's MAC again over
exactly those bytes before copying any of them into the cache (the file may have changed since; later
changes cannot reach the snapshot): a mismatch reports the blocks as load errors, recomputed. Files are
opened through a root that must be this user's (0700) with O_NOFOLLOW and must be this user's 0600 files.
An accepted file reports its tokens (rounded down to whole blocks, at most prompt - 1: vLLM computes the
last prompt token itself) as matched; `update_state_after_alloc` and `build_connector_meta` hand the
request's block ids to the worker. Worker side: `start_load_kv` snapshots the file and copies each layer's
K and V rows into the paged cache slots of those blocks before the forward runs (synchronous:
`wait_for_layer_load` has nothing to wait for). Nothing is saved (`save_kv_layer` is a no-op): this is
a consumer. A file that fails validation at load time reports its blocks through
`get_block_ids_with_load_errors`, so vLLM recomputes them.

`SupportsHMA` is implemented (one group of full-attention layers here) so the same connector loads
into a hybrid model's attention layers.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole, SupportsHMA)

from labkit.crossmodel import shm
from labkit.crossmodel.paged import layer_index, scatter, slot_mapping, split_kv

try:  # under vLLM's logger so its handlers print our lines beside its own
    from vllm.logger import init_logger

    logger = init_logger("vllm.labkit_xfer")
except Exception:  # pragma: no cover
    logger = logging.getLogger(__name__)

# vllm_xargs key of a request that asks for prompt logprobs *and* the mapped cache (quality measurement).
# vLLM skips every cached prefix for prompt-logprob requests; this opt-in keeps the connector's tokens,
# and the engine returns logprobs for the positions it computes (the tail after the loaded tokens).
FORCE_KEY = "labkit_xfer_load"


def _zero_fill_prompt_logprobs() -> None:
    """vLLM 0.32 allocates a request's prompt-logprob buffers with torch.empty and fills only the
    positions it computes; with a loaded prefix the rest stays garbage and detokenizing it raises
    OverflowError in the API server. Zero-filled buffers make those entries token 0 / logprob 0, which
    the measurement ignores (it reads only computed positions). Enabled by the connector's extra config
    `zero_fill_prompt_logprobs` (the quality measurement), never by default."""
    # vLLM lives in its own venv, not labkit's: imported only inside its process
    from vllm.v1 import outputs

    if getattr(outputs.LogprobsTensors.empty_cpu, "_labkit", False):
        return
    orig = outputs.LogprobsTensors.empty_cpu

    def empty_cpu(num_positions, num_tokens_per_position):
        t = orig(num_positions, num_tokens_per_position)
        t.logprob_token_ids.zero_()
        t.logprobs.zero_()
        t.selected_token_ranks.zero_()
        return t

    empty_cpu._labkit = True
    outputs.LogprobsTensors.empty_cpu = staticmethod(empty_cpu)


@dataclass
class LoadSpec:
    req_id: str
    path: str
    prompt: list[int]
    start: int          # first token to load (tokens before are already in vLLM's prefix cache)
    end: int            # one past the last token to load
    block_ids: list[int]


@dataclass
class XferMeta(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)


class LabkitXferConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.root = Path(extra.get("shm_root") or shm.default_root())
        self.fingerprint = str(extra.get("fingerprint", ""))
        if extra.get("zero_fill_prompt_logprobs"):
            _zero_fill_prompt_logprobs()
        self.block_size = int(vllm_config.cache_config.block_size)
        mc, pc = vllm_config.model_config, vllm_config.parallel_config
        self.num_layers = int(mc.get_num_layers(pc))
        self.kv_heads = int(mc.get_num_kv_heads(pc))
        self.head_dim = int(mc.get_head_size())
        self._matched: dict[str, tuple[str, int]] = {}
        self._need_load: dict[str, tuple[Any, str, int, int]] = {}
        self._kv: dict[str, torch.Tensor] = {}
        self._load_errors: set[int] = set()
        self._verified: dict[str, tuple] = {}     # path -> (inode, size, mtime) whose payload CRC matched
        self.stats = {"loaded_requests": 0, "loaded_tokens": 0, "refused": 0, "load_s": 0.0}
        logger.info("labkit xfer connector (%s): root %s, model fingerprint %s, %d layers x %d kv heads x %d, "
                    "block %d", role.name, self.root, self.fingerprint, self.num_layers, self.kv_heads,
                    self.head_dim, self.block_size)

    # ---- scheduler side -------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        ids = list(request.prompt_token_ids or [])
        if len(ids) < 2:
            return 0, False
        path = shm.path_for(ids, self.root)
        if not os.path.lexists(path):
            return 0, False
        try:   # opened through the checked root, O_NOFOLLOW, ours and 0600 (see labkit.crossmodel.shm)
            hdr = shm.validate(path, ids, self.fingerprint, self.num_layers, self.kv_heads, self.head_dim)
            if self._verified.get(str(path)) != hdr.file_version:
                hdr = shm.validate(path, ids, self.fingerprint, self.num_layers, self.kv_heads, self.head_dim,
                                   verify_payload=True)
            self._verified[str(path)] = hdr.file_version
        except (shm.ShmError, OSError) as ex:
            self._verified.pop(str(path), None)
            self.stats["refused"] += 1
            logger.warning("labkit xfer: refusing KV file for request %s: %s; vLLM prefills it", request.request_id, ex)
            return 0, False
        n = (min(hdr.num_tokens, len(ids) - 1) // self.block_size) * self.block_size
        if n <= num_computed_tokens:
            return 0, False
        sp = getattr(request, "sampling_params", None)
        if sp is not None and (sp.extra_args or {}).get(FORCE_KEY):
            request.skip_reading_prefix_cache = False
        self._matched[request.request_id] = (str(path), n)
        return n - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if num_external_tokens > 0 and request.request_id in self._matched:
            path, n = self._matched.pop(request.request_id)
            self._need_load[request.request_id] = (request, path, n - num_external_tokens, n)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = XferMeta()
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._need_load:
                req, path, start, end = self._need_load.pop(new.req_id)
                meta.loads.append(LoadSpec(new.req_id, path, list(req.prompt_token_ids), start, end,
                                           list(new.block_ids[0])))
        return meta

    def request_finished(self, request, block_ids):
        self._matched.pop(request.request_id, None)
        self._need_load.pop(request.request_id, None)
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # ---- worker side ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._kv = {name: t for name, t in kv_caches.items()}
        name, t = next(iter(self._kv.items()))
        layout = split_kv(t, self.kv_heads, self.head_dim)[2]
        logger.info("labkit xfer: %d KV layers registered, e.g. %s %s %s (layout %s)", len(self._kv), name,
                    tuple(t.shape), t.dtype, layout)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        for ld in getattr(meta, "loads", []):
            t0 = time.perf_counter()
            bs = self.block_size
            try:
                hdr = shm.validate(ld.path, ld.prompt, self.fingerprint, self.num_layers, self.kv_heads,
                                   self.head_dim)
                f = shm.KVFile(Path(ld.path), hdr)      # a private snapshot: later writes cannot reach it
                why = f.problem()                      # CRC-32 and MAC over the very bytes copied below
                if why:
                    f.close()
                    raise shm.ShmError(why)
            except (shm.ShmError, OSError) as ex:
                logger.warning("labkit xfer: KV file for %s failed at load time: %s; vLLM recomputes", ld.req_id, ex)
                self._load_errors |= set(ld.block_ids[ld.start // bs: (ld.end + bs - 1) // bs])
                continue
            layers = getattr(forward_context, "no_compile_layers", {}) or {}
            slots = slot_mapping(ld.start, ld.end, ld.block_ids, bs)
            how = "backend writer"
            for name, cache in self._kv.items():
                layer = layers.get(name)
                k, v = f.layer(layer_index(name))
                k, v = k[ld.start: ld.end].to(cache.dtype).contiguous(), v[ld.start: ld.end].to(cache.dtype).contiguous()
                if layer is not None and hasattr(getattr(layer, "impl", None), "do_kv_cache_update"):
                    # the attention backend's own cache writer: right for any layout / ISA packing
                    layer.impl.do_kv_cache_update(layer, k, v, cache, slots)
                else:
                    how = "labkit scatter"
                    scatter(f, {name: cache}, ld.start, ld.end, ld.block_ids, bs, self.kv_heads, self.head_dim)
            f.close()
            dt = time.perf_counter() - t0
            self.stats["loaded_requests"] += 1
            self.stats["loaded_tokens"] += ld.end - ld.start
            self.stats["load_s"] += dt
            logger.info("labkit xfer: loaded %d tokens x %d layers for %s from %s in %.1f ms (%s)", ld.end - ld.start,
                        len(self._kv), ld.req_id, Path(ld.path).name, dt * 1e3, how)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self):
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out
