"""Attention over KV rows: sparse (decode, over the selected rows) and dense causal (prefill).

A row is one token's K+V for one QSA layer: `[2, n_kv_heads, head_dim]` bf16 (K then V).
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from ... import envs
from . import arch
from .sparse_prefill import prefill_select, sparse_prefill_attention


if arch.HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _merge_kernel(o1_ptr, o2_ptr, l1_ptr, l2_ptr, out_ptr, T, H, D: tl.constexpr, BT: tl.constexpr):
        """Two partial attentions of head h's queries [BT] (outputs [H, T, D], natural-log LSEs [H, T]) merged by
        their log-sum-exps in fp32, written as [T, H, D] in the output's dtype."""
        h = tl.program_id(1).to(tl.int64)
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        tm = t < T
        d = tl.arange(0, D)
        l1 = tl.load(l1_ptr + h * T + t, mask=tm, other=0.0)
        l2 = tl.load(l2_ptr + h * T + t, mask=tm, other=0.0)
        m = tl.maximum(l1, l2)
        w1, w2 = tl.exp(l1 - m), tl.exp(l2 - m)
        src = (h * T + t)[:, None].to(tl.int64) * D + d[None, :]
        o1 = tl.load(o1_ptr + src, mask=tm[:, None], other=0.0).to(tl.float32)
        o2 = tl.load(o2_ptr + src, mask=tm[:, None], other=0.0).to(tl.float32)
        o = (o1 * w1[:, None] + o2 * w2[:, None]) / (w1 + w2)[:, None]
        dst = (t[:, None].to(tl.int64) * H + h) * D + d[None, :]
        tl.store(out_ptr + dst, o.to(out_ptr.dtype.element_ty), mask=tm[:, None])


def merge_by_lse(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """Two partial attentions of the same queries (o [1, H, T, D], LSE [1, H, T]) merged by log-sum-exp, in fp32:
    [T, H, D] in o1's dtype. One kernel where kernels run (eager's fp32 ops were ~10 passes over [H, T, D] a QSA
    layer of a chunk, ~1.7 ms at 8K tokens on an H100), the same ops in torch elsewhere."""
    if not arch.kernels_run(o1, o2) or o1.shape[-1] & (o1.shape[-1] - 1):
        m = torch.maximum(l1, l2)
        w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
        o = (o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]
        return o[0].transpose(0, 1).to(o1.dtype).contiguous()
    _, H, T, D = o1.shape
    out = torch.empty((T, H, D), dtype=o1.dtype, device=o1.device)
    BT = 16
    _merge_kernel[(triton.cdiv(T, BT), H)](o1.contiguous(), o2.contiguous(), l1.float().contiguous(),
                                           l2.float().contiguous(), out, T, H, D=D, BT=BT, num_warps=4)
    return out


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


# Which kernel prefill's dense attention takes (the engine switch LABKIT_PREFILL_ATTN, `labkit/envs.py`):
# "split" (cuDNN: the prefix with the GQA group folded into the queries, then the chunk's causal square,
# merged by log-sum-exp), "sdpa" (SDPA's flash/efficient kernels per KV head under a lower-right causal
# mask), or "auto" (split where cuDNN attention runs, else sdpa).
PREFILL_KERNEL = envs.owner_value("LABKIT_PREFILL_ATTN")


def dense_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of a chunk's queries q [T, Hq, D] over all keys so far k, v [S, n_kv, D]
    (S >= T, the chunk is the last T of them): bottom-right-aligned causal mask. Returns [T, Hq, D]."""
    if prefill_kernel(q.device) == "split":
        return split_prefill_attention(q, k, v)
    return grouped_sdpa_attention(q, k, v)


def prefill_kernel(device: torch.device) -> str:
    """The kernel `dense_prefill_attention` takes on `device` ("split" or "sdpa")."""
    if PREFILL_KERNEL == "sdpa" or device.type != "cuda":
        return "sdpa"
    if PREFILL_KERNEL == "split" or _cudnn_attention_ok(device):
        return "split"
    return "sdpa"


def _cudnn_attention_ok(device: torch.device) -> bool:
    """cuDNN's fused attention is called directly (not through SDPA, whose cuDNN backend torch 2.11 leaves off
    by default), so it needs cuDNN and a Hopper-class GPU, where it was measured (head_dim 256)."""
    return torch.backends.cudnn.is_available() and arch.native("cudnn_split", device)


def grouped_sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA per KV head with a lower-right causal mask (the flash or efficient kernel on CUDA; the CPU path)."""
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


def _cudnn(q, k, v, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's fused attention [B, H, Tq, D] x [B, H, Tk, D] -> (out [B, H, Tq, D], natural-log LSE [B, H, Tq])."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)
    return out[0], out[1].reshape(q.shape[:3])


def attention_with_lse(q, k, v, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition of `_cudnn` in torch ops (fp32 scores; causal = top-left aligned)."""
    s = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        Tq, Tk = s.shape[-2:]
        s = s.masked_fill(torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.softmax(s, -1) @ v.float()).to(q.dtype), lse


def split_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attend=None) -> torch.Tensor:
    """`dense_prefill_attention` as two cuDNN calls. Why: cuDNN's kernel runs at ~90% of the bf16 GEMM peak at
    this shape but SDPA reaches it only without a mask and with K/V as many heads as Q; a chunk's causal mask
    against a longer prefix is lower-right aligned, which SDPA sends to the flash kernel (~40% of the peak).
    So: (1) the queries against the prefix [0, S - T), which they see whole (no mask): each KV head's G query
    heads stacked along the query axis, one cuDNN head per KV head, so each prefix row is read once for its
    G heads and nothing is expanded; (2) the queries against the chunk's own T keys, a square whose causal
    mask is cuDNN's own (top-left = bottom-right); (3) the two merged by their log-sum-exps. `attend` stands in
    for cuDNN (`attention_with_lse`, the definition in torch ops: how the CPU tests check the fold and merge)."""
    attend = attend or _cudnn
    T, Hq, D = q.shape
    S, n_kv, _ = k.shape
    G, P = Hq // n_kv, S - T
    qh = q.transpose(0, 1).unsqueeze(0).contiguous()                                  # [1, Hq, T, D]
    kc = k[P:].transpose(0, 1).repeat_interleave(G, 0).unsqueeze(0)                 # the chunk's keys, per Q head
    vc = v[P:].transpose(0, 1).repeat_interleave(G, 0).unsqueeze(0)
    o2, l2 = attend(qh, kc, vc, causal=True)
    if P == 0:
        return o2[0].transpose(0, 1).contiguous()
    qf = q.view(T, n_kv, G, D).permute(1, 2, 0, 3).reshape(1, n_kv, G * T, D)       # group folded into queries
    kp = k[:P].transpose(0, 1).unsqueeze(0).contiguous()                              # [1, n_kv, P, D]
    vp = v[:P].transpose(0, 1).unsqueeze(0).contiguous()
    o1, l1 = attend(qf, kp, vp, causal=False)
    o1 = o1.view(n_kv, G, T, D).reshape(1, Hq, T, D)
    l1 = l1.view(n_kv, G, T).reshape(1, Hq, T)
    return merge_by_lse(o1, l1, o2, l2)

PREFILL_ATTENTION = ("dense", "sparse")


def prefill_attend(engine, ki: int, slot: int, q, k, v, iq, iw, pos, mark) -> torch.Tensor:
    """A prefill chunk's attention over its prefix k, v [end, n_kv, D] as the engine's `prefill_attention` says:
    `dense` (every query over its whole causal prefix) or `sparse` (QSA's own rule: the indexer scores the
    prefix for each query and it attends to its top `budget` rows; `sparse_prefill.py`). While the prefix is no
    longer than the budget every query keeps all it sees, so sparse is dense there and takes the dense path."""
    end = k.shape[0]
    if engine.prefill_attention == "sparse" and end > engine.budget:
        c = engine.cache
        mark("index_score")            # the indexer's scores and the top-k, fused: no T x S matrix in HBM
        idx, valid = prefill_select(iq, iw, c.index.keys[ki, slot, :end], c.index.scales[ki, slot, :end], pos,
                                    engine.budget)
        mark("attention")
        return sparse_prefill_attention(q, k, v, idx, valid)
    mark("attention")
    with fast_sdpa(q.device):
        return dense_prefill_attention(q, k, v)


def fast_sdpa(device: torch.device):
    """On CUDA forbid SDPA's math fallback: at 248K tokens it would materialise a T x S score matrix."""
    if device.type != "cuda":
        return nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
