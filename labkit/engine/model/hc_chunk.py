"""The hyper-connections' mix over a prefill chunk: the stream's bytes read twice, where eager's ops read and wrote
them a dozen times.

    stream, y, zero, inj = hc_chunk.mix(hc, h, d)     # `hybrid.hc_in`'s returns; d a tensor or `hc_mix.Pending`

Eager, a mix of 8,192 rows of the published shape is ~15 passes over the [N, 4 x 2,560] stream and its fp32 copies
(~6 GB, ~2 ms on an H100) and there are 96 a chunk, with the injection after each sub-block materialised as
another [N, 4 x H] fp32 product. Here:

1. `_hc_stream_kernel` (a block of rows, one copy): the stream h + d formed (d dense, or the pending injection
   inj x o plus the n-gram rows, each rounded where eager rounds), written, and its sum of squares taken; then,
   after a barrier, the normed copy xn = bf16(bf16(s / rms) x norm_w) written from the stream just stored (its
   lines still in L1/L2);
2. the down product xn @ w_down and the silu of its rank columns (cuBLAS and one small op: [N, 324]);
3. `_hc_up_kernel` (a block of rows, `BN` outputs of H): the up product for each copy through the tensor cores,
   its sigmoid (of the bf16-rounded gate, as eager's) times that copy's xn, the copies' mean: y.

After the sub-block nothing is launched (`hc_mix.pending_out`): the injection rides to the next mix. Bytes a mix:
the stream read and written once, xn written and read once, y written: ~0.8 GB at the published shape, ~0.27 ms
at 3 TB/s.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .arch import HAVE_TRITON, interpret_mode, kernels_run
from .gemv import matmul
from .hc_mix import Pending

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .norm_rows import bf16_round, eager_round

    @triton.jit
    def _hc_stream_kernel(h_ptr, d_ptr, inj_ptr, o_ptr, e_ptr, nw_ptr, s_ptr, xn_ptr, N, H, eps, HC: tl.constexpr,
                          BM: tl.constexpr, BH: tl.constexpr, PEND: tl.constexpr, HAS_E: tl.constexpr,
                          EXACT: tl.constexpr):
        c = tl.program_id(1)
        m = tl.program_id(0) * BM + tl.arange(0, BM)
        mm = m < N
        row = m.to(tl.int64)[:, None] * (HC * H)
        if PEND:
            g = tl.load(inj_ptr + m.to(tl.int64) * HC + c, mask=mm, other=0.0).to(tl.float32)
        ss = tl.zeros([BM], dtype=tl.float32)
        for j0 in range(0, H, BH):
            j = j0 + tl.arange(0, BH)
            om = mm[:, None] & (j < H)[None, :]
            col = c * H + j[None, :]
            hv = tl.load(h_ptr + row + col, mask=om, other=0.0).to(tl.float32)
            if PEND:
                hj = m.to(tl.int64)[:, None] * H + j[None, :]
                t = eager_round(g[:, None] * tl.load(o_ptr + hj, mask=om, other=0.0).to(tl.float32), EXACT)
                if HAS_E:
                    t = eager_round(t + tl.load(e_ptr + hj, mask=om, other=0.0).to(tl.float32), EXACT)
            else:
                t = tl.load(d_ptr + row + col, mask=om, other=0.0).to(tl.float32)
            s = eager_round(hv + t, EXACT)
            tl.store(s_ptr + row + col, s.to(s_ptr.dtype.element_ty), mask=om)
            ss += tl.sum(s * s, axis=1)
        r = 1.0 / tl.sqrt(ss / H + eps)
        tl.debug_barrier()             # the stream this program stored, read back by other threads of it
        for j0 in range(0, H, BH):
            j = j0 + tl.arange(0, BH)
            om = mm[:, None] & (j < H)[None, :]
            col = c * H + j[None, :]
            s = tl.load(s_ptr + row + col, mask=om, other=0.0).to(tl.float32)
            nw = tl.load(nw_ptr + c * H + j, mask=j < H, other=0.0).to(tl.float32)
            xn = bf16_round(bf16_round(s * r[:, None]) * nw[None, :])
            tl.store(xn_ptr + row + col, xn.to(xn_ptr.dtype.element_ty), mask=om)

    @triton.jit
    def _hc_up_kernel(a_ptr, wu_ptr, xn_ptr, y_ptr, N, H, R, wu_sk, wu_sn, HC: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, BK: tl.constexpr, EXACT: tl.constexpr):
        m = tl.program_id(0) * BM + tl.arange(0, BM)
        j = tl.program_id(1) * BN + tl.arange(0, BN)
        mm, jm = m < N, j < H
        om = mm[:, None] & jm[None, :]
        y = tl.zeros([BM, BN], dtype=tl.float32)
        for c in tl.static_range(HC):
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(0, R, BK):
                k = k0 + tl.arange(0, BK)
                km = k < R
                a = tl.load(a_ptr + m.to(tl.int64)[:, None] * R + k[None, :], mask=mm[:, None] & km[None, :], other=0.0)
                w = tl.load(wu_ptr + k.to(tl.int64)[:, None] * wu_sk + (c * H + j).to(tl.int64)[None, :] * wu_sn,
                            mask=km[:, None] & jm[None, :], other=0.0)
                if EXACT:
                    acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, w, acc)
            gate = bf16_round(acc)                                              # eager's gate is a bf16 product
            xn = tl.load(xn_ptr + m.to(tl.int64)[:, None] * (HC * H) + c * H + j[None, :], mask=om, other=0.0)
            y += xn.to(tl.float32) / (1.0 + tl.exp(-gate))
        tl.store(y_ptr + m.to(tl.int64)[:, None] * H + j[None, :], bf16_round(y / HC).to(y_ptr.dtype.element_ty),
                 mask=om)


MIN_ROWS = 17              # rows from which a mix takes these kernels (fewer: the decode mix, `hc_mix`)
BM_STREAM, BH_STREAM = 8, 512
BM_UP, BN_UP, BK_UP = 64, 64, 64


def applies(hc, h: torch.Tensor) -> bool:
    """Whether `mix` runs: a chunk's rows, bf16 stream and weights, where kernels run."""
    return (HAVE_TRITON and kernels_run(h) and h.dim() == 2 and h.shape[0] >= MIN_ROWS and h.dtype == torch.bfloat16
            and hc.w_down.dtype == h.dtype and hc.w_up.dtype == h.dtype)


def mix(hc, h: torch.Tensor, d) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hybrid.hc_in`'s returns (the stream, the sub-block's input as a pair, the injection logits) for the stream
    h [N, hc x H] plus d (a tensor of h's shape, or `hc_mix.Pending`). The caller checks `applies`."""
    N, HH = h.shape
    HC, R = hc.hc, hc.rank
    H = HH // HC
    pend = isinstance(d, Pending)
    e = d.e.contiguous() if pend and d.e is not None else None
    h = h.contiguous()
    stream, xn = torch.empty_like(h), torch.empty_like(h)
    args = (d.inj.contiguous(), d.o.contiguous()) if pend else (h, h)
    _hc_stream_kernel[(triton.cdiv(N, BM_STREAM), HC)](
        h, h if pend else d.contiguous(), *args, e if e is not None else h, hc.norm_w, stream, xn, N, H, hc.eps,
        HC=HC, BM=BM_STREAM, BH=BH_STREAM, PEND=pend, HAS_E=e is not None, EXACT=interpret_mode(), num_warps=4)
    lr = matmul(xn, hc.w_down)
    act = F.silu(lr[:, :R]).contiguous()
    inj = lr[:, R:R + HC]
    y = torch.empty((N, H), dtype=h.dtype, device=h.device)
    wu = hc.w_up
    _hc_up_kernel[(triton.cdiv(N, BM_UP), triton.cdiv(H, BN_UP))](
        act, wu, xn, y, N, H, R, wu.stride(0), wu.stride(1), HC=HC, BM=BM_UP, BN=BN_UP, BK=BK_UP,
        EXACT=interpret_mode(), num_warps=4)
    return stream, y, torch.zeros_like(y), inj


def chunk_in(eager_in):
    """`hc_in` for prefill: `mix` where it applies, else the eager pieces (the pending injection made a tensor)."""
    def hc_in(hc, x, d):
        if applies(hc, x):
            return mix(hc, x, d)
        return eager_in(hc, x, d.dense() if isinstance(d, Pending) else d)
    return hc_in
