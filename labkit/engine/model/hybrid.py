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

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ... import envs
from ...shapes import ModelShape, check_weights_dtype, routing_spec
from .attention import sparse_decode_attention
from .experts import MoE
from . import hc_chunk, hc_mix
from .gemv import matmul, norm_matmul, norm_silu_glu
from .kv import quantize_index_keys
from .layers import FFN, DeltaNetLayer, HyperConnection, QSALayer, RMSNorm, inject, make_weight, normal_rows
from .ngram import NgramTable
from .norm_rows import add_norm
from .quant import QuantWeight


class Block(nn.Module):
    def __init__(self, kind: str, s: ModelShape, gen, dtype, device, weights_dtype: str = "bf16", bank=None,
                 index: int = 0):
        super().__init__()
        self.kind, self.index = kind, index
        self.norm1, self.norm2 = RMSNorm(s.hidden, dtype, device), RMSNorm(s.hidden, dtype, device)
        self.mixer = (QSALayer if kind == "qsa" else DeltaNetLayer)(s, gen, dtype, device, weights_dtype)
        self.ffn = (MoE(s, gen, dtype, device, weights_dtype, bank=bank) if s.moe
                    else FFN(s, gen, dtype, device, weights_dtype))
        self.moe = s.moe
        # hyper-connections before the mixer and before the FFN (None: a plain residual stream)
        self.hc1 = HyperConnection(s, gen, dtype, device) if s.hc_count > 1 else None
        self.hc2 = HyperConnection(s, gen, dtype, device) if s.hc_count > 1 else None
        self.ngram = index in s.ple_layers and s.ngram_heads > 0     # the n-gram embedding joins here


class HybridModel(nn.Module):
    """`weights_dtype`: "bf16" or "w4a16" (`quant.py`). `expert_banks`: how many layers' routed experts are
    held; layer i takes bank i mod expert_banks (default: every layer its own). Where every layer's experts do
    not fit the device (the reference shape's 512 experts are 241 GB in bf16), fewer banks keep each step's
    bytes (a layer still reads its distinct experts from HBM; two layers sharing a bank are 12 or more layers
    apart, far beyond what the L2 cache holds) and hold less; runs record the banks. `ngram_table_bytes`: the
    n-gram embedding's table in host RAM (default the shape's)."""

    def __init__(self, shape: ModelShape, device: torch.device | str = "cpu", seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, weights_dtype: str = "auto", expert_banks: int | None = None,
                 ngram_table_bytes: int | None = None, routing: str = "router", stage: tuple[int, int] | None = None):
        super().__init__()
        device = torch.device(device)
        # `stage` (first, end): only blocks [first, end) are built, the embedding with block 0 and the head with
        # the last (a card of a layer split, as `memory_plan` plans it: built alone, nothing of the others held)
        first, end = stage or (0, shape.layers)
        self.range = (first, end)
        weights_dtype, banks = resolve_holding(shape, device, weights_dtype, expert_banks, end - first)
        self.shape, self.device, self.dtype, self.weights_dtype = shape, device, dtype, weights_dtype
        self.expert_banks, self.routing = banks, routing
        gen = torch.Generator(device=device).manual_seed(seed)
        attn = set(shape.attn_layer_ids)
        self.embed = None
        if first == 0:
            self.embed = nn.Parameter(torch.empty(shape.vocab, shape.hidden, dtype=dtype, device=device),
                                      requires_grad=False)
            for r0, r1, t in normal_rows(gen, shape.vocab, shape.hidden, device):
                self.embed[r0:r1] = t
        blocks = []
        for j, i in enumerate(range(first, end)):
            bank = blocks[j % self.expert_banks].ffn.bank() if shape.moe and j >= self.expert_banks else None
            blocks.append(Block("qsa" if i in attn else "dn", shape, gen, dtype, device, weights_dtype, bank, i))
        self.blocks = nn.ModuleList(blocks)
        last = end == shape.layers
        self.norm = RMSNorm(shape.hidden, dtype, device) if last else None
        self.lm_head = make_weight(gen, shape.hidden, shape.vocab, dtype, device) if last else None
        self.kind_index = kind_index(self.blocks)
        self.ngram = (NgramTable(shape, device, ngram_table_bytes, seed)
                      if shape.ngram_heads and any(b.ngram for b in blocks) else None)
        if shape.moe and routing != "router":
            biases = routing_biases(shape, routing, seed)
            for b in self.blocks:
                b.ffn.route_bias.copy_(biases[b.index])

    def holding(self) -> dict:
        """How the weights are held, for a run's rows and manifest."""
        return {"weights_dtype": self.weights_dtype, "expert_banks": self.expert_banks or None,
                "routing": self.routing if self.shape.moe else None,
                "ngram_table_bytes": self.ngram.nbytes if self.ngram is not None else None}

    def weight_bytes(self) -> int:
        """Bytes the weights hold on the device (parameters and W4A16 buffers, shared banks once)."""
        seen, n = set(), 0
        for t in list(self.parameters()) + [b for m in self.modules() if isinstance(m, QuantWeight)
                                             for b in m.buffers()]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                n += t.numel() * t.element_size()
        return n

    def step_weight_bytes(self, concurrency: int = 1, experts_read: float | None = None) -> int:
        """Weight bytes one decode step reads (the roofline's numerator): every dense weight, the distinct
        routed experts (`experts_read` a layer, else the uniform-routing expectation at `concurrency`), one
        embedding row a request. A pipeline stage counts its own layers."""
        if not self.shape.moe and self.shape.hc_count == 1:
            emb = self.embed.numel() * self.embed.element_size() if self.embed is not None else 0
            return self.weight_bytes() - emb
        parts = self.shape.step_weight_bytes(concurrency, self.weights_dtype, experts_read)
        share = len(self.blocks) / self.shape.layers
        return int((parts["dense"] + parts["experts"] + parts["hc"]) * share
                   + (parts["head"] if self.lm_head is not None else 0))

    @property
    def n_attn(self) -> int:
        return sum(1 for b in self.blocks if b.kind == "qsa")

    @property
    def n_dn(self) -> int:
        return sum(1 for b in self.blocks if b.kind == "dn")


# device memory the holding rule leaves for the KV's device side, the index keys, staging and workspaces
HOLDING_RESERVE = 12 << 30


def resolve_holding(s: ModelShape, device: torch.device, weights_dtype: str, banks: int | None,
                    layers: int | None = None) -> tuple[str, int]:
    """(weights_dtype, expert banks) for `auto` and 0: bf16 where the whole model (or its `layers` of a stage)
    fits the device less `HOLDING_RESERVE`, else W4A16 (with as many expert banks as fit where even that does not
    fit whole: a card of the reference box's size, whose owners run the W4A16 checkpoint); explicit values kept
    (banks at most the layers). Off CUDA every shape is held whole."""
    check_weights_dtype(weights_dtype, auto=True)
    if not s.moe:
        return ("bf16" if weights_dtype == "auto" else weights_dtype), 0
    layers = layers or s.layers
    room = torch.cuda.mem_get_info(device)[0] - HOLDING_RESERVE if device.type == "cuda" else float("inf")

    def held(dtype):
        return s.weight_bytes(dtype) * layers / s.layers
    if weights_dtype == "auto":
        weights_dtype = "bf16" if held("bf16") <= room else "w4a16"
    if banks:
        return weights_dtype, min(banks, layers)
    bank = s.step_weight_bytes(1, weights_dtype, experts_read=s.experts)["experts"] / s.layers
    rest = held(weights_dtype) - bank * layers
    fit = int((room - rest) // bank) if room != float("inf") else layers
    return weights_dtype, max(1, min(layers, fit))


def routing_biases(s: ModelShape, routing: str, seed: int) -> torch.Tensor:
    """[layers, experts] fp32 added to the router's logits when it chooses (not to the weights it gives): log of
    an expert popularity, so the choice follows it. `zipf:S`: popularity 1 / rank^S over a seeded permutation per
    layer; `file:PATH`: a JSON object {"experts": [...]} of frequencies for every layer, or {"layers": [[...],
    ...]} one list a layer (a recorded routing's counts)."""
    kind, v = routing_spec(routing, s)            # checked as a plan checks it (BadInput in one line)
    if kind == "zipf":
        g = torch.Generator().manual_seed(seed + 7)
        rank = torch.arange(1, s.experts + 1, dtype=torch.float32)
        pop = rank ** -v
        return torch.stack([pop[torch.randperm(s.experts, generator=g)] for _ in range(s.layers)]).log()
    if kind == "file":
        t = torch.tensor(v, dtype=torch.float32)
        return (t.clamp_min(0) + 1e-6).log() - math.log(float(t.sum(1).mean()) + 1e-6)
    raise ValueError(f"routing {routing!r} adds no bias: the router chooses")


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


def moe_residual(blk, x, d):
    """The routed experts of h = x + d: (h, moe(norm2(h)), the distinct experts read [1])."""
    h, y = add_norm(x, d, blk.norm2)
    out, n = blk.ffn(y)
    return h, out, n


def hc_in(hc, x, d):
    """Hyper-connections before a sub-block: the stream h = x + d [N, hc * H], the sub-block's input as a pair
    (its mix, nothing added), the injection logits."""
    h = x + d
    y, inj = hc.mix(h)
    return h, y, torch.zeros_like(y), inj


def hc_out(h, inj, o):
    """After a sub-block: the stream and the output injected into each copy (the pair the next piece adds)."""
    return h, inject(inj, o)


def hc_head(x, d, hc: int):
    """The streams [N, hc * H] as one hidden state for the final norm and head: their mean, as a pair."""
    h = (x + d).view(x.shape[0], hc, -1).float().mean(1).to(x.dtype)
    return h, torch.zeros_like(h)


def qsa_pre(blk, x, d, pos):
    """Projections of a QSA block of h = x + d: h, then q [N, Hq, D], gate, the K/V row to store, its
    fp8 index key + scale, and the indexer's query and head weights."""
    h, y = add_norm(x, d, blk.norm1)
    q, gate, kv_row, iq, iw, ik = blk.mixer.project(y, pos)
    k8, sc = quantize_index_keys(ik)
    return h, q, gate, kv_row.contiguous(), k8, sc, iq, iw


def dn_prefill(blk, x, d, S, conv, mark=None):
    """Prefill, a DeltaNet block's mixer over a chunk of h = x + d (chunked recurrence; S and conv in
    place): (h, its output, unadded). Eager: every chunk is a new shape. `mark`: the anatomy's phase lines."""
    h, y = add_norm(x, d, blk.norm1)
    return h, blk.mixer.forward_seq(y, S, conv, mark=mark)


def dn_prefill_segments(blk, x, d, segments: list, mark=None):
    """`dn_prefill` over several requests' chunks in one forward: rows one request after another, `segments`
    [(a, e, S, conv)] each request's rows and its own state and conv window (`DeltaNetLayer.forward_segments`)."""
    h, y = add_norm(x, d, blk.norm1)
    return h, blk.mixer.forward_segments(y, segments, mark=mark)


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
    moe_residual: object
    hc_in: object
    hc_out: object
    compiled: bool


# LABKIT_COMPILE / the decode parameter compile_blocks: torch.compile the block pieces (off: eager)
COMPILE = envs.owner_value("LABKIT_COMPILE")
_FNS: dict[bool, BlockFns] = {}


def block_fns(compiled: bool) -> BlockFns:
    compiled = compiled and COMPILE
    if compiled not in _FNS:
        pieces = (dn_pre, dn_post, dn_project, dn_out, ffn_residual, qsa_pre, qsa_project, sparse_attention, qsa_out,
                  moe_residual, hc_in, hc_out)
        if compiled:
            import torch._dynamo        # slow to import: loaded only when blocks are compiled
            torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
            pieces = tuple(torch.compile(fn, dynamic=False) for fn in pieces)
            # the hyper-connections' mixes: two launches each where the kernels apply (`hc_mix`), the compiled
            # pieces elsewhere
            pieces = (*pieces[:-2], hc_mix.fused_in(pieces[-2]), hc_mix.pending_out)
        else:
            # eager (prefill, and decode without compile): a chunk's mixes in the chunk kernels where they run
            # (`hc_chunk`: the stream read twice a mix, where eager's ops read it a dozen times), the eager pieces
            # elsewhere; the injection pending to the next mix either way
            pieces = (*pieces[:-2], hc_chunk.chunk_in(pieces[-2]), hc_mix.pending_out)
        _FNS[compiled] = BlockFns(*pieces, compiled=compiled)
    return _FNS[compiled]
