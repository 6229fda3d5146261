"""Small-batch matrix products that stream the weight once: `out[M, N] = x[M, K] @ w[K, N]` for M <= 16.

    y = matmul(x, w)            # the engine's entry: the GEMV below where it applies, else `x @ w`
    y = gemv(x, w, out=None)    # the Triton kernel itself (bf16/fp16, w row-major [K, N] as the layers hold it)
    h = silu_glu(x, w_gu)       # the SwiGLU's silu(x @ gate) * (x @ up) from one pass over w_gu = [gate | up]
    h, y = norm_matmul(x, d, norm, w)     # the residual pair (x, d) summed and RMS-normed inside the kernel:
    h, g = norm_silu_glu(x, d, norm, w_gu)  # (x + d, norm(x + d) @ w), no norm kernel before the product

Why: at decode the activations have one row per request (M = 1..16) and every weight is read once per
step, so a step's weights phase is a pure stream of HBM. cuBLAS runs these shapes at ~60% of the
contiguous read bandwidth on an H200; a kernel that does nothing but stream W and keep all M rows of
the accumulator in registers reaches most of it.

How: each program owns BLOCK_N columns and a range of K, reads [BLOCK_K, BLOCK_N] tiles of W (rows of W
are contiguous along N, so each tile is BLOCK_K coalesced row segments) and accumulates fp32 for all M
rows (a tensor-core `tl.dot` with the rows padded to 16, or for M = 1 plain FMAs into a [BLOCK_K,
BLOCK_N] accumulator reduced once at the end). On K-major weights the tensor-core path runs swapped,
out^T = w^T @ x^T (`Config.swap`): the weight tile is the MMA's wide side and the 16 padded rows its narrow
one (why: Hopper's warpgroup MMA wants an M side of 64, which a weight tile has and 16 padded rows do not;
which MMA Triton 3.6 picked on the H200 was not inspected, only the time, in the tables of docs/roofline.md).
When N alone gives too few programs to fill the GPU (N = 2048: 16 tiles for 132 SMs), K is split over
SPLIT programs per tile: each writes its fp32 partial, bumps the tile's arrival counter, and the last to
arrive sums the partials in split order (deterministic: the same bits whichever program came last), writes
the output and resets the counter to zero. One kernel per product, no memset and no host sync: fixed
shapes, capturable in a CUDA graph. The counters are one int32 per column tile and device, zero between
calls; concurrent products on two streams of one device would share them, so products run on one stream
per device (as the engine's step does).
`silu_glu` is the same kernel with the gate and up tiles of one column range side by side (two
accumulators, the activation applied to the fp32 sums before the one rounding): the FFN's [M, 2F]
product is never written or read back.
The products after an RMSNorm (both input projections, the FFN's gate/up, the head) take the residual
pair instead of the normed activation: every program sums the row's squares (the whole row, 4 KB of
hidden state from L2, all its loads in flight at once), norms each tile of x as it loads it, and one
program writes h = x + d for the next block. That takes the norm's own kernel, ~1.7 µs and a launch gap
each, out of a step 97 times, and lets one GEMV follow another under PDL (a plain kernel between them
waited for the first to end and made the second wait for it).

torch.compile: `matmul` and `silu_glu` call the kernel through the custom ops `labkit::gemv` and
`labkit::gemv_silu_glu` (each with a fake implementation for tracing), so a compiled block (the
engine's `block_fns` on CUDA) keeps them inside its graph as extern kernels, without a graph break, and
inductor still fuses the elementwise work around them; the step's CUDA graph then captures them like
any other kernel (the first call compiles the Triton kernel, which the runner's warm-up does before
capture). On CPU `matmul` is `x @ w`, so CPU results are unchanged; under `TRITON_INTERPRET=1` the
kernel runs on CPU tensors (its tests). `LABKIT_GEMV` (read at import; `set_mode` in a process) picks
where it runs: "auto" (default), "1", "0".

Layouts: w [K, N] row-major, or K-major (a [N, K] weight seen transposed: each output column's weights
contiguous), the layers' default (`layers.K_MAJOR`). Measured on an H200, a step's 193 weight matrices
from one CUDA graph at M = 1 (results/20261202-171000-gemv-kmajor-h200): cuBLAS 2.34 ms (69% of the read
bandwidth); this kernel on row-major weights 3.34 ms at its best configuration per shape
(results/20261202-033500-gemv-tiles-h200), on K-major weights 2.07 ms (78%) with PDL. At M = 4 and 16 it
ties or loses to cuBLAS on either layout, so "auto" takes it for one row against K-major weights only:
the resident step at 64K, c = 1, went 3.85 -> 3.69 ms. Swapped, with the sweep's best tiles per matrix, it
ties cuBLAS at M = 4 back to back (2.23 ms, results/20261203-085200-gemv-swap-h200) and still makes the
step at c = 4 slower (4.46 -> 4.88 ms at the default tiles, 4.51 -> 5.63 at the best ones;
results/20261203-090500-gemv-rows-tiles-h200): `LABKIT_GEMV_ROWS` (default 1) widens "auto" for an A/B.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import envs
from . import arch
from .arch import HAVE_TRITON, interpret_mode
from .grouped_gemv import qmatmul
from .quant import QuantWeight

if HAVE_TRITON:
    import triton
    import triton.language as tl

MAX_M = 16                      # rows the kernel takes; above it cuBLAS's tiled GEMMs win
_DTYPES = (torch.bfloat16, torch.float16)
_INTERPRET = interpret_mode()
# LABKIT_GEMV: "auto" (default) the kernel for one row against K-major weights, the case where it beats
# cuBLAS on an H200; "1" every layout and 1-16 rows; "0" never (read at import; `set_mode` in a process)
_MODE = envs.owner_value("LABKIT_GEMV")
# programmatic dependent launch (sm90+): the row-major defaults without it (LABKIT_GEMV_PDL=1 adds it; with
# it a step's 193 products took 7.27 ms against 2.59 for cuBLAS), the K-major one-row defaults with it
# (LABKIT_GEMV_PDL=0 takes it off; with it 2.07 ms against 2.31 without, the best configurations)
_PDL_MODE = envs.owner_value("LABKIT_GEMV_PDL")     # auto, on, off


def _pdl(k_major: bool) -> bool:
    return _PDL_MODE == "on" or (_PDL_MODE == "auto" and k_major)


# the fused gate/up (silu(x @ gate) * (x @ up) in one kernel); LABKIT_GEMV_GLU=0 runs the plain product
# and the torch ops after it, for an A/B
_GLU = envs.owner_value("LABKIT_GEMV_GLU")
# the residual add and RMSNorm before a product inside the kernel (`norm_matmul`); LABKIT_GEMV_NORM=0 runs
# them as torch ops before it, for an A/B. Measured on an H200 at 64K (results/20261203-060400-norm-gemv-h200,
# each variant its own process): the resident step at c = 1 3.687 -> 3.244 ms (615 -> 510 kernels). At
# c = 4 the fused products through the GEMV's tensor-core path instead of cuBLAS + the norm kernel made the
# step slower, 4.507 -> 4.897 ms, so LABKIT_GEMV_NORM_ROWS (the rows up to which "auto" fuses, K-major
# weights) is 1 by default: at 2-16 rows the norm stays a torch op before cuBLAS, as before
_NORM = envs.owner_value("LABKIT_GEMV_NORM")
_NORM_ROWS = envs.owner_value("LABKIT_GEMV_NORM_ROWS")
# LABKIT_GEMV_ROWS: the rows up to which "auto" takes the kernel against K-major weights (1: one row only)
_ROWS = envs.owner_value("LABKIT_GEMV_ROWS")
# LABKIT_GEMV_SWAP: the tensor-core path (2-16 rows, K-major) as out^T = w^T @ x^T ("1", default) or x @ w
_SWAP = envs.owner_value("LABKIT_GEMV_SWAP")
COUNTER_SLOTS = arch.COUNTER_SLOTS  # column tiles a split product may have (split only for few tiles)


def set_mode(mode: str) -> None:
    """"auto", "1" or "0" for `matmul` (the env `LABKIT_GEMV` sets it at import). torch.compile guards
    on it: a compiled function recompiles when it changes."""
    global _MODE
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"gemv mode {mode!r}: auto, 1 or 0")
    _MODE = mode


def set_enabled(on: bool) -> None:
    """The kernel for every layout and 1-16 rows (mode "1"), or never (mode "0")."""
    set_mode("1" if on else "0")


def mode() -> str:
    return _MODE


def enabled() -> bool:
    return _MODE != "0"


def gemv_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The definition the kernel is checked against: fp32 products and sums, one rounding at the end (the tests
    measure the kernel's error from it before that rounding: called on fp32 copies of the inputs)."""
    return (x.float() @ w.float()).to(x.dtype)


if HAVE_TRITON:
    @triton.jit
    def _accumulate(acc, xt, w, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, ACC2D: tl.constexpr,
                    SWAP: tl.constexpr):
        if USE_DOT and SWAP:   # out^T [BLOCK_N, M_PAD] += w^T @ x^T: the weight tile is the MMA's wide side
            if DOT_F32:
                acc = tl.dot(tl.trans(w).to(tl.float32), tl.trans(xt).to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(tl.trans(w), tl.trans(xt), acc)
        elif USE_DOT:
            if DOT_F32:   # the interpreter's dot gets bf16 wrong; exact fp32 operands, same products
                acc = tl.dot(xt.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, w, acc)
        elif ACC2D:   # one row, xt [BLOCK_K, 1]: products kept per K row, summed once after the loop
            acc += xt.to(tl.float32) * w.to(tl.float32)
        else:   # one row, xt [BLOCK_K, 1]: the tile's products summed over its K rows into acc [1, BLOCK_N]
            acc += tl.sum(xt.to(tl.float32) * w.to(tl.float32), axis=0)[None, :]
        return acc

    @triton.jit
    def _row_rms(x_ptr, d_ptr, h_ptr, eps, M, K, stride_xm, stride_xk, stride_dm, stride_dk, H_ROWS,
                 M_PAD: tl.constexpr, USE_DOT: tl.constexpr, NORM: tl.constexpr, NORM_K: tl.constexpr,
                 NORM_BLOCK: tl.constexpr):
        """With NORM, 1 / rms of each row of h = x + d (h rounded as the add rounds, squares summed in
        fp32, mean over K, as `layers.RMSNorm`), shaped to broadcast over an activation tile ([M_PAD, 1]
        for the dot path's [M_PAD, BLOCK_K] tiles, [1, M_PAD] for the FMA path's [BLOCK_K, M_PAD]); the
        first H_ROWS rows of h are stored ([M, K] contiguous: M rows by one program, none by the rest).
        Without NORM, 1.0 (unused)."""
        if NORM:
            m = tl.arange(0, M_PAD)
            mm = m < M
            ss = tl.zeros((M_PAD,), dtype=tl.float32)
            for c in tl.static_range(0, NORM_K, NORM_BLOCK):   # unrolled: every chunk's loads in flight
                k = c + tl.arange(0, NORM_BLOCK)
                mask = mm[:, None] & (k < K)[None, :]
                xt = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :] * stride_xk, mask=mask, other=0.0)
                dt = tl.load(d_ptr + m[:, None] * stride_dm + k[None, :] * stride_dk, mask=mask, other=0.0)
                h = (xt.to(tl.float32) + dt.to(tl.float32)).to(xt.dtype)
                tl.store(h_ptr + m[:, None] * K + k[None, :], h, mask=(m < H_ROWS)[:, None] & (k < K)[None, :])
                hf = h.to(tl.float32)
                ss += tl.sum(hf * hf, axis=1)
            r = 1.0 / tl.sqrt(ss / K + eps)
            if USE_DOT:
                r = r[:, None]
            else:
                r = r[None, :]
        else:
            r = 1.0
        return r                  # one return: the compiler checks every return's type alike

    @triton.jit
    def _normed(x_p, d_p, nw_p, r, mask, NORM: tl.constexpr):
        """An activation tile: x as it is, or with NORM the RMSNorm of h = x + d at its rows' 1/rms r,
        rounded where `layers.RMSNorm` rounds (h, then h * r, then the weight's product)."""
        xt = tl.load(x_p, mask=mask, other=0.0)
        if NORM:
            h = (xt.to(tl.float32) + tl.load(d_p, mask=mask, other=0.0).to(tl.float32)).to(xt.dtype)
            xn = (h.to(tl.float32) * r).to(xt.dtype)
            xt = (xn.to(tl.float32) * tl.load(nw_p, mask=mask, other=0.0).to(tl.float32)).to(xt.dtype)
        return xt

    @triton.jit(do_not_specialize=["M"])     # M = 4 and M = 16 share one compiled kernel
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, part_ptr, cnt_ptr, d_ptr, nw_ptr, h_ptr, eps, M, N, K,
                     stride_xm, stride_xk, stride_dm, stride_dk, stride_om,
                     stride_wk, stride_wn, K_PER_SPLIT, SPLIT, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, GLU: tl.constexpr,
                     PEEL: tl.constexpr, USE_GDC: tl.constexpr, ACC2D: tl.constexpr, NORM: tl.constexpr,
                     NORM_K: tl.constexpr, NORM_BLOCK: tl.constexpr, SWAP: tl.constexpr):
        """out = x @ w, or with GLU (w = [gate | up], 2N columns) out = silu(x @ gate) * (x @ up).
        PEEL: the first K block is taken out of the loop so that its weight tile can be loaded before x;
        with USE_GDC (launched with programmatic dependent launch) the wait on the kernel before, whose
        output x is, goes between the two: the weights never depend on it. (The interpreter has no
        grid dependency control: there PEEL runs alone, which is how its tests cover the peeled path.)
        w is [K, N] with strides (stride_wk, stride_wn): row-major (stride_wn 1, the layers' layout) or
        K-major (stride_wk 1: a [N, K] weight seen transposed, each output column's weights contiguous);
        Triton specializes a stride of 1, so either way the tile's loads are contiguous along its unit
        stride. ACC2D (the one-row path): the products accumulate in a [BLOCK_K, BLOCK_N] tile and are
        summed over K once at the end, not per tile (a K-major tile's K runs across threads).
        NORM: x is the residual pair (x, d) and the product's input is RMSNorm(h = x + d) with weight nw:
        every program sums h^2 over the whole row (NORM_K, K rounded up to a power of two, in unrolled
        chunks of NORM_BLOCK: the loads all in flight at once, from L2), program (0, 0) writes h (the
        residual the next block adds to), and each tile is normed as it is loaded (`_normed`)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < N
        m = tl.arange(0, M_PAD)
        mm = m < M
        kk = tl.arange(0, BLOCK_K)
        k0 = pid_k * K_PER_SPLIT
        k_end = tl.minimum(k0 + K_PER_SPLIT, K)
        w_p = w_ptr + (k0 + kk)[:, None].to(tl.int64) * stride_wk + n[None, :].to(tl.int64) * stride_wn
        UP = N * stride_wn                       # the up half of [gate | up], N columns on
        if USE_DOT:   # x tile [M_PAD, BLOCK_K]; for one row [BLOCK_K, 1], already along W's rows
            x_p = x_ptr + m[:, None] * stride_xm + (k0 + kk)[None, :] * stride_xk
            d_p = d_ptr + m[:, None] * stride_dm + (k0 + kk)[None, :] * stride_dk
            nw_p = nw_ptr + (k0 + kk)[None, :]
        else:
            x_p = x_ptr + (k0 + kk)[:, None] * stride_xk + m[None, :] * stride_xm
            d_p = d_ptr + (k0 + kk)[:, None] * stride_dk + m[None, :] * stride_dm
            nw_p = nw_ptr + (k0 + kk)[:, None]
        if ACC2D:
            acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        elif SWAP:
            acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
        else:
            acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)     # M_PAD is 1 on the FMA path
        acc_u = tl.zeros_like(acc)
        if PEEL:
            # the first tile streams while the kernel before finishes; then wait for x, and let the
            # next kernel's programs launch (they in turn only prefetch weights before their wait)
            km = (k0 + kk) < k_end
            wm = km[:, None] & nm[None, :]
            w0 = tl.load(w_p, mask=wm, other=0.0)
            if GLU:
                w0u = tl.load(w_p + UP, mask=wm, other=0.0)
            if USE_GDC:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
        r = _row_rms(x_ptr, d_ptr, h_ptr, eps, M, K, stride_xm, stride_xk, stride_dm, stride_dk,
                     tl.where((pid_n == 0) & (pid_k == 0), M, 0), M_PAD, USE_DOT, NORM, NORM_K, NORM_BLOCK)
        if PEEL:
            if USE_DOT:
                xt = _normed(x_p, d_p, nw_p, r, mm[:, None] & km[None, :], NORM)
            else:
                xt = _normed(x_p, d_p, nw_p, r, km[:, None] & mm[None, :], NORM)
            acc = _accumulate(acc, xt, w0, USE_DOT, DOT_F32, ACC2D, SWAP)
            if GLU:
                acc_u = _accumulate(acc_u, xt, w0u, USE_DOT, DOT_F32, ACC2D, SWAP)
            w_p += BLOCK_K * stride_wk
            x_p += BLOCK_K * stride_xk
            d_p += BLOCK_K * stride_dk
            nw_p += BLOCK_K
            k_first = k0 + BLOCK_K
        else:
            k_first = k0
        for kb in range(k_first, k_end, BLOCK_K):
            km = (kb + kk) < k_end
            wm = km[:, None] & nm[None, :]
            if USE_DOT:                                              # from L2: x is small
                xt = _normed(x_p, d_p, nw_p, r, mm[:, None] & km[None, :], NORM)
            else:
                xt = _normed(x_p, d_p, nw_p, r, km[:, None] & mm[None, :], NORM)
            acc = _accumulate(acc, xt, tl.load(w_p, mask=wm, other=0.0), USE_DOT, DOT_F32, ACC2D, SWAP)
            if GLU:
                acc_u = _accumulate(acc_u, xt, tl.load(w_p + UP, mask=wm, other=0.0), USE_DOT, DOT_F32, ACC2D, SWAP)
            w_p += BLOCK_K * stride_wk
            x_p += BLOCK_K * stride_xk
            d_p += BLOCK_K * stride_dk
            nw_p += BLOCK_K
        if ACC2D:                                # the one sum over K
            acc = tl.sum(acc, axis=0)[None, :]
            acc_u = tl.sum(acc_u, axis=0)[None, :]
        if SWAP:                                 # back to [M_PAD, BLOCK_N]
            acc = tl.trans(acc)
            acc_u = tl.trans(acc_u)
        omask = mm[:, None] & nm[None, :]
        o_p = out_ptr + m[:, None] * stride_om + n[None, :]
        if SPLIT == 1:
            if GLU:
                acc = acc * tl.sigmoid(acc) * acc_u
            tl.store(o_p, acc.to(out_ptr.dtype.element_ty), mask=omask)
        else:
            # partial [SPLIT, M, PW] fp32; the arrival counter orders it before the last program's reads
            PW = 2 * N if GLU else N                 # a partial row: the gate and up sums side by side
            p_p = part_ptr + (pid_k * M + m[:, None]) * PW + n[None, :]
            tl.store(p_p, acc, mask=omask)
            if GLU:
                tl.store(p_p + N, acc_u, mask=omask)
            tl.debug_barrier()                       # every thread's partial stored before the release
            arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:
                tot = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
                tot_u = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
                for s in range(SPLIT):               # split order, whoever arrived last: deterministic
                    q_p = part_ptr + (s * M + m[:, None]) * PW + n[None, :]
                    tot += tl.load(q_p, mask=omask, other=0.0, cache_modifier=".cg")
                    if GLU:
                        tot_u += tl.load(q_p + N, mask=omask, other=0.0, cache_modifier=".cg")
                if GLU:
                    tot = tot * tl.sigmoid(tot) * tot_u
                tl.store(o_p, tot.to(out_ptr.dtype.element_ty), mask=omask)
                tl.atomic_xchg(cnt_ptr + pid_n, 0)  # zero again for the next product (graph replays too)


@dataclass(frozen=True)
class Config:
    block_n: int
    block_k: int
    split: int
    use_dot: bool
    num_warps: int
    num_stages: int
    pdl: bool = False        # programmatic dependent launch (sm90+): weights prefetched before the wait
    acc2d: bool = False      # one row: sum the products over K once after the loop, not per tile
    swap: bool = False       # the tensor-core path as out^T = w^T @ x^T (the weight tile the MMA's M side)


def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: CUDA, compute capability 9 or above, not under `arch=portable`; never under
    the interpreter."""
    return not _INTERPRET and arch.native("pdl", device)


_counters = arch.arrival_counters


def default_config(M: int, N: int, K: int, sms: int = 132, k_major: bool = False, normed: bool = False,
                   smem: int = 227 * 1024) -> Config:
    """One row: tiles of [128, 128] (32 KB of weight in one load, summed into a [128] accumulator), K
    split until the programs cover the SMs four times. More rows: the tensor-core path on [64, 128]
    tiles through a four-stage pipeline, K split until the programs cover the SMs twice (each program
    keeps two K blocks at least). On row-major weights neither is faster than cuBLAS on an H200, nor is
    the best configuration per shape (scripts/gemv_bench.py, most often [64, 256] tiles in two stages):
    simple defaults, not tuned ones. K-major, one row: the tuned default below (the one the engine runs)."""
    if k_major and M == 1:
        # K-major, one row: the sweep's best on an H200 (scripts/gemv_bench.py --layout nk): [256, 32]
        # tiles (32 columns of 512 contiguous bytes) where the columns alone give two programs an SM,
        # else [512, 16] with K split for two programs an SM; products summed once after the loop; PDL
        bn = 32 if -(-N // 32) >= 2 * sms else 16
        bk = 256 if bn == 32 else 512
        return Config(bn, bk, split_for(N, K, bn, bk, 2, sms), False, num_warps=4, num_stages=2,
                      pdl=_pdl(True), acc2d=True)
    if k_major and normed:
        # a norm-fused product (the input projections, the FFN's gate/up, the head; N >= 5,632) at 2-16
        # rows: the sweep's best for these matrices at M = 4 on an H200, [128, 64] tiles through the
        # tensor cores in three stages, no split (no partials to sum), PDL; [128, 32] where 64 columns
        # would leave SMs idle (the fused gate/up: 88 tiles of its 5,632 outputs)
        return Config(64 if -(-N // 64) >= sms else 32, 128, 1, True, num_warps=4, num_stages=3, pdl=_pdl(True),
                      swap=_SWAP)
    if k_major:
        # 2-16 rows: [64, 128] tiles, K split for two programs an SM. Swapped (LABKIT_GEMV_SWAP, default on)
        # a step's matrices back to back at M = 4 took 2.63 ms against 2.97 unswapped and cuBLAS's 2.22; the
        # sweep's best tiles per matrix ([32, 256] unsplit for the wide ones) tied cuBLAS there (2.23 ms) but
        # made the step at c = 4 slower than these (5.63 against 4.88 ms; cuBLAS 4.46-4.51;
        # results/20261203-085200-gemv-swap-h200, results/20261203-090500-gemv-rows-tiles-h200): the step
        # is the figure, so these stay, and "auto" keeps cuBLAS at 2-16 rows
        return Config(64, 128, split_for(N, K, 64, 128, 2, sms, 2), True, num_warps=4, num_stages=3, pdl=_pdl(True),
                      swap=_SWAP)
    if M == 1:
        bn, bk, per_sm, min_blocks, warps, stages = 128, 128, 4, 1, 4, 1
    else:
        # four stages of [128, 64] gate and up tiles take 104 KB of shared memory; a block gets 99 KB on
        # sm_86 and sm_89 (`smem`): three there
        bn, bk, per_sm, min_blocks, warps, stages = 128, 64, 2, 2, 4, 4 if smem >= 128 * 1024 else 3
    return Config(bn, bk, split_for(N, K, bn, bk, per_sm, sms, min_blocks), M > 1, num_warps=warps,
                  num_stages=stages, pdl=_pdl(False))


def split_for(N: int, K: int, block_n: int, block_k: int, per_sm: int, sms: int, min_blocks: int = 1) -> int:
    """K split so that the programs cover the SMs per_sm times (each split keeping min_blocks K blocks),
    rounded so that no split is empty."""
    tiles = -(-N // block_n)
    kblocks = -(-K // block_k)
    split = max(1, min(-(-per_sm * sms // tiles), max(1, kblocks // min_blocks)))
    return -(-kblocks // -(-kblocks // split))


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, config: Config | None = None,
         glu: bool = False, norm: tuple | None = None):
    """x [M, K] (1 <= M <= 16), w [K, N] row-major, same dtype (bf16 or fp16) -> out [M, N] of x's dtype.
    glu: w is [gate | up] ([K, 2F]) and out [M, F] = silu(x @ gate) * (x @ up), rounded once.
    norm = (d, nw, eps): the product's input is RMSNorm(h = x + d) with weight nw [K] (the residual pair
    of `hybrid.py`, normed inside the kernel: no norm kernel before it); returns (h, out)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"gemv: x {tuple(x.shape)} and w {tuple(w.shape)} are not [M, K] and [K, N]")
    M, K = x.shape
    if norm is not None:
        d, nw, eps = norm
        if d.shape != x.shape or d.dtype != x.dtype or nw.shape != (K,) or nw.dtype != x.dtype or not nw.is_contiguous():
            raise ValueError(f"gemv: the norm takes d like x {tuple(x.shape)} and a contiguous weight [{K}], "
                             f"got d {tuple(d.shape)} {d.dtype} and weight {tuple(nw.shape)} {nw.dtype}")
    if glu and w.shape[1] % 2:
        raise ValueError(f"gemv: a gate|up weight has an even number of columns, got {w.shape[1]}")
    N = w.shape[1] // 2 if glu else w.shape[1]
    if not 1 <= M <= MAX_M:
        raise ValueError(f"gemv: {M} rows, the kernel takes 1 to {MAX_M}")
    if x.dtype != w.dtype or x.dtype not in _DTYPES:
        raise ValueError(f"gemv: dtypes {x.dtype} and {w.dtype}, the kernel takes bf16 or fp16 for both")
    if not layout_ok(w):
        raise ValueError("gemv: w must be [K, N] row-major or K-major (a [N, K] weight transposed; rows may be padded)")
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    elif out.shape != (M, N) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"gemv: out must be [{M}, {N}] {x.dtype} with unit column stride")
    k_major = is_k_major(w)
    # the columns a program's tiles cover: row-major [gate | up] counts both halves, K-major the outputs
    c = config or default_config(M, w.shape[1] if glu and not k_major else N, K, arch.multiprocessors(x.device), k_major=k_major,
                                 normed=norm is not None, smem=arch.smem_per_block(x.device))
    tiles = triton.cdiv(N, c.block_n)
    k_per = triton.cdiv(triton.cdiv(K, c.block_k), c.split) * c.block_k
    split = triton.cdiv(K, k_per)                      # the splits that hold any K
    if split > 1 and tiles > COUNTER_SLOTS:
        raise ValueError(f"gemv: split over {tiles} column tiles, at most {COUNTER_SLOTS}")
    m_pad = 16 if c.use_dot else 1
    if m_pad < M:
        raise ValueError(f"gemv: the FMA path takes one row, got {M}")
    gdc = c.pdl and pdl_supported(x.device)
    part = torch.empty((split, M, w.shape[1]), dtype=torch.float32, device=x.device) if split > 1 else out
    cnt = _counters(x.device) if split > 1 else out
    h, norm_k, norm_block = out, 1, 1                  # without the norm: placeholders the kernel never reads
    if norm is not None:
        h = torch.empty((M, K), dtype=x.dtype, device=x.device)
        norm_k = triton.next_power_of_2(K)
        # the row's sum of squares in unrolled chunks of at most 4,096 values a program (one chunk for one row)
        norm_block = min(norm_k, 4096 // m_pad)
    else:
        d, nw, eps = x, x, 0.0
    _gemv_kernel[(tiles, split)](x, w, out, part, cnt, d, nw, h, float(eps), M, N, K, x.stride(0), x.stride(1),
                                 d.stride(0), d.stride(1), out.stride(0), w.stride(0), w.stride(1), k_per,
                                 split, M_PAD=m_pad, BLOCK_N=c.block_n, BLOCK_K=c.block_k, USE_DOT=c.use_dot,
                                 DOT_F32=_INTERPRET, GLU=glu, PEEL=c.pdl, USE_GDC=gdc, ACC2D=c.acc2d and not c.use_dot,
                                 NORM=norm is not None, NORM_K=norm_k, NORM_BLOCK=norm_block,
                                 SWAP=c.swap and c.use_dot,
                                 num_warps=c.num_warps, num_stages=c.num_stages, **({"launch_pdl": True} if gdc else {}))
    return out if norm is None else (h, out)


def silu_glu_reference(x: torch.Tensor, w_gu: torch.Tensor) -> torch.Tensor:
    """The fused product's definition: fp32 gate and up, silu(gate) * up, one rounding (checked as `gemv_reference`
    is)."""
    g, u = (x.float() @ w_gu.float()).chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(x.dtype)


# ------------------------------------------------------------------ the engine's entry
@torch.library.custom_op("labkit::gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return gemv(x, w)


@_gemv_op.register_fake
def _(x, w):
    return x.new_empty((x.shape[0], w.shape[1]))


@torch.library.custom_op("labkit::gemv_silu_glu", mutates_args=())
def _gemv_glu_op(x: torch.Tensor, w_gu: torch.Tensor) -> torch.Tensor:
    return gemv(x, w_gu, glu=True)


@_gemv_glu_op.register_fake
def _(x, w_gu):
    return x.new_empty((x.shape[0], w_gu.shape[1] // 2))


@torch.library.custom_op("labkit::gemv_norm", mutates_args=())
def _gemv_norm_op(x: torch.Tensor, d: torch.Tensor, nw: torch.Tensor, w: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return gemv(x, w, norm=(d, nw, eps))


@_gemv_norm_op.register_fake
def _(x, d, nw, w, eps):
    return x.new_empty(x.shape), x.new_empty((x.shape[0], w.shape[1]))


@torch.library.custom_op("labkit::gemv_norm_silu_glu", mutates_args=())
def _gemv_norm_glu_op(x: torch.Tensor, d: torch.Tensor, nw: torch.Tensor, w_gu: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return gemv(x, w_gu, glu=True, norm=(d, nw, eps))


@_gemv_norm_glu_op.register_fake
def _(x, d, nw, w_gu, eps):
    return x.new_empty(x.shape), x.new_empty((x.shape[0], w_gu.shape[1] // 2))


def kernel_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `matmul` takes the kernel: Triton where it runs (CUDA; CPU only under the interpreter),
    bf16/fp16 on both sides, and by the mode: "1" 1 <= M <= 16 and either layout of w; "auto" K-major
    weights and up to `LABKIT_GEMV_ROWS` rows, one by default (where it is faster than cuBLAS in the step;
    at M = 4 and 16 cuBLAS ties or wins)."""
    if _MODE == "0" or not HAVE_TRITON:
        return False
    if x.device.type != ("cpu" if _INTERPRET else "cuda"):
        return False
    if not (x.dim() == 2 and w.dim() == 2 and x.dtype == w.dtype and x.dtype in _DTYPES and layout_ok(w)):
        return False
    if _MODE == "auto":
        return 1 <= x.shape[0] <= min(_ROWS, MAX_M) and is_k_major(w)
    return 1 <= x.shape[0] <= MAX_M


def layout_ok(w: torch.Tensor) -> bool:
    """w [K, N] row-major (unit column stride, rows may be padded) or K-major (unit row stride: a [N, K]
    weight seen as its transpose, the layout of a checkpoint's nn.Linear)."""
    K, N = w.shape
    return (w.stride(1) == 1 and w.stride(0) >= N) or (is_k_major(w) and w.stride(1) >= K)


def is_k_major(w: torch.Tensor) -> bool:
    """Unit row stride across more than one column: a [N, K] weight seen as its [K, N] transpose (a
    single column is row-major too, and read as that)."""
    return w.stride(0) == 1 and w.shape[1] > 1 and w.shape[0] > 1


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x @ w`, through the GEMV kernel where it applies (see `kernel_applies`); a W4A16 weight through the
    grouped kernel (`grouped_gemv.qmatmul`)."""
    if isinstance(w, QuantWeight):
        return qmatmul(x, w)
    if kernel_applies(x, w):
        return torch.ops.labkit.gemv(x, w)
    return x @ w


def norm_applies(x: torch.Tensor, d: torch.Tensor, norm, w: torch.Tensor) -> bool:
    """Whether `norm_matmul` / `norm_silu_glu` fuse the residual add and the norm into the kernel: the
    kernel applies to the product as `matmul` would take it, or, in mode "auto", K-major weights and
    up to `_NORM_ROWS` rows (LABKIT_GEMV_NORM_ROWS; 1 by default, which adds nothing to `matmul`'s rule); the
    norm's weight has x's dtype and length; `LABKIT_GEMV_NORM=0` turns the fusion off."""
    if not _NORM or not (d.shape == x.shape and d.dtype == x.dtype and norm.weight.dtype == x.dtype
                         and norm.weight.shape == (x.shape[-1],) and norm.weight.is_contiguous()):
        return False
    if kernel_applies(x, w):
        return True
    return (_MODE == "auto" and x.dim() == 2 and 1 <= x.shape[0] <= _NORM_ROWS
            and kernel_applies(x[:1], w))


def norm_matmul(x: torch.Tensor, d: torch.Tensor, norm, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual pair (x, d) into a normed product: (h, norm(h) @ w) for h = x + d, `norm` an RMSNorm
    (its `weight` and `eps`). One kernel where `norm_applies` (the add, the norm and the product; no
    norm kernel before the product), else exactly those torch ops."""
    if not isinstance(w, QuantWeight) and norm_applies(x, d, norm, w):
        return torch.ops.labkit.gemv_norm(x, d, norm.weight, w, norm.eps)
    h = x + d
    return h, matmul(norm(h), w)


def norm_silu_glu(x: torch.Tensor, d: torch.Tensor, norm, w_gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_matmul` for the SwiGLU's first half: (h, silu_glu(norm(h), w_gu)), one kernel where it applies."""
    if not isinstance(w_gu, QuantWeight) and _GLU and w_gu.shape[-1] % 2 == 0 and norm_applies(x, d, norm, w_gu):
        return torch.ops.labkit.gemv_norm_silu_glu(x, d, norm.weight, w_gu, norm.eps)
    h = x + d
    return h, silu_glu(norm(h), w_gu)


def silu_glu(x: torch.Tensor, w_gu: torch.Tensor) -> torch.Tensor:
    """The SwiGLU's first half, `silu(g) * u` for `g, u = (x @ w_gu).chunk(2)`: one kernel reading w_gu
    once (gate and up tiles side by side, the product never written) where the kernel applies, else
    exactly those torch ops; a W4A16 weight through the grouped kernel, gate and up side by side too."""
    if isinstance(w_gu, QuantWeight):
        return qmatmul(x, w_gu, glu=True)
    if _GLU and kernel_applies(x, w_gu) and w_gu.shape[1] % 2 == 0:
        return torch.ops.labkit.gemv_silu_glu(x, w_gu)
    g, u = (x @ w_gu).chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u
