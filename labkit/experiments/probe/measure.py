"""Link probe: the physical limits that bound sparse KV offload on this host, measured through the
engine's own strategy classes (what the probe reports is what a decode step can get).

Rows (`experiment=probe`, with `gbps` where bytes move):
- `contiguous`: pinned host->device copies of 1, 8, 48 and 256 MiB (and device->host, `direction=d2h`);
- `pageable`: 256 MiB from ordinary (unpinned) memory;
- `per_row`, `host_gather` (1, 4, all threads), `zero_copy` (each gather launch configuration),
  `hbm_gather` (`resident` over device memory): one decode step of the reference shape,
  12 layers x 2048 rows x 2048 B = 48 MiB, loaded layer by layer with `strategy.load` from random rows
  of a `pool_gib` pool (large, so rows are spread as in a 1M-token cache; per_row: one layer);
- `hbm_read`: a contiguous read of device memory (the weights' roofline);
- `host_read`, `host_write`, `host_copy`, `host_triad` (`threads` 1 and every core): host RAM bandwidth, STREAM's
  kernels and counting (`labkit.hostmem`), the bound of every CPU-staged offload; kept as this host's
  measurement, which every later run's manifest records (`host_memory_bandwidth`);
- `contiguous_under_host_load`, `zero_copy_under_host_load` (CUDA only): the pinned 256 MiB copy and the zero-copy
  gather of a step while every core but one streams host memory (`host_load_gbps`: what that load moved), to
  set beside the same rows idle: offload shares host RAM with everything else the host does;
- `weight_product`: each distinct weight matrix of the reference shape times M = 1, 4, 16 activation rows,
  through the engine's `gemv.matmul` with the lab's GEMV off (`path=cublas`) and on (`path=gemv`), L2
  flushed before each product, graph-replayed; `gbps` = the matrix's bytes over the time (the share of
  `hbm_read` a step's weights phase can reach, matrix by matrix);
- `index_score`, `select`, `topk_sort`, `score_select`: one QSA layer's selection at 8K..1M context and
  batch 1..16: the fused score kernel, our radix select, torch.topk + sort (the previous path), and
  score + select together, each replayed from a CUDA graph as in a decode step.

Timing follows `triton.testing.do_bench`: every call between its own pair of CUDA events, calls issued
back to back with no host sync in between (one at the end), the L2 cache flushed before each call
where device memory is read, and the variants of one measurement interleaved round by round so that
drift (clocks, a neighbour on the host) falls on all of them alike.
"""
from __future__ import annotations

import math
import statistics
import os
import time
import threading

import torch
import numpy as np
import psutil

from ...engine.model.kv import KVPool
from ...engine.transfer import HostGather, PerRow, Resident, ZeroCopy
from ...stats import spread
from ...params import BadInput, check_positive, resolve_device
from ...sweep import event_ms
from ... import sweep
from ...engine.model import gemv as G
from ...engine.model.indexer import index_scores
from ...engine.model.kv import quantize_index_keys
from ...engine.model.layers import make_weight
from ...engine.model.select import select_topk, select_topk_torch
from ...hostmem import keep, measure, FULL_MIB, QUICK_MIB, cached
from ...shapes import ModelShape
from ...telemetry import Sampler

EXPERIMENT = "probe"
ROW_BYTES, LAYERS, BUDGET = 2048, 12, 2048
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


def _row(strategy: str, nbytes: int | None, ts: list[float], **extra) -> dict:
    t = spread(ts)
    return {"experiment": EXPERIMENT, "status": "ok", "error": None, "strategy": strategy, "bytes": nbytes,
            "step_ms_median": t.median, "step_ms_min": t.min, "step_ms_max": t.max, "repeats": t.n,
            "gbps": nbytes / t.median / 1e6 if nbytes else None, **extra}


def probe_contiguous(dev, repeats, sizes_mib=(1, 8, 48, 256)) -> list[dict]:
    rows = []
    pin = dev.type == "cuda"
    for mib in sizes_mib:
        n = mib << 20
        h = torch.empty(n, dtype=torch.uint8, pin_memory=pin).random_(0, 255)
        d = torch.empty(n, dtype=torch.uint8, device=dev)
        ts = bench({"h2d": lambda: d.copy_(h, non_blocking=True), "d2h": lambda: h.copy_(d, non_blocking=True)}, dev, repeats)
        rows += [_row("contiguous", n, ts[k], size_mib=mib, direction=k) for k in ("h2d", "d2h")]
        del h, d
    return rows


def probe_pageable(dev, repeats) -> list[dict]:
    n = 256 << 20
    h = torch.empty(n, dtype=torch.uint8).random_(0, 255)
    d = torch.empty(n, dtype=torch.uint8, device=dev)
    ts = bench({"pageable": lambda: d.copy_(h)}, dev, max(4, repeats // 2))
    return [_row("pageable", n, ts["pageable"], size_mib=256, direction="h2d")]


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
        out.append(_row("per_row", BUDGET * ROW_BYTES, ts["per_row"], correct=bool(torch.equal(dst[0].cpu(), ref[0])), **extra))
    if "host_gather" in which:
        saved = torch.get_num_threads()
        threads = sorted({1, 4, os.cpu_count() or 1})
        strats = {th: HostGather(threads=th) for th in threads}
        ts = bench({th: gather_step(st, pool, idx, dst) for th, st in strats.items()}, dev, max(8, repeats // 2))
        ok = correct()                # the last call's bytes (every variant writes the same rows)
        out += [_row("host_gather", step, ts[th], threads=th, correct=ok, **extra) for th in threads]
        torch.set_num_threads(saved)
    if "zero_copy" in which:
        configs = ZERO_COPY_CONFIGS if dev.type == "cuda" else [(4, 4)]
        strats = {c: ZeroCopy(*c) for c in configs}
        ts = bench({c: gather_step(st, pool, idx_d, dst) for c, st in strats.items()}, dev, repeats)
        for c, st in strats.items():
            gather_step(st, pool, idx_d, dst)()
            out.append(_row("zero_copy", step, ts[c], rows_per_prog=c[0], num_warps=c[1], correct=correct(), **extra))
    if "hbm_gather" in which and dev.type == "cuda":
        dpool = KVPool("device", LAYERS, min(pool.data.shape[1], 1 << 16) // 256, 256, ROW_BYTES, dev)
        dpool.fill_random_(2)
        didx = idx_d % dpool.data.shape[1]
        ts = bench({"hbm": gather_step(Resident(), dpool, didx, dst)}, dev, repeats, flush=True)
        out.append(_row("hbm_gather", step, ts["hbm"], **extra))
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
    return _row("hbm_read", n, ts["read"])


def gemm_peak(dev: torch.device, repeats: int = 20, n: int = 8192) -> dict:
    """The dense bf16 peak as a product reaches it: an n^3 GEMM on random data (the compute bound of a
    prefill anatomy's weights and attention phases)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    ts = bench({"gemm": lambda: a @ b}, dev, repeats)
    row = _row("gemm_bf16", None, ts["gemm"], size=n)
    row["tflops"] = 2 * n ** 3 / row["step_ms_median"] / 1e9
    del a, b
    return row


def probe_weights(dev: torch.device, repeats: int, shape: str = "qwen3.8-flash-next", ms=(1, 4, 16)) -> list[dict]:
    """`weight_product` rows: a matrix, M and path (cuBLAS, or the lab's GEMV where it applies). Each timed
    call is a graph of up to 8 products over distinct copies of the matrix back to back, as a step streams
    its weights (one product alone would time the graph's launch; the same copy twice, L2), per product."""
    out, was = [], G.mode()
    g = torch.Generator(device=dev).manual_seed(0)
    try:
        for name, (K, N, count) in ModelShape.from_name(shape).weight_matrices().items():
            nbytes = K * N * 2
            copies = max(1, min(8, (1 << 30) // nbytes))
            ws = [make_weight(g, K, N, torch.bfloat16, dev) for _ in range(copies)]   # the layers' layout
            for M in ms:
                x = torch.randn(M, K, generator=g, device=dev).to(torch.bfloat16)
                for path in ("cublas", "gemv"):
                    G.set_mode("1" if path == "gemv" else "0")     # the kernel at every M, the engine takes it at M = 1
                    if path == "gemv" and not G.kernel_applies(x, ws[0]):
                        continue
                    ts = bench({path: lambda x=x: [G.matmul(x, w) for w in ws]}, dev, repeats, flush=True, graph=True)
                    out.append(_row("weight_product", nbytes, [t / copies for t in ts[path]], path=path, matrix=name,
                                    M=M, concurrency=M, matrices_per_step=count, copies=copies))
            del ws
    finally:
        G.set_mode(was)
    return out


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
                out.append(_row(name, None, t, context_len=n, concurrency=B, budget=k))
            del k8, sc, scores
    return out


def probe_host_memory(repeats: int, array_mib: int) -> list[dict]:
    """STREAM's four kernels on host RAM at 1 thread and every core (`labkit.hostmem`), one row each; the
    measurement becomes this host's kept one."""
    rec = measure(array_mib, max(3, min(repeats, 10)))
    rows = [_row(f"host_{name.split('_')[0]}", moved, [t * 1e3 for t in ts], threads=th, array_mib=rec["array_mib"])
            for name, (th, moved, ts) in rec.pop("_times").items()]
    keep(rec, "labkit run probe")
    return rows


class HostLoad:
    """Every core but one streaming host memory (numpy copies on threads: numpy lets go of the GIL while it
    copies), as a context: `gbps` afterwards is what the load moved, counted as STREAM counts a copy."""

    def __init__(self, threads: int | None = None, mib: int = 128):
        self.threads = threads or max(1, (os.cpu_count() or 2) - 1)
        self.mib, self.moved, self.gbps = mib, [0] * self.threads, 0.0

    def _copy(self, i: int) -> None:
        src = np.ones((self.mib << 20) // 8)
        dst = np.empty_like(src)
        while not self._stop.is_set():
            np.copyto(dst, src)
            self.moved[i] += 2 * src.nbytes

    def __enter__(self) -> "HostLoad":
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._copy, args=(i,), daemon=True) for i in range(self.threads)]
        self._t0 = time.perf_counter()
        for t in self._threads:
            t.start()
        time.sleep(0.2)                      # the arrays allocated and the copies running before anything is timed
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        self.gbps = sum(self.moved) / (time.perf_counter() - self._t0) / 1e9


def probe_link_under_host_load(dev, pool_gib: float, repeats: int) -> list[dict]:
    """The pinned 256 MiB host->device copy and one decode step's zero-copy gather, timed while `HostLoad` runs."""
    n = 256 << 20
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True).random_(0, 255)
    d = torch.empty(n, dtype=torch.uint8, device=dev)
    pool, idx, dst = gather_workload(dev, min(pool_gib, 8.0))
    idx_d = idx.to(dev)
    step = LAYERS * BUDGET * ROW_BYTES
    with HostLoad() as load:
        ts = bench({"h2d": lambda: d.copy_(h, non_blocking=True),
                    "zero_copy": gather_step(ZeroCopy(4, 4), pool, idx_d, dst)}, dev, repeats)
    extra = {"host_load_threads": load.threads, "host_load_gbps": load.gbps}
    del h, d, pool
    return [_row("contiguous_under_host_load", n, ts["h2d"], size_mib=256, direction="h2d", **extra),
            _row("zero_copy_under_host_load", step, ts["zero_copy"], rows_per_prog=4, num_warps=4, **extra)]


LINK_UNDER_LOAD_SKIPPED = "skipped: no CUDA GPU here (host and \"device\" are one memory, there is no link to load)"


def probe_stages(device: str = "auto", pool_gib: float = 0.0, repeats: int = 20, gathers=None,
                 selection: bool = True, weights: bool = True, host: bool = False) -> list[tuple[str, "callable"]]:
    """The probe's measurements in order, each a (name, function -> rows) pair: what a progress bar counts. `host`:
    host RAM and the link under a host-memory load too (`labkit run probe`; a decode run's own probe leaves them to
    the manifest's kept measurement)."""
    dev = resolve_device(device)
    check_positive("repeats", [repeats])
    if pool_gib < 0:
        raise BadInput(f"pool_gib must be >= 0, got {pool_gib}")
    pool_gib = pool_gib or (24.0 if dev.type == "cuda" else 0.25)
    stages = [("contiguous", lambda: probe_contiguous(dev, repeats)), ("pageable", lambda: probe_pageable(dev, repeats)),
              ("gathers", lambda: probe_gathers(dev, pool_gib, repeats, **({} if gathers is None else {"which": gathers})))]
    if host:
        mib = FULL_MIB if dev.type == "cuda" else QUICK_MIB
        stages.append(("host_memory", lambda: probe_host_memory(repeats, mib)))
        if dev.type == "cuda":
            stages.append(("link_under_host_load", lambda: probe_link_under_host_load(dev, pool_gib, repeats)))
    if dev.type == "cuda":
        stages.append(("hbm_read", lambda: [hbm_read_gbps(dev)]))
        if weights:
            stages.append(("weights", lambda: probe_weights(dev, repeats)))
    if selection:
        stages.append(("selection", lambda: probe_selection(dev, repeats, **({} if dev.type == "cuda" else
                                                            {"contexts": (4096,), "batches": (1,), "budget": 64}))))
    return stages


def run_probe(device: str = "auto", pool_gib: float = 0.0, repeats: int = 20, gathers=None,
              selection: bool = True, weights: bool = True, host: bool = False) -> list[dict]:
    """Every probe row, stage after stage (the first failure raises)."""
    return [r for _, stage in probe_stages(device, pool_gib, repeats, gathers, selection, weights, host) for r in stage()]


def check(p: dict) -> dict:
    """Validate resolved parameters against this machine (one line on bad input); returns them."""
    p = dict(p)
    p["device"] = str(resolve_device(p["device"]))       # repeats and pool_gib: bounds declared on the SPEC
    total = psutil.virtual_memory().total
    if p["pool_gib"] * 2**30 > total:
        raise BadInput(f"pool_gib={p['pool_gib']:g}: a {p['pool_gib']:g} GiB pinned host pool does not fit this "
                       f"machine's {total / 2**30:.0f} GiB of RAM")
    return p


def headline(m) -> list[str]:
    """The link's GB/s per path, best configuration of each: the figures every speed plot's bound comes from."""
    ok = m[(m["experiment"] == EXPERIMENT) & (m["status"] == "ok")]

    def best(strategy: str, **where) -> str:
        r = ok[ok["strategy"] == strategy]
        for k, v in where.items():
            r = r[r[k] == v] if k in r else r.iloc[0:0]
        return "-" if r.empty or r["gbps"].isna().all() else f"{r['gbps'].max():.1f}"

    lines = [f"contiguous H2D {best('contiguous', direction='h2d')} GB/s, D2H {best('contiguous', direction='d2h')}, "
             f"pageable {best('pageable')}",
             f"sparse gather of a step: zero_copy {best('zero_copy')} GB/s, host_gather {best('host_gather')}, "
             f"per_row {best('per_row')}" + (f", from device memory {best('hbm_gather')}" if "hbm_gather" in set(ok["strategy"]) else "")]
    if "hbm_read" in set(ok["strategy"]):
        lines.append(f"device memory read {best('hbm_read')} GB/s")
    if "host_copy" in set(ok["strategy"]):
        n = int(ok.loc[ok["strategy"] == "host_copy", "threads"].max())
        loaded = (f"H2D {best('contiguous_under_host_load')} GB/s (idle {best('contiguous', direction='h2d')}), "
                  f"zero_copy {best('zero_copy_under_host_load')}" if "contiguous_under_host_load" in set(ok["strategy"])
                  else LINK_UNDER_LOAD_SKIPPED)
        lines.append(f"host RAM copy {best('host_copy', threads=1)} GB/s on 1 core, {best('host_copy', threads=n)} on {n} "
                     f"(triad {best('host_triad', threads=1)} / {best('host_triad', threads=n)}); link under a "
                     f"host-memory load: {loaded}")
    return lines


def run(p: dict, progress_bar: bool = True):
    """A run folder with the probe rows and telemetry (checked parameters: `experiments.probe`)."""
    dev = resolve_device(p["device"])
    run = sweep.open_run(p, EXPERIMENT)
    base = {"device": str(dev), "gpu_name": run.manifest.get("gpu_name") or "cpu", "shape": "qwen3.8-flash-next"}
    if dev.type != "cuda":
        run.update_manifest(link_under_host_load=LINK_UNDER_LOAD_SKIPPED)
    stages = probe_stages(p["device"], p["pool_gib"], p["repeats"], host=True)
    with sweep.bar(len(stages), EXPERIMENT, progress_bar) as bar:
        for name, stage in stages:
            bar.set_postfix_str(name)
            with sweep.point(run, {**base, "experiment": EXPERIMENT}):
                for r in stage():
                    run.add({**base, **r})
            if name == "host_memory":          # this run measured the host in full: its manifest says so
                run.update_manifest(host_memory_bandwidth=cached() or run.manifest.get("host_memory_bandwidth"))
            bar.update()
    # The NVML sampler runs after the timed probes, not beside them (its thread competes with the
    # host-side gathers): a short contiguous copy under it records the link generation under load.
    tel = Sampler(gpus=[dev.index or 0] if dev.type == "cuda" else []).start()
    try:
        if dev.type == "cuda":
            probe_contiguous(dev, 8, sizes_mib=(256,))
    finally:
        tel.stop()
        run.write_table("telemetry", tel.frame())
        run.finish()        # the shared rule; an exception in flight (Ctrl-C included) decides too
    sweep.headline(sweep.summary_lines(lambda: headline(run.metrics())), progress_bar, EXPERIMENT)
    return run
