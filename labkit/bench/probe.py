"""Link probe: the physical limits that bound sparse KV offload on this host (after shared/probes/pcie_probe.py).

Measures, as tidy `experiment=probe` rows with `gbps`:
- `contiguous`: pinned host->device copies of 1, 8, 48 and 256 MiB (and device->host, `direction=d2h`);
- `pageable`: 256 MiB from ordinary (unpinned) memory;
- `per_row`: one `copy_` per 2 KiB row, as naive per-block transfers do;
- `host_gather`: CPU threads gather the step's rows into pinned staging, then one DMA (1, 4, all threads);
- `zero_copy`: the Triton gather kernel reading mapped pinned host memory (each launch configuration);
- `hbm_gather`: the same kernel over device memory (what a no-offload engine pays).
The gather probes move one decode step of the reference shape: 12 layers x 2048 rows x 2048 B = 48 MiB,
from random rows of a `pool_gib` pool (large, so rows are spread as in a 1M-token cache).
"""
from __future__ import annotations

import os
import time

import torch

from ..engine.gather import HAVE_TRITON, gather_rows
from ..engine.kv import KVPool
from .params import Param, check_positive, resolve, resolve_device, BadInput

EXPERIMENT = "probe"
SPEC = [
    Param("device", "str", "auto", "auto, cpu, cuda, cuda:N"),
    Param("pool_gib", "float", 0.0, "host pool to gather from (0: 24 GiB on CUDA, 0.25 on CPU)"),
    Param("repeats", "int", 20, "timed repeats per measurement"),
    Param("out_dir", "str", "", "run folder (empty: results/<run-id>)"),
]
ROW_BYTES, LAYERS, BUDGET = 2048, 12, 2048


def _timer(dev: torch.device, fn, repeats: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    ts = []
    if dev.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(repeats):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e))
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)


def _row(strategy: str, nbytes: int, ts: list[float], **extra) -> dict:
    med = ts[len(ts) // 2]
    return {"experiment": EXPERIMENT, "status": "ok", "error": None, "strategy": strategy, "bytes": nbytes,
            "step_ms_median": med, "step_ms_min": ts[0], "step_ms_max": ts[-1], "repeats": len(ts),
            "gbps": nbytes / med / 1e6, **extra}


def probe_contiguous(dev, repeats, sizes_mib=(1, 8, 48, 256)) -> list[dict]:
    rows = []
    pin = dev.type == "cuda"
    for mib in sizes_mib:
        n = mib << 20
        h = torch.empty(n, dtype=torch.uint8, pin_memory=pin).random_(0, 255)
        d = torch.empty(n, dtype=torch.uint8, device=dev)
        rows.append(_row("contiguous", n, _timer(dev, lambda: d.copy_(h, non_blocking=True), repeats), size_mib=mib, direction="h2d"))
        rows.append(_row("contiguous", n, _timer(dev, lambda: h.copy_(d, non_blocking=True), repeats), size_mib=mib, direction="d2h"))
        del h, d
    return rows


def probe_pageable(dev, repeats) -> list[dict]:
    n = 256 << 20
    h = torch.empty(n, dtype=torch.uint8).random_(0, 255)
    d = torch.empty(n, dtype=torch.uint8, device=dev)
    return [_row("pageable", n, _timer(dev, lambda: d.copy_(h), max(3, repeats // 4)), size_mib=256, direction="h2d")]


def probe_gathers(dev, pool_gib: float, repeats: int, which=("per_row", "host_gather", "zero_copy", "hbm_gather")) -> list[dict]:
    out = []
    W = ROW_BYTES // 8
    n_rows = max(BUDGET, int(pool_gib * 2**30) // (LAYERS * ROW_BYTES))
    pool = KVPool("host", LAYERS, n_rows // 256, 256, ROW_BYTES, dev)    # pinned (registered) on CUDA
    pool.fill_random_(0)
    R = pool.data.shape[1]
    g = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.randperm(R, generator=g)[:BUDGET].sort().values for _ in range(LAYERS)])  # [L, B]
    flat = (idx + torch.arange(LAYERS)[:, None] * R).reshape(-1)            # rows of the [L*R, W] view
    idx_d = flat.to(dev)
    src = pool.data.view(-1, W)
    dst = torch.empty((LAYERS * BUDGET, W), dtype=torch.int64, device=dev)
    step = LAYERS * BUDGET * ROW_BYTES
    ref = src[flat]
    extra = {"pool_bytes": pool.nbytes}
    if "per_row" in which:
        def per_row():   # one layer's rows, one copy each (the full step would take ~0.4 s)
            for j, r in enumerate(idx[0].tolist()):
                dst[j].copy_(src[r], non_blocking=True)
        out.append(_row("per_row", BUDGET * ROW_BYTES, _timer(dev, per_row, 3, warmup=1), **extra))
    if "host_gather" in which:
        stage = torch.empty((LAYERS * BUDGET, W), dtype=torch.int64, pin_memory=dev.type == "cuda")
        saved = torch.get_num_threads()
        for th in sorted({1, 4, os.cpu_count() or 1}):
            torch.set_num_threads(th)
            def host_gather():
                torch.index_select(src, 0, flat, out=stage)
                dst.copy_(stage, non_blocking=True)
            out.append(_row("host_gather", step, _timer(dev, host_gather, max(5, repeats // 2)), threads=th, **extra))
        torch.set_num_threads(saved)
    if "zero_copy" in which:
        variants = [(1, 4), (2, 4), (4, 4), (4, 8), (8, 8)] if dev.type == "cuda" else [(4, 4)]
        for rpp, nw in variants:
            if dev.type == "cuda" or HAVE_TRITON:
                dst.fill_(-1)
                ts = _timer(dev, lambda: gather_rows(src, idx_d, dst, rows_per_prog=rpp, num_warps=nw), repeats)
                ok = bool(torch.equal(dst.cpu(), ref))
                out.append(_row("zero_copy", step, ts, rows_per_prog=rpp, num_warps=nw, correct=ok, **extra))
    if "hbm_gather" in which and dev.type == "cuda":
        dpool = torch.empty((LAYERS * min(R, 1 << 16), W), dtype=torch.int64, device=dev).random_()
        didx = (idx_d % dpool.shape[0])
        out.append(_row("hbm_gather", step, _timer(dev, lambda: gather_rows(dpool, didx, dst), repeats), **extra))
        del dpool
    del pool
    return out


def probe_indexer(dev, repeats, contexts=(65536, 1 << 20), budget=BUDGET) -> list[dict]:
    """Where a QSA layer's selection time goes as context grows: the fused index-score pass over
    66 B/token fp8 keys, and the exact top-k over the scores (one request, one layer)."""
    from ..engine.indexer import index_scores, select_topk
    from ..engine.kv import quantize_index_keys
    out = []
    g = torch.Generator(device=dev).manual_seed(0)
    for n in contexts:
        k8, sc = quantize_index_keys(torch.randn(1, n, 64, generator=g, device=dev))
        q = torch.randn(1, 4, 64, generator=g, device=dev).to(torch.bfloat16)
        w = torch.randn(1, 4, generator=g, device=dev).to(torch.bfloat16)
        lens = torch.tensor([n], device=dev)
        ts = _timer(dev, lambda: index_scores(q, w, k8, sc, lens), repeats)
        out.append(_row("indexer_score", n * 66, ts, context_len=n))
        scores = index_scores(q, w, k8, sc, lens)
        ts = _timer(dev, lambda: select_topk(scores, budget), repeats)
        out.append(_row("topk", n * 4, ts, context_len=n, budget=budget))
    return out


def run_probe(device: str = "auto", pool_gib: float = 0.0, repeats: int = 20, gathers=None) -> list[dict]:
    dev = resolve_device(device)
    check_positive("repeats", [repeats])
    if pool_gib < 0:
        raise BadInput(f"pool_gib must be >= 0, got {pool_gib}")
    pool_gib = pool_gib or (24.0 if dev.type == "cuda" else 0.25)
    rows = probe_contiguous(dev, repeats) + probe_pageable(dev, repeats)
    rows += probe_gathers(dev, pool_gib, repeats, **({} if gathers is None else {"which": gathers}))
    rows += probe_indexer(dev, repeats, contexts=(65536, 1 << 20) if dev.type == "cuda" else (4096,))
    return rows


def run(given: dict, progress_bar: bool = True):
    """`labkit run probe` / `labkit probe`: a run folder with the probe rows and telemetry."""
    from ..results import Run
    from ..telemetry import Sampler
    p = resolve(SPEC, given, EXPERIMENT)
    dev = resolve_device(p["device"])
    run = Run.create(p["out_dir"] or None, EXPERIMENT, p)
    tel = Sampler(gpus=[dev.index or 0] if dev.type == "cuda" else []).start()
    base = {"device": str(dev), "gpu_name": run.manifest.get("gpu_name") or "cpu", "shape": "qwen3.8-flash-next"}
    try:
        for r in run_probe(p["device"], p["pool_gib"], p["repeats"]):
            run.add({**base, **r})
    except Exception as ex:
        from .params import one_line
        run.add({**base, "experiment": EXPERIMENT, "status": "failed", "error": one_line(ex)})
    finally:
        tel.stop()
        run.write_table("telemetry", tel.frame())
        run.finish("ok" if all(r["status"] == "ok" for r in run.records) else "partial")
    return run
