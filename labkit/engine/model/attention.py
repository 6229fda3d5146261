"""Attention over KV rows: sparse (decode, over the selected rows) and dense causal (prefill).

A row is one token's K+V for one QSA layer: `[2, n_kv_heads, head_dim]` bf16 (K then V).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def split_rows(rows: torch.Tensor, n_kv: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., 2*n_kv*head_dim] bf16 -> K, V each [..., n_kv, head_dim]."""
    kv = rows.unflatten(-1, (2, n_kv, head_dim))
    return kv[..., 0, :, :], kv[..., 1, :, :]


def sparse_decode_attention(q: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor, n_kv: int) -> torch.Tensor:
    """q [B, Hq, D] attends to its own selected rows [B, k, 2*n_kv*D] where valid [B, k]. Returns [B, Hq, D]."""
    B, Hq, D = q.shape
    k, v = split_rows(rows, n_kv, D)                                 # [B, k, n_kv, D]
    qg = q.view(B, n_kv, Hq // n_kv, D)                              # grouped query heads
    s = torch.einsum("bgqd,bngd->bgqn", qg, k).float() * (D ** -0.5)
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).to(v.dtype)
    o = torch.einsum("bgqn,bngd->bgqd", p, v)
    return o.reshape(B, Hq, D)


def dense_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of a chunk's queries q [T, Hq, D] over all keys so far k, v [S, n_kv, D]
    (S >= T, the chunk is the last T of them): bottom-right-aligned causal mask. Returns [T, Hq, D]."""
    T, Hq, D = q.shape
    S, n_kv, _ = k.shape
    group = Hq // n_kv
    bias = causal_lower_right(T, S)
    out = torch.empty_like(q)
    for g in range(n_kv):   # one KV head at a time: no repeat_interleave copy of a 248K-token prefix
        qg = q[:, g * group:(g + 1) * group].transpose(0, 1).unsqueeze(0)          # [1, group, T, D]
        kg = k[:, g].unsqueeze(0).unsqueeze(0).expand(1, group, S, D)
        vg = v[:, g].unsqueeze(0).unsqueeze(0).expand(1, group, S, D)
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=bias)
        out[:, g * group:(g + 1) * group] = og[0].transpose(0, 1)
    return out

def fast_sdpa(device: torch.device):
    """On CUDA forbid SDPA's math fallback: at 248K tokens it would materialise a T x S score matrix."""
    if device.type != "cuda":
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
