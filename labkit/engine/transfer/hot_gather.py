"""The hot cache's split path: one gather kernel that reads hits from device slots and misses from
(mapped, pinned) host memory, and writes each kept miss into its slot on the way.

`gather_hot_rows(src, rows, slots, slot, victim, out)`, all row tensors `[*, W]` int64:
    out[j] = slots[slot[j]]            if slot[j] >= 0   (a hit: device memory)
    out[j] = src[rows[j]]              otherwise         (a miss: read over the link)
    slots[victim[j]] = out[j]          if victim[j] >= 0 (the miss is kept)
Victim slots are never hit slots of the same step (the hot cache protects them), so the reads and
writes of one launch never overlap.

`gather_hot_rows(..., rev=REV)` (the deferred path, `HotCache(defer=True)`): the kernel looks each row
up itself, `slot[j] = REV[rows[j]]`, and keeps nothing (`slot` and `victim` are not read); the misses
reach their slots afterwards, from `out`, when the bookkeeping has chosen the victims. `gather_hot_rows_reference` is the same in torch ops (the CPU path
and what the kernel is checked against under TRITON_INTERPRET=1); it reads every row of `src`, which is
harmless on a CPU where host and device are one memory, and is why CUDA always takes the kernel.
"""
from __future__ import annotations

import torch

from ..model.arch import HAVE_TRITON, kernels_run
from ..model.gather import col_block

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_hot_kernel(src_ptr, rows_ptr, slots_ptr, slot_ptr, victim_ptr, out_ptr, n_rows,
                           W: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, LOOKUP: tl.constexpr):
        pid = tl.program_id(0)
        j = pid * ROWS + tl.arange(0, ROWS)
        jm = j < n_rows
        r = tl.load(rows_ptr + j, mask=jm, other=0).to(tl.int64)
        if LOOKUP:      # slot_ptr is the reverse index (int32, by pool row); nothing is kept
            s = tl.load(slot_ptr + r, mask=jm, other=-1).to(tl.int64)
            v = tl.full([ROWS], -1, tl.int64)
        else:
            s = tl.load(slot_ptr + j, mask=jm, other=-1).to(tl.int64)
            v = tl.load(victim_ptr + j, mask=jm, other=-1).to(tl.int64)
        hit = (s >= 0)[:, None]
        keep = (v >= 0)[:, None]
        for c in tl.static_range(0, W, BLOCK):
            col = c + tl.arange(0, BLOCK)
            m = jm[:, None] & (col[None, :] < W)
            a = tl.load(slots_ptr + s[:, None] * W + col[None, :], mask=m & hit, other=0)
            b = tl.load(src_ptr + r[:, None] * W + col[None, :], mask=m & (~hit), other=0)
            x = tl.where(hit, a, b)
            tl.store(out_ptr + j.to(tl.int64)[:, None] * W + col[None, :], x, mask=m)
            tl.store(slots_ptr + v[:, None] * W + col[None, :], x, mask=m & keep)


    @triton.jit
    def _insert_kernel(staged_ptr, victim_ptr, slots_ptr, n_rows, W: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        j = pid * ROWS + tl.arange(0, ROWS)
        v = tl.load(victim_ptr + j, mask=j < n_rows, other=-1).to(tl.int64)
        keep = v >= 0
        if tl.max(keep.to(tl.int32), 0) > 0:          # most programs keep nothing: one load and out
            for c in tl.static_range(0, W, BLOCK):
                col = c + tl.arange(0, BLOCK)
                m = keep[:, None] & (col[None, :] < W)
                x = tl.load(staged_ptr + j.to(tl.int64)[:, None] * W + col[None, :], mask=m)
                tl.store(slots_ptr + v[:, None] * W + col[None, :], x, mask=m)


def insert_rows(staged: torch.Tensor, victim: torch.Tensor, slots: torch.Tensor, rows_per_prog: int = 4,
                num_warps: int = 4) -> None:
    """The deferred inserts: `slots[victim[j]] = staged[j]` where `victim[j] >= 0`. Only the kept
    rows are read and written (an `index_copy_` of every row into a trash slot would move the whole
    selection, 4 MiB a layer at the reference point, for the few dozen rows a step keeps)."""
    if not kernels_run(staged, victim, slots):
        slots.index_copy_(0, torch.where(victim >= 0, victim, slots.shape[0] - 1), staged)
        return
    M, W = staged.shape
    _insert_kernel[(triton.cdiv(M, rows_per_prog),)](staged, victim, slots, M, W=W, ROWS=rows_per_prog,
                                                     BLOCK=col_block(W), num_warps=num_warps)


def gather_hot_rows_reference(src, rows, slots, slot, victim, out):
    hit = (slot >= 0)[:, None]
    dev = out.device
    cold = src.index_select(0, rows.to(src.device)).to(dev)
    out.copy_(torch.where(hit, slots.index_select(0, slot.clamp_min(0)), cold))
    trash = slots.shape[0] - 1        # callers keep a spare last slot for the masked writes
    slots.index_copy_(0, torch.where(victim >= 0, victim, trash), out)
    return out


def gather_hot_rows(src: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, slot: torch.Tensor | None,
                    victim: torch.Tensor | None, out: torch.Tensor, rows_per_prog: int = 4, num_warps: int = 4,
                    rev: torch.Tensor | None = None):
    """Module docstring; with `rev` (the layer's reverse index) `slot` and `victim` are not used."""
    assert src.dim() == 2 and slots.dim() == 2 and out.dim() == 2
    assert src.shape[1] == slots.shape[1] == out.shape[1] and rows.numel() == out.shape[0]
    if rev is None:
        assert rows.numel() == slot.numel() == victim.numel()
    if not kernels_run(src, rows, slots, out):
        if rev is not None:
            slot = rev.index_select(0, rows).to(torch.int64)
            victim = torch.full_like(slot, -1)
        return gather_hot_rows_reference(src, rows, slots, slot, victim, out)
    M, W = out.shape
    lookup = rev is not None
    _gather_hot_kernel[(triton.cdiv(M, rows_per_prog),)](src, rows, slots, rev if lookup else slot,
                                                         rows if lookup else victim, out, M, W=W,
                                                         ROWS=rows_per_prog, BLOCK=col_block(W), LOOKUP=lookup,
                                                         num_warps=num_warps)
    return out
