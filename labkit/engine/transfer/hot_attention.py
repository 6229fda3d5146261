"""Fused miss-load sparse attention for the hot cache: one kernel reads each selected row where it is
(hits from the device slots, misses straight from mapped pinned host memory), writes each kept miss
into its slot on the way, and attends over the rows (FlashOffloading's fused kernel).

    out = hot_sparse_attention(q, src, slots, rows, slot, victim, valid, n_kv)

q [B, Hq, D] bf16; `src` [R, W] and `slots` [S + 1, W] int64 rows (a row is K then V,
`[2, n_kv, D]` bf16); rows / slot / victim [B*k] as `hot_gather.gather_hot_rows` takes them; valid
[B, k]. Returns [B, Hq, D] bf16, equal to `gather_hot_rows` followed by
`attention.sparse_decode_attention` within bf16 rounding (the reference, `hot_sparse_attention_reference`,
is exactly that), and leaves the slots exactly as `gather_hot_rows` leaves them.

Split-K (flash-decoding): program (b, g, split) takes `SPLIT` selected rows of request b and its KV
head g, loads only that head's K and V (so the programs of one row together read it once and write
it into its victim slot once), keeps the online-softmax partials (running max, sum, weighted V) in
fp32, and a small combine merges the splits. At batch 1 the reference shape has 2 KV heads: without
the split only two programs would pull 2048 rows over the link.
"""
from __future__ import annotations

import torch

from ..model.attention import sparse_decode_attention
from ..model.arch import HAVE_TRITON, kernels_run
from .hot_gather import gather_hot_rows_reference

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _hot_attn_kernel(q_ptr, src_ptr, slots_ptr, rows_ptr, slot_ptr, victim_ptr, valid_ptr,
                         o_ptr, m_ptr, l_ptr, rev_ptr, stage_ptr, K, NS, sm_scale,
                         NKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, GP: tl.constexpr,
                         DP: tl.constexpr, BN: tl.constexpr, SPLIT: tl.constexpr, DEFER: tl.constexpr):
        b = tl.program_id(0)
        g = tl.program_id(1)
        sp = tl.program_id(2)
        ROW: tl.constexpr = 2 * NKV * D                      # bf16 elements per row
        hq = tl.arange(0, GP)
        d = tl.arange(0, DP)
        hm = hq < G
        dm = d < D
        qrow = (b * NKV * G + g * G + hq).to(tl.int64)
        q = tl.load(q_ptr + qrow[:, None] * D + d[None, :], mask=hm[:, None] & dm[None, :], other=0.0)
        q = q.to(tl.float32)     # bf16 values are exact in fp32 (and in tf32, the dot's precision)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        koff = g * D
        voff = (NKV + g) * D
        for n0 in tl.static_range(0, SPLIT, BN):
            j = sp * SPLIT + n0 + tl.arange(0, BN)
            jm = j < K
            idx = b * K + j
            r = tl.load(rows_ptr + idx, mask=jm, other=0).to(tl.int64)
            if DEFER:    # look the row up; misses go to the staging rows, the bookkeeping keeps them later
                s = tl.load(rev_ptr + r, mask=jm, other=-1).to(tl.int64)
                v = tl.full([BN], -1, tl.int64)
            else:
                s = tl.load(slot_ptr + idx, mask=jm, other=-1).to(tl.int64)
                v = tl.load(victim_ptr + idx, mask=jm, other=-1).to(tl.int64)
            ok = tl.load(valid_ptr + idx, mask=jm, other=0) != 0
            hit = (s >= 0)[:, None]
            m2 = jm[:, None] & dm[None, :]
            kh = tl.load(slots_ptr + s[:, None] * ROW + koff + d[None, :], mask=m2 & hit, other=0.0)
            kc = tl.load(src_ptr + r[:, None] * ROW + koff + d[None, :], mask=m2 & (~hit), other=0.0)
            vh = tl.load(slots_ptr + s[:, None] * ROW + voff + d[None, :], mask=m2 & hit, other=0.0)
            vc = tl.load(src_ptr + r[:, None] * ROW + voff + d[None, :], mask=m2 & (~hit), other=0.0)
            kk = tl.where(hit, kh, kc)
            vv = tl.where(hit, vh, vc)
            keep = m2 & (~hit) & (v >= 0)[:, None]
            tl.store(slots_ptr + v[:, None] * ROW + koff + d[None, :], kk, mask=keep)
            tl.store(slots_ptr + v[:, None] * ROW + voff + d[None, :], vv, mask=keep)
            if DEFER:
                cold = m2 & (~hit)
                tl.store(stage_ptr + idx.to(tl.int64)[:, None] * ROW + koff + d[None, :], kk, mask=cold)
                tl.store(stage_ptr + idx.to(tl.int64)[:, None] * ROW + voff + d[None, :], vv, mask=cold)
            sc = tl.dot(q, tl.trans(kk.to(tl.float32))) * sm_scale                         # [GP, BN] fp32
            sc = tl.where((ok & jm)[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(sc - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16).to(tl.float32), vv.to(tl.float32))
            m_i = m_new
        part = (b * NKV + g) * NS + sp
        tl.store(m_ptr + part * GP + hq, m_i)
        tl.store(l_ptr + part * GP + hq, l_i)
        tl.store(o_ptr + (part * GP + hq)[:, None] * DP + d[None, :], acc)


def hot_sparse_attention_reference(q, src, slots, rows, slot, victim, valid, n_kv):
    """The split path: gather (hits from slots, misses from src, misses into their slots), then attend."""
    B = q.shape[0]
    tmp = torch.empty((rows.numel(), src.shape[1]), dtype=src.dtype, device=q.device)
    gather_hot_rows_reference(src, rows, slots, slot, victim, tmp)
    return sparse_decode_attention(q, tmp.view(torch.bfloat16).view(B, valid.shape[1], -1), valid, n_kv)


def hot_sparse_attention(q, src, slots, rows, slot, victim, valid, n_kv: int, split: int = 32, block_n: int = 16,
                         rev=None, stage=None):
    """Sparse decode attention over the selected rows wherever they are (module docstring). With `rev`
    (the layer's reverse index; the deferred path) each row is looked up in the kernel, `slot` and
    `victim` are not used, nothing is kept, and every miss is written to its row of `stage` [B*k, W]."""
    defer = rev is not None
    if defer:
        assert stage is not None and stage.shape == (rows.numel(), src.shape[1])
    if not kernels_run(q, src, slots, rows):
        if defer:
            slot = rev.index_select(0, rows).to(torch.int64)
            victim = torch.full_like(slot, -1)
            miss = slot < 0
            stage[miss] = src.index_select(0, rows[miss].to(src.device)).to(stage.device)
        return hot_sparse_attention_reference(q, src, slots, rows, slot, victim, valid, n_kv)
    B, Hq, D = q.shape
    K = valid.shape[1]
    G = Hq // n_kv
    GP, DP = max(16, triton.next_power_of_2(G)), max(16, triton.next_power_of_2(D))
    split = max(block_n, min(split, triton.next_power_of_2(K)))
    NS = triton.cdiv(K, split)
    dev = q.device
    o = torch.empty((B, n_kv, NS, GP, DP), dtype=torch.float32, device=dev)
    m = torch.empty((B, n_kv, NS, GP), dtype=torch.float32, device=dev)
    l = torch.empty((B, n_kv, NS, GP), dtype=torch.float32, device=dev)
    _hot_attn_kernel[(B, n_kv, NS)](q.contiguous(), src.view(torch.bfloat16), slots.view(torch.bfloat16),
                                    rows, rows if defer else slot, rows if defer else victim, valid.view(torch.int8),
                                    o, m, l, rev if defer else rows, (stage if defer else src).view(torch.bfloat16),
                                    K, NS, D ** -0.5, NKV=n_kv, G=G, D=D, GP=GP, DP=DP, BN=block_n, SPLIT=split,
                                    DEFER=defer, num_warps=4)
    # combine the splits: softmax partials weighted by exp(m_split - m_max)
    mx = m.amax(2, keepdim=True)
    mx = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    w = torch.exp(m - mx)
    den = (w * l).sum(2)
    num = (w[..., None] * o).sum(2)
    out = (num / den[..., None])[:, :, :G, :D]
    return out.reshape(B, Hq, D).to(q.dtype)
