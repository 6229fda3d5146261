"""The hyper-connections' mix at decode in two launches, the injection of the sub-block before folded in.

    stream, y, zero, inj = hc_mix(hc, h, pending)       # pending: a tensor to add, or `Pending(inj, o, e)`

What one mix computes (`layers.HyperConnection.mix`, the definition): the stream h + d [N, hc * H] (d: the last
sub-block's output o injected into each copy by its logit, plus the n-gram rows where the block has them), each
copy RMS-normed, a low-rank product of all of them (`w_down`: rank columns and hc injection logits), silu, a product
back up (`w_up`), and the sub-block's input y [N, H] is the mean over copies of sigmoid(up) * normed copy. Written
op by op that is ~8 kernels a mix (inductor's norm, gate and injection kernels, two bf16 GEMVs): on an H100 ~25 µs
against the ~4.2 µs its 13.4 MB of weights take to read, 2.4 ms of a step's 9 (docs/reference-model.md).

Here (N ≤ `HC_MAX_ROWS` rows, bf16):
- `_hc_down_kernel`, one program a K range of one copy (BK values) x BN of the down product's columns: it forms the
  stream there (each add rounded to bf16 as eager rounds it; column block 0 writes it), its partial sum of squares,
  and the partial product sum_k bf16(s * norm_w) * W in fp32. Each copy's 1/rms multiplies that copy's partials
  afterwards (the norm is a per-copy scale, so it factors out of the sum); the last program of a column block to
  arrive takes every split's squares and partials in one tile, sums them in split order (the same bits at every
  launch), and writes silu of the rank columns and the injection logits, bf16 (column block 0's last: each copy's
  1/rms too).
- `_hc_up_kernel`, one program BN outputs of H in all hc copies at once (the [hc * BN, rank] rows of `w_up`, read
  before the wait on the kernel before): one product, sigmoid, the normed copies rebuilt from the stream and 1/rms,
  their mean; it writes y and the zero the sub-block's residual pair starts with.
- After the sub-block nothing is launched: `Pending(inj, o)` rides to the next mix's first kernel.
Both take programmatic dependent launch where the GPU has it (`HC_PDL`), the weight tile loaded before the wait. Under
the interpreter (whose casts truncate) every rounding to bf16 is `bf16_round`'s integer form, so the CPU tests check
eager's roundings; on the GPU the stream's roundings are converts the compiler may fold (`eager_round`).

The rounding differs from the definition's where the norm's scale factors out (bf16(s * w) * r for
bf16(bf16(s * r) * w)) and where the compiler folds a rounding: within bf16's step, as inductor's fused form differs
too; the tests bound it.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ... import envs
from . import arch
from .arch import HAVE_TRITON, interpret_mode
from .layers import inject

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .norm_rows import bf16_round, eager_round

    @triton.jit
    def _hc_down_kernel(h_ptr, d_ptr, inj_ptr, o_ptr, e_ptr, nw_ptr, w_ptr, stream_ptr, part_ptr, ss_ptr, act_ptr,
                        injo_ptr, r_ptr, cnt_ptr, M, H, R, NP, w_sk, w_sn, eps,
                        HC: tl.constexpr, BM: tl.constexpr, ROWS: tl.constexpr, RB: tl.constexpr, BK: tl.constexpr,
                        BN: tl.constexpr,
                        SP2: tl.constexpr, PEND: tl.constexpr, HAS_E: tl.constexpr, GDC: tl.constexpr,
                        DOT_F32: tl.constexpr):
        """PEND: 0 nothing to add, 1 a tensor d [M, HC * H], 2 the injection inj [M, HC] x o [M, H]; HAS_E: the
        n-gram rows e [M, H] added to every copy on top. Partials `part` [S, M, NP] fp32, squares `ss` [NB, S, M]
        (each column block its own: its last arrival must not wait on another block's)."""
        pk = tl.program_id(0)
        pn = tl.program_id(1)
        pm = tl.program_id(2)
        S = tl.num_programs(0)
        k = pk * BK + tl.arange(0, BK)
        n = pn * BN + tl.arange(0, BN)
        nm = n < R + HC
        w = tl.load(w_ptr + k[:, None].to(tl.int64) * w_sk + n[None, :].to(tl.int64) * w_sn, mask=nm[None, :],
                    other=0.0)                                          # [BK, BN]: read before the wait
        nw = tl.load(nw_ptr + k).to(tl.float32)
        if GDC:
            tl.extra.cuda.gdc_wait()                                     # h, o, inj are the kernels before's
            tl.extra.cuda.gdc_launch_dependents()
        c = (pk * BK) // H                                               # the copy this K range is in
        kc = k - c * H
        m = pm * BM + tl.arange(0, BM)
        mm = m < M
        at = m[:, None].to(tl.int64) * (HC * H) + k[None, :]
        s = tl.load(h_ptr + at, mask=mm[:, None], other=0.0)
        if PEND == 1:
            t = tl.load(d_ptr + at, mask=mm[:, None], other=0.0)
        if PEND == 1:
            t = t.to(tl.float32)
        if PEND == 2:
            g = tl.load(inj_ptr + m * HC + c, mask=mm, other=0.0).to(tl.float32)
            ov = tl.load(o_ptr + m[:, None].to(tl.int64) * H + kc[None, :], mask=mm[:, None], other=0.0)
            t = eager_round(g[:, None] * ov.to(tl.float32), DOT_F32)
        if HAS_E:
            ev = tl.load(e_ptr + m[:, None].to(tl.int64) * H + kc[None, :], mask=mm[:, None], other=0.0)
            if PEND == 0:
                t = ev.to(tl.float32)
            else:
                t = eager_round(t + ev.to(tl.float32), DOT_F32)
        sf = s.to(tl.float32)
        if PEND != 0 or HAS_E:
            sf = eager_round(sf + t, DOT_F32)
        s = sf.to(s.dtype)                                               # exact: sf is a bf16 value
        tl.store(stream_ptr + at, s, mask=(mm & ((m * 0 + pn) == 0))[:, None])
        tl.store(ss_ptr + (pn * S + pk) * M + m, tl.sum(sf * sf, axis=1), mask=mm)
        a = eager_round(sf * nw[None, :], DOT_F32).to(s.dtype)
        if DOT_F32:
            p = tl.dot(a.to(tl.float32), w.to(tl.float32))
        else:
            p = tl.dot(a, w)
        tl.store(part_ptr + (pk * M + m[:, None]).to(tl.int64) * NP + n[None, :], p, mask=mm[:, None])
        tl.debug_barrier()                                               # every thread's partials stored first
        slot = pm * tl.num_programs(1) + pn
        if tl.atomic_add(cnt_ptr + slot, 1, sem="acq_rel", scope="gpu") == S - 1:
            sp = tl.arange(0, SP2)
            spm = sp < S
            cs = tl.arange(0, HC)
            own = ((sp * BK) // H)[None, :] == cs[:, None]               # [HC, SP2]: split sp is in copy c
            for r0 in tl.static_range(0, ROWS, RB):                       # RB rows a pass: one round trip each
                rows = pm * BM + r0 + tl.arange(0, RB)
                rok = rows < M
                sq = tl.load(ss_ptr + (pn * S + sp)[None, :] * M + rows[:, None], mask=rok[:, None] & spm[None, :],
                             other=0.0, cache_modifier=".cg")                                    # [RB, SP2]
                pt = tl.load(part_ptr + (sp[None, :, None] * M + rows[:, None, None]).to(tl.int64) * NP
                             + n[None, None, :], mask=(rok[:, None] & spm[None, :])[:, :, None], other=0.0,
                             cache_modifier=".cg")                                               # [RB, SP2, BN]
                ssc = tl.sum(tl.where(own[None, :, :], sq[:, None, :], 0.0), axis=2)            # [RB, HC]
                rc = 1.0 / tl.sqrt(ssc / H + eps)
                rs = tl.sum(tl.where(own[None, :, :], rc[:, :, None], 0.0), axis=1)             # [RB, SP2]
                tl.store(r_ptr + rows[:, None] * HC + cs[None, :], rc,
                         mask=rok[:, None] & ((cs * 0 + pn) == 0)[None, :])
                lr = bf16_round(tl.sum(pt * rs[:, :, None], axis=1))                                 # [RB, BN]
                ro = rows[:, None] * R + n[None, :]
                tl.store(act_ptr + ro, bf16_round(lr / (1.0 + tl.exp(-lr))).to(s.dtype),
                         mask=rok[:, None] & (n < R)[None, :])
                tl.store(injo_ptr + rows[:, None] * HC + (n - R)[None, :], lr.to(s.dtype),
                         mask=rok[:, None] & ((n >= R) & nm)[None, :])
            tl.atomic_xchg(cnt_ptr + slot, 0)                            # zero for the next launch (graph replays)

    @triton.jit
    def _hc_up_kernel(act_ptr, w_ptr, stream_ptr, r_ptr, nw_ptr, y_ptr, zero_ptr, M, H, R, w_sk, w_sn,
                      HC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, RP: tl.constexpr, GDC: tl.constexpr,
                      DOT_F32: tl.constexpr):
        """One program: outputs [j0, j0 + BN) of y in every copy: columns q of the tile are (copy q // BN, output
        j0 + q % BN) of `w_up` [R, HC * H]; rows [pm * BM, +BM)."""
        pj = tl.program_id(0)
        pm = tl.program_id(1)
        q = tl.arange(0, HC * BN)
        col = (q // BN) * H + pj * BN + q % BN                           # [HC * BN] columns of w_up and the stream
        jm = (pj * BN + q % BN) < H
        kk = tl.arange(0, RP)
        km = kk < R
        w = tl.load(w_ptr + kk[:, None].to(tl.int64) * w_sk + col[None, :].to(tl.int64) * w_sn,
                    mask=km[:, None] & jm[None, :], other=0.0)          # [RP, HC * BN]: read before the wait
        nw = tl.load(nw_ptr + col, mask=jm, other=0.0).to(tl.float32)
        if GDC:
            tl.extra.cuda.gdc_wait()                                     # the down kernel's act, r and stream
            tl.extra.cuda.gdc_launch_dependents()
        m = pm * BM + tl.arange(0, BM)
        mm = m < M
        a = tl.load(act_ptr + m[:, None] * R + kk[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        s = tl.load(stream_ptr + m[:, None].to(tl.int64) * (HC * H) + col[None, :], mask=mm[:, None] & jm[None, :],
                    other=0.0)                                           # issued with a: one round trip
        rr = tl.load(r_ptr + m[:, None] * HC + (q // BN)[None, :], mask=mm[:, None], other=0.0)
        if DOT_F32:
            gate = tl.dot(a.to(tl.float32), w.to(tl.float32))
        else:
            gate = tl.dot(a, w)                                          # [BM, HC * BN] fp32
        gate = bf16_round(gate)
        xn = bf16_round(bf16_round(s.to(tl.float32) * rr) * nw[None, :])          # the definition's normed copy, bf16
        v = xn / (1.0 + tl.exp(-gate))
        y = tl.sum(tl.reshape(v, (BM, HC, BN)), axis=1) / HC             # [BM, BN]: the copies' mean
        j = pj * BN + tl.arange(0, BN)
        om = mm[:, None] & (j < H)[None, :]
        tl.store(y_ptr + m[:, None] * H + j[None, :], bf16_round(y).to(s.dtype), mask=om)
        tl.store(zero_ptr + m[:, None] * H + j[None, :], tl.zeros([BM, BN], dtype=s.dtype), mask=om)


HC_FUSED = envs.owner_value("LABKIT_HC_FUSED")     # the two-launch mix at decode (off: the compiled pieces, an A/B)
HC_MAX_ROWS = 16           # rows (requests) a launch takes; more go the compiled way (prefill never comes here)
HC_BK = 256                # K values of a copy a down program takes (the largest power of two up to it dividing H)
HC_BN_DOWN = 64            # down-product columns a program
HC_BN_UP = 8               # outputs of H a program in the up kernel (all hc copies: 4 x 8 columns of w_up)
HC_WARPS_DOWN = 4          # warps a down program (8: 21.6 against 13.1 µs a mix on an H100, scripts/hc_mix_bench.py)
HC_TAIL_ROWS = 4           # rows the last arrival sums at once (its partials tile: rows x splits x columns)
# programmatic dependent launch (weights read before the wait on the kernel before): 10.7 against 15.9 µs a mix on
# an H100 (scripts/hc_mix_bench.py). The kernels are compiled with the wait wherever the GPU has it, launched with
# the attribute or not (the wait is a no-op without it). A chain compiled without the wait gave bits one bf16 step
# apart from the chain with it on an H100: the same PTX arithmetic, so most likely the compiler contracting a mul
# and an add into an FMA, which depends on the code around it. That read as a race between kernels until the two
# forms were told apart: the GPU test compares the same compiled kernels launched both ways.
HC_PDL = envs.owner_value("LABKIT_HC_PDL")
_BM = 16                   # a tensor-core product's narrow side


class Pending(NamedTuple):
    """What the stream has still to add after a sub-block: its output o [N, H] into each copy scaled by that
    copy's logit inj [N, hc], and the next block's n-gram rows e [N, H] (every copy) where it has them."""
    inj: torch.Tensor
    o: torch.Tensor
    e: torch.Tensor | None = None

    def dense(self) -> torch.Tensor:
        """The addend as a tensor [N, hc * H], rounded as eager's ops round it."""
        d = inject(self.inj, self.o)
        return d if self.e is None else d + self.e.repeat(1, self.inj.shape[1])


def add_rows(d, e: torch.Tensor):
    """The n-gram rows e [N, H] joined to what the stream adds (every copy)."""
    if isinstance(d, Pending):
        return d._replace(e=e) if d.e is None else d._replace(e=d.e + e)
    return d + e.repeat(1, d.shape[1] // e.shape[1])


def settle(x):
    """The residual pair with a pending injection made a tensor (the head and a pipeline stage's hand-off)."""
    return (x[0], x[1].dense()) if isinstance(x[1], Pending) else x


def _down_block(H: int) -> int:
    bk = HC_BK
    while bk > 16 and H % bk:
        bk //= 2
    return bk


def applies(hc, h: torch.Tensor) -> bool:
    """Whether `hc_mix` runs the two kernels: bf16 stream and weights, few rows, on CUDA or the interpreter."""
    H = h.shape[-1] // hc.hc
    return (HC_FUSED and HAVE_TRITON and arch.kernels_run(h) and h.dim() == 2 and 1 <= h.shape[0] <= HC_MAX_ROWS
            and h.dtype == torch.bfloat16 and hc.w_down.dtype == h.dtype and hc.w_up.dtype == h.dtype
            and H % _down_block(H) == 0 and H % 16 == 0 and hc.hc & (hc.hc - 1) == 0)


def hc_mix(hc, h: torch.Tensor, d) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hybrid.hc_in`'s returns (the stream, the sub-block's input as a pair, the injection logits) for the stream
    h [N, hc * H] plus d (a tensor of h's shape, or `Pending`), in two launches. The caller checks `applies`."""
    M, HH = h.shape
    HC, R = hc.hc, hc.rank
    H = HH // HC
    dev = h.device
    BK = _down_block(H)
    S = HH // BK
    NB = triton.cdiv(R + HC, HC_BN_DOWN)
    NP = NB * HC_BN_DOWN
    MB = triton.cdiv(M, _BM)
    pend = 2 if isinstance(d, Pending) else 1
    e = d.e.contiguous() if pend == 2 and d.e is not None else None
    inj_in, o_in, d_in = (d.inj.contiguous(), d.o.contiguous(), h) if pend == 2 else (h, h, d.contiguous())
    h = h.contiguous()
    stream = torch.empty_like(h)
    part = torch.empty((S, M, NP), dtype=torch.float32, device=dev)
    ss = torch.empty((NB, S, M), dtype=torch.float32, device=dev)
    act = torch.empty((M, R), dtype=h.dtype, device=dev)
    inj = torch.empty((M, HC), dtype=h.dtype, device=dev)
    r = torch.empty((M, HC), dtype=torch.float32, device=dev)
    y = torch.empty((M, H), dtype=h.dtype, device=dev)
    zero = torch.empty((M, H), dtype=h.dtype, device=dev)
    gdc = not interpret_mode() and arch.native("pdl", dev)         # compiled with the wait where the GPU has it
    pdl = {"launch_pdl": True} if gdc and HC_PDL else {}
    wd, wu = hc.w_down, hc.w_up
    _hc_down_kernel[(S, NB, MB)](
        h, d_in, inj_in, o_in, e if e is not None else h, hc.norm_w, wd, stream, part, ss, act, inj, r,
        arch.arrival_counters(dev), M, H, R, NP, wd.stride(0), wd.stride(1), hc.eps,
        HC=HC, BM=_BM, ROWS=min(M, _BM), RB=min(triton.next_power_of_2(M), HC_TAIL_ROWS), BK=BK, BN=HC_BN_DOWN,
        SP2=triton.next_power_of_2(S), PEND=pend,
        HAS_E=e is not None, GDC=gdc, DOT_F32=interpret_mode(), num_warps=HC_WARPS_DOWN, **pdl)
    _hc_up_kernel[(triton.cdiv(H, HC_BN_UP), MB)](
        act, wu, stream, r, hc.norm_w, y, zero, M, H, R, wu.stride(0), wu.stride(1),
        HC=HC, BM=_BM, BN=HC_BN_UP, RP=triton.next_power_of_2(R), GDC=gdc, DOT_F32=interpret_mode(), num_warps=4,
        **pdl)
    return stream, y, zero, inj


def fused_in(compiled_in):
    """`hc_in` for compiled decode: the two kernels where they apply, else the compiled pieces (the pending
    injection made a tensor first)."""
    def hc_in(hc, x, d):
        if applies(hc, x):
            return hc_mix(hc, x, d)
        return compiled_in(hc, x, d.dense() if isinstance(d, Pending) else d)
    return hc_in


def pending_out(h, inj, o):
    """`hc_out` at compiled decode: nothing launched, the injection rides to the next mix (or `settle`)."""
    return h, Pending(inj, o)
