"""The all-reduce a tensor-parallel decode step waits on twice a layer, measured among this box's GPUs: one
process per GPU, NCCL, the bf16 activations of one step at concurrency 1..16 (`concurrency` rows of the shape's
hidden size: latency-bound, a few KiB) and two larger messages for the bus bandwidth.

Timing follows nccl-tests' all_reduce_perf: the ranks aligned by a one-element all-reduce, then `inner` all-reduces
back to back between two CUDA events on rank 0, their mean per all-reduce; `repeats` such timings give the median,
min and max. Each
size is first checked: every rank adds its rank + 1, and every element must come back as the sum over the ranks.

The same harness runs on CPU tensors with the `gloo` backend (what a machine with no GPU can check: two real
processes, a real all_reduce); the probe itself measures only NCCL between GPUs. The processes meet through a file in
a fresh temporary folder (no port to pick or collide on), and rank 0 hands its timings back through one there.
This module imports nothing heavy: each spawned process imports it afresh.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ... import atomic
from ...params import BadInput
from ...shapes import PRESETS

SHAPE = "qwen3.8-flash-next"         # the probe's shape: the published one
CONCURRENCY = (1, 2, 4, 8, 16)       # rows of one decode step's activations
BANDWIDTH_BYTES = (1 << 20, 16 << 20)
BACKENDS = ("nccl", "gloo")
WARMUP = 5
INNER = 10          # all-reduces per timed call: one alone would time the launch and the events, not the link
TIMEOUT_S = 300     # the whole measurement: ranks that never meet (a broken peer path) fail the stage, not the probe
RESULT = "rank0.json"


def step_sizes(hidden: int | None = None, large=BANDWIDTH_BYTES) -> list[tuple[int | None, int]]:
    """(concurrency, bytes) of each measured message: one decode step's bf16 activations at each concurrency
    (`hidden` x 2 bytes a row, the probe's shape's by default), then the bandwidth sizes `large` (concurrency None)."""
    hidden = hidden or PRESETS[SHAPE].hidden
    return [(c, c * hidden * 2) for c in CONCURRENCY] + [(None, b) for b in large]


def skipped(dev: torch.device) -> str | None:
    """Why this machine cannot measure an all-reduce between GPUs, in one line; None when it can."""
    if dev.type != "cuda":
        return "skipped: no CUDA GPU here (an all-reduce between GPUs needs 2 or more)"
    n = torch.cuda.device_count()
    if n < 2:
        return f"skipped: {n} CUDA GPU visible here; an all-reduce between GPUs needs 2 or more"
    if not dist.is_nccl_available():
        return "skipped: this torch build has no NCCL"
    return None


def bus_gbps(nbytes: int, ms: float, ranks: int) -> float:
    """nccl-tests' bus bandwidth: what each link carries in a ring all-reduce, 2 (n - 1) / n of the bytes, a second."""
    return 2 * (ranks - 1) / ranks * nbytes / ms / 1e6


def measure(sizes: list[int], repeats: int, backend: str = "nccl", ranks: int | None = None, inner: int = INNER,
            timeout_s: float = TIMEOUT_S, start_method: str | None = None) -> dict:
    """Time all_reduce of bf16 tensors of each size in bytes among `ranks` processes (NCCL: one per GPU, every
    visible GPU by default; gloo: CPU tensors, 2 by default). Returns {"ranks", "backend", "times_ms": {bytes: [ms per
    all-reduce, one a repeat]}, "sums": {bytes: [min, max] of the checked reduction}, "expected_sum", "nccl_version"}.
    Processes are spawned for NCCL (CUDA cannot be used in a forked child of a process that has used it), forked
    for gloo where the platform can (no fresh interpreter to start: the CPU check stays short)."""
    if backend not in BACKENDS:
        raise BadInput(f"all-reduce backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    ranks = ranks or (torch.cuda.device_count() if backend == "nccl" else 2)
    if not 2 <= ranks <= 1024:
        raise BadInput(f"an all-reduce needs 2 or more ranks, got {ranks}")
    if backend == "nccl" and ranks > torch.cuda.device_count():
        raise BadInput(f"{ranks} NCCL ranks need {ranks} GPUs; {torch.cuda.device_count()} visible here")
    if not sizes or any(not isinstance(b, int) or b < 2 or b % 2 for b in sizes):
        raise BadInput(f"all-reduce sizes must be even byte counts >= 2 (bf16 elements), got {sizes}")
    if repeats < 1 or inner < 1:
        raise BadInput(f"repeats and inner must be >= 1, got {repeats} and {inner}")
    method = start_method or ("fork" if backend == "gloo" and "fork" in mp.get_all_start_methods() else "spawn")
    with tempfile.TemporaryDirectory(prefix="labkit-allreduce-") as folder:
        ctx = mp.start_processes(_worker, args=(ranks, backend, list(sizes), repeats, inner, folder), nprocs=ranks,
                                 join=False, start_method=method)
        _join(ctx, timeout_s)
        out = json.loads((Path(folder) / RESULT).read_text())
    for k in ("times_ms", "sums"):
        out[k] = {int(b): v for b, v in out[k].items()}
    return out


def _join(ctx, timeout_s: float) -> None:
    """Wait for every rank; a rank that raised becomes one line (its exception's), one still running at the deadline
    is ended and the measurement fails with a TimeoutError."""
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                for p in ctx.processes:
                    p.join(5)
                raise TimeoutError(f"the all-reduce ranks did not finish within {timeout_s:g} s")
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as ex:
        lines = [ln for ln in str(ex).strip().splitlines() if ln.strip()]
        raise RuntimeError(f"an all-reduce rank failed: {lines[-1].strip() if lines else type(ex).__name__}") from None


def _worker(rank: int, ranks: int, backend: str, sizes: list[int], repeats: int, inner: int, folder: str) -> None:
    """One rank: join the group, check and time each size, rank 0 writes what it timed."""
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)       # one core a rank: the ranks share the machine's cores
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"file://{os.path.join(folder, 'rendezvous')}", rank=rank,
                            world_size=ranks, timeout=timedelta(seconds=TIMEOUT_S))
    try:
        out = {"ranks": ranks, "backend": backend, "expected_sum": ranks * (ranks + 1) / 2, "times_ms": {}, "sums": {},
               "nccl_version": _nccl_version() if cuda else None}
        for nbytes in sizes:
            out["sums"][nbytes] = _checked_sum(nbytes // 2, rank, ranks, dev)
            out["times_ms"][nbytes] = _timed(torch.zeros(nbytes // 2, dtype=torch.bfloat16, device=dev),
                                             repeats, inner, cuda)
        if rank == 0:
            atomic.write_text(Path(folder) / RESULT, json.dumps(out))
    finally:
        dist.destroy_process_group()


def _nccl_version() -> str:
    v = torch.cuda.nccl.version()        # a tuple (2, 21, 5); older torch builds give one int
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def _checked_sum(numel: int, rank: int, ranks: int, dev: torch.device) -> list[float]:
    """Every rank adds rank + 1; each element must be 1 + 2 + ... + ranks (exact in bf16 for any box's rank
    count). [min, max] of the result, or RuntimeError naming what came back."""
    x = torch.full((numel,), rank + 1, dtype=torch.bfloat16, device=dev)
    dist.all_reduce(x)
    lo, hi = float(x.min()), float(x.max())
    want = ranks * (ranks + 1) / 2
    if lo != want or hi != want:
        raise RuntimeError(f"all_reduce of {numel * 2} bytes over {ranks} ranks summed to {lo:g}..{hi:g}, not {want:g}")
    return [lo, hi]


def _timed(x: torch.Tensor, repeats: int, inner: int, cuda: bool) -> list[float]:
    """ms per all-reduce of `x`, one value a repeat, each the mean of `inner` back-to-back calls (zeros: the sum
    stays zero however often it runs). CUDA events where the tensor is on a GPU, the host clock on the CPU."""
    one = torch.zeros(1, dtype=x.dtype, device=x.device)
    for _ in range(WARMUP):
        dist.all_reduce(x)
    out = []
    for _ in range(repeats):
        dist.all_reduce(one)              # the ranks start together: rank 0 does not time waiting for the others
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                dist.all_reduce(x)
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                dist.all_reduce(x)
            out.append((time.perf_counter() - t0) * 1e3 / inner)
    return out
