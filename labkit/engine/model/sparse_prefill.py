"""Sparse prefill for QSA layers: each query of a chunk keeps its top-`k` keys by index score and attends
to those rows only, without a T x S score matrix anywhere.

`prefill_select(iq [T, Hi, Di], iw [T, Hi], keys [S, Di] fp8, scales [S] fp16, q_pos [T], k)
    -> (idx [T, k] int64 ascending, valid [T, k] bool)`
`sparse_prefill_attention(q [T, Hq, D], k, v [S, n_kv, D], idx, valid) -> [T, Hq, D]`

Which keys: those of `select.py` per query, over the positions it may see (0..q_pos[t]). The score is the
indexer's (`indexer.py`): score[t, s] = scales[s] * sum_h iw[t, h] * relu(iq[t, h] . keys[s]), here in
fp32 throughout (fp8 and bf16 inputs, fp32 products and sums). The k largest win; among scores equal to
the k-th largest the lowest positions. A query that sees fewer than k keys takes them all; the rest of
its slots are `valid=False` and point at position 0 (a real row: a masked softmax weight never meets a
NaN from memory that was never written).

How (CUDA, Triton; the `_reference` functions are the same definitions in torch ops, the CPU path and the
tests' ground truth). Scores cost Hi x Di = 256 MACs a pair, on tensor cores (`tl.dot`, bf16 in, fp32
out): recomputing them is cheaper than storing T x S of them. One program owns `BT` queries and streams
the keys they can see in tiles of `BS`, in position order. The default (`method="sampled"`):
1. bound: every st-th key's score for every query (st = 8, or wider past 128K keys so that ~16K are sampled:
   64 at 1M), stored as [T, S / st] int32 order keys (`select.order_keys` less 2^31); torch.topk gives each
   query the sampled key of rank 1.6 k / st + 8, a lower bound on its k-th largest score that fails about once
   in a million queries (the sample's count above the k-th largest is binomial, mean k / st). A query that sees
   at most `cap` keys takes them all;
2. collect: one pass over all keys writes each query's keys above its bound, (key, position), in position
   order, the first `cap` kept (`sampled_cap`: the expected count plus six spreads, 8,192 at k = 2,048), and the
   positions of the keys equal to it, the first k kept. Ties need the second list: a query whose head weights
   are all negative scores every key with no positive dot exactly 0, its k-th largest is one of thousands of
   equal keys, and only positions order those, so the first k of them are exactly the ones a top-k takes.
   A program holds 64 queries' index heads for the whole pass and scores each key tile with wgmma; the ranks
   in the tile of both lists come from one more product (with a triangular matrix of ones), and the few kept
   keys are stored from the registers as they lie. A query block's keys are cut into ranges (`collect_splits`),
   each its own program writing its own segment of the lists: four programs a multiprocessor instead of one;
3. pick: one program a query, reading the segments as one list. With k or more keys above the bound, four
   radix passes over that list in registers find the k-th largest and a running count ranks its ties by
   position; with fewer, all of them and the first equal ones, the two lists merged by position (a binary
   search of each in the other);
4. a query with too few in both lists (the sample put the bound above the k-th largest) or more than `cap`
   above it is flagged, and the exact passes run for the flagged queries only: four histogram passes over all
   their keys (pass p counts the next 8 bits of the keys whose higher bits equal the prefix found so far; each
   program owns its queries' histograms, stored once without atomics) and a write pass. They are launched
   always; a program with no flagged query reads nothing (no sync).
Memory besides inputs and outputs at T = 8,192, k = 2,048: the sample (<= 512 MB), the lists [T, ranges,
cap] x 8 B and [T, ranges, k] x 4 B (2.4 GB at four ranges, written only where a key is kept), histograms
[4, T, 256] int32. `method="exact"` runs the exact passes for every query.
A query that sees n < k keys asks for n: all are taken.

Attention: one program per (query, KV head). The selected rows are read once for all the query heads of
that KV head (GQA), in blocks of `BK`, with an online softmax; fp32 accumulation.
"""
from __future__ import annotations


import torch

from . import arch, fp8
from .arch import HAVE_TRITON, interpret_mode, kernels_run
from .select import NEG_INF, select_topk_reference

if HAVE_TRITON:
    import triton
    import triton.language as tl

RADIX, N_PASSES = 256, 4
SAMPLE_STRIDE = 8          # the sample: every 8th key at least
SAMPLE_KEYS = 16384        # the sampled path: about this many sampled keys a query


# ------------------------------------------------------------------ the definitions (torch ops)

def prefill_scores_reference(iq, iw, keys, scales, q_pos) -> torch.Tensor:
    """scores [T, S] fp32, -inf at positions a query may not see (s > q_pos[t])."""
    kf = keys.to(torch.float32)                                                   # [S, Di]
    dots = torch.einsum("thd,sd->tsh", iq.to(torch.float32), kf)                  # [T, S, Hi]
    s = (torch.relu(dots) * iw.to(torch.float32)[:, None, :]).sum(-1) * scales.to(torch.float32)[None, :]
    pos = torch.arange(keys.shape[0], device=keys.device)
    return s.masked_fill(pos[None, :] > q_pos[:, None], NEG_INF)


def prefill_select_reference(iq, iw, keys, scales, q_pos, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition: `select_topk_reference` over each query's causal scores (k may exceed S: the
    slots past the visible keys come back invalid)."""
    _check_select(iq, iw, keys, scales, q_pos, k)
    s = prefill_scores_reference(iq, iw, keys, scales, q_pos)
    if k > s.shape[1]:
        s = torch.nn.functional.pad(s, (0, k - s.shape[1]), value=NEG_INF)
    return select_topk_reference(s, k)


def sparse_prefill_attention_reference(q, k, v, idx, valid) -> torch.Tensor:
    """Each query t attends to rows idx[t][valid[t]] of its KV head; fp32 math, output in q's dtype."""
    T, Hq, D = q.shape
    n_kv = k.shape[1]
    kk = k[idx].to(torch.float32)                                                 # [T, k, n_kv, D]
    vv = v[idx].to(torch.float32)
    qg = q.view(T, n_kv, Hq // n_kv, D).to(torch.float32)
    s = torch.einsum("tgqd,tngd->tgqn", qg, kk) * (D ** -0.5)
    s = s.masked_fill(~valid[:, None, None, :], NEG_INF)
    o = torch.einsum("tgqn,tngd->tgqd", torch.softmax(s, dim=-1), vv)
    return o.reshape(T, Hq, D).to(q.dtype)


def _check_select(iq, iw, keys, scales, q_pos, k):
    if iq.dim() != 3 or iw.shape != iq.shape[:2] or keys.dim() != 2 or keys.shape[1] != iq.shape[2]:
        raise ValueError(f"prefill_select: iq {tuple(iq.shape)}, iw {tuple(iw.shape)}, keys {tuple(keys.shape)} "
                         "do not fit [T, Hi, Di], [T, Hi], [S, Di]")
    if scales.shape != keys.shape[:1] or q_pos.shape != iq.shape[:1]:
        raise ValueError(f"prefill_select: scales {tuple(scales.shape)} / q_pos {tuple(q_pos.shape)} do not fit "
                         f"S={keys.shape[0]}, T={iq.shape[0]}")
    if k < 1:
        raise ValueError(f"prefill_select: k={k} must be at least 1")


def _check_attention(q, k, v, idx, valid):
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k.shape[2] != q.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(f"sparse_prefill_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "do not fit [T, Hq, D], [S, n_kv, D] with n_kv dividing Hq")
    if idx.shape != valid.shape or idx.dim() != 2 or idx.shape[0] != q.shape[0]:
        raise ValueError(f"sparse_prefill_attention: idx {tuple(idx.shape)} / valid {tuple(valid.shape)} "
                         f"do not fit [T={q.shape[0]}, k]")


# ------------------------------------------------------------------ the kernels

if HAVE_TRITON:
    @triton.jit
    def _key_tile(k_ptr, sc_ptr, s0, S, k_ss, BS: tl.constexpr, DI: tl.constexpr, STRIDE: tl.constexpr):
        """The index keys [DI, BS] (fp8, as stored) and scales [BS] at positions (s0 + j) * STRIDE, the positions
        and which of them exist. Loaded on their own so that a loop can ask for the next tile before it scores
        this one."""
        s = (s0 + tl.arange(0, BS)).to(tl.int32) * STRIDE        # int32 whatever s0 is (a loop's may be int64)
        sm = s < S
        di = tl.arange(0, DI)
        offs = s[None, :].to(tl.int64) * k_ss + di[:, None]
        if k_ptr.dtype.element_ty == tl.uint8:      # the portable operand: bytes decoded (`fp8.operand`)
            kt = fp8.e4m3_to_f32(tl.load(k_ptr + offs, mask=sm[None, :], other=0))
        else:
            kt = tl.load(k_ptr + offs, mask=sm[None, :], other=0.0)
        return kt, tl.load(sc_ptr + s, mask=sm, other=0.0), s, sm

    @triton.jit
    def _order_key(acc):
        """uint32 keys in the order of the fp32 scores (negative: all bits flipped; else the sign bit set)."""
        u = acc.to(tl.int32, bitcast=True)
        return (u ^ ((u >> 31) | (-2147483647 - 1))).to(tl.uint32, bitcast=True)

    @triton.jit
    def _query_head(iq_ptr, iw_ptr, t, tm, iq_st, iq_sh, iw_st, h: tl.constexpr, DI: tl.constexpr,
                    DOT_F32: tl.constexpr):
        """Index head h of queries t: the query rows as the product wants them and the head weights."""
        di = tl.arange(0, DI)
        q = tl.load(iq_ptr + t[:, None].to(tl.int64) * iq_st + h * iq_sh + di[None, :], mask=tm[:, None], other=0.0)
        w = tl.load(iw_ptr + t.to(tl.int64) * iw_st + h, mask=tm, other=0.0).to(tl.float32)
        if DOT_F32:
            return q.to(tl.float32), w
        return q.to(tl.bfloat16), w

    @triton.jit
    def _add_head(acc, q, w, kt, DOT_F32: tl.constexpr):
        if DOT_F32:
            d = tl.dot(q, kt, input_precision="ieee")
        else:
            d = tl.dot(q, kt)
        return acc + w[:, None] * tl.maximum(d, 0.0)

    @triton.jit
    def _score_keys(iq_ptr, iw_ptr, kt, sc, s, sm, t, tm, qp, iq_st, iq_sh, iw_st, HI: tl.constexpr,
                    DI: tl.constexpr, DOT_F32: tl.constexpr):
        """Order-preserving uint32 keys [BT, BS] of queries t against a key tile, and which of them the queries
        see."""
        if DOT_F32:   # the interpreter: exact fp32 operands (fp8 and bf16 values are), the same products
            kt = kt.to(tl.float32)
        else:
            kt = kt.to(tl.bfloat16)
        acc = tl.zeros([t.shape[0], kt.shape[1]], dtype=tl.float32)
        for h in tl.static_range(HI):
            qh, wh = _query_head(iq_ptr, iw_ptr, t, tm, iq_st, iq_sh, iw_st, h, DI, DOT_F32)
            acc = _add_head(acc, qh, wh, kt, DOT_F32)
        key = _order_key(acc * sc.to(tl.float32)[None, :])
        return key, tm[:, None] & sm[None, :] & (s[None, :] <= qp[:, None])

    @triton.jit
    def _score_tile(iq_ptr, iw_ptr, k_ptr, sc_ptr, t, tm, qp, s0, S, iq_st, iq_sh, iw_st, k_ss,
                    BS: tl.constexpr, HI: tl.constexpr, DI: tl.constexpr, DOT_F32: tl.constexpr,
                    STRIDE: tl.constexpr):
        """Order-preserving uint32 keys [BT, BS] of queries t at positions (s0 + j) * STRIDE, which of them
        the queries see, and the positions."""
        kt, sc, s, sm = _key_tile(k_ptr, sc_ptr, s0, S, k_ss, BS, DI, STRIDE)
        key, ok = _score_keys(iq_ptr, iw_ptr, kt, sc, s, sm, t, tm, qp, iq_st, iq_sh, iw_st, HI, DI, DOT_F32)
        return key, ok, s

    @triton.jit
    def _walk(hist_ptr, t, tm, T, need, PASSES: tl.constexpr, RADIX: tl.constexpr):
        """(prefix, need) of queries t after PASSES passes: per pass the digit holding the need-th largest
        key (the largest d with count(digit >= d) >= need) and the equals of the prefix still needed."""
        bins = tl.arange(0, RADIX)
        prefix = tl.zeros_like(t).to(tl.uint32)
        for p in tl.static_range(PASSES):
            h = tl.load(hist_ptr + ((p * T + t[:, None]).to(tl.int64) * RADIX + bins[None, :]), mask=tm[:, None],
                        other=0)
            ge = tl.sum(h, 1)[:, None] - tl.cumsum(h, 1) + h
            d = tl.sum((ge >= need[:, None]).to(tl.int32), 1) - 1
            need -= tl.sum(tl.where(bins[None, :] > d[:, None], h, 0), 1)
            prefix = (prefix << 8) | d.to(tl.uint32)
        return prefix, need

    @triton.jit
    def _rows(qp_ptr, flag_ptr, T, BT: tl.constexpr, USE_FLAG: tl.constexpr):
        """This program's queries, which take part, their positions (-1: none, so they see no key)."""
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        tm = t < T
        if USE_FLAG:   # the exact passes run for the queries whose bound failed only
            tm = tm & (tl.load(flag_ptr + t, mask=tm, other=0) != 0)
        return t, tm, tl.load(qp_ptr + t, mask=tm, other=-1)

    @triton.jit
    def _want(qp, S, K):
        """The rank the walk looks for: min(k, keys the query sees)."""
        return tl.minimum(tl.minimum(qp + 1, S), K).to(tl.int32)

    @triton.jit
    def _select_hist_kernel(iq_ptr, iw_ptr, k_ptr, sc_ptr, qp_ptr, hist_ptr, flag_ptr, T, S, K, iq_st, iq_sh, iw_st,
                            k_ss, PASS: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, HI: tl.constexpr,
                            DI: tl.constexpr, RADIX: tl.constexpr, DOT_F32: tl.constexpr, USE_FLAG: tl.constexpr):
        t, tm, qp = _rows(qp_ptr, flag_ptr, T, BT, USE_FLAG)
        want = _want(qp, S, K)
        if PASS > 0:
            prefix, _left = _walk(hist_ptr, t, tm, T, want, PASS, RADIX)
        rows = tl.arange(0, BT)
        bins = tl.arange(0, RADIX)
        hist = tl.zeros([BT, RADIX], dtype=tl.int32)
        end = tl.minimum(tl.max(qp, 0) + 1, S)                   # past the tile's last visible key
        for s0 in range(0, end, BS):
            key, ok, _pos = _score_tile(iq_ptr, iw_ptr, k_ptr, sc_ptr, t, tm, qp, s0, S, iq_st, iq_sh, iw_st, k_ss,
                                        BS, HI, DI, DOT_F32, 1)
            if PASS == 0:
                match = ok
            else:
                match = ok & ((key >> (32 - 8 * PASS)) == prefix[:, None])
            # non-matching keys go to bin 0 and are taken out again: RADIX bins, not RADIX + 1
            digit = tl.where(match, (key >> (24 - 8 * PASS)) & (RADIX - 1), 0).to(tl.int32)
            n_match = tl.sum(match.to(tl.int32), 1)
            # tl.histogram is 1-D: one query's row at a time (its cost grows with the bins, so BT rows as
            # BT * RADIX bins would cost BT times more than this)
            for r in tl.static_range(BT):
                dr = tl.sum(tl.where(rows[:, None] == r, digit, 0), 0)
                nr = tl.sum(tl.where(rows == r, n_match, 0), 0)
                hr = tl.histogram(dr, RADIX) - tl.where(bins == 0, BS - nr, 0)
                hist += tl.where(rows[:, None] == r, hr[None, :], 0)
        tl.store(hist_ptr + ((PASS * T + t[:, None]).to(tl.int64) * RADIX + bins[None, :]), hist, mask=tm[:, None])

    @triton.jit
    def _select_write_kernel(iq_ptr, iw_ptr, k_ptr, sc_ptr, qp_ptr, hist_ptr, flag_ptr, idx_ptr, valid_ptr, T, S, K,
                             iq_st, iq_sh, iw_st, k_ss, BT: tl.constexpr, BS: tl.constexpr, HI: tl.constexpr,
                             DI: tl.constexpr, RADIX: tl.constexpr, DOT_F32: tl.constexpr, USE_FLAG: tl.constexpr):
        t, tm, qp = _rows(qp_ptr, flag_ptr, T, BT, USE_FLAG)
        thr, need = _walk(hist_ptr, t, tm, T, _want(qp, S, K), 4, RADIX)
        taken = tl.zeros([BT], dtype=tl.int32)                  # written so far, per query
        eq_seen = tl.zeros([BT], dtype=tl.int32)                # equals of the threshold met so far
        end = tl.minimum(tl.max(qp, 0) + 1, S)
        for s0 in range(0, end, BS):
            key, ok, s = _score_tile(iq_ptr, iw_ptr, k_ptr, sc_ptr, t, tm, qp, s0, S, iq_st, iq_sh, iw_st, k_ss,
                                     BS, HI, DI, DOT_F32, 1)
            eq = (ok & (key == thr[:, None])).to(tl.int32)
            take = (ok & (key > thr[:, None])) | ((eq == 1) & (eq_seen[:, None] + tl.cumsum(eq, 1) <= need[:, None]))
            ti = take.to(tl.int32)
            rank = taken[:, None] + tl.cumsum(ti, 1) - 1
            at = t[:, None].to(tl.int64) * K + rank
            tl.store(idx_ptr + at, tl.zeros_like(rank).to(tl.int64) + s[None, :], mask=take)
            tl.store(valid_ptr + at, ti.to(tl.int8), mask=take)
            taken += tl.sum(ti, 1)
            eq_seen += tl.sum(eq, 1)

    # ---- the sampled path: the bound from a sample's scores kept in HBM, one collect pass on wide tiles

    @triton.jit
    def _sample_kernel(iq_ptr, iw_ptr, k_ptr, sc_ptr, qp_ptr, out_ptr, T, S, NS, iq_st, iq_sh, iw_st, k_ss,
                       BT: tl.constexpr, BS: tl.constexpr, HI: tl.constexpr, DI: tl.constexpr, DOT_F32: tl.constexpr,
                       STRIDE: tl.constexpr):
        """Keys of every STRIDE-th position for BT queries x BS sampled positions, as int32 (key - 2^31: the same
        order for torch.topk), the smallest int32 where the query does not see the key."""
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        tm = t < T
        qp = tl.load(qp_ptr + t, mask=tm, other=-1)
        j0 = tl.program_id(1) * BS
        key, ok, _s = _score_tile(iq_ptr, iw_ptr, k_ptr, sc_ptr, t, tm, qp, j0, S, iq_st, iq_sh, iw_st, k_ss, BS, HI, DI,
                                  DOT_F32, STRIDE)
        v = (tl.where(ok, key, 0) ^ 0x80000000).to(tl.int32, bitcast=True)
        j = j0 + tl.arange(0, BS)
        tl.store(out_ptr + t[:, None].to(tl.int64) * NS + j[None, :], v, mask=tm[:, None] & (j < NS)[None, :])

    @triton.jit
    def _store_at(row, at, key, s, PAIR: tl.constexpr, ASM: tl.constexpr):
        """Entry `at` of each query's list at `row` (where at >= 0): the pair (key, position s), or the position
        alone. On the GPU a store in the registers' own layout with its address made in the store: a tl.store
        would first move the tile, its pointers and its mask through shared memory into a layout made for
        coalescing, which the scattered stores of a few keys a tile cannot use. The interpreter runs tl.store."""
        if ASM:
            if PAIR:
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; .reg .b64 a; setp.ge.s32 p, $2, 0; mad.wide.s32 a, $2, 8, $1; "
                    "@p st.global.v2.b32 [a], {$3, $4}; mov.b32 $0, 0; }",
                    "=r,l,r,r,r", [row[:, None], at, key.to(tl.int32, bitcast=True), s[None, :]], dtype=tl.int32,
                    is_pure=False, pack=1)
            else:
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; .reg .b64 a; setp.ge.s32 p, $2, 0; mad.wide.s32 a, $2, 4, $1; "
                    "@p st.global.b32 [a], $3; mov.b32 $0, 0; }",
                    "=r,l,r,r", [row[:, None], at, s[None, :]], dtype=tl.int32, is_pure=False, pack=1)
        elif PAIR:
            tl.store(row[:, None] + 2 * at, key.to(tl.int32, bitcast=True), mask=at >= 0)
            tl.store(row[:, None] + 2 * at + 1, tl.zeros_like(at) + s[None, :], mask=at >= 0)
        else:
            tl.store(row[:, None] + at, tl.zeros_like(at) + s[None, :], mask=at >= 0)

    @triton.jit
    def _append_both(key, s, gt, eq, cnt, ecnt, g_row, e_row, CAP, ECAP, upper, DOT_F32: tl.constexpr,
                     ASM: tl.constexpr):
        """A tile's keys above the bound appended to each query's (key, position) list at `g_row` and those equal to
        it to its position list at `e_row`, in position order, the first CAP / ECAP kept; the new counts. Both
        running ranks come from one product with an upper-triangular matrix of ones on the tensor cores, not a scan:
        gt + 256 eq (0, 1 or 256: exact in bf16; sums below 2^24: exact in fp32) gives the count of keys above in
        its low 8 bits (at most BS < 256) and the count of equal ones above them."""
        both = gt.to(tl.int32) + 256 * eq.to(tl.int32)
        if DOT_F32:
            inc = tl.dot(both.to(tl.float32), upper, input_precision="ieee").to(tl.int32)
        else:
            inc = tl.dot(both.to(tl.bfloat16), upper).to(tl.int32)
        at = cnt[:, None] + (inc & 255) - 1
        _store_at(g_row, tl.where(gt & (at < CAP), at, -1), key, s, True, ASM)
        at = ecnt[:, None] + (inc >> 8) - 1
        _store_at(e_row, tl.where(eq & (at < ECAP), at, -1), key, s, False, ASM)
        return cnt + tl.sum(gt.to(tl.int32), 1), ecnt + tl.sum(eq.to(tl.int32), 1)

    @triton.jit
    def _score_hoisted(kt, sc, q0, w0, q1, w1, q2, w2, q3, w3, HI: tl.constexpr, DOT_F32: tl.constexpr):
        """Order keys of a key tile against query heads held since the program began (at most four)."""
        if DOT_F32:
            kt = kt.to(tl.float32)
        else:
            kt = kt.to(tl.bfloat16)
        acc = _add_head(tl.zeros([q0.shape[0], kt.shape[1]], dtype=tl.float32), q0, w0, kt, DOT_F32)
        if HI > 1:
            acc = _add_head(acc, q1, w1, kt, DOT_F32)
        if HI > 2:
            acc = _add_head(acc, q2, w2, kt, DOT_F32)
        if HI > 3:
            acc = _add_head(acc, q3, w3, kt, DOT_F32)
        return _order_key(acc * sc.to(tl.float32)[None, :])

    @triton.jit
    def _collect_sampled_kernel(iq_ptr, iw_ptr, k_ptr, sc_ptr, qp_ptr, bound_ptr, glist_ptr, gcnt_ptr,
                                epos_ptr, ecnt_ptr, T, S, CAP, ECAP, iq_st, iq_sh, iw_st, k_ss,
                                BT: tl.constexpr, BS: tl.constexpr, HI: tl.constexpr, DI: tl.constexpr,
                                DOT_F32: tl.constexpr, HOIST: tl.constexpr,
                                ASM: tl.constexpr):
        """Each query's keys above its bound, (key, position) pairs (the first CAP kept), and the positions of the
        keys equal to it (the first ECAP), in position order, and how many there were. Equal keys only the position
        orders, and at most k of them are wanted, so keeping the first is exact however many ties there are.
        Program (i, j) takes the j-th of the grid's SPLITS ranges of key tiles for BT queries, into its own segment
        of each list ([T, SPLITS, CAP] entries, counts [T, SPLITS]): more programs than one per query block keep
        a multiprocessor busy while another waits. HOIST (HI <= 4): the query heads loaded once, not once a tile."""
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        sp, n_sp = tl.program_id(1), tl.num_programs(1)
        tm = t < T
        qp = tl.load(qp_ptr + t, mask=tm, other=-1)
        b = tl.load(bound_ptr + t, mask=tm, other=0).to(tl.uint32, bitcast=True) ^ 0x80000000
        cnt = tl.zeros([BT], dtype=tl.int32)
        ecnt = tl.zeros([BT], dtype=tl.int32)
        end = tl.minimum(tl.max(qp, 0) + 1, S)
        per = tl.cdiv(tl.cdiv(end, BS), n_sp) * BS                   # keys a split, whole tiles
        lo = sp * per
        hi = tl.minimum(lo + per, end)
        seg = t.to(tl.int64) * n_sp + sp
        g_row = glist_ptr + seg * (2 * CAP)
        e_row = epos_ptr + seg * ECAP
        j = tl.arange(0, BS)
        if DOT_F32:
            upper = (j[:, None] <= j[None, :]).to(tl.float32)
        else:
            upper = (j[:, None] <= j[None, :]).to(tl.bfloat16)
        q0, w0, q1, w1, q2, w2, q3, w3 = 0, 0, 0, 0, 0, 0, 0, 0
        if HOIST:
            q0, w0 = _query_head(iq_ptr, iw_ptr, t, tm, iq_st, iq_sh, iw_st, 0, DI, DOT_F32)
            if HI > 1:
                q1, w1 = _query_head(iq_ptr, iw_ptr, t, tm, iq_st, iq_sh, iw_st, 1, DI, DOT_F32)
            if HI > 2:
                q2, w2 = _query_head(iq_ptr, iw_ptr, t, tm, iq_st, iq_sh, iw_st, 2, DI, DOT_F32)
            if HI > 3:
                q3, w3 = _query_head(iq_ptr, iw_ptr, t, tm, iq_st, iq_sh, iw_st, 3, DI, DOT_F32)
        for s0 in range(lo, hi, BS):
            kt, sc, s, sm = _key_tile(k_ptr, sc_ptr, s0, S, k_ss, BS, DI, 1)
            if HOIST:
                key = _score_hoisted(kt, sc, q0, w0, q1, w1, q2, w2, q3, w3, HI, DOT_F32)
                ok = tm[:, None] & sm[None, :] & (s[None, :] <= qp[:, None])
            else:
                key, ok = _score_keys(iq_ptr, iw_ptr, kt, sc, s, sm, t, tm, qp, iq_st, iq_sh, iw_st, HI, DI, DOT_F32)
            cnt, ecnt = _append_both(key, s, ok & (key > b[:, None]), ok & (key == b[:, None]), cnt, ecnt, g_row,
                                     e_row, CAP, ECAP, upper, DOT_F32, ASM)
        tl.store(gcnt_ptr + seg, cnt, mask=tm)
        tl.store(ecnt_ptr + seg, ecnt, mask=tm)

    @triton.jit
    def _segments(j, cnt_ptr, CAP, SPLITS: tl.constexpr):
        """The slot of entry j of a query's segments read as one list in position order (segment i: its first
        min(count, CAP) entries), -1 past the end."""
        slot = tl.zeros_like(j) - 1
        start = 0
        for i in tl.static_range(SPLITS):
            c = tl.minimum(tl.load(cnt_ptr + i), CAP)
            slot = tl.where((j >= start) & (j < start + c), i * CAP + j - start, slot)
            start += c
        return slot

    @triton.jit
    def _radix_threshold(key, m, need, N: tl.constexpr, RADIX: tl.constexpr):
        """The need-th largest of key[m] (four 8-bit passes over a vector in registers) and how many keys equal
        to it are still needed after every key above it."""
        bins = tl.arange(0, RADIX)
        thr = tl.zeros((), dtype=tl.uint32)
        for p in tl.static_range(4):
            if p == 0:
                match = m
            else:
                match = m & ((key >> (32 - 8 * p)) == thr)
            digit = tl.where(match, (key >> (24 - 8 * p)) & (RADIX - 1), 0).to(tl.int32)
            h = tl.histogram(digit, RADIX) - tl.where(bins == 0, N - tl.sum(match.to(tl.int32), 0), 0)
            ge = tl.sum(h, 0) - tl.cumsum(h, 0) + h
            d = tl.sum((ge >= need).to(tl.int32), 0) - 1
            need -= tl.sum(tl.where(bins > d, h, 0), 0)
            thr = (thr << 8) | d.to(tl.uint32)
        return thr, need

    @triton.jit
    def _pick_kernel(qp_ptr, glist_ptr, gcnt_ptr, epos_ptr, ecnt_ptr, flag_ptr, idx_ptr, valid_ptr, S, K,
                     CAP: tl.constexpr, ECAP: tl.constexpr, NA: tl.constexpr, NH: tl.constexpr,
                     LOG: tl.constexpr, RADIX: tl.constexpr, SPLITS: tl.constexpr):
        """One query: its k largest from the two lists (each in SPLITS segments of CAP / ECAP entries, read as
        one), written in position order. At least k above the bound: the k largest of those (ties by a running
        count: the list is in position order). Fewer: all of them and the first equal ones, the two lists merged by
        position. Too few in both (the sample put the bound above the k-th largest) or more than CAP above it
        (no segment can be over its CAP then): flagged for the exact passes."""
        t = tl.program_id(0)
        qp = tl.load(qp_ptr + t)
        k_eff = tl.minimum(tl.minimum(qp + 1, S), K).to(tl.int32)
        g_cnt, e_cnt = gcnt_ptr + t * SPLITS, ecnt_ptr + t * SPLITS
        ca = tl.sum(tl.load(g_cnt + tl.arange(0, SPLITS)), 0)
        ce = tl.sum(tl.load(e_cnt + tl.arange(0, SPLITS)), 0)
        row = t.to(tl.int64) * K
        g_row = glist_ptr + t.to(tl.int64) * (SPLITS * 2 * CAP)      # (key, position) pairs
        e_row = epos_ptr + t.to(tl.int64) * (SPLITS * ECAP)
        if (ca + ce < k_eff) | (ca > CAP):
            tl.store(flag_ptr + t, 1)
        elif ca >= k_eff:
            j = tl.arange(0, NA)
            slot = _segments(j, g_cnt, CAP, SPLITS)
            m = slot >= 0
            key = tl.load(g_row + 2 * slot, mask=m, other=0).to(tl.uint32, bitcast=True)
            pos = tl.load(g_row + 2 * slot + 1, mask=m, other=0)
            thr, need = _radix_threshold(key, m, k_eff, NA, RADIX)
            eq = (m & (key == thr)).to(tl.int32)
            take = (m & (key > thr)) | ((eq == 1) & (tl.cumsum(eq, 0) <= need))
            rank = tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(idx_ptr + row + rank, pos.to(tl.int64), mask=take)
            tl.store(valid_ptr + row + rank, take.to(tl.int8), mask=take)
        else:
            # every key above the bound and the first k_eff - ca equal to it: two lists each in position order,
            # merged by rank (a key's index in its list plus how many of the other list's positions are lower)
            jm = tl.arange(0, NH)
            ne = k_eff - ca
            ga = tl.load(g_row + 2 * _segments(jm, g_cnt, CAP, SPLITS) + 1, mask=jm < ca, other=0)
            ge = tl.load(e_row + _segments(jm, e_cnt, ECAP, SPLITS), mask=jm < ne, other=0)
            ra = jm + _lower_bound(e_row, 1, e_cnt, ECAP, ne, ga, LOG, SPLITS)
            re = jm + _lower_bound(g_row + 1, 2, g_cnt, CAP, ca, ge, LOG, SPLITS)
            tl.store(idx_ptr + row + ra, ga.to(tl.int64), mask=jm < ca)
            tl.store(idx_ptr + row + re, ge.to(tl.int64), mask=jm < ne)
            tl.store(valid_ptr + row + jm, (jm < k_eff).to(tl.int8), mask=jm < k_eff)

    @triton.jit
    def _lower_bound(ptr, step, cnt_ptr, CAP, n, x, LOG: tl.constexpr, SPLITS: tl.constexpr):
        """For each x, how many of the first n entries of an ascending list are below it (a binary search of LOG
        steps, 2^LOG > n); the list is SPLITS segments of `step`-spaced entries at ptr (`_segments`)."""
        lo = tl.zeros_like(x)
        hi = tl.zeros_like(x) + n
        for _ in tl.static_range(LOG):
            mid = (lo + hi) // 2
            live = lo < hi
            below = live & (tl.load(ptr + _segments(mid, cnt_ptr, CAP, SPLITS) * step, mask=live, other=0) < x)
            lo = tl.where(below, mid + 1, lo)
            hi = tl.where(live & (~below), mid, hi)
        return lo

    @triton.jit
    def _sparse_attn_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, valid_ptr, o_ptr, K, qk_scale, q_st, q_sh, k_ss, k_sh,
                            v_ss, v_sh, o_st, o_sh, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                            DP: tl.constexpr, BK: tl.constexpr, DOT_F32: tl.constexpr):
        t, g = tl.program_id(0), tl.program_id(1)
        hr = tl.arange(0, GP)
        hm = hr < G
        hq = g * G + hr
        d = tl.arange(0, DP)
        dm = d < D
        q = tl.load(q_ptr + t.to(tl.int64) * q_st + hq[:, None] * q_sh + d[None, :], mask=hm[:, None] & dm[None, :],
                    other=0.0)
        m_i = tl.full([GP], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GP], dtype=tl.float32)
        acc = tl.zeros([GP, DP], dtype=tl.float32)
        for j0 in range(0, K, BK):
            j = j0 + tl.arange(0, BK)
            jm = j < K
            r = tl.load(idx_ptr + t.to(tl.int64) * K + j, mask=jm, other=0)
            ok = jm & (tl.load(valid_ptr + t.to(tl.int64) * K + j, mask=jm, other=0) != 0)
            lm = ok[:, None] & dm[None, :]
            kk = tl.load(k_ptr + r[:, None] * k_ss + g * k_sh + d[None, :], mask=lm, other=0.0)     # [BK, DP]
            vv = tl.load(v_ptr + r[:, None] * v_ss + g * v_sh + d[None, :], mask=lm, other=0.0)
            if DOT_F32:
                s = tl.dot(q.to(tl.float32), tl.trans(kk.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(kk))
            s = tl.where(ok[None, :], s * qk_scale, float("-inf"))                               # log2 units
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)    # a block with nothing valid yet: no NaN
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            if DOT_F32:
                acc = acc * alpha[:, None] + tl.dot(p, vv.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(vv.dtype), vv)
            m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(o_ptr + t.to(tl.int64) * o_st + hq[:, None] * o_sh + d[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=hm[:, None] & dm[None, :])


def sample_stride(S: int) -> int:
    """The sampled path's stride: every 8th key, wider past 128K keys so that a query's sample stays ~16K keys
    (at 1M: every 64th)."""
    return max(SAMPLE_STRIDE, triton.next_power_of_2(-(-S // SAMPLE_KEYS)))


def sample_rank(want, st: int):
    """The rank in the sample whose key bounds the want-th largest from below: 1.6 want / st + 8. The sample's
    count above the k-th largest is binomial (mean k / st, ~sqrt of it spread): at 1M (st = 64) 32 +- 5.6
    against a rank of 59, so the bound fails about once in a million queries."""
    return (16 * want + 10 * st - 1) // (10 * st) + 8


def sampled_cap(k: int, st: int) -> int:
    """Keys above the sampled bound kept a query: the expected count (rank x stride) plus six spreads, rounded up
    to a power of two (8,192 at k = 2,048 from 64K to 1M keys)."""
    rank = sample_rank(k, st)
    return max(256, triton.next_power_of_2(int(rank * st + 6 * rank ** 0.5 * st)))


def collect_splits(T, S, bt, bs, dev) -> int:
    """Key ranges a query block's collect pass is cut into: about four programs a multiprocessor (a program of 64
    queries holds 4 warps; alone on one, it waits on every tile's loads and products), a power of two up to 4,
    none shorter than 16 tiles. On an H200 at 248K, 1 / 2 / 4 ranges: 14.3 / 9.9 / 9.6 ms of collect (64 x 64)."""
    if dev.type != "cuda":
        return 1
    want = max(1, 4 * arch.multiprocessors(dev) // triton.cdiv(T, bt))
    tiles = triton.cdiv(S, bs)
    n = 1
    while 2 * n <= min(want, 4) and tiles // (2 * n) >= 16:
        n *= 2
    return n


def prefill_select_triton(iq, iw, keys, scales, q_pos, k: int, method: str = "sampled", bt: int = 16,
                          bs: int = 128, warps: int = 8, cap: int | None = None, stats: dict | None = None,
                          bt_sampled: int = 64, bs_sampled: int = 32, warps_sampled: int = 4,
                          splits: int | None = None, stride: int | None = None, hoist: bool = True):
    """`method="sampled"` (default): every `stride`-th key's score for every query kept in HBM ([T, S / stride]
    int32, ~16K columns; `sample_stride`), torch.topk of it gives each query a lower bound on its k-th largest
    score; one pass over all keys (`bt_sampled` queries x `bs_sampled` keys a tile, `warps_sampled` warps, the keys
    of a query block cut into `splits` ranges: `collect_splits`) collects the keys above the bound (at most `cap`,
    `sampled_cap`) and those equal to it (the first k); a per-query kernel takes the k largest. Queries whose
    bound failed take the exact passes, launched always (a program with none of them reads nothing: no host
    sync). `"exact"`: the exact passes for every query, four histogram passes and a write pass over every key
    (`bt` queries x `bs` keys a tile). `stats`, if given, receives `fallback` [T] int32 (1: took the exact passes)
    and, on the sampled path, `above` [T] (keys above the bound) and, if it holds a list under "events", CUDA
    events around the bound, the collect and the pick. `hoist=False` reloads the query heads every tile (the
    path for more than four index heads). Loading the next key tile ahead and Triton's software pipelining were
    measured too and moved nothing (at 248K, 9.6-9.8 against 9.9 ms of collect); they are not kept. The defaults
    are the fastest of eight measured on an H200 at 248K (64 queries x 32 keys, 4 warps, 4 ranges: 14.1 ms against
    14.7-19.7; 142 registers a thread, no spill)."""
    _check_select(iq, iw, keys, scales, q_pos, k)
    if method not in ("sampled", "exact"):
        raise ValueError(f"prefill_select: unknown method {method!r} (sampled, exact)")
    if splits is not None and (splits < 1 or splits & (splits - 1)):
        raise ValueError(f"prefill_select: splits={splits} must be a power of two (1, 2, 4, ...)")
    if bs_sampled not in (16, 32, 64, 128):    # the collect's ranks keep a tile's count in 8 bits
        raise ValueError(f"prefill_select: bs_sampled={bs_sampled} must be 16, 32, 64 or 128")
    T, Hi, Di = iq.shape
    S = keys.shape[0]
    if iq.stride(2) != 1 or iw.stride(1) != 1 or keys.stride(1) != 1 or Di & (Di - 1) or Di < 16:
        raise ValueError(f"prefill_select: the kernel wants unit-stride rows and a power-of-two Di >= 16 (Di={Di})")
    dev = iq.device
    # the projection's strided rows (Hi x Di + Hi apart) copied whole: rows 16-element aligned let the kernels
    # load them in vectors (T x Hi x Di x 2 bytes, 4 MB at T = 8,192: microseconds)
    iq, iw, scales, q_pos = iq.contiguous(), iw.contiguous(), scales.contiguous(), q_pos.contiguous()
    idx = torch.zeros((T, k), dtype=torch.int64, device=dev)                      # untaken slots: position 0,
    valid = torch.zeros((T, k), dtype=torch.bool, device=dev)                     # invalid
    head = (iq, iw, fp8.operand(keys), scales, q_pos)
    strides = (iq.stride(0), iq.stride(1), iw.stride(0), keys.stride(0))
    tiles = dict(HI=Hi, DI=Di, DOT_F32=interpret_mode(), num_warps=warps)
    flag = torch.zeros(T, dtype=torch.int32, device=dev) if method == "sampled" else q_pos
    if method == "sampled":
        collect = dict(BT=bt_sampled, BS=bs_sampled, HOIST=hoist and Hi <= 4, HI=Hi, DI=Di,
                       DOT_F32=interpret_mode(), ASM=arch.native("ptx_store", dev), num_warps=warps_sampled)
        _select_sampled(head, strides, T, S, k, flag, idx, valid, {**tiles, "BS": 128, "num_warps": 8}, 16, stride,
                        cap, stats, collect, splits or collect_splits(T, S, bt_sampled, bs_sampled, dev))
        if stats is not None:
            stats["fallback"] = flag
    tiles = {**tiles, "BT": bt, "BS": bs, "RADIX": RADIX}
    grid = (triton.cdiv(T, bt),)
    hist = torch.empty((N_PASSES, T, RADIX), dtype=torch.int32, device=dev)     # rows written by their pass
    use_flag = method == "sampled"
    for p in range(N_PASSES):
        _select_hist_kernel[grid](*head, hist, flag, T, S, k, *strides, PASS=p, USE_FLAG=use_flag, **tiles)
    _select_write_kernel[grid](*head, hist, flag, idx, valid.view(torch.int8), T, S, k, *strides, USE_FLAG=use_flag,
                               **tiles)
    return idx, valid


def _select_sampled(head, strides, T, S, k, flag, idx, valid, tiles, bt, stride, cap, stats, collect, splits):
    """The sampled path: the bound (`tiles`, `bt`: the sample kernel's), the collect pass (`collect`: its tile and
    switches; `splits` ranges of keys a query block, each into its own segments of the lists), the pick.
    `stats["events"]`, a list if given, receives a CUDA event before and after each."""
    q_pos, dev = head[4], head[0].device
    events = None if stats is None else stats.get("events")
    _mark(events)
    st = stride or sample_stride(S)
    cap = cap or sampled_cap(k, st)
    # every segment holds the whole cap: keys above a bound crowd where attention looks (the recent context), so a
    # smaller share would send queries to the exact passes; the lists take splits x T x cap x 8 bytes (512 MB a
    # split at T = 8,192, k = 2,048), written only where a key is kept
    bound = sampled_bound(head, strides, T, S, k, st, cap, tiles, bt)
    glist = torch.empty((T, splits, cap, 2), dtype=torch.int32, device=dev)  # (key, position) above the bound
    epos = torch.empty((T, splits, k), dtype=torch.int32, device=dev)         # positions equal to it
    gcnt = torch.empty((T, splits), dtype=torch.int32, device=dev)
    ecnt = torch.empty((T, splits), dtype=torch.int32, device=dev)
    _mark(events)
    _collect_sampled_kernel[(triton.cdiv(T, collect["BT"]), splits)](*head, bound, glist, gcnt, epos, ecnt, T, S,
                                                                     cap, k, *strides, **collect)
    _mark(events)
    na = triton.next_power_of_2(cap)
    _pick_kernel[(T,)](q_pos, glist, gcnt, epos, ecnt, flag, idx, valid.view(torch.int8), S, k, CAP=cap, ECAP=k, NA=na, NH=triton.next_power_of_2(k), LOG=k.bit_length() + 1, RADIX=RADIX,
                       SPLITS=splits, num_warps=4 if na <= 4096 else 8)
    _mark(events)
    if stats is not None:
        stats["above"] = gcnt.sum(1)


def _mark(events):
    if events is not None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        events.append(e)


def sampled_bound(head, strides, T, S, k, st, cap, tiles, bt):
    """[T] int32 (key - 2^31): each query's lower bound on its k-th largest key, from every st-th key's score
    (the smallest int32, so every key, for a query that sees at most `cap`)."""
    q_pos = head[4]
    n_s = -(-S // st)
    sample = torch.empty((T, n_s), dtype=torch.int32, device=q_pos.device)
    _sample_kernel[(triton.cdiv(T, bt), triton.cdiv(n_s, tiles["BS"]))](*head, sample, T, S, n_s, *strides, BT=bt,
                                                                        STRIDE=st, **tiles)
    seen = torch.clamp(q_pos + 1, max=S)                                          # keys a query sees
    seen_s = torch.div(torch.clamp(q_pos, max=S - 1), st, rounding_mode="floor") + 1   # sampled ones
    rank = torch.minimum(sample_rank(torch.clamp(seen, max=k), st), seen_s)
    top = torch.topk(sample, min(n_s, sample_rank(k, st)), dim=1).values
    bound = top.gather(1, (rank - 1)[:, None])[:, 0]
    return torch.where(seen <= cap, torch.iinfo(torch.int32).min, bound).to(torch.int32).contiguous()


def prefill_select(iq, iw, keys, scales, q_pos, k: int):
    """Top-k keys per query of a prefill chunk, causal, in position order (see the module docstring)."""
    if kernels_run(keys):
        return prefill_select_triton(iq, iw, keys, scales, q_pos, k)
    return prefill_select_reference(iq, iw, keys, scales, q_pos, k)


def sparse_prefill_attention_triton(q, k, v, idx, valid, bk: int = 32, warps: int | None = None):
    _check_attention(q, k, v, idx, valid)
    T, Hq, D = q.shape
    n_kv = k.shape[1]
    G = Hq // n_kv
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("sparse_prefill_attention: the kernel wants unit-stride head dims")
    out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    kk = idx.shape[1]
    idx, valid = idx.contiguous(), valid.contiguous()
    qk_scale = (D ** -0.5) * 1.4426950408889634                                   # exp2 in the kernel
    # 32 rows a block, 8 warps at D = 256: 178 registers a thread, no spill on sm_90 (64 rows: 255 and a spill)
    _sparse_attn_kernel[(T, n_kv)](q, k, v, idx, valid.view(torch.int8), out, kk, qk_scale, q.stride(0), q.stride(1),
                                   k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
                                   G=G, GP=max(16, triton.next_power_of_2(G)), D=D,
                                   DP=max(16, triton.next_power_of_2(D)), BK=bk, DOT_F32=interpret_mode(),
                                   num_warps=warps or (4 if D <= 128 else 8))
    return out


def sparse_prefill_attention(q, k, v, idx, valid):
    """Each query of a chunk attends to its selected rows only: q [T, Hq, D], k, v [S, n_kv, D] (strided views
    of the pool's rows are fine), idx/valid [T, k] from `prefill_select`. Returns [T, Hq, D]."""
    if kernels_run(q):
        return sparse_prefill_attention_triton(q, k, v, idx, valid)
    _check_attention(q, k, v, idx, valid)
    return sparse_prefill_attention_reference(q, k, v, idx, valid)
