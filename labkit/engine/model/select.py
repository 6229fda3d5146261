"""Top-`k` selection of index scores, in position order, without a sort: a radix threshold select.

`select_topk(scores [B, L] fp32, k) -> (pos [B, k] int64 ascending, valid [B, k] bool)`.

Which positions: the `k` largest scores of each row; among scores equal to the k-th largest (the
threshold), the lowest positions win. That tie rule is ours (torch.topk documents none), so sets are
compared with torch.topk's exactly when the threshold value is unique, and as value multisets always.
Positions whose score is -inf (not yet written: fewer valid tokens than `k`) may fill the tail of the
selection; they come back `valid=False` and pointing at position 0 (real, finite rows: the masked
softmax weight 0 never meets a NaN from uninitialised memory).

How (CUDA, Triton; `select_topk_reference` is the same function in torch ops and the CPU path):
1. each fp32 score becomes an order-preserving 32-bit key (flip the sign bit of non-negative floats,
   all bits of negative ones);
2. four passes over the keys, 8 bits each from the top: a histogram of the next digit among keys
   whose higher digits equal the prefix found so far (block-local `tl.histogram`, then 256 atomic
   adds per block). Each program finds that prefix itself from the histograms of the passes before
   (`_walk`: per pass the digit holding the k-th largest and how many of the threshold's equals are
   still needed; at most three 256-bin loads from L2), so no kernel runs between the passes;
3. a count pass (per block: keys above the threshold, keys equal to it; the row's threshold and
   equals still needed stored once) and a write pass that places each taken position at its rank,
   found from the counts of the blocks before it and a block-local prefix sum. No sort of k elements,
   no full sort of L: one fill and 6 small kernels, each reading L keys once at most. Measured on an
   H200 at batch 1, 64K: 31 µs with a digit-pick kernel after each pass (13 kernels and fills), 27.7
   with the picks folded in (a launch in a graph is ~0.6 µs; the histograms are most of the rest),
   23.7 with blocks sized to one to two programs an SM (`default_block`).
"""
from __future__ import annotations


import torch

from ... import envs

from . import arch
from .arch import HAVE_TRITON, kernels_run

if HAVE_TRITON:
    import triton
    import triton.language as tl

NEG_INF = float("-inf")
DIGIT_BITS, N_PASSES = 8, 4
RADIX = 1 << DIGIT_BITS


def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """fp32 -> int64 keys in [0, 2^32) with the same order (the transform the kernels apply)."""
    u = scores.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    neg = (u >> 31) == 1
    return torch.where(neg, (~u) & 0xFFFFFFFF, u | 0x80000000)


def select_topk_reference(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition in torch ops: k largest, ties at the threshold to the lowest positions."""
    B, L = scores.shape
    if not 0 < k <= L:
        raise ValueError(f"select k={k} of {L} scores")
    key = order_keys(scores)
    thr = torch.topk(key, k, dim=-1).values[:, -1:]                  # the k-th largest key per row
    gt = key > thr
    eq = key == thr
    need = k - gt.sum(-1, keepdim=True)                                # equals still needed
    take = gt | (eq & (torch.cumsum(eq.to(torch.int64), -1) <= need))
    pos = torch.nonzero(take)[:, 1].view(B, k)                         # row-major: ascending per row
    valid = torch.gather(scores, 1, pos) > NEG_INF
    return torch.where(valid, pos, torch.zeros_like(pos)), valid


if HAVE_TRITON:
    @triton.jit
    def _keys(s_ptr, offs, mask):
        u = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        return tl.where((u >> 31) == 1, (~u) & 0xFFFFFFFF, u | 0x80000000)

    @triton.jit
    def _walk(hist_ptr, b, B, K, PASSES: tl.constexpr, RADIX: tl.constexpr):
        """(prefix, need) after PASSES passes of row b: per pass the digit d holding the need-th
        largest (the largest d with count(digit >= d) >= need), and the equals still needed."""
        bins = tl.arange(0, RADIX)
        prefix = tl.zeros((), dtype=tl.int64)
        need = tl.zeros((), dtype=tl.int64) + K
        for p in tl.static_range(PASSES):
            h = tl.load(hist_ptr + (p * B + b) * RADIX + bins)
            ge = tl.sum(h, 0) - tl.cumsum(h, 0) + h                        # count of digits >= d
            d = tl.sum((ge >= need).to(tl.int32), 0) - 1
            need -= tl.sum(tl.where(bins > d, h, 0), 0).to(tl.int64)
            prefix = (prefix << 8) | d.to(tl.int64)
        return prefix, need

    @triton.jit
    def _hist_kernel(s_ptr, hist_ptr, cand_ptr, cnt_ptr, L, B, K, CAP, PASS: tl.constexpr, CAND: tl.constexpr,
                     BLOCK: tl.constexpr, RADIX: tl.constexpr):
        b, j = tl.program_id(1), tl.program_id(0)
        offs = j * BLOCK + tl.arange(0, BLOCK)
        # CAND: the row's candidates (`_compact_kernel`) when they fitted, else all its scores; a program
        # past the row's candidates does nothing (the grid is sized for the scores: a graph's grid is fixed)
        if CAND:
            n = tl.load(cnt_ptr + b)
        else:
            n = L
        over = n > CAP
        lim = tl.where(over, L, n)
        if j * BLOCK < lim:
            if over:
                m = offs < L
                key = _keys(s_ptr + b * L, offs, m)
            else:
                m = offs < n
                key = tl.load(cand_ptr + b * CAP + offs, mask=m, other=0).to(tl.int64) & 0xFFFFFFFF
            if PASS == 0:
                match = m
            else:
                prefix, _ = _walk(hist_ptr, b, B, K, PASS, RADIX)
                match = m & ((key >> (32 - 8 * PASS)) == prefix)
            # Non-matching keys go to bin 0 and are taken out of it again: a RADIX-bin histogram, not
            # 2*RADIX (tl.histogram's cost grows with the bins).
            digit = tl.where(match, (key >> (24 - 8 * PASS)) & (RADIX - 1), 0)
            h = tl.histogram(digit.to(tl.int32), RADIX)
            bins = tl.arange(0, RADIX)
            h = h - tl.where(bins == 0, BLOCK - tl.sum(match.to(tl.int32), 0), 0)
            tl.atomic_add(hist_ptr + (PASS * B + b) * RADIX + bins, h, mask=h > 0)

    @triton.jit
    def _submax_kernel(s_ptr, max_ptr, L, MS, BLOCK: tl.constexpr, SUB: tl.constexpr):
        """The largest score of each run of SUB positions, as a score (the key's inverse transform)."""
        b, j = tl.program_id(1), tl.program_id(0)
        offs = j * BLOCK + tl.arange(0, BLOCK)
        key = tl.where(offs < L, _keys(s_ptr + b * L, offs, offs < L), 0)   # past L: key 0, below every score's
        mx = tl.max(tl.reshape(key, (BLOCK // SUB, SUB)), 1)
        u = tl.where((mx >> 31) == 1, mx ^ 0x80000000, (~mx) & 0xFFFFFFFF)
        out = j * (BLOCK // SUB) + tl.arange(0, BLOCK // SUB)
        tl.store(max_ptr + b * MS + out, u.to(tl.uint32).to(tl.float32, bitcast=True))

    @triton.jit
    def _bound_kernel(hist_ptr, lb_ptr, B, K, RADIX: tl.constexpr):
        """The k-th largest run maximum of row b (four passes over the maxima): a lower bound on the
        row's k-th largest score, as a key."""
        b = tl.program_id(0)
        lb, _ = _walk(hist_ptr, b, B, K, 4, RADIX)
        tl.store(lb_ptr + b, lb)

    @triton.jit
    def _compact_kernel(s_ptr, lb_ptr, cnt_ptr, cand_ptr, L, CAP, BLOCK: tl.constexpr):
        """The keys at or above the row's bound, appended to its candidates (in no order: histograms
        do not need one); past CAP only counted, which sends the row's passes back to its scores."""
        b, j = tl.program_id(1), tl.program_id(0)
        offs = j * BLOCK + tl.arange(0, BLOCK)
        m = offs < L
        key = _keys(s_ptr + b * L, offs, m)
        c = m & (key >= tl.load(lb_ptr + b))
        n = tl.sum(c.to(tl.int32), 0)
        if n > 0:
            at = tl.atomic_add(cnt_ptr + b, n) + tl.cumsum(c.to(tl.int32), 0) - 1
            tl.store(cand_ptr + b * CAP + at, key.to(tl.int32), mask=c & (at < CAP))

    @triton.jit
    def _count_kernel(s_ptr, hist_ptr, thr_ptr, need_ptr, gt_ptr, eq_ptr, L, B, K, NBLK, PASSES: tl.constexpr,
                      BLOCK: tl.constexpr, RADIX: tl.constexpr):
        b, j = tl.program_id(1), tl.program_id(0)
        offs = j * BLOCK + tl.arange(0, BLOCK)
        m = offs < L
        key = _keys(s_ptr + b * L, offs, m)
        thr, need = _walk(hist_ptr, b, B, K, PASSES, RADIX)
        if j == 0:                                   # the write pass reads them, once a row
            tl.store(thr_ptr + b, thr)
            tl.store(need_ptr + b, need)
        tl.store(gt_ptr + b * NBLK + j, tl.sum((m & (key > thr)).to(tl.int32), 0))
        tl.store(eq_ptr + b * NBLK + j, tl.sum((m & (key == thr)).to(tl.int32), 0))

    @triton.jit
    def _write_kernel(s_ptr, thr_ptr, need_ptr, gt_ptr, eq_ptr, pos_ptr, valid_ptr, rows_ptr, table_ptr,
                      table_stride, L, NBLK, K, PAGE: tl.constexpr, ROWS: tl.constexpr,
                      BLOCK: tl.constexpr, NBLK_P2: tl.constexpr):
        b, j = tl.program_id(1), tl.program_id(0)
        blk = tl.arange(0, NBLK_P2)
        before = blk < j
        gt_before = tl.sum(tl.load(gt_ptr + b * NBLK + blk, mask=before, other=0), 0)
        eq_before = tl.sum(tl.load(eq_ptr + b * NBLK + blk, mask=before, other=0), 0)
        need = tl.load(need_ptr + b).to(tl.int32)
        offs = j * BLOCK + tl.arange(0, BLOCK)
        m = offs < L
        key = _keys(s_ptr + b * L, offs, m)
        thr = tl.load(thr_ptr + b)
        eq = (m & (key == thr)).to(tl.int32)
        take = (m & (key > thr)) | ((eq == 1) & (eq_before + tl.cumsum(eq, 0) <= need))
        rank = gt_before + tl.minimum(eq_before, need) + tl.cumsum(take.to(tl.int32), 0) - 1
        sc = tl.load(s_ptr + b * L + offs, mask=m, other=float("-inf"))
        ok = sc > float("-inf")
        pos = tl.where(ok, offs, 0).to(tl.int64)
        tl.store(pos_ptr + b * K + rank, pos, mask=take)
        tl.store(valid_ptr + b * K + rank, ok.to(tl.int8), mask=take)
        if ROWS:   # the pool rows of the request in row b: page table lookup, fused here
            page = tl.load(table_ptr + b * table_stride + pos // PAGE, mask=take, other=0)
            tl.store(rows_ptr + b * K + rank, page * PAGE + pos % PAGE, mask=take)


FIXED_BLOCK = envs.owner_value("LABKIT_SELECT_BLOCK")


def default_block(B: int, L: int, sms: int = 132) -> int:
    """Keys a program: the smallest power of two that keeps a pass at most two programs an SM (so
    between one and two), 512 to 2048 keys.
    `LABKIT_SELECT_BLOCK` fixes it (an A/B against the heuristic)."""
    if FIXED_BLOCK:
        return FIXED_BLOCK
    want = -(-B * L // (2 * sms))
    return max(512, min(2048, 1 << max(0, want - 1).bit_length()))


BOUND_MIN_KEYS = 1 << 22


def bound_run(B: int, L: int, k: int, force: bool = False) -> int:
    """Positions a run whose maxima bound the k-th largest score from below, or 0 where the bound is not
    worth its kernels: at least 2k runs a row (else the bound is loose), runs of 32 to 256 positions, and
    `BOUND_MIN_KEYS` keys in the batch at least unless forced (below it the passes are short anyway)."""
    sub = 256
    while sub > 32 and L // sub < 2 * k:
        sub //= 2
    if L // sub < 2 * k or (B * L < BOUND_MIN_KEYS and not force):
        return 0
    return sub


def candidate_cap(L: int) -> int:
    """Candidates kept a row: a quarter of it (a row with more is read whole)."""
    return -(-L // 4)


def _bounded_candidates(s, k, block, nblk, sub, cap, hist_m, cnt, warps):
    """The keys of each row at or above a lower bound on its k-th largest score, compacted (`cand`
    [B, cap] int32, `cnt` [B] how many; a row over cap keeps its count and is read whole later).
    The bound: the k-th largest of the row's run maxima (runs of `sub` positions). k runs have their
    maximum at or above it, k distinct scores, so the k-th largest score is too; every selected key is a
    candidate, and the digits the passes find over candidates are the digits over the row."""
    B, L = s.shape
    ms = nblk * (block // sub)
    maxima = torch.empty((B, ms), dtype=torch.float32, device=s.device)
    _submax_kernel[(nblk, B)](s, maxima, L, ms, BLOCK=block, SUB=sub, num_warps=warps)
    mblock = min(default_block(B, ms), triton.next_power_of_2(ms))
    hist_m = hist_m.view(N_PASSES, B, RADIX)
    for p in range(N_PASSES):
        _hist_kernel[(triton.cdiv(ms, mblock), B)](maxima, hist_m, maxima, cnt, ms, B, k, 0, PASS=p, CAND=False,
                                                    BLOCK=mblock, RADIX=RADIX, num_warps=4)
    lb = torch.empty(B, dtype=torch.int64, device=s.device)
    _bound_kernel[(B,)](hist_m, lb, B, k, RADIX=RADIX)
    cand = torch.empty((B, cap), dtype=torch.int32, device=s.device)
    _compact_kernel[(nblk, B)](s, lb, cnt, cand, L, cap, BLOCK=block, num_warps=warps)
    return cand


def select_topk_triton(scores: torch.Tensor, k: int, block: int | None = None, out=None, pages=None,
                       bound: bool | None = None):
    B, L = scores.shape
    if not 0 < k <= L:
        raise ValueError(f"select k={k} of {L} scores")
    s = scores.contiguous()
    dev = s.device
    if block is None:
        block = default_block(B, L, arch.multiprocessors(dev))
    block = min(block, triton.next_power_of_2(L))
    nblk = triton.cdiv(L, block)
    sub = 0 if bound is False else bound_run(B, L, k, force=bool(bound))       # None: where it pays
    if sub and block < sub:
        sub = 0
    cap = candidate_cap(L) if sub else 0
    # the one fill: the histograms of the passes, of the run maxima's passes, the candidate counts
    zero = torch.zeros(2 * N_PASSES * B * RADIX + B, dtype=torch.int32, device=dev)
    hist = zero[:N_PASSES * B * RADIX].view(N_PASSES, B, RADIX)
    thr, need = torch.empty(B, dtype=torch.int64, device=dev), torch.empty(B, dtype=torch.int64, device=dev)
    # at most 2048 keys a program: measured on an H200 (scripts/select_bench.py), larger blocks were slower
    # at every batch and context, also at batch 16 x 1M where 8,192 programs share the 16 x 256 bins; at
    # batch 1 a pass of 2048-key programs is 32 programs at 64K, too few for 132 SMs
    warps = 16 if block >= 16384 else (8 if block >= 4096 else 4)
    cnt = zero[2 * N_PASSES * B * RADIX:]
    cand = s                                   # unread unless the candidates are
    if sub:
        cand = _bounded_candidates(s, k, block, nblk, sub, cap, zero[N_PASSES * B * RADIX:2 * N_PASSES * B * RADIX],
                                   cnt, warps)
    for p in range(N_PASSES):
        _hist_kernel[(nblk, B)](s, hist, cand, cnt, L, B, k, cap, PASS=p, CAND=bool(sub), BLOCK=block, RADIX=RADIX,
                                num_warps=warps)
    gt = torch.empty((B, nblk), dtype=torch.int32, device=dev)
    eq = torch.empty((B, nblk), dtype=torch.int32, device=dev)
    _count_kernel[(nblk, B)](s, hist, thr, need, gt, eq, L, B, k, nblk, PASSES=N_PASSES, BLOCK=block, RADIX=RADIX,
                             num_warps=warps)
    pos, valid = out if out is not None else (torch.empty((B, k), dtype=torch.int64, device=dev),
                                              torch.empty((B, k), dtype=torch.bool, device=dev))
    rows, table, page = (None, None, 1) if pages is None else pages
    _write_kernel[(nblk, B)](s, thr, need, gt, eq, pos, valid.view(torch.int8), rows if rows is not None else pos,
                             table if table is not None else pos, table.stride(0) if table is not None else 0,
                             L, nblk, k, PAGE=page, ROWS=rows is not None, BLOCK=block,
                             NBLK_P2=triton.next_power_of_2(nblk), num_warps=warps)
    return pos, valid


def select_topk(scores: torch.Tensor, k: int, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                pages: tuple | None = None):
    """Top-k positions per row in ascending order and which are real (see the module docstring).
    `out=(pos [B, k] int64, valid [B, k] bool)` receives them in place (a decode step's static buffers).
    `pages=(rows [B, k] int64, table [B, pages] int64, page_size)`: also write each selected position's
    pool row (`table[b, pos // page_size] * page_size + pos % page_size`, row b of the batch is request
    slot b), fused into the write pass on CUDA."""
    if kernels_run(scores):
        return select_topk_triton(scores, k, out=out, pages=pages)
    pos, valid = select_topk_reference(scores, k)
    if out is not None:
        out[0].copy_(pos)
        out[1].copy_(valid)
        pos, valid = out
    if pages is not None:
        rows, table, page = pages
        rows.copy_(torch.gather(table[:pos.shape[0]], 1, pos // page) * page + pos % page)
    return pos, valid


def select_topk_torch(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous path, kept as the benchmark's baseline: torch.topk, then a sort of the k positions."""
    vals, pos = torch.topk(scores, k, dim=-1, sorted=False)
    pos, order = torch.sort(pos, dim=-1)
    valid = torch.gather(vals, -1, order) > NEG_INF
    return torch.where(valid, pos, torch.zeros_like(pos)), valid


def select_blocks(scores: torch.Tensor, k: int, block: int, lens: torch.Tensor,
                  out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Block-granular top-k (PulseInfer's selection): positions in whole aligned blocks of `block`, each
    block scored by its best position, the k // block best blocks kept in ascending order. Positions at
    or past a request's length (`lens [B]`) in a kept block, and every position of a padding block (a
    request with fewer than k // block blocks), are not valid. In their place: the same offset within the
    first block (below the length), not position 0 for each as `select_topk` does: a padding block is then
    `block` consecutive rows like any other, one copy (or one unit per head), where position 0 repeated
    was a one-row copy per entry (masked either way: finite, written rows). Device ops only, so a captured
    step may contain it. A block of aligned positions is `block` consecutive pool rows when the page size
    is a multiple of `block`: one copy."""
    B, L = scores.shape
    if block < 1 or k % block:
        raise ValueError(f"select_blocks: k={k} must be a multiple of block={block}")
    nb = -(-L // block)
    if not 0 < k // block <= nb:
        raise ValueError(f"select_blocks: {k // block} blocks of {nb}")
    s = scores if nb * block == L else torch.nn.functional.pad(scores, (0, nb * block - L), value=NEG_INF)
    bpos, bvalid = select_topk(s.view(B, nb, block).amax(-1), k // block)
    pos = (bpos[:, :, None] * block + torch.arange(block, device=scores.device)).reshape(B, k)
    # expand, not repeat_interleave: the latter may size its output on the host (a sync inside a capture)
    valid = bvalid[:, :, None].expand(B, k // block, block).reshape(B, k) & (pos < lens.view(B, 1))
    # an invalid position of a selected block is past the length, and a padding block came back as block 0:
    # either way the offset in the first block, clamped below the length (a row that was written)
    pad = torch.minimum(pos % block, (lens.view(B, 1) - 1).clamp_min(0))
    pos = torch.where(valid, pos, pad)
    if out is not None:
        out[0].copy_(pos)
        out[1].copy_(valid)
        pos, valid = out
    return pos, valid
