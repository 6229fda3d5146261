"""QSA indexer: score every past token from its compressed index key, keep the top `budget`.

score[t] = scale[t] * sum_h w[h] * relu(q[h] . key8[t])   (DeepSeek-style lightning indexer; the
per-token scale factors out of the relu because it is positive). Keys are fp8 with one fp16 scale:
`index_dim + 2` bytes per token per layer, resident on the device.
"""
from __future__ import annotations

import torch

from . import fp8
from .arch import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

NEG_INF = float("-inf")

if HAVE_TRITON:
    @triton.jit
    def _index_score_kernel(q_ptr, w_ptr, k_ptr, s_ptr, len_ptr, out_ptr, L, k_sb, k_st, s_sb, HI: tl.constexpr,
                            D: tl.constexpr, BLOCK_T: tl.constexpr):
        # One program scores BLOCK_T positions of one request: fp8 keys -> fp32 (natively, or their bytes
        # decoded where the GPU has no e4m3 load: `fp8.operand`), HI dot products,
        # relu, head-weighted sum, times the per-token scale; -inf past the request's length.
        b = tl.program_id(1)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = t < L
        d = tl.arange(0, D)
        k = fp8.load_fp8(k_ptr, b * k_sb + t[:, None] * k_st + d[None, :], tm[:, None])
        acc = tl.zeros([BLOCK_T], dtype=tl.float32)
        for h in tl.static_range(HI):
            qh = tl.load(q_ptr + (b * HI + h) * D + d).to(tl.float32)
            wh = tl.load(w_ptr + b * HI + h).to(tl.float32)
            acc += wh * tl.maximum(tl.sum(k * qh[None, :], axis=1), 0.0)
        sc = tl.load(s_ptr + b * s_sb + t, mask=tm, other=0.0).to(tl.float32)
        n = tl.load(len_ptr + b)
        tl.store(out_ptr + b * L + t, tl.where(t < n, acc * sc, float("-inf")), mask=tm)


def index_scores_triton(q, w, keys, scales, lens, block_t: int = 256):
    B, L, D = keys.shape
    Hi = q.shape[1]
    assert keys.stride(2) == 1 and scales.stride(1) == 1
    out = torch.empty((B, L), dtype=torch.float32, device=keys.device)
    grid = (triton.cdiv(L, block_t), B)
    _index_score_kernel[grid](q.contiguous(), w.contiguous(), fp8.operand(keys), scales, lens, out, L, keys.stride(0),
                              keys.stride(1), scales.stride(0), HI=Hi, D=D, BLOCK_T=block_t, num_warps=4)
    return out


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor,
                 lens: torch.Tensor) -> torch.Tensor:
    """q [B, Hi, D], w [B, Hi], keys [B, cap, D] fp8, scales [B, cap] fp16, lens [B] -> scores [B, cap] fp32,
    -inf at positions >= lens (not yet written). One fused pass over the keys on CUDA (66 B/token read)."""
    if keys.device.type == "cuda" and HAVE_TRITON:
        return index_scores_triton(q, w, keys, scales, lens)
    return index_scores_reference(q, w, keys, scales, lens)


def index_scores_reference(q, w, keys, scales, lens):
    """The definition, in torch ops (CPU path and the kernel's reference)."""
    cap = keys.shape[1]
    k = keys.to(q.dtype)                                            # [B, cap, D]
    s = torch.bmm(k, q.transpose(1, 2))                             # [B, cap, Hi]
    s = torch.relu(s).to(torch.float32)
    s = torch.bmm(s, w.to(torch.float32).unsqueeze(-1)).squeeze(-1) * scales.to(torch.float32)
    pos = torch.arange(cap, device=keys.device)
    return s.masked_fill(pos[None, :] >= lens[:, None], NEG_INF)
