"""Copy a /dev/shm KV file into an engine's paged KV cache (no vLLM import: tested on its own).

A paged cache holds, per layer, `num_blocks` blocks of `block_size` token slots; a request's tokens
live at slot (block_ids[pos // block_size], pos % block_size). Layouts handled by `split_kv`:
(2, blocks, heads, block_size, dim), (blocks, heads, block_size, 2*dim) (vLLM 0.32's CPU backend: per
block and head, block_size K rows then block_size V rows, i.e. a (blocks, heads, 2*block_size, dim)
view chunked in two) and (blocks, 2, block_size, heads, dim) (flash-attention backends). Inside vLLM
the connector prefers the attention backend's own writer (`impl.do_kv_cache_update`), which also
covers ISA-specific packings; `scatter` is the fallback and the tested reference.
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"layers\.(\d+)\.")


def layer_index(name: str) -> int:
    """12 for 'model.layers.12.self_attn.attn'."""
    m = _LAYER.search(name)
    if m is None:
        raise ValueError(f"cannot find a layer index in {name!r}")
    return int(m.group(1))


def split_kv(cache: torch.Tensor, kv_heads: int, head_dim: int):
    """(K view, V view, layout name) of one layer's paged cache, views indexable [block, head, offset, dim]."""
    if cache.dim() == 5 and cache.shape[0] == 2 and cache.shape[2] == kv_heads:
        return cache[0], cache[1], "2,NB,H,BS,D"
    if cache.dim() == 4 and cache.shape[1] == kv_heads and cache.shape[-1] == 2 * head_dim:
        nb, h, bs, _ = cache.shape
        k, v = cache.view(nb, h, 2 * bs, head_dim).chunk(2, dim=2)
        return k, v, "NB,H,BS,2D"
    if cache.dim() == 5 and cache.shape[1] == 2 and cache.shape[3] == kv_heads:
        return cache[:, 0].transpose(1, 2), cache[:, 1].transpose(1, 2), "NB,2,BS,H,D"
    raise ValueError(f"unknown KV cache layout {tuple(cache.shape)} for {kv_heads} heads x {head_dim}")


def scatter(kvfile, caches: dict[str, torch.Tensor], start: int, end: int, block_ids, block_size: int,
            kv_heads: int, head_dim: int) -> int:
    """Copy tokens [start, end) of every layer of `kvfile` (shm.KVFile) into the paged caches; returns bytes."""
    pos = torch.arange(start, end)
    blk = torch.as_tensor(list(block_ids), dtype=torch.long)[pos // block_size]
    off = pos % block_size
    n = 0
    for name, cache in caches.items():
        k_dst, v_dst, _ = split_kv(cache, kv_heads, head_dim)
        k, v = kvfile.layer(layer_index(name))
        k_dst[blk, :, off] = k[start:end].to(cache.dtype)
        v_dst[blk, :, off] = v[start:end].to(cache.dtype)
        n += 2 * (end - start) * kv_heads * head_dim * cache.element_size()
    return n


def slot_mapping(start: int, end: int, block_ids, block_size: int) -> torch.Tensor:
    """Flat slot index (block * block_size + offset) of tokens [start, end), as engines take it."""
    pos = torch.arange(start, end)
    return torch.as_tensor(list(block_ids), dtype=torch.long)[pos // block_size] * block_size + pos % block_size


def gather(cache: torch.Tensor, start: int, end: int, block_ids, block_size: int, kv_heads: int, head_dim: int):
    """(K, V) [end - start, heads, dim] of tokens [start, end) read back from one layer's paged cache."""
    pos = torch.arange(start, end)
    blk = torch.as_tensor(list(block_ids), dtype=torch.long)[pos // block_size]
    off = pos % block_size
    k_src, v_src, _ = split_kv(cache, kv_heads, head_dim)
    return k_src[blk, :, off], v_src[blk, :, off]
