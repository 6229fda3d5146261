"""Row-wise kernels of a prefill chunk, each one pass where eager's ops were several, rounded as eager rounds:
the residual add and RMSNorm (`h = x + d`, `norm(h)`) and DeltaNet's output gate (per-head norm x silu(z)); and the
bf16 roundings the engine's kernels share (`bf16_round`, `eager_round`).

    h, y = add_norm(x, d, blk.norm1)         # [N, H] each: eager's `h = x + d; norm(h)`
    g = gated_norm(o, z, mixer.o_norm)       # [N, H x dv]: eager's `o_norm(o) * silu(z)`, or None (eager's then)

Eager, the two are seven kernels over [N, H] and its fp32 copies (the add, a float copy, the square, the mean,
the scale, the bf16 copy, the weight): ~0.5 GB at an 8,192-token chunk of the published shape, and a chunk has 96
of them. Here one program a row reads x and d once and writes h and y (~170 MB). Decode's few rows keep their
compiled pieces (inductor fuses the same chain there), as does anything traced by torch.compile.
"""
from __future__ import annotations

import torch

from .arch import HAVE_TRITON, kernels_run

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def bf16_round(x):
        """fp32 x rounded to the nearest bf16 (ties to even), kept fp32: integer operations, which the compiler cannot
        fold away as it folds a convert to bf16 and back (measured: the stream came out a bf16 step off eager's)."""
        u = x.to(tl.uint32, bitcast=True)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        return u.to(tl.float32, bitcast=True)

    @triton.jit
    def eager_round(x, EXACT: tl.constexpr):
        """x rounded to bf16 (kept fp32) as eager rounds it: `bf16_round` where EXACT (the interpreter, whose casts
        truncate), else a convert and back, which the compiler may fold into the next operation (a bf16 step from
        eager at most, as inductor's fused pieces; `bf16_round` on every element of the [16, BK] tile cost the down
        kernel ~2.5 µs a mix on an H100: scripts/hc_mix_bench.py)."""
        if EXACT:
            return bf16_round(x)
        else:
            return x.to(tl.bfloat16).to(tl.float32)


    @triton.jit
    def _add_norm_kernel(x_ptr, d_ptr, w_ptr, h_ptr, y_ptr, H, eps, BH: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * H
        j = tl.arange(0, BH)
        m = j < H
        x = tl.load(x_ptr + r + j, mask=m, other=0.0).to(tl.float32)
        d = tl.load(d_ptr + r + j, mask=m, other=0.0).to(tl.float32)
        h = bf16_round(x + d)                          # eager's bf16 add (integer rounding: no fold into the norm)
        tl.store(h_ptr + r + j, h.to(h_ptr.dtype.element_ty), mask=m)
        rr = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
        w = tl.load(w_ptr + j, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + r + j, bf16_round(bf16_round(h * rr) * w).to(y_ptr.dtype.element_ty), mask=m)


    @triton.jit
    def _gated_norm_kernel(o_ptr, z_ptr, w_ptr, out_ptr, H, D: tl.constexpr, HP: tl.constexpr, eps):
        """One row: each head's D values RMS-normed (bf16), times the norm's weight (bf16), times silu(z) (bf16)."""
        r = tl.program_id(0).to(tl.int64) * H * D
        hh = tl.arange(0, HP)
        d = tl.arange(0, D)
        m = (hh < H)[:, None]
        at = r + hh[:, None] * D + d[None, :]
        o = bf16_round(tl.load(o_ptr + at, mask=m, other=0.0).to(tl.float32))      # eager's o.to(z.dtype)
        rr = 1.0 / tl.sqrt(tl.sum(o * o, axis=1) / D + eps)
        w = tl.load(w_ptr + d).to(tl.float32)
        y = bf16_round(bf16_round(o * rr[:, None]) * w[None, :])
        z = tl.load(z_ptr + at, mask=m, other=0.0).to(tl.float32)
        g = bf16_round(z / (1.0 + tl.exp(-z)))
        tl.store(out_ptr + at, bf16_round(y * g).to(out_ptr.dtype.element_ty), mask=m)


MIN_ROWS = 17              # fewer rows: a decode step's, whose compiled pieces fuse the same chain


def add_norm(x: torch.Tensor, d: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """(h = x + d, norm(h)) for x, d [N, H] bf16 and `layers.RMSNorm` `norm`."""
    if (not HAVE_TRITON or x.dim() != 2 or x.shape[0] < MIN_ROWS or x.dtype != torch.bfloat16 or d.dtype != x.dtype
            or d.shape != x.shape or torch.compiler.is_compiling() or not kernels_run(x, d)):
        h = x + d
        return h, norm(h)
    x, d = x.contiguous(), d.contiguous()
    N, H = x.shape
    h, y = torch.empty_like(x), torch.empty_like(x)
    _add_norm_kernel[(N,)](x, d, norm.weight, h, y, H, norm.eps, BH=triton.next_power_of_2(H), num_warps=8)
    return h, y


def gated_norm(o: torch.Tensor, z: torch.Tensor, norm) -> torch.Tensor | None:
    """DeltaNet's output gate over a chunk's rows: `norm`(o) per head x silu(z), [N, H x D] bf16, for o [N, H, D]
    (any float dtype: rounded to z's bf16 first, as eager) and z [N, H x D] bf16; one kernel (eager's was ~8 passes
    over [N, H x D] and its fp32 copies, ~0.8 ms a DeltaNet layer at an 8K chunk on an H100). None where it does
    not apply (the caller takes eager's ops)."""
    if (not HAVE_TRITON or o.dim() != 3 or o.shape[0] < MIN_ROWS or z.dtype != torch.bfloat16
            or z.shape != (o.shape[0], o.shape[1] * o.shape[2]) or o.shape[2] & (o.shape[2] - 1)
            or torch.compiler.is_compiling() or not kernels_run(o, z)):
        return None
    N, H, D = o.shape
    out = torch.empty((N, H * D), dtype=z.dtype, device=z.device)
    _gated_norm_kernel[(N,)](o.contiguous(), z.contiguous(), norm.weight, out, H, D=D,
                             HP=triton.next_power_of_2(H), eps=norm.eps, num_warps=8)
    return out
