"""A QSA layer's decode step between its input projection and attention, as one kernel: the per-head
norms and partial RoPE of q and k, and the K/V row the cache stores.

    q, gate, kv_row = qsa_heads(mixer, y, pos)    # y = norm1(x) @ w_in, [B, >= splits]

The torch definition is `QSALayer.heads_reference` (what `QSALayer.project` does after its product):
split y, view q and the output gate per head, RMSNorm q and k over head_dim, rotate the first
rotary_dim dims (neox half split), concatenate k and v into the row. torch.compile fuses that into
~8 kernels of 1-2 µs a layer (measured on an H200 at 64K, c = 1: the QSA layers' share of the step's
288 inductor kernels, results/20261202-040000-resident-pair-h200). Here one program per (request,
head) of q and per (request, key head) of k: it loads its head's D values (and each value's RoPE
partner, a second load from L1 rather than a shuffle), norms, rotates, stores; a k program also
copies its head's v into the row. Roundings follow the torch ops: the norm's output rounded to the
activation dtype before its weight, the weighted value rounded again, the rotation in fp32 rounded
once. The indexer's parts of y and the index key's quantisation stay in the compiled piece before it
(`hybrid.qsa_project`), where inductor fuses them after the product.

On for the compiled decode step (`LABKIT_QSA_FUSED=0` turns it off for an A/B): measured on an H200 at 64K,
the resident step 3.925 -> 3.828 ms at c = 1 and 4.552 -> 4.450 at c = 4 (844 -> 760 kernels; one process
each, results/20261202-071000-qsa-fused-h200). Checked against `heads_reference` on CPU under the Triton
interpreter and on the GPU (tests/test_gpu_qsa.py).
"""
from __future__ import annotations


import torch

from ... import envs

from .arch import HAVE_TRITON, kernels_run
from .layers import rope_inv_freq

if HAVE_TRITON:
    import triton
    import triton.language as tl

FUSED_QSA = envs.owner_value("LABKIT_QSA_FUSED")

if HAVE_TRITON:
    @triton.jit
    def _normed(row_ptr, w_ptr, j, r):
        """One head's values at j, RMS-normed with the precomputed r, rounded as the torch norm rounds."""
        x = tl.load(row_ptr + j).to(tl.float32)
        n = (x * r).to(w_ptr.dtype.element_ty).to(tl.float32)
        return (n * tl.load(w_ptr + j).to(tl.float32)).to(w_ptr.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _qsa_heads_kernel(y_ptr, y_sb, pos_ptr, inv_ptr, qn_w, kn_w, q_ptr, kv_ptr, kv_sb, eps_q, eps_k,
                          HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr):
        b, h = tl.program_id(0), tl.program_id(1)
        j = tl.arange(0, D)
        HALF: tl.constexpr = ROT // 2
        is_q = h < HQ
        if is_q:   # q of head h: the first D of its [q | gate] block of 2D
            row = y_ptr + b * y_sb + h * 2 * D
            w_ptr, eps = qn_w, eps_q
        else:      # k of key head h - HQ: after the HQ [q | gate] blocks
            row = y_ptr + b * y_sb + HQ * 2 * D + (h - HQ) * D
            w_ptr, eps = kn_w, eps_k
        xf = tl.load(row + j).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
        n = _normed(row, w_ptr, j, r)
        # RoPE: dims [0, HALF) pair with [HALF, ROT); the angle index is j mod HALF
        in_rot = j < ROT
        partner = tl.where(j < HALF, j + HALF, tl.where(in_rot, j - HALF, j))
        p = _normed(row, w_ptr, partner, r)
        i = tl.where(j < HALF, j, tl.where(in_rot, j - HALF, 0))
        ang = tl.load(pos_ptr + b).to(tl.float32) * tl.load(inv_ptr + i)      # the torch path's fp32 product
        c, s = tl.cos(ang), tl.sin(ang)
        rot = tl.where(j < HALF, n * c - p * s, n * c + p * s)
        out = tl.where(in_rot, rot, n).to(q_ptr.dtype.element_ty)
        if is_q:
            tl.store(q_ptr + (b * HQ + h) * D + j, out)
        else:
            kh = h - HQ
            tl.store(kv_ptr + b * kv_sb + kh * D + j, out)
            v = tl.load(y_ptr + b * y_sb + HQ * 2 * D + HKV * D + kh * D + j)
            tl.store(kv_ptr + b * kv_sb + HKV * D + kh * D + j, v)


_INV: dict = {}


def _inv_freq(half: int, theta: float, device) -> torch.Tensor:
    """`layers.rope_inv_freq`, made once per device (before a CUDA graph's capture: the warm-up's step)."""
    key = (half, theta, str(device))
    if key not in _INV:
        _INV[key] = rope_inv_freq(half, theta, device)
    return _INV[key]


def usable(mixer, y: torch.Tensor) -> bool:
    """Whether the kernel takes this layer and input: Triton where it runs, head_dim a power of two,
    an even rotary_dim within it, y row-major [B, >= the splits' sum], bf16/fp16."""
    s = mixer.s
    D = s.head_dim
    return (kernels_run(y) and D & (D - 1) == 0 and s.rotary_dim % 2 == 0 and 0 < s.rotary_dim <= D
            and y.dim() == 2 and y.stride(1) == 1 and y.shape[1] >= sum(mixer.splits)
            and y.dtype in (torch.bfloat16, torch.float16) and mixer.q_norm.weight.dtype == y.dtype)


def qsa_heads(mixer, y: torch.Tensor, pos: torch.Tensor, theta: float = 1e7):
    """y = norm1(x) @ w_in [B, >= sum(splits)], pos [B] -> q [B, Hq, D] (normed, roped), gate [B, Hq, D]
    (a view of y), kv_row [B, 2 Hkv D] (k normed and roped, then v). The kernel where it runs
    (`usable`), else the first three of `mixer.heads_reference` (the same values)."""
    if not usable(mixer, y):
        return mixer.heads_reference(y, pos, theta)[:3]
    s = mixer.s
    B, D, HQ, HKV = y.shape[0], s.head_dim, s.n_heads, s.n_kv_heads
    q = torch.empty((B, HQ, D), dtype=y.dtype, device=y.device)
    kv_row = torch.empty((B, 2 * HKV * D), dtype=y.dtype, device=y.device)
    _qsa_heads_kernel[(B, HQ + HKV)](y, y.stride(0), pos, _inv_freq(s.rotary_dim // 2, theta, y.device),
                                     mixer.q_norm.weight, mixer.k_norm.weight, q, kv_row,
                                     kv_row.stride(0), mixer.q_norm.eps, mixer.k_norm.eps,
                                     HQ=HQ, HKV=HKV, D=D, ROT=s.rotary_dim, num_warps=4 if D >= 256 else 2)
    gate = y[:, :HQ * 2 * D].unflatten(1, (HQ, 2 * D))[..., D:]
    return q, gate, kv_row
