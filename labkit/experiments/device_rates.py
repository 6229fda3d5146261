"""What the device and its host link can do, measured as the engine uses them: contiguous copies, one decode
step's sparse gathers through each transfer strategy, the device's read bandwidth and dense GEMM peak, the
selection kernels. `labkit run probe` measures these (and the host's own memory); a decode run measures the link
part in its own folder (`run_link_probe`) and its roofline's read bandwidth (`hbm_read_gbps`), prefill its
bounds' rates (`gemm_peak`, `hbm_read_gbps`, `probe_contiguous`), multigpu one decode step's gather per GPU
(`gather_workload`, `gather_step`). Every row is tagged `experiment=probe`, whichever run measured it.

Timing follows `triton.testing.do_bench`: every call between its own pair of CUDA events, calls issued
back to back with no host sync in between (one at the end), the L2 cache flushed before each call
where device memory is read, and the variants of one measurement interleaved round by round so that
drift (clocks, a neighbour on the host) falls on all of them alike.
"""
from __future__ import annotations

import math
import os
import statistics

import torch

from ..engine.model.indexer import index_scores
from ..engine.model.kv import KVPool, quantize_index_keys
from ..engine.model.select import select_topk, select_topk_torch
from ..engine.transfer import HostGather, PerRow, Resident, ZeroCopy
from ..params import BadInput, check_positive, resolve_device
from ..stats import spread
from ..sweep import event_ms

PROBE = "probe"          # the experiment column of these rows, in a probe run or in another run's own probe
ROW_BYTES, LAYERS, BUDGET = 2048, 12, 2048       # one decode step of the reference shape: 48 MiB
ZERO_COPY_CONFIGS = [(1, 4), (2, 4), (4, 4), (4, 8), (8, 8)]      # (rows per program, warps)
L2_FLUSH_BYTES = 256 << 20


def bench(fns: dict, dev: torch.device, repeats: int, rounds: int = 4, flush: bool = False,
          warmup: int = 3, graph: bool = False) -> dict[str, list[float]]:
    """ms per call of each function: `repeats` calls each, in `rounds` interleaved rounds. `graph`:
    each function is captured once in a CUDA graph and its replays are timed, as a decode step runs it
    (a sequence of small kernels launched from Python would time the launches, not the GPU)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    if graph and dev.type == "cuda":
        captured = {}
        for name, fn in fns.items():
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            captured[name] = g.replay
        fns = captured
    cuda = dev.type == "cuda"
    scratch = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=dev) if cuda and flush else None
    per_round = max(1, math.ceil(repeats / rounds))
    out: dict[str, list[float]] = {k: [] for k in fns}
    if cuda:
        torch.cuda.synchronize(dev)
    for _ in range(rounds):
        for name, fn in fns.items():
            out[name] += event_ms(fn, per_round, dev, mode="queued",
                                  before=scratch.zero_ if scratch is not None else None)
    return out


def rate_row(strategy: str, nbytes: int | None, ts: list[float], **extra) -> dict:
    t = spread(ts)
    return {"experiment": PROBE, "status": "ok", "error": None, "strategy": strategy, "bytes": nbytes,
            "step_ms_median": t.median, "step_ms_min": t.min, "step_ms_max": t.max, "repeats": t.n,
            "gbps": nbytes / t.median / 1e6 if nbytes else None, **extra}


def random_bytes(n: int, pin: bool = False) -> torch.Tensor:
    """n host bytes, every page written, of random-looking content: one 1 MiB random block tiled over them
    (`random_` over 256 MiB takes ~2.3 s on a CPU; a copy's speed does not depend on the values, only on the pages
    being real, not the shared zero page an untouched allocation reads from)."""
    h = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
    block = torch.randint(0, 255, (min(n, 1 << 20),), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    for s in range(0, n, block.numel()):
        part = h[s:s + block.numel()]
        part.copy_(block[:part.numel()])
    return h


def probe_contiguous(dev, repeats, sizes_mib=(1, 8, 48, 256)) -> list[dict]:
    rows = []
    pin = dev.type == "cuda"
    for mib in sizes_mib:
        n = mib << 20
        h = random_bytes(n, pin)
        d = torch.empty(n, dtype=torch.uint8, device=dev)
        ts = bench({"h2d": lambda: d.copy_(h, non_blocking=True), "d2h": lambda: h.copy_(d, non_blocking=True)}, dev, repeats)
        rows += [rate_row("contiguous", n, ts[k], size_mib=mib, direction=k) for k in ("h2d", "d2h")]
        del h, d
    return rows


def probe_pageable(dev, repeats) -> list[dict]:
    n = 256 << 20
    h = random_bytes(n)
    d = torch.empty(n, dtype=torch.uint8, device=dev)
    ts = bench({"pageable": lambda: d.copy_(h)}, dev, max(4, repeats // 2))
    return [rate_row("pageable", n, ts["pageable"], size_mib=256, direction="h2d")]


def gather_step(strategy, pool: KVPool, idx: torch.Tensor, dst: torch.Tensor, layers: int = LAYERS):
    """One decode step's loads, layer by layer, as the engine issues them."""
    def run():
        for layer in range(layers):
            strategy.load(pool, layer, idx[layer], dst[layer])
    return run


def gather_workload(dev, pool_gib: float, seed: int = 1):
    """One decode step's loads of the reference shape: a host pool of `pool_gib` (pinned, registered on
    CUDA; large, so rows are spread as in a 1M-token cache), BUDGET random rows per layer (sorted, on the
    host) and the step's destination on `dev`. Returns (pool, idx [LAYERS, BUDGET], dst)."""
    rows_per_layer = max(BUDGET, int(pool_gib * 2**30) // (LAYERS * ROW_BYTES)) // 256 * 256
    pool = KVPool("host", LAYERS, rows_per_layer // 256, 256, ROW_BYTES, dev)
    pool.fill_random_(0)
    R = pool.data.shape[1]
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(R, generator=g)[:BUDGET].sort().values for _ in range(LAYERS)])
    return pool, idx, torch.empty((LAYERS, BUDGET, ROW_BYTES // 8), dtype=torch.int64, device=dev)


LINK_PROGRAMS = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 36, 40, 48, 56, 64)


def link_rates(dev, rows_per_load: int, repeats: int = 10, pool_gib: float = 2.0, seed: int = 1) -> dict[int, float]:
    """The zero-copy gather's GB/s over one decode step's loads (LAYERS loads of `rows_per_load` random 2 KiB
    rows from a pinned host pool) at each program count of LINK_PROGRAMS, plus 0 for the default launch
    (rows / 4 programs): the calibration behind decode's `link_gbps`."""
    rows_per_layer = max(rows_per_load, int(pool_gib * 2**30) // (LAYERS * ROW_BYTES)) // 256 * 256 + 256
    pool = KVPool("host", LAYERS, rows_per_layer // 256, 256, ROW_BYTES, dev)
    pool.fill_random_(0)
    R = pool.data.shape[1]
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(R, generator=g)[:rows_per_load].sort().values for _ in range(LAYERS)]).to(dev)
    dst = torch.empty((LAYERS, rows_per_load, ROW_BYTES // 8), dtype=torch.int64, device=dev)
    nbytes = LAYERS * rows_per_load * ROW_BYTES
    progs = [0] + [q for q in LINK_PROGRAMS if q <= rows_per_load]
    ts = bench({q: gather_step(ZeroCopy(programs=q), pool, idx, dst) for q in progs}, dev, repeats)
    del pool
    return {q: nbytes / (statistics.median(t) * 1e6) for q, t in ts.items()}


def emulated_link(rates: dict[int, float], target_gbps: float) -> tuple[int, float]:
    """(programs, GB/s measured with them) whose rate is nearest `target_gbps` (by ratio)."""
    q = min((q for q in rates if q), key=lambda q: abs(math.log(rates[q] / target_gbps)))
    return q, rates[q]


def probe_gathers(dev, pool_gib: float, repeats: int,
                  which=("per_row", "host_gather", "zero_copy", "hbm_gather")) -> list[dict]:
    out = []
    pool, idx, dst = gather_workload(dev, pool_gib)
    idx_d = idx.to(dev)
    step = LAYERS * BUDGET * ROW_BYTES
    ref = torch.stack([pool.data[layer][idx[layer]] for layer in range(LAYERS)])
    extra = {"pool_bytes": pool.nbytes}

    def correct() -> bool:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        ok = bool(torch.equal(dst.cpu(), ref))
        dst.fill_(-1)
        return ok

    if "per_row" in which:   # one layer's rows, one copy each (the full step would take ~0.4 s)
        dst.fill_(-1)
        ts = bench({"per_row": gather_step(PerRow(), pool, idx, dst, layers=1)}, dev, 3, rounds=1, warmup=1)
        out.append(rate_row("per_row", BUDGET * ROW_BYTES, ts["per_row"], correct=bool(torch.equal(dst[0].cpu(), ref[0])), **extra))
    if "host_gather" in which:
        saved = torch.get_num_threads()
        threads = sorted({1, 4, os.cpu_count() or 1})
        strats = {th: HostGather(threads=th) for th in threads}
        ts = bench({th: gather_step(st, pool, idx, dst) for th, st in strats.items()}, dev, max(8, repeats // 2))
        ok = correct()                # the last call's bytes (every variant writes the same rows)
        out += [rate_row("host_gather", step, ts[th], threads=th, correct=ok, **extra) for th in threads]
        torch.set_num_threads(saved)
    if "zero_copy" in which:
        configs = ZERO_COPY_CONFIGS if dev.type == "cuda" else [(4, 4)]
        strats = {c: ZeroCopy(*c) for c in configs}
        ts = bench({c: gather_step(st, pool, idx_d, dst) for c, st in strats.items()}, dev, repeats)
        for c, st in strats.items():
            gather_step(st, pool, idx_d, dst)()
            out.append(rate_row("zero_copy", step, ts[c], rows_per_prog=c[0], num_warps=c[1], correct=correct(), **extra))
    if "hbm_gather" in which and dev.type == "cuda":
        dpool = KVPool("device", LAYERS, min(pool.data.shape[1], 1 << 16) // 256, 256, ROW_BYTES, dev)
        dpool.fill_random_(2)
        didx = idx_d % dpool.data.shape[1]
        ts = bench({"hbm": gather_step(Resident(), dpool, didx, dst)}, dev, repeats, flush=True)
        out.append(rate_row("hbm_gather", step, ts["hbm"], **extra))
        del dpool
    del pool
    return out


def hbm_read_gbps(dev: torch.device, gib: float = 2.0, repeats: int = 20) -> dict:
    """Contiguous read bandwidth of device memory (a sum over `gib` of bf16, L2 flushed before each
    call): the denominator of the weight-streaming roofline."""
    x = torch.ones(int(gib * 2**30) // 2, dtype=torch.bfloat16, device=dev)
    ts = bench({"read": lambda: x.sum(dtype=torch.float32)}, dev, repeats, flush=True)
    n = x.numel() * 2
    del x
    return rate_row("hbm_read", n, ts["read"])


def gemm_peak(dev: torch.device, repeats: int = 20, n: int = 8192) -> dict:
    """The dense bf16 peak as a product reaches it: an n^3 GEMM on random data (the compute bound of a
    prefill anatomy's weights and attention phases)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    ts = bench({"gemm": lambda: a @ b}, dev, repeats)
    row = rate_row("gemm_bf16", None, ts["gemm"], size=n)
    row["tflops"] = 2 * n ** 3 / row["step_ms_median"] / 1e9
    del a, b
    return row


def probe_selection(dev, repeats, contexts=(8 << 10, 64 << 10, 256 << 10, 1 << 20), batches=(1, 4, 16),
                    budget=BUDGET, index_dim=64, index_heads=4) -> list[dict]:
    """One QSA layer's selection: score (66 B/token fp8 keys), our select, torch.topk + sort, both."""
    out = []
    g = torch.Generator(device=dev).manual_seed(0)
    for B in batches:
        for n in contexts:
            k8, sc = quantize_index_keys(torch.randn(B, n, index_dim, generator=g, device=dev))
            q = torch.randn(B, index_heads, index_dim, generator=g, device=dev).to(torch.bfloat16)
            w = torch.randn(B, index_heads, generator=g, device=dev).to(torch.bfloat16)
            lens = torch.full((B,), n, device=dev)
            scores = index_scores(q, w, k8, sc, lens)
            k = min(budget, n)
            ts = bench({"index_score": lambda: index_scores(q, w, k8, sc, lens),
                        "select": lambda: select_topk(scores, k),
                        "topk_sort": lambda: select_topk_torch(scores, k),
                        "score_select": lambda: select_topk(index_scores(q, w, k8, sc, lens), k)}, dev, repeats,
                       graph=True)
            for name, t in ts.items():
                out.append(rate_row(name, None, t, context_len=n, concurrency=B, budget=k))
            del k8, sc, scores
    return out


def probe_device(device: str, pool_gib: float, repeats: int) -> tuple[torch.device, float]:
    """The device a probe measures and its host pool's GiB (0: 24 on CUDA, a quarter GiB on a CPU), checked."""
    dev = resolve_device(device)
    check_positive("repeats", [repeats])
    if pool_gib < 0:
        raise BadInput(f"pool_gib must be >= 0, got {pool_gib}")
    return dev, pool_gib or (24.0 if dev.type == "cuda" else 0.25)


def link_stages(dev: torch.device, pool_gib: float, repeats: int, gathers=None,
                selection: bool = True) -> list[tuple[str, "callable"]]:
    """The link's measurements in order, each a (name, function -> rows) pair: contiguous and pageable copies,
    a step's gathers, the device's read bandwidth (CUDA), the selection kernels."""
    stages = [("contiguous", lambda: probe_contiguous(dev, repeats)), ("pageable", lambda: probe_pageable(dev, repeats)),
              ("gathers", lambda: probe_gathers(dev, pool_gib, repeats, **({} if gathers is None else {"which": gathers})))]
    if dev.type == "cuda":
        stages.append(("hbm_read", lambda: [hbm_read_gbps(dev)]))
    if selection:
        stages.append(("selection", lambda: probe_selection(dev, repeats, **({} if dev.type == "cuda" else
                                                            {"contexts": (4096,), "batches": (1,), "budget": 64}))))
    return stages


def run_link_probe(device: str = "auto", pool_gib: float = 0.0, repeats: int = 20, gathers=None,
                   selection: bool = True) -> list[dict]:
    """Every link row, stage after stage (the first failure raises): a decode run's own probe."""
    dev, pool_gib = probe_device(device, pool_gib, repeats)
    return [r for _, stage in link_stages(dev, pool_gib, repeats, gathers, selection) for r in stage()]
