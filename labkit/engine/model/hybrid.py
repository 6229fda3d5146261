"""The hybrid decoder's weights and its block compute, nothing about where KV lives.

    model = HybridModel(shape, device, seed)     # random seeded weights, bf16
    fns   = block_fns(compiled=True)             # the block pieces, fused by torch.compile on CUDA

A block is `x + mixer(norm1(x))`, then `x + ffn(norm2(x))` (each add deferred into the next piece's norm:
the residual stream travels as a pair, see below). The mixer is a gated DeltaNet layer (fixed
state) or a QSA layer, whose attention sits between its projections (`qsa_pre`) and its output
(`qsa_out`): that is where the engine reads KV, so the pieces are separate functions here and the one
composition of a block lives in `engine.Engine.block` (prefill and decode both run it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import envs
from torch import nn

from ...shapes import ModelShape
from .attention import sparse_decode_attention
from .kv import quantize_index_keys
from .gemv import matmul, norm_matmul, norm_silu_glu
from .layers import FFN, DeltaNetLayer, QSALayer, RMSNorm, make_weight


class Block(nn.Module):
    def __init__(self, kind: str, s: ModelShape, gen, dtype, device):
        super().__init__()
        self.kind = kind
        self.norm1, self.norm2 = RMSNorm(s.hidden, dtype, device), RMSNorm(s.hidden, dtype, device)
        self.mixer = QSALayer(s, gen, dtype, device) if kind == "qsa" else DeltaNetLayer(s, gen, dtype, device)
        self.ffn = FFN(s, gen, dtype, device)


class HybridModel(nn.Module):
    def __init__(self, shape: ModelShape, device: torch.device | str = "cpu", seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        device = torch.device(device)
        self.shape, self.device, self.dtype = shape, device, dtype
        gen = torch.Generator(device=device).manual_seed(seed)
        attn = set(shape.attn_layer_ids)
        self.embed = nn.Parameter((torch.randn(shape.vocab, shape.hidden, generator=gen, device=device)).to(dtype),
                                  requires_grad=False)
        self.blocks = nn.ModuleList(Block("qsa" if i in attn else "dn", shape, gen, dtype, device)
                                    for i in range(shape.layers))
        self.norm = RMSNorm(shape.hidden, dtype, device)
        self.lm_head = make_weight(gen, shape.hidden, shape.vocab, dtype, device)
        self.kind_index = kind_index(self.blocks)

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def step_weight_bytes(self) -> int:
        """Weight bytes one decode step reads: all but the embedding table, of which it reads one row
        per request (the roofline's numerator)."""
        emb = self.embed.numel() * self.embed.element_size() if self.embed is not None else 0
        return self.weight_bytes() - emb

    @property
    def n_attn(self) -> int:
        return sum(1 for b in self.blocks if b.kind == "qsa")

    @property
    def n_dn(self) -> int:
        return sum(1 for b in self.blocks if b.kind == "dn")


def kind_index(blocks) -> list[int]:
    """Index of each block among its kind: QSA i -> KV pool layer i, DeltaNet j -> state slot j."""
    return [sum(1 for b in blocks[:i] if b.kind == blk.kind) for i, blk in enumerate(blocks)]


# ---------------------------------------------------------------------------- block pieces
# A decode step of the reference shape is ~3,700 small kernels when run op by op: even replayed from a
# CUDA graph that costs ~9 ms, three times the 3.1 ms its 7 GB of weights take to read. torch.compile
# fuses each piece's elementwise chains into a few Triton kernels; written as functions of the block
# (not methods), one compiled graph serves every layer of a kind (parameters are lifted as inputs).
# The pieces end where the step anatomy draws its phase lines (weights | DeltaNet | attention).
#
# The residual stream travels as a pair (x, d) whose sum is the hidden state: a piece adds the pair
# where its norm reads it (inductor fuses the add into the norm's kernel, which writes the sum too) and
# returns its own last product unadded. Written `x + x @ w` at a piece's end, inductor makes the add an
# addmm whose output must first be a copy of x: a device copy of 1-2 µs before each of the 96 residual
# products of a step (measured on an H200 at 64K: 99 copies, 0.10 ms of kernels; the profile in
# results/20261202-033500-gemv-tiles-h200). The sums are eager's: the product rounded to bf16, then the
# add rounded (the addmm had rounded product and add once), as on CPU.
def dn_pre(blk, x, d, conv):
    """Decode, a DeltaNet block up to its recurrence (projection, conv window, gates); conv in place.
    Returns the residual h = x + d, then the recurrence's inputs."""
    h = x + d
    return (h, *blk.mixer.step_inputs(blk.norm1(h), conv))


def dn_post(blk, o, z):
    """The recurrence's output o [B, H, dv] through the gated norm and output projection (unadded)."""
    return blk.mixer.output(o, z)


def dn_project(blk, x, d):
    """Decode, a DeltaNet block's input projection of norm1(x + d): the residual h = x + d and what
    `deltanet_step.deltanet_mix` takes (add, norm and product one kernel where the GEMV runs)."""
    return norm_matmul(x, d, blk.norm1, blk.mixer.w_in)


def dn_out(blk, g):
    """The mixer's gated, normed output g [B, H * dv] through the output projection (unadded)."""
    return matmul(g, blk.mixer.w_o)


def ffn_residual(blk, x, d):
    """The FFN of h = x + d: returns (h, ffn(norm2(h))), the pair the next block adds (the add, the norm
    and the fused gate/up one kernel where the GEMV runs)."""
    h, g = norm_silu_glu(x, d, blk.norm2, blk.ffn.w_gu)
    return h, matmul(g, blk.ffn.w_d)


def qsa_pre(blk, x, d, pos):
    """Projections of a QSA block of h = x + d: h, then q [N, Hq, D], gate, the K/V row to store, its
    fp8 index key + scale, and the indexer's query and head weights."""
    h = x + d
    q, gate, kv_row, iq, iw, ik = blk.mixer.project(blk.norm1(h), pos)
    k8, sc = quantize_index_keys(ik)
    return h, q, gate, kv_row.contiguous(), k8, sc, iq, iw


def dn_prefill(blk, x, d, S, conv, mark=None):
    """Prefill, a DeltaNet block's mixer over a chunk of h = x + d (chunked recurrence; S and conv in
    place): (h, its output, unadded). Eager: every chunk is a new shape. `mark`: the anatomy's phase lines."""
    h = x + d
    return h, blk.mixer.forward_seq(blk.norm1(h), S, conv, mark=mark)


def qsa_project(blk, x, d):
    """Decode with the fused QSA heads (`qsa_step.qsa_heads` takes y next): h = x + d, y = norm1(h) @ w_in,
    the index key quantised, the indexer's query and head weights."""
    h, y = norm_matmul(x, d, blk.norm1, blk.mixer.w_in)
    iq, iw, ik = blk.mixer.index_parts(y)
    k8, sc = quantize_index_keys(ik)
    return h, y, k8, sc, iq, iw


def sparse_attention(q, rows, valid, n_kv: int):
    return sparse_decode_attention(q, rows, valid, n_kv)


def qsa_out(blk, att, gate):
    """Attention's output through the sigmoid gate and the output projection (unadded)."""
    return blk.mixer.output(att, gate)


@dataclass(frozen=True)
class BlockFns:
    dn_pre: object
    dn_post: object
    dn_project: object
    dn_out: object
    ffn_residual: object
    qsa_pre: object
    qsa_project: object
    sparse_attention: object
    qsa_out: object
    compiled: bool


# LABKIT_COMPILE / the decode parameter compile_blocks: torch.compile the block pieces (off: eager)
COMPILE = envs.owner_value("LABKIT_COMPILE")
_FNS: dict[bool, BlockFns] = {}


def block_fns(compiled: bool) -> BlockFns:
    compiled = compiled and COMPILE
    if compiled not in _FNS:
        pieces = (dn_pre, dn_post, dn_project, dn_out, ffn_residual, qsa_pre, qsa_project, sparse_attention, qsa_out)
        if compiled:
            import torch._dynamo
            torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
            pieces = tuple(torch.compile(fn, dynamic=False) for fn in pieces)
        _FNS[compiled] = BlockFns(*pieces, compiled=compiled)
    return _FNS[compiled]
