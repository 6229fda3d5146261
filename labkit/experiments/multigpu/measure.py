"""Several GPUs of one host, in one run folder (experiment `multigpu`): what a layer split buys over one
GPU, with and without pipelined micro-batches, and whether each GPU's own link carries its share.

Rows (`experiment` column):
- `gather`: one decode step's zero-copy gathers (12 layers x 2048 rows x 2 KiB from a pinned pool
  registered for that GPU, as `probe` measures them) on each GPU alone (`mode=alone`), then on every
  GPU at once (`mode=together`, the same calls issued to all GPUs without waiting): GB/s per GPU and,
  for `together`, the aggregate (`gbps_aggregate`) -- the bound the split's offloaded decode can reach.
- `decode`: the decode table of sparse offload (context x concurrency x strategy) once per `layout`: `1gpu` (the first
  device alone), `split` (the layers over every device, the stages taking turns) and `pipelined` (the
  same split with `micro_batches` micro-batches in flight on different stages at once). Split rows carry
  each stage's engine-counted link bytes beside each GPU's NVML RX, and the step's bubbles.
- `handoff`: the activations of one step copied stage k -> stage k+1 (device to device) on their own.
Tables: `timeline` (the sampled steps of every split point: micro-batch, stage, start, end), telemetry.

    labkit run multigpu -p devices=cuda:0,cuda:1 -p context_lens=64K,1M -p concurrency=1,4,8
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import time

import pandas as pd
import torch

from ...engine.model.cache import build_on_devices
from ...engine.drive.pipeline import device_guard
from ...engine.transfer import ZeroCopy
from ...results import Run
from ...stats import spread
from ...telemetry import Sampler
from ..decode_session import DecodeSession, derive
from ...params import BadInput, fill_auto, resolve_device
from ..device_rates import BUDGET, LAYERS, ROW_BYTES, gather_step, gather_workload
from ... import sweep
from . import SPEC, MultigpuPlan
from .. import plan as plan_experiment, plan_from_params

EXPERIMENT = "multigpu"


def check(p: dict) -> MultigpuPlan:
    """Check resolved parameters; the decode plans of every layout are checked here (one line, nothing
    allocated). Returns the plan with `device_list` and `layouts` (name -> checked decode params)."""
    p = dict(p)
    auto = p["devices"] == "auto"
    if auto:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        p["devices"] = ",".join(f"cuda:{i}" for i in range(n)) if n else "cpu,cpu"
    devs = [resolve_device(d.strip()) for d in p["devices"].split(",") if d.strip()]
    # Asked for by name, one device is a mistake; found by `auto` (a one-GPU host running the nightly
    # plan), it is a run of the 1gpu layout and the link alone: nothing to split, nothing failed.
    if len(devs) < 2 and not auto:
        raise BadInput(f"devices={p['devices']}: a split needs at least two devices")
    fill_auto(SPEC, p, devs[0].type)     # contexts, budget, gather pool; then the declared bounds and choices
    plan = MultigpuPlan.from_params(p)
    common = dict(shape=plan.shape, strategies=plan.strategies, context_lens=plan.context_lens, budgets=[plan.budget],
                  concurrency=plan.concurrency, repeats=plan.repeats, steps=plan.steps, prefill_lens=[], probe=False,
                  anatomy=plan.anatomy, seed=plan.seed)
    layouts = {"1gpu": {**common, "device": str(devs[0])}}
    if len(devs) > 1:
        mbs = sorted({1, *[m for m in plan.micro_batches if m > 1]})
        layouts["split"] = {**common, "device": ",".join(map(str, devs)), "micro_batches": mbs}
    decode_plans = {name: plan_experiment("decode", lay) for name, lay in layouts.items()}
    return dataclasses.replace(plan, layouts={name: dp.params for name, dp in decode_plans.items()},  # as recorded
                               device_list=[str(d) for d in devs],
                               shape=decode_plans["1gpu"].shape)         # "auto" as the layouts decided it


# ---------------------------------------------------------------------------------------------- gather
def gather_scaling(devices: list[torch.device], pool_gib: float, repeats: int) -> list[dict]:
    """One decode step's zero-copy gathers per GPU, alone and on every GPU at once. Each GPU reads its
    own pinned pool (built and registered by a thread bound to that GPU) over its own link."""
    def build(dev: torch.device):
        pool, idx, dst = gather_workload(dev, pool_gib, seed=dev.index or 0)
        return pool, idx.to(dev), dst, idx

    built = build_on_devices(build, devices, device_of=lambda d: d)
    zc = ZeroCopy()
    step_bytes = LAYERS * BUDGET * ROW_BYTES
    launch = [gather_step(zc, pool, idx, dst) for pool, idx, dst, _ in built]     # one decode step's gathers per GPU
    graphs = _step_graphs(devices, launch)
    for i in range(len(devices)):     # warm-up: pages touched, clocks up
        with device_guard(devices[i]):
            graphs[i]()
    _sync(devices)
    out = []
    for i, d in enumerate(devices):
        ms, _ = _timed_round_robin(devices, graphs, [i], repeats)
        out.append(_gather_row("alone", d, i, step_bytes, ms[i], built[i][0].nbytes))
    ms, wall = _timed_round_robin(devices, graphs, list(range(len(devices))), repeats)
    agg = len(devices) * repeats * step_bytes / wall / 1e9
    for i, d in enumerate(devices):
        out.append(_gather_row("together", d, i, step_bytes, ms[i], built[i][0].nbytes, gbps_aggregate=agg))
    ok = all(torch.equal(dst.cpu(), torch.stack([pool.data[l][ix[l]] for l in range(LAYERS)]))
             for pool, _, dst, ix in built)
    for r in out:
        r["correct"] = ok
    built.clear()          # the pinned pools go with this frame
    gc.collect()
    return out


def _sync(devices: list[torch.device]) -> None:
    for d in devices:
        if devices[0].type == "cuda":
            torch.cuda.synchronize(d)


def _step_graphs(devices: list[torch.device], launch: list) -> list:
    """Each GPU's step as one CUDA graph, as a decode step runs it: replays cost the issuing thread ~10 us, so
    issuing to both GPUs from one thread keeps both busy (12 launches from Python per step and GPU would not:
    the first measurement here was host-bound at 1.56x). On a CPU, the eager calls."""
    for i, d in enumerate(devices):   # eager once first: kernels compiled outside any capture
        with device_guard(d):
            launch[i]()
    _sync(devices)
    graphs = []
    for i, d in enumerate(devices):
        if devices[0].type != "cuda":
            graphs.append(launch[i])
            continue
        with device_guard(d):
            g, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(device=d)
            with torch.cuda.graph(g, stream=side):
                launch[i]()
            graphs.append(g.replay)
    _sync(devices)
    return graphs


def _timed_round_robin(devices: list[torch.device], graphs: list, which: list[int],
                       repeats: int) -> tuple[dict[int, list[float]], float]:
    """ms per step on each GPU in `which` (its own events), issued round-robin; and the wall time."""
    cuda = devices[0].type == "cuda"
    ev = {i: [] for i in which}
    _sync(devices)
    t0 = time.perf_counter()
    for _ in range(repeats):
        for i in which:
            with device_guard(devices[i]):
                if cuda:
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    graphs[i]()
                    b.record()
                    ev[i].append((a, b))
                else:
                    s = time.perf_counter()
                    graphs[i]()
                    ev[i].append(time.perf_counter() - s)
    _sync(devices)
    wall = time.perf_counter() - t0
    ms = {i: [a.elapsed_time(b) for a, b in e] if cuda else [x * 1e3 for x in e] for i, e in ev.items()}
    return ms, wall


def _gather_row(mode: str, d: torch.device, i: int, step_bytes: int, ms: list[float], pool_bytes: int,
                **extra) -> dict:
    t = spread(ms)
    return dict(experiment="gather", status="ok", mode=mode, device=str(d), gpu=i, step_bytes=step_bytes,
                ms_median=t.median, ms_min=t.min, ms_max=t.max, gbps=step_bytes / (t.median / 1e3) / 1e9,
                **extra, pool_bytes=pool_bytes)


# ---------------------------------------------------------------------------------------------- hand-off
def handoff_latency(devices: list[torch.device], hidden: int, batches: list[int], repeats: int = 50) -> list[dict]:
    """One step's activations [B, hidden] bf16 copied device k -> k+1, on their own (events on the
    destination's stream, which a cross-device copy fences)."""
    out = []
    cuda = devices[0].type == "cuda"
    for k in range(len(devices) - 1):
        src_d, dst_d = devices[k], devices[k + 1]
        for b in batches:
            src = torch.randn((b, hidden), device=src_d).to(torch.bfloat16)
            dst = torch.empty((b, hidden), dtype=torch.bfloat16, device=dst_d)
            with device_guard(dst_d):
                ts = sweep.event_ms(lambda: dst.copy_(src, non_blocking=cuda), repeats, dst_d, warmup=3)
            assert torch.equal(dst.cpu(), src.cpu())
            t = spread(ts)
            out.append(dict(experiment="handoff", status="ok", src=str(src_d), dst=str(dst_d), concurrency=b,
                            bytes=b * hidden * 2, us_median=t.median * 1e3, us_min=t.min * 1e3, us_max=t.max * 1e3))
    return out


# ---------------------------------------------------------------------------------------------- the run
def layout_of(rec: dict) -> str:
    if "," not in str(rec.get("devices", "")):
        return "1gpu"
    return "split" if rec.get("micro_batches", 1) == 1 else "pipelined"


def run(plan: MultigpuPlan, progress_bar: bool = True) -> Run:
    """Gather scaling, hand-off latency and every layout's decode points (a checked plan)."""
    devs = [torch.device(d) for d in plan.device_list]
    cuda = devs[0].type == "cuda"
    recorded = plan.params
    run = sweep.open_run(recorded, EXPERIMENT, {k: v for k, v in recorded.items() if k != "layouts"})
    grids = {name: derive(plan_from_params("decode", lay)) for name, lay in plan.layouts.items()}
    n_points = sum(len(grid.points) for grid in grids.values())
    bar = sweep.bar(n_points + 2, f"{EXPERIMENT} {len(devs)} devices", progress_bar)
    tel = Sampler(gpus=[d.index or 0 for d in devs] if cuda else [])
    shape = grids["1gpu"].shape
    run.update_manifest(telemetry=tel.reason or "nvml", weight_bytes=shape.weight_bytes(), shape_info=shape.summary(),
                        devices=list(plan.device_list))
    spans: list[dict] = []
    try:
        bar.set_postfix_str("gather scaling")
        with sweep.point(run, {"experiment": "gather"}):
            for r in gather_scaling(devs, plan.gather_pool_gib, plan.gather_repeats):
                run.add(r)
        gc.collect()
        bar.update()
        bar.set_postfix_str("activation hand-off")
        with sweep.point(run, {"experiment": "handoff"}):
            for r in handoff_latency(devs, shape.hidden, sorted(set(plan.concurrency))):
                run.add(r)
        bar.update()
        tel.start()
        # Concurrency groups outermost, layouts inside: a run cut short loses the largest group, not a
        # whole layout. One layout's caches are released before the next builds its own (at 1M x 8
        # requests the host KV is ~190 GiB: two at once would not fit).
        with contextlib.ExitStack() as stack:
            sessions = {name: stack.enter_context(DecodeSession(grid, tel)) for name, grid in grids.items()}
            if "split" in sessions and sessions["split"].stage_layers:
                run.update_manifest(stage_layers=[list(r) for r in sessions["split"].stage_layers])
            for conc in plan.concurrency:
                for name, grid in grids.items():
                    for pt in (q for q in grid.points if q.concurrency == conc):
                        bar.set_postfix_str(f"{name} {pt.strategy} ctx={pt.context_len} c={conc} mb={pt.micro_batches}")
                        got: list[dict] = []
                        rec = sessions[name].measure(pt, timeline=got)
                        rec.setdefault("devices", grid.plan.device)
                        rec["layout"] = layout_of({**rec, "micro_batches": pt.micro_batches})
                        spans += [{**s, "layout": rec["layout"]} for s in got]
                        run.add(rec)
                        bar.update()
                    sessions[name].caches.release()
    finally:
        bar.close()
        tel.stop()
        run.write_table("telemetry", tel.frame())
        run.write_table("timeline", pd.DataFrame(spans))
        run.finish()        # the shared rule; an exception in flight (Ctrl-C included) decides too
    sweep.headline(sweep.summary_lines(lambda: headline(run.metrics())), progress_bar, EXPERIMENT)
    return run


def headline(m: pd.DataFrame) -> list[str]:
    """The gather's scaling over the GPUs, and split / pipelined against one GPU at the largest point."""
    s, lines = summary(m), []
    if "gather_scaling" in s:
        lines.append(f"zero-copy gather: {s['gather_alone_gbps']:.1f} GB/s on one device alone, "
                     f"{s['gather_together_gbps']:.1f} GB/s all together ({s['gather_scaling']:.2f}x)")
    t = s.get("table")
    if t is not None and len(t):
        big = t[(t["context_len"] == t["context_len"].max())]
        big = big[big["concurrency"] == big["concurrency"].max()]
        for r in big.to_dict("records"):
            ratios = [f"{lay} {r[f'{lay}_over_1gpu']:.2f}x" for lay in ("split", "pipelined")
                      if f"{lay}_over_1gpu" in r and r[f"{lay}_over_1gpu"] == r[f"{lay}_over_1gpu"]]
            lines.append(f"{r['strategy']} at {int(r['context_len'])} tokens x {int(r['concurrency'])}: 1gpu "
                         f"{r['1gpu']:,.0f} tok/s" + (", " + ", ".join(ratios) if ratios else ""))
    return lines[:4]


def summary(m: pd.DataFrame) -> dict:
    """The headline figures from a run's metrics: gather scaling, and per (strategy, context,
    concurrency) the split/pipelined aggregate tok/s over one GPU's."""
    out = {}
    g = m[(m.experiment == "gather") & (m.status == "ok")]
    if len(g):
        alone = g[g["mode"] == "alone"].gbps.max()
        out["gather_alone_gbps"] = float(alone)
        out["gather_together_gbps"] = float(g[g["mode"] == "together"].gbps_aggregate.iloc[0])
        out["gather_scaling"] = out["gather_together_gbps"] / alone
    d = m[(m.experiment == "decode") & (m.status == "ok")]
    if len(d):
        t = d.pivot_table(index=["strategy", "context_len", "concurrency"], columns="layout", values="tok_s", aggfunc="max")
        for lay in ("split", "pipelined"):
            if lay in t and "1gpu" in t:
                t[f"{lay}_over_1gpu"] = t[lay] / t["1gpu"]
        out["table"] = t.reset_index()
    return out

