"""One decode step of the gated delta rule as one kernel per layer.

    o = delta_step(S, q, k, v, log_a, beta)       # S [B, H, dk, dv] fp32, updated in place

per request b and value head h (key head h // (H / Hk): the key heads are shared, not repeated):
    S <- exp(log_a) * S;   S <- S + beta * k (v - S^T k)^T;   o = S^T q
Written op by op this is a decay, two batched matrix-vector products, an outer product, an add and a
third product over a 2 MiB fp32 state per request and layer: six kernels and the state read four
times. The Triton kernel reads each [dk, DV] tile of the state once, writes it once, and returns o.
`delta_step_reference` is the same function in torch (the CPU path and the kernel's reference).
"""
from __future__ import annotations

import torch

from .gather import HAVE_TRITON, interpret_mode

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _delta_step_kernel(S_ptr, q_ptr, k_ptr, v_ptr, la_ptr, beta_ptr, o_ptr, H, HK,
                           DK: tl.constexpr, DV: tl.constexpr, TILE: tl.constexpr):
        b, h, t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        kh = h // (H // HK)
        i = tl.arange(0, DK)
        j = t * TILE + tl.arange(0, TILE)
        s_ptr = S_ptr + ((b * H + h) * DK + i[:, None]) * DV + j[None, :]
        S = tl.load(s_ptr)                                                # [DK, TILE] fp32
        kv = tl.load(k_ptr + (b * HK + kh) * DK + i).to(tl.float32)
        qv = tl.load(q_ptr + (b * HK + kh) * DK + i).to(tl.float32)
        vv = tl.load(v_ptr + (b * H + h) * DV + j).to(tl.float32)
        a = tl.exp(tl.load(la_ptr + b * H + h).to(tl.float32))
        beta = tl.load(beta_ptr + b * H + h).to(tl.float32)
        S = S * a
        v_old = tl.sum(S * kv[:, None], axis=0)                           # [TILE]
        S = S + (beta * kv)[:, None] * (vv - v_old)[None, :]
        tl.store(s_ptr, S)
        tl.store(o_ptr + (b * H + h) * DV + j, tl.sum(S * qv[:, None], axis=0))


def delta_step_reference(S, q, k, v, log_a, beta):
    """torch ops: S [B, H, dk, dv] fp32 in place; q, k [B, Hk, dk]; v [B, H, dv]; log_a, beta [B, H]."""
    rep = S.shape[1] // q.shape[1]
    q, k = q.float().repeat_interleave(rep, 1), k.float().repeat_interleave(rep, 1)
    S.mul_(log_a.float().exp()[..., None, None])
    v_old = torch.einsum("bhkv,bhk->bhv", S, k)
    S.add_(torch.einsum("bhk,bhv->bhkv", k * beta.float()[..., None], v.float() - v_old))
    return torch.einsum("bhkv,bhk->bhv", S, q)


def _triton_ok(t: torch.Tensor) -> bool:
    if not HAVE_TRITON:
        return False
    return t.device.type == "cpu" if interpret_mode() else t.device.type == "cuda"


def delta_step(S, q, k, v, log_a, beta, tile: int = 32):
    B, H, DK, DV = S.shape
    if not _triton_ok(S) or DV % tile or DK & (DK - 1) or tile & (tile - 1):
        return delta_step_reference(S, q, k, v, log_a, beta)
    assert S.is_contiguous() and S.dtype == torch.float32
    o = torch.empty((B, H, DV), dtype=torch.float32, device=S.device)
    _delta_step_kernel[(B, H, DV // tile)](S, q.contiguous(), k.contiguous(), v.contiguous(), log_a.contiguous(),
                                            beta.contiguous(), o, H, q.shape[1], DK=DK, DV=DV, TILE=tile, num_warps=4)
    return o
