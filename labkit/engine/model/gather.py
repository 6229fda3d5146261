"""Row gather/scatter kernels: read selected rows of a KV pool wherever it lives.

`gather_rows(src, rows, out)` copies `src[rows[j]]` to `out[j]`. The Triton kernel runs on a CUDA
device; `src` may be a *pinned host* tensor: the GPU's threads then read mapped host memory straight
over PCIe (zero-copy, no staging, no host thread). On a machine without CUDA the same kernel runs
under `TRITON_INTERPRET=1` (tests), and `torch.index_select` is the reference it is checked against.

Each program moves `ROWS` rows of `W` int64 words with one 2-D load, so several KiB per program are in
flight: PCIe reads have ~1 µs latency and the link only fills when many requests are outstanding.
"""
from __future__ import annotations

import torch

from .arch import HAVE_TRITON, interpret_mode, kernels_run  # noqa: F401 (interpret_mode: the tests ask it here)

if HAVE_TRITON:
    import triton
    import triton.language as tl


if HAVE_TRITON:
    @triton.jit
    def _gather_rows_kernel(src_ptr, rows_ptr, dst_ptr, n_rows, W: tl.constexpr, ROWS: tl.constexpr,
                            BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        j = pid * ROWS + tl.arange(0, ROWS)
        jm = j < n_rows
        r = tl.load(rows_ptr + j, mask=jm, other=0).to(tl.int64)
        for c in tl.static_range(0, W, BLOCK):
            col = c + tl.arange(0, BLOCK)
            m = jm[:, None] & (col[None, :] < W)
            v = tl.load(src_ptr + r[:, None] * W + col[None, :], mask=m)
            tl.store(dst_ptr + j.to(tl.int64)[:, None] * W + col[None, :], v, mask=m)

    @triton.jit
    def _gather_rows_paced_kernel(src_ptr, rows_ptr, dst_ptr, n_rows, n_progs, W: tl.constexpr, BLOCK: tl.constexpr):
        # `n_progs` programs, each one row at a time (grid-stride): a read over the host link is
        # latency-bound, so the rate follows the programs (about 1 GB/s each for 2 KiB rows on PCIe 5.0)
        pid = tl.program_id(0)
        for j in range(pid, n_rows, n_progs):
            r = tl.load(rows_ptr + j).to(tl.int64)
            for c in tl.static_range(0, W, BLOCK):
                col = c + tl.arange(0, BLOCK)
                m = col < W
                v = tl.load(src_ptr + r * W + col, mask=m)
                tl.store(dst_ptr + j * W + col, v, mask=m)      # j * W < 2**31: a load is at most ~1M words

    @triton.jit
    def _scatter_rows_kernel(src_ptr, rows_ptr, dst_ptr, rev_ptr, slots_ptr, n_rows, W: tl.constexpr,
                             ROWS: tl.constexpr, BLOCK: tl.constexpr, REFRESH: tl.constexpr):
        pid = tl.program_id(0)
        j = pid * ROWS + tl.arange(0, ROWS)
        jm = j < n_rows
        r = tl.load(rows_ptr + j, mask=jm, other=0).to(tl.int64)
        if REFRESH:   # the row's cached copy, where it has one (rev >= 0), gets the same bytes
            s = tl.load(rev_ptr + r, mask=jm, other=-1).to(tl.int64)
            sm = jm & (s >= 0)
        for c in tl.static_range(0, W, BLOCK):
            col = c + tl.arange(0, BLOCK)
            m = jm[:, None] & (col[None, :] < W)
            v = tl.load(src_ptr + j.to(tl.int64)[:, None] * W + col[None, :], mask=m)
            tl.store(dst_ptr + r[:, None] * W + col[None, :], v, mask=m)
            if REFRESH:
                tl.store(slots_ptr + s[:, None] * W + col[None, :], v, mask=sm[:, None] & (col[None, :] < W))


def col_block(W: int) -> int:
    return min(256, triton.next_power_of_2(W))


def gather_rows(src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, rows_per_prog: int = 4,
                num_warps: int = 4) -> torch.Tensor:
    """out[j] = src[rows[j]] for 2-D int64 `src [R, W]`, `rows [M]` int64, `out [M, W]`."""
    assert src.dim() == 2 and out.dim() == 2 and src.shape[1] == out.shape[1] and rows.numel() == out.shape[0]
    if not kernels_run(src, rows, out):
        return torch.index_select(src, 0, rows.to(src.device), out=out) if out.device == src.device \
            else out.copy_(src[rows.to(src.device)])
    M, W = out.shape
    grid = (triton.cdiv(M, rows_per_prog),)
    _gather_rows_kernel[grid](src, rows, out, M, W=W, ROWS=rows_per_prog, BLOCK=col_block(W), num_warps=num_warps)
    return out


def gather_rows_paced(src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, programs: int) -> torch.Tensor:
    """`gather_rows` by exactly `programs` programs, one row at a time each: a slower host link, emulated
    (the rows' arrival rate follows the programs reading them)."""
    assert src.dim() == 2 and out.dim() == 2 and src.shape[1] == out.shape[1] and rows.numel() == out.shape[0]
    if not kernels_run(src, rows, out):
        return gather_rows(src, rows, out)
    M, W = out.shape
    _gather_rows_paced_kernel[(max(1, min(programs, M)),)](src, rows, out, M, max(1, min(programs, M)), W=W,
                                                          BLOCK=col_block(W), num_warps=4)
    return out


def scatter_rows(values: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor, rows_per_prog: int = 1,
                 rev: torch.Tensor | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
    """dst[rows[j]] = values[j] — writes a decode step's new rows into the pool (host or device). With `rev`
    (a row's slot, -1 when it has none) and `slots` (whose last row is a trash row), also slots[rev[rows[j]]] =
    values[j] where a row has a slot, in the same kernel: the hot cache's refresh of a cached copy (in torch ops
    five small kernels a layer)."""
    assert values.dim() == 2 and dst.dim() == 2 and values.shape[1] == dst.shape[1]
    assert (rev is None) == (slots is None) and (slots is None or slots.shape[1] == dst.shape[1])
    if not kernels_run(values, rows, dst):
        dst.index_copy_(0, rows.to(dst.device), values.to(dst.device))
        if rev is not None:   # no host sync (graphs): rows without a slot write slots' last row, a trash row
            s = rev.index_select(0, rows.to(rev.device)).to(torch.int64)
            slots.index_copy_(0, torch.where(s >= 0, s, slots.shape[0] - 1).to(slots.device), values.to(slots.device))
        return dst
    M, W = values.shape
    refresh = rev is not None
    _scatter_rows_kernel[(triton.cdiv(M, rows_per_prog),)](values, rows, dst, rev if refresh else rows,
                                                           slots if refresh else dst, M, W=W, ROWS=rows_per_prog,
                                                           BLOCK=col_block(W), REFRESH=refresh, num_warps=4)
    return dst
