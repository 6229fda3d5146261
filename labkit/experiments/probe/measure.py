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
- `allreduce` (2 or more CUDA GPUs; `labkit.experiments.probe.allreduce`): NCCL all-reduce among every visible
  GPU, one process each, of one decode step's bf16 activations at concurrency 1..16 (`concurrency` rows of the
  shape's hidden size: the two messages a tensor-parallel layer waits on) and of 1 and 16 MiB; `latency_us_*` per
  all-reduce, `gbps` the bus bandwidth 2 (n - 1) / n x bytes / time (`algbw_gbps`: bytes / time), `ranks`/`gpus`
  the GPUs taking part. `labkit predict --calibration` takes the concurrency-1 latency as `allreduce_us`. Fewer
  than 2 GPUs: no rows, the manifest's `allreduce` and the closing lines say it was skipped and why.

The link's measurements and their timing (`triton.testing.do_bench`'s way) are `labkit.experiments.device_rates`,
shared with the runs that measure their own bounds (decode, prefill, multigpu); host RAM, the link under a host load
and the weight products are the probe's own.
"""
from __future__ import annotations

import os
import time
import threading

import torch
import numpy as np
import psutil

from ...engine.transfer import ZeroCopy
from ...params import BadInput, resolve_device
from ... import sweep
from ...engine.model import gemv as G
from ...engine.model.layers import make_weight
from ...hostmem import keep, measure, FULL_MIB, QUICK_MIB, cached
from ...shapes import ModelShape
from ...telemetry import Sampler
from . import ProbePlan
from . import allreduce as AR
from ..device_rates import (BUDGET, LAYERS, PROBE, ROW_BYTES, bench, gather_step, gather_workload, link_stages,
                            probe_contiguous, probe_device, random_bytes, rate_row)

EXPERIMENT = PROBE


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
                    out.append(rate_row("weight_product", nbytes, [t / copies for t in ts[path]], path=path, matrix=name,
                                    M=M, concurrency=M, matrices_per_step=count, copies=copies))
            del ws
    finally:
        G.set_mode(was)
    return out


def probe_host_memory(repeats: int, array_mib: int) -> list[dict]:
    """STREAM's four kernels on host RAM at 1 thread and every core (`labkit.hostmem`), one row each; the
    measurement becomes this host's kept one."""
    rec = measure(array_mib, max(3, min(repeats, 10)))
    rows = [rate_row(f"host_{name.split('_')[0]}", moved, [t * 1e3 for t in ts], threads=th, array_mib=rec["array_mib"])
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
    h = random_bytes(n, pin=True)
    d = torch.empty(n, dtype=torch.uint8, device=dev)
    pool, idx, dst = gather_workload(dev, min(pool_gib, 8.0))
    idx_d = idx.to(dev)
    step = LAYERS * BUDGET * ROW_BYTES
    with HostLoad() as load:
        ts = bench({"h2d": lambda: d.copy_(h, non_blocking=True),
                    "zero_copy": gather_step(ZeroCopy(4, 4), pool, idx_d, dst)}, dev, repeats)
    extra = {"host_load_threads": load.threads, "host_load_gbps": load.gbps}
    del h, d, pool
    return [rate_row("contiguous_under_host_load", n, ts["h2d"], size_mib=256, direction="h2d", **extra),
            rate_row("zero_copy_under_host_load", step, ts["zero_copy"], rows_per_prog=4, num_warps=4, **extra)]


def probe_allreduce(repeats: int, backend: str = "nccl", hidden: int | None = None, ranks: int | None = None,
                    large=AR.BANDWIDTH_BYTES, inner: int = AR.INNER) -> list[dict]:
    """`allreduce` rows, one a message size (`labkit.experiments.probe.allreduce`): one decode step's activations at
    each concurrency, then the bandwidth sizes. NCCL among the GPUs; `backend="gloo"` runs the same harness on
    CPU tensors (what a machine without GPUs checks it by)."""
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.empty_cache()          # the earlier stages' cached blocks back to the card rank 0 shares
    sizes = AR.step_sizes(hidden, large)
    got = AR.measure([b for _, b in sizes], repeats, backend, ranks, inner)
    n, rows = got["ranks"], []
    for c, nbytes in sizes:
        r = rate_row("allreduce", nbytes, got["times_ms"][nbytes], backend=backend, ranks=n,
                     gpus=n if backend == "nccl" else 0, concurrency=c, dtype="bf16",
                     size_mib=None if c else nbytes / 2**20, inner=inner, nccl_version=got["nccl_version"],
                     correct=got["sums"][nbytes][0] == got["expected_sum"] == got["sums"][nbytes][1])
        r.update(algbw_gbps=r["gbps"], gbps=AR.bus_gbps(nbytes, r["step_ms_median"], n),
                 **{f"latency_us_{k}": r[f"step_ms_{k}"] * 1e3 for k in ("median", "min", "max")})
        rows.append(r)
    return rows


LINK_UNDER_LOAD_SKIPPED = "skipped: no CUDA GPU here (host and \"device\" are one memory, there is no link to load)"


def probe_stages(device: str = "auto", pool_gib: float = 0.0, repeats: int = 20, gathers=None,
                 selection: bool = True, weights: bool = True, host: bool = False,
                 allreduce: bool = False) -> list[tuple[str, "callable"]]:
    """The probe's measurements in order, each a (name, function -> rows) pair: what a progress bar counts. The link's
    (`device_rates.link_stages`, what a decode run's own probe measures too), then `host`: host RAM and the link
    under a host-memory load after the gathers, `weights`: the weight products after the read bandwidth (CUDA), and
    `allreduce`: NCCL among the GPUs, last, where there are 2 or more (`AR.skipped` says why not)."""
    dev, pool_gib = probe_device(device, pool_gib, repeats)
    stages = link_stages(dev, pool_gib, repeats, gathers, selection)
    after = {"gathers": [], "hbm_read": []}
    if host:
        mib = FULL_MIB if dev.type == "cuda" else QUICK_MIB
        after["gathers"].append(("host_memory", lambda: probe_host_memory(repeats, mib)))
        if dev.type == "cuda":
            after["gathers"].append(("link_under_host_load", lambda: probe_link_under_host_load(dev, pool_gib, repeats)))
    if weights and dev.type == "cuda":
        after["hbm_read"].append(("weights", lambda: probe_weights(dev, repeats)))
    out = [s for name, fn in stages for s in [(name, fn), *after.get(name, [])]]
    if allreduce and AR.skipped(dev) is None:
        out.append(("allreduce", lambda: probe_allreduce(repeats)))
    return out


def check(p: dict) -> ProbePlan:
    """Validate resolved parameters against this machine (one line on bad input); returns the plan."""
    plan = ProbePlan.from_params({**p, "device": str(resolve_device(p["device"]))})   # bounds: declared on the SPEC
    total = psutil.virtual_memory().total
    if plan.pool_gib * 2**30 > total:
        raise BadInput(f"pool_gib={plan.pool_gib:g}: a {plan.pool_gib:g} GiB pinned host pool does not fit this "
                       f"machine's {total / 2**30:.0f} GiB of RAM")
    return plan


def allreduce_line(m, skipped: str | None = None) -> str | None:
    """The all-reduce among the GPUs in one line: one decode step's latency and the largest message's bus bandwidth,
    why it was skipped, or its failure; None where the run says nothing of it (a probe from before the stage)."""
    ar = m[(m["experiment"] == EXPERIMENT) & (m["strategy"] == "allreduce") & (m["status"] == "ok")] \
        if "strategy" in m else m.iloc[0:0]
    if not ar.empty:
        one, big = ar.sort_values("bytes").iloc[0], ar.sort_values("bytes").iloc[-1]
        nccl = f" (NCCL {one['nccl_version']})" if isinstance(one.get("nccl_version"), str) else ""
        among = (f"{int(one['ranks'])} GPUs{nccl}" if one.get("backend", "nccl") == "nccl"
                 else f"{int(one['ranks'])} {one['backend']} ranks")
        return (f"all-reduce among {among}: {one['latency_us_median']:.1f} µs for one decode "
                f"step at concurrency 1 ({int(one['bytes']):,} B; min {one['latency_us_min']:.1f}, max "
                f"{one['latency_us_max']:.1f}), bus {big['gbps']:.1f} GB/s at {big['bytes'] / 2**20:g} MiB; "
                f"`labkit predict --calibration` on this run folder takes the first as allreduce_us")
    failed = m[(m["status"] == "failed") & (m["stage"] == "allreduce")] if "stage" in m else m.iloc[0:0]
    if not failed.empty:
        return f"all-reduce among the GPUs failed: {failed['error'].iloc[0]}"
    return f"all-reduce among the GPUs {skipped}" if skipped else None


def headline(m, allreduce_skipped: str | None = None) -> list[str]:
    """The link's GB/s per path, best configuration of each: the figures every speed plot's bound comes from; then
    the all-reduce among the GPUs (or why it was skipped)."""
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
    ar = allreduce_line(m[m["experiment"] == EXPERIMENT], allreduce_skipped)
    return lines + ([ar] if ar else [])


def run(plan: ProbePlan, progress_bar: bool = True):
    """A run folder with the probe rows and telemetry (a checked plan: `experiments.probe`)."""
    dev = resolve_device(plan.device)
    run = sweep.open_run(plan.params, EXPERIMENT)
    base = {"device": str(dev), "gpu_name": run.manifest.get("gpu_name") or "cpu", "shape": "qwen3.8-flash-next"}
    if dev.type != "cuda":
        run.update_manifest(link_under_host_load=LINK_UNDER_LOAD_SKIPPED)
    skipped = AR.skipped(dev)            # fewer than 2 GPUs: no stage, the manifest and the closing lines say why
    if skipped:
        run.update_manifest(allreduce=skipped)
    stages = probe_stages(plan.device, plan.pool_gib, plan.repeats, host=True, allreduce=True)
    with sweep.bar(len(stages), EXPERIMENT, progress_bar) as bar:
        for name, stage in stages:
            bar.set_postfix_str(name)
            with sweep.point(run, {**base, "experiment": EXPERIMENT}, stage=name):     # a failed row names its stage
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
    sweep.headline(sweep.summary_lines(lambda: headline(run.metrics(), skipped)), progress_bar, EXPERIMENT)
    return run
