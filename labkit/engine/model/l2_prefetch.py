"""Weights read into L2 while the GPU does work that barely touches HBM, so the product that comes next
finds them there.

    pf = Prefetcher(device)          # one per engine; a no-op off CUDA or when turned off
    pf.fork([blk.mixer.w_o])         # a side stream reads w_o (as much of it as the L2 budget allows)
    ...                              # the mixer's small kernels run on the main stream meanwhile
    pf.join()                        # the main stream waits for the side stream (before a graph ends)
    touch(t, sink)                   # the kernel itself: reads every 4-byte word of t, XOR per program

Why: a decode step reads its weights once, but between two weight products there are stretches of small
kernels (DeltaNet's recurrence and gates, the index score and top-k of a QSA layer) during which HBM is
nearly idle, and the product after them then starts cold. On an H200 (a graph-replayed step at 64K, c = 1)
cuBLAS's output projections (16.8 MB) took 9 µs against 4 µs at the read bandwidth, the kernel's ramp and
tail, and its split-K reduce. Reading w_o into L2 during the mixer turns most of that product's HBM reads
into L2 hits. L2 is 50 MB on an H200, so a fork reads at most `budget_bytes` (by default half the L2) and
the rest of the tensors stays cold.

How: `touch` is a Triton kernel that loads the tensor as int32 words over a few programs per SM and
stores one XOR per program into a sink (the store is what keeps the loads from being dead code; the
XOR makes the kernel checkable: every word must have been read). `fork` runs it on a side stream that
first waits on the main stream, so in a captured CUDA graph it is a parallel branch starting where the
fork was called; `join` makes the main stream wait on the branch. Every fork must be joined before a
graph capture ends (the engine joins at the end of each block and before a QSA layer's load request,
where a piecewise graph may end). Nothing is computed from the loaded values: the step's results are the
same bits with and without it.

`LABKIT_L2_PREFETCH=1` (read at import) turns it on; `set_enabled` in a running process (graphs captured
before keep what they captured).
"""
from __future__ import annotations

import os

import torch

from .gather import HAVE_TRITON, interpret_mode

if HAVE_TRITON:
    import triton
    import triton.language as tl

_ENABLED = os.environ.get("LABKIT_L2_PREFETCH", "0") == "1"
BLOCK = 4096                   # int32 words a program loads per iteration: 16 KB, 32 words a thread
PROGRAMS_PER_SM = 4            # enough bytes in flight to stream at the read bandwidth, few enough to
                               # leave room beside the main stream's small kernels
SINK_SLOTS = 1 << 14


def set_enabled(on: bool) -> None:
    global _ENABLED
    _ENABLED = bool(on)


def enabled() -> bool:
    return _ENABLED


if HAVE_TRITON:
    @triton.jit
    def _xor(a, b):
        return a ^ b

    @triton.jit
    def _touch_kernel(ptr, n_words, sink_ptr, PER_PROG, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        start = pid.to(tl.int64) * PER_PROG
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for off in range(0, PER_PROG, BLOCK):
            idx = start + off + tl.arange(0, BLOCK)
            acc ^= tl.load(ptr + idx, mask=idx < n_words, other=0)   # PER_PROG: whole blocks
        tl.store(sink_ptr + pid, tl.reduce(acc, 0, _xor))


def _words(t: torch.Tensor, max_bytes: int) -> tuple[torch.Tensor, int]:
    """The tensor's storage as int32 words (a contiguous prefix of at most max_bytes)."""
    if not t.is_contiguous() or t.numel() * t.element_size() % 4:
        raise ValueError(f"touch: a contiguous tensor of whole 4-byte words, got {tuple(t.shape)} {t.dtype}")
    w = t.view(-1).view(torch.int32)
    return w, min(w.numel(), max_bytes // 4)


def programs_for(n_words: int, sms: int) -> tuple[int, int]:
    """(programs, words per program): PROGRAMS_PER_SM programs an SM, each a whole number of blocks."""
    blocks = -(-n_words // BLOCK)
    per = -(-blocks // (PROGRAMS_PER_SM * sms)) * BLOCK
    return -(-n_words // per), per


def touch(t: torch.Tensor, sink: torch.Tensor, max_bytes: int | None = None, sms: int = 132) -> int:
    """Read the first max_bytes of t (all of it by default) with the kernel; sink[p] gets the XOR of the
    words program p read. Returns the number of programs."""
    w, n = _words(t, t.numel() * t.element_size() if max_bytes is None else max_bytes)
    if n == 0:
        return 0
    progs, per = programs_for(n, sms)
    if progs > sink.numel() or sink.dtype != torch.int32:
        raise ValueError(f"touch: sink must be int32 with >= {progs} slots")
    _touch_kernel[(progs,)](w, n, sink, per, BLOCK=BLOCK, num_warps=4)
    return progs


class Prefetcher:
    """A side stream that reads weights into L2 while the main stream works (see the module doc)."""

    def __init__(self, device: torch.device, budget_bytes: int | None = None):
        self.device = torch.device(device)
        self.on = (_ENABLED and HAVE_TRITON and self.device.type == "cuda" and not interpret_mode())
        self._open = False
        if not self.on:
            return
        props = torch.cuda.get_device_properties(self.device)
        self.sms = props.multi_processor_count
        self.budget = props.L2_cache_size // 2 if budget_bytes is None else budget_bytes
        self.stream = torch.cuda.Stream(self.device)
        self.sink = torch.zeros(SINK_SLOTS, dtype=torch.int32, device=self.device)

    def fork(self, tensors) -> None:
        """Start reading `tensors` in order into L2 on the side stream, up to the budget in all."""
        if not self.on:
            return
        self.join()                                   # one branch open at a time
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        left = self.budget
        with torch.cuda.stream(self.stream):
            for t in tensors:
                if left <= 0:
                    break
                nbytes = min(t.numel() * t.element_size(), left)
                touch(t, self.sink, nbytes, self.sms)
                left -= nbytes
        self._open = True

    def join(self) -> None:
        if self._open:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self._open = False
