"""The residual add and RMSNorm of a prefill chunk's rows in one pass: `h = x + d`, `norm(h)`.

    h, y = add_norm(x, d, blk.norm1)         # [N, H] each: eager's `h = x + d; norm(h)`, rounded as eager rounds

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

    from .hc_mix import bf16_round

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
