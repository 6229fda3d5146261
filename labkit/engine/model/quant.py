"""W4A16 weights: 4-bit values, a bf16 scale and a 4-bit zero per group of 128 along K (AWQ's layout, which
the public RTX 3090 checkpoint of the reference model uses), bf16 activations.

    qw = QuantWeight.random(gen, K, N, experts=E)     # [E, N, K] as N rows of K, packed two values a byte
    w  = qw.dequantize()                              # [E, K, N] bf16: the reference the kernels match

A weight of K inputs and N outputs is held K-major, each output's K values contiguous (as a checkpoint's
nn.Linear), packed two to a byte along K (the low nibble first): `q [E, N, K/2]` uint8, `scales [E, N, K/128]`
bf16, `zeros [E, N, K/128]` uint8 (0-15). A value is (nibble - zero) * scale. One expert (`E = 1`) is a dense
matrix. The kernels (`experts.grouped_gemv`) dequantise a tile of 128 K values at a time in registers: one
scale and one zero per output row and tile.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ...shapes import W4_GROUP


class QuantWeight(nn.Module):
    """A W4A16 weight (or a stack of experts' weights), the kernels' operand. `shape` is (E, K, N) as the
    products read it."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
        super().__init__()
        if q.dim() != 3 or q.dtype != torch.uint8 or scales.shape != zeros.shape or scales.shape[:2] != q.shape[:2]:
            raise ValueError(f"QuantWeight: q {tuple(q.shape)} {q.dtype}, scales {tuple(scales.shape)}, zeros "
                             f"{tuple(zeros.shape)} do not fit [E, N, K/2] uint8 and [E, N, K/{W4_GROUP}]")
        if scales.shape[2] * W4_GROUP != 2 * q.shape[2]:
            raise ValueError(f"QuantWeight: K = {2 * q.shape[2]} is not {scales.shape[2]} groups of {W4_GROUP}")
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("zeros", zeros, persistent=False)

    @property
    def experts(self) -> int:
        return self.q.shape[0]

    @property
    def K(self) -> int:
        return 2 * self.q.shape[2]

    @property
    def N(self) -> int:
        return self.q.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.zeros))

    @classmethod
    def random(cls, gen: torch.Generator, K: int, N: int, experts: int = 1, device="cpu") -> "QuantWeight":
        """Seeded random codes, zeros around 8 and scales of a weight ~ N(0, 1/K) (the bf16 weights' scale)."""
        if K % W4_GROUP:
            raise ValueError(f"W4A16 needs K to be a multiple of {W4_GROUP}, got {K}")
        dev = torch.device(device)
        # drawn as int32 a few experts at a time: the whole bank's int32 draw would be 8x the codes' bytes (3.1 GiB
        # for one layer of 512 experts, over a 24 GiB card's spare room)
        q = torch.empty((experts, N, K // 2), dtype=torch.uint8, device=dev)
        step = max(1, (64 << 20) // max(1, N * (K // 2) * 4))
        for i in range(0, experts, step):
            n = min(step, experts - i)
            q[i:i + n] = torch.randint(0, 256, (n, N, K // 2), generator=gen, device=dev, dtype=torch.int32)
        g = K // W4_GROUP
        zeros = torch.randint(7, 9, (experts, N, g), generator=gen, device=dev, dtype=torch.int32).to(torch.uint8)
        # codes spread over 16 levels: a std of ~4.6 levels; the weights' std is 1 / sqrt(K)
        scales = (torch.rand((experts, N, g), generator=gen, device=dev) * 0.2 + 0.9) / (4.6 * math.sqrt(K))
        return cls(q, scales.to(torch.bfloat16), zeros)

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "QuantWeight":
        """Round-to-nearest asymmetric 4-bit quantisation of w [E, K, N] (or [K, N]): per output and group of
        128 along K, scale = (max - min) / 15, zero = round(-min / scale)."""
        if w.dim() == 2:
            w = w[None]
        E, K, N = w.shape
        if K % W4_GROUP:
            raise ValueError(f"W4A16 needs K to be a multiple of {W4_GROUP}, got {K}")
        g = w.float().transpose(1, 2).reshape(E, N, K // W4_GROUP, W4_GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-8).to(torch.bfloat16)
        zero = torch.round(-lo / scale.float()).clamp(0, 15)
        codes = torch.round(g / scale.float()[..., None] + zero[..., None]).clamp(0, 15).to(torch.uint8)
        codes = codes.reshape(E, N, K)
        q = codes[..., 0::2] | (codes[..., 1::2] << 4)
        return cls(q.contiguous(), scale, zero.to(torch.uint8))

    def dequantize(self) -> torch.Tensor:
        """[E, K, N] bf16: the values the kernels compute with (fp32 dequantisation, one rounding to bf16)."""
        return dequantize(self.q, self.scales, self.zeros)


def unpack(q: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 -> [..., K] int codes 0-15, the low nibble first."""
    lo, hi = (q & 0xF).to(torch.int32), (q >> 4).to(torch.int32)
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    E, N, _ = q.shape
    codes = unpack(q).view(E, N, -1, W4_GROUP).float()
    w = (codes - zeros.float()[..., None]) * scales.float()[..., None]
    return w.view(E, N, -1).to(torch.bfloat16).transpose(1, 2)
