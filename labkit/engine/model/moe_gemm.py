"""The routed experts of a prefill chunk as grouped GEMMs: one launch a product over every expert the chunk chose.

    blocks = align(experts, n_experts, bm)            # the (token, expert) pairs sorted by expert, each expert's
                                                      # rows padded to a whole block of `bm`
    act  = moe_gemm(y, w_gu, blocks, glu=True)        # [blocks x bm, I]: silu(gate) * up, rows in block order
    down = moe_gemm(act, w_d, blocks, scatter=True)   # [T * k, H]: each pair's row, in token order
    out  = combine(down, p, shared, gate_logit)       # sum_j p[t, j] down[t * k + j] + sigmoid(gate) * shared

Why: at decode a step's tokens choose a few experts, one or two rows each, and `grouped_gemv` streams each chosen
weight once. A prefill chunk of 8,192 tokens makes 81,920 pairs over all 512 experts (~160 rows an expert): a
row-at-a-time product re-reads an expert's weight for every row, 160 times its bytes. Here a program owns one
block of `bm` rows of one expert and `bn` outputs, and streams that weight tile once for all of them through the
tensor cores (`tl.dot`): the design of the serving engines' fused MoE kernels (pairs sorted by expert, each
expert's rows padded to the block, one launch over all experts).

W4A16 weights are dequantised in the GEMM's loads (one bf16 tile of `bk` K values per program and step, its scale
and zero once a row and group of 128): a layer's 512 experts dequantised once a chunk would be 5 GB of bf16 to
write and read again, more than the GEMM's own time. bf16 weight stacks take the same kernel without the
dequantisation.

Programs are ordered with the output tiles of one block adjacent (the block's gathered input rows stay in L2 for
its siblings) and the blocks of one expert adjacent (its weight tiles stay in L2 for the expert's next block).
The sort and padding are device ops (no host sync); programs past the chunk's block count return at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import envs
from ...shapes import W4_GROUP
from .arch import HAVE_TRITON, interpret_mode, kernels_run
from .grouped_gemv import operands, weight_k, weight_n
from .quant import dequantize

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _w_tile(w_ptr, s_ptr, z_ptr, e, n, nm, k0, w_se, w_sn, s_se, s_sn, BN: tl.constexpr, BK: tl.constexpr,
                QUANT: tl.constexpr):
        """Rows n of weight e, K values [k0, k0 + BK), as the product's right operand, bf16 [BK, BN]; W4A16
        dequantised (BK divides a group of 128: one scale and zero a row): a [BN, BK / 2] byte tile (each row's
        bytes contiguous) whose nibbles are joined, then transposed. Loading each byte for both of its K values
        and shifting, as a [BK, BN] tile, measured ~20x slower on an H100 (the loads run along the strided axis)."""
        if QUANT:
            g = k0 // 128
            sc = tl.load(s_ptr + e * s_se + n.to(tl.int64) * s_sn + g, mask=nm, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + e * s_se + n.to(tl.int64) * s_sn + g, mask=nm, other=0).to(tl.float32)
            kk = k0 // 2 + tl.arange(0, BK // 2)
            b = tl.load(w_ptr + e * w_se + n[:, None].to(tl.int64) * w_sn + kk[None, :], mask=nm[:, None], other=0)
            v = tl.reshape(tl.join((b & 0xF).to(tl.float32), (b >> 4).to(tl.float32)), [BN, BK])   # k = 2i, 2i+1
            return tl.trans(((v - z[:, None]) * sc[:, None]).to(tl.bfloat16))
        else:
            k = k0 + tl.arange(0, BK)
            return tl.load(w_ptr + e * w_se + n[None, :].to(tl.int64) * w_sn + k[:, None], mask=nm[None, :],
                           other=0.0)

    @triton.jit
    def _mac(acc, x, w, DOT_F32: tl.constexpr):
        """acc [BM, BN] += x [BM, BK] . w [BK, BN] (fp32 in the interpreter, whose bf16 dot is not the GPU's)."""
        if DOT_F32:
            return tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(x, w, acc)

    @triton.jit
    def _moe_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, rows_ptr, bexp_ptr, nblk_ptr, N, K, R, TOPK,
                         x_st, out_st, w_se, w_sn, s_se, s_sn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         QUANT: tl.constexpr, GLU: tl.constexpr, GATHER: tl.constexpr, SCATTER: tl.constexpr,
                         DOT_F32: tl.constexpr):
        pid = tl.program_id(0)
        n_tiles = tl.cdiv(N, BN)
        b, t = pid // n_tiles, pid % n_tiles          # a block's output tiles adjacent: its input rows shared in L2
        if b < tl.load(nblk_ptr):
            e = tl.load(bexp_ptr + b).to(tl.int64)
            m = b * BM + tl.arange(0, BM)
            pair = tl.load(rows_ptr + m)              # R marks a padding row
            mm = pair < R
            if GATHER:
                src = (pair // TOPK).to(tl.int64)
            else:
                src = m.to(tl.int64)
            n = t * BN + tl.arange(0, BN)
            nm = n < N
            acc = tl.zeros([BM, BN], dtype=tl.float32)
            acc_u = tl.zeros([BM, BN], dtype=tl.float32)
            for k0 in range(0, K, BK):
                k = k0 + tl.arange(0, BK)
                x = tl.load(x_ptr + src[:, None] * x_st + k[None, :], mask=mm[:, None], other=0.0)
                acc = _mac(acc, x, _w_tile(w_ptr, s_ptr, z_ptr, e, n, nm, k0, w_se, w_sn, s_se, s_sn, BN, BK, QUANT),
                           DOT_F32)
                if GLU:
                    acc_u = _mac(acc_u, x, _w_tile(w_ptr, s_ptr, z_ptr, e, n + N, nm, k0, w_se, w_sn, s_se, s_sn, BN,
                                                   BK, QUANT), DOT_F32)
            if GLU:
                acc = acc / (1.0 + tl.exp(-acc)) * acc_u
            if SCATTER:
                dst = pair.to(tl.int64)
            else:
                dst = m.to(tl.int64)
            tl.store(out_ptr + dst[:, None] * out_st + n[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=mm[:, None] & nm[None, :])

    @triton.jit
    def _combine_kernel(down_ptr, p_ptr, sh_ptr, g_ptr, out_ptr, H, TOPK: tl.constexpr, BH: tl.constexpr,
                        SHARED: tl.constexpr):
        """One token's `BH` outputs: its k pairs' rows (contiguous, k x H) weighted by p, in fp32, plus the gated
        shared expert."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        hm = h < H
        acc = tl.zeros([BH], dtype=tl.float32)
        for j in tl.static_range(TOPK):
            p = tl.load(p_ptr + t * TOPK + j)
            acc += p * tl.load(down_ptr + (t * TOPK + j) * H + h, mask=hm, other=0.0).to(tl.float32)
        if SHARED:
            gate = tl.sigmoid(tl.load(g_ptr + t).to(tl.float32))
            acc += gate * tl.load(sh_ptr + t * H + h, mask=hm, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=hm)


@dataclass
class Blocks:
    """A chunk's pairs in expert order, padded per expert to whole blocks (all on the device, fixed sizes)."""
    rows: torch.Tensor         # [blocks_max x bm] int32: the pair (t x k + j) at each place, R where padding
    expert: torch.Tensor       # [blocks_max] int32: the expert of each block (valid below n_blocks)
    n_blocks: torch.Tensor     # [1] int32
    distinct: torch.Tensor     # [1] int32: the experts chosen at least once (what the chunk reads)
    pairs: int                 # R = T x k
    topk: int
    bm: int


@dataclass(frozen=True)
class Tiles:
    bm: int = 64               # rows a program (a block of one expert's pairs)
    bn: int = 64               # outputs a program (of gate and of up each, for a gate|up product)
    bk: int = 64               # K values a step (divides the W4A16 group of 128)
    warps: int = 4
    stages: int = 3


MOE_GEMM = envs.owner_value("LABKIT_MOE_GEMM")     # off: a chunk's experts take the decode kernel (an A/B)
MIN_TOKENS = 64            # tokens from which a forward's experts take the GEMMs (a decode step's few stay per row)


def applies(y: torch.Tensor) -> bool:
    """Whether the routed experts of y [T, hidden] take the grouped GEMMs."""
    # not inside a CUDA graph's capture: a decode batch of 64 or more requests keeps the decode kernel there (the
    # GEMM path has no host sync, but its capture and replay are not yet tested on a GPU)
    capturing = y.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    return MOE_GEMM and y.shape[0] >= MIN_TOKENS and kernels_run(y) and not capturing


# per product, the tiles measured fastest on an H100 at the reference shape's widths (`scripts/moe_gemm_bench.py`:
# 2.48 and 1.22 ms for an 8,192-token chunk's gate|up and down, 28% of cuBLAS's bf16 rate; both share the blocks)
TILES = {"glu": Tiles(), "down": Tiles(bn=128)}


def align(experts: torch.Tensor, n_experts: int, bm: int) -> Blocks:
    """The pairs of `experts` [T, k] sorted by expert (stable: token order within an expert), each expert's rows
    padded to a multiple of `bm`; device ops only."""
    T, k = experts.shape
    R = T * k
    flat = experts.reshape(-1)
    dev = flat.device
    # scatter_add, not bincount: bincount reads the largest id back to size its output (a host sync)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    by_e = flat[order]
    rank = torch.arange(R, device=dev) - (torch.cumsum(counts, 0) - counts)[by_e]
    cap = R + min(n_experts, R) * (bm - 1)          # every expert chosen pads at most bm - 1 rows
    cap = (cap + bm - 1) // bm * bm
    rows = torch.full((cap,), R, dtype=torch.int32, device=dev)
    rows[(ends - padded)[by_e] + rank] = order.to(torch.int32)
    starts = torch.arange(0, cap, bm, device=dev)
    expert = torch.searchsorted(ends, starts, right=True).clamp_max(n_experts - 1).to(torch.int32)
    return Blocks(rows, expert, (ends[-1:] // bm).to(torch.int32), (counts > 0).sum().view(1).to(torch.int32),
                  R, k, bm)


def moe_gemm(x: torch.Tensor, w, blocks: Blocks, glu: bool = False, scatter: bool = False,
             tiles: Tiles | None = None) -> torch.Tensor:
    """`glu`: x [T, K] (each pair's token's row gathered) through its expert's gate|up weight, silu(gate) * up,
    [blocks_max x bm, N'/2] in block order (padding rows unwritten). Else x [blocks_max x bm, K] in block order
    (the activations) through the expert's weight, each pair's row written to its place t x k + j of [T x k, N]
    (`scatter`) or left in block order. `w`: a stack of K-major weights, bf16 [E, N', K] or a QuantWeight."""
    t, s, z, quant = operands(w)
    N, K = weight_n(w) // (2 if glu else 1), weight_k(w)
    tiles = tiles or TILES["glu" if glu else "down"]
    if K % tiles.bk or (quant and W4_GROUP % tiles.bk):
        raise ValueError(f"moe_gemm: K = {K} is not a multiple of the tile's {tiles.bk}"
                         + (f" or {tiles.bk} does not divide the group of {W4_GROUP}" if quant else ""))
    if blocks.rows.shape[0] % tiles.bm or tiles.bm != blocks.bm:
        raise ValueError(f"moe_gemm: blocks of {blocks.bm} rows, tiles of {tiles.bm}")
    if not kernels_run(x):
        return moe_gemm_reference(x, w, blocks, glu, scatter)
    x = x.contiguous()
    rows_out = blocks.pairs if scatter else blocks.rows.shape[0]
    out = torch.empty((rows_out, N), dtype=x.dtype, device=x.device)
    grid = (blocks.expert.shape[0] * triton.cdiv(N, tiles.bn),)
    _moe_gemm_kernel[grid](x, t, s, z, out, blocks.rows, blocks.expert, blocks.n_blocks, N, K, blocks.pairs,
                           blocks.topk, x.stride(0), out.stride(0), t.stride(0), t.stride(1), s.stride(0), s.stride(1),
                           BM=tiles.bm, BN=tiles.bn, BK=tiles.bk, QUANT=quant, GLU=glu, GATHER=glu, SCATTER=scatter,
                           DOT_F32=interpret_mode(),
                           num_warps=tiles.warps, num_stages=tiles.stages)
    return out


def moe_gemm_reference(x: torch.Tensor, w, blocks: Blocks, glu: bool = False, scatter: bool = False) -> torch.Tensor:
    """`moe_gemm` in torch ops, block by block (fp32 products, one rounding): the definition the kernel is checked
    against, and the path where kernels do not run."""
    t, s, z, quant = operands(w)
    n_out = weight_n(w) // (2 if glu else 1)
    out = torch.zeros((blocks.pairs if scatter else blocks.rows.shape[0], n_out), dtype=x.dtype, device=x.device)
    rows, bm = blocks.rows.long(), blocks.bm
    for b in range(int(blocks.n_blocks)):
        e = int(blocks.expert[b])
        place = torch.arange(b * bm, (b + 1) * bm, device=x.device)
        pair = rows[place]
        keep = pair < blocks.pairs
        place, pair = place[keep], pair[keep]
        xs = x[pair // blocks.topk] if glu else x[place]
        we = dequantize(t[e:e + 1], s[e:e + 1], z[e:e + 1])[0] if quant else t[e].t()   # [K, N']
        y = xs.float() @ we.float()
        if glu:
            y = torch.nn.functional.silu(y[:, :n_out]) * y[:, n_out:]
        out[pair if scatter else place] = y.to(x.dtype)
    return out


def combine(down: torch.Tensor, p: torch.Tensor, shared: torch.Tensor | None = None,
            gate_logit: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's k rows of `down` [T x k, H] weighted by p [T, k] (fp32), plus sigmoid(gate_logit) [T, 1] x
    shared [T, H]: [T, H] in down's dtype, rounded once."""
    T, k = p.shape
    H = down.shape[1]
    if not kernels_run(down):
        out = (down.view(T, k, H).float() * p[..., None].float()).sum(1)
        if shared is not None:
            out = out + torch.sigmoid(gate_logit.float()) * shared.float()
        return out.to(down.dtype)
    out = torch.empty((T, H), dtype=down.dtype, device=down.device)
    BH = 1024              # a program reads k rows of 2 KB each: wide loads, a few programs an output row
    has = shared is not None
    _combine_kernel[(T, triton.cdiv(H, BH))](down, p.float().contiguous(), shared if has else down,
                                             gate_logit.contiguous() if has else p, out, H, TOPK=k, BH=BH,
                                             SHARED=has, num_warps=4)
    return out


def routed_experts(y: torch.Tensor, w_gu, w_d, experts: torch.Tensor, p: torch.Tensor, n_experts: int,
                   shared: torch.Tensor | None = None, gate_logit: torch.Tensor | None = None):
    """A chunk's routed experts: (out [T, H] with the gated shared expert added, the distinct experts read [1])."""
    blocks = align(experts, n_experts, TILES["glu"].bm)
    act = moe_gemm(y, w_gu, blocks, glu=True)
    down = moe_gemm(act, w_d, blocks, scatter=True)
    return combine(down, p, shared, gate_logit), blocks.distinct
