"""fp8 e4m3 index keys on every architecture: stored as `torch.float8_e4m3fn` (1 byte a value), read by the
kernels either natively (sm_89+) or as their bytes, decoded in the kernel (`e4m3_to_f32`), where the GPU has
no e4m3 load (Ampere) or `arch=portable` asks for it.

The decode is bit-exact to torch's `float8_e4m3fn -> float32`, the two NaN codes (0x7f, 0xff) and the
subnormals included: the byte's sign, exponent and mantissa are moved into an fp16's fields (e4m3's exponent
bias 7 against fp16's 15), the fp16 widened to fp32 and scaled by 2^8, which is exact for every e4m3 value,
subnormals too (they land on fp16 subnormals with the same digits); the NaN codes, finite in that mapping,
are replaced by the quiet NaN torch gives (0x7ff00000, sign kept).
"""
from __future__ import annotations

import torch

from . import arch
from .arch import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def e4m3_to_f32(b):
        """fp32 values of e4m3 bytes `b` (uint8 or int8, any shape)."""
        x = b.to(tl.uint8, bitcast=True).to(tl.int32)
        h = (((x & 0x80) << 8) | ((x & 0x7F) << 7)).to(tl.int16)
        f = h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        nan = (((x & 0x80) << 24) | 0x7FF00000).to(tl.float32, bitcast=True)
        return tl.where((x & 0x7F) == 0x7F, nan, f)

    @triton.jit
    def load_fp8(ptr, offs, mask):
        """Values at `ptr + offs` as fp32: a native e4m3 load, or the bytes decoded when `ptr` points at
        uint8 (the portable operand, `operand`)."""
        if ptr.dtype.element_ty == tl.uint8:
            return e4m3_to_f32(tl.load(ptr + offs, mask=mask, other=0))
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _decode_kernel(b_ptr, o_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        tl.store(o_ptr + i, e4m3_to_f32(tl.load(b_ptr + i, mask=m, other=0)), mask=m)


def operand(keys: torch.Tensor) -> torch.Tensor:
    """fp8 keys as a kernel on `keys.device` takes them: themselves where e4m3 loads are native, else their
    bytes (a view, no copy)."""
    if keys.dtype == torch.float8_e4m3fn and not arch.native("fp8_load", keys.device):
        return keys.view(torch.uint8)
    return keys


def decode(b: torch.Tensor) -> torch.Tensor:
    """The in-kernel decode of e4m3 bytes `b` (uint8), run as a kernel of its own: what the tests compare
    with torch's conversion."""
    out = torch.empty(b.shape, dtype=torch.float32, device=b.device)
    n = b.numel()
    _decode_kernel[(triton.cdiv(n, 256),)](b.reshape(-1), out.reshape(-1), n, BLOCK=256)
    return out
