"""Capacity and goodput under a device-memory cap (FlashOffloading's comparison): for a context length and a cap (e.g. 24 GiB, the reference box's per-card memory), how
many requests fit, and the decode goodput of those that keep their TPOT under a limit, in three
configurations:

| config    | prefill                                   | decode                                       |
|-----------|-------------------------------------------|----------------------------------------------|
| `none`    | KV resident; one layer-sized prefix copy  | KV resident (`resident`)                     |
| `prefill` | rotating layer buffers (4 layers on device)| KV resident (`resident`)                     |
| `both`    | rotating layer buffers                    | KV in host RAM, `hot_cache` slots on device  |

Device bytes (`budget_bytes`), from the engine's own allocations: the weights, a fixed `workspace_gib`
(prefill activations, CUDA graphs, cuBLAS), the prefill working set of one prompt of the context, and
per request: its KV (not in `both`), its index keys, its DeltaNet state, the decode staging of
`budget` rows, and in `both` the hot cache's slots and reverse index (`HotCache.device_bytes`). `both`
is also bounded by host RAM (`host_cap_gib` of pinned KV). In a colocated engine, decode holds every
request's KV, so prefill-only offload changes only the prefill working set (four layer buffers
against sync's one, so it may hold one request *fewer*); its gain in the seed is prefill throughput
(`experiments/prefill/measure.py`), not decode capacity. Offload in both stages is what multiplies the batch.

Goodput: decode tok/s of the requests whose TPOT stays under `tpot_ms`. For a configuration, the
decode step is timed (the decode sweep's `measure_decode`, CUDA graphs, under the cap) at its full
capacity; a step over the limit means those requests are not good, so the batch a scheduler would
admit instead is timed too (capacity x limit / step, once more if still over). goodput = batch /
step for the largest timed batch under the limit, 0 when none is.

    labkit run capacity --out DIR -p context_len=32K -p mem_cap_gib=24 -p tpot_ms=30

The defaults are sized to the machine: the cap is 24 GiB or the GPU's memory if smaller (on a CPU, where
the "device" is host RAM, a quarter of the RAM available); a CPU times at most `CPU_MAX_BATCH` requests.
Bad input (cap below the weights, a capacity of 0 requests, unknown config or hot policy, a timed batch
whose caches would not fit the RAM available now): one line, exit 2, before anything is allocated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
import pandas as pd

from ...engine.transfer.hot_cache import HotCache, check_settings
from ...engine.model.layers import dn_state_shapes
from ...engine.model.prefill_buffers import rotating_buffer_bytes
from ...results import Run
from ...shapes import ModelShape, planned_shape
from ...params import BadInput, fill_auto, gib, resolve_device
from ... import sweep
from .. import check_selection, plan as plan_experiment
from . import CONFIGS, SPEC, CapacityPlan
from ..device_cap import apply_cap, check_cap
from ...engine.transfer import settings_of
from ..decode_session import Caches, derive, Point, measure_decode, DecodeSession

EXPERIMENT = "capacity"
REFERENCE_CAP_GIB = 24.0     # the reference box's per-card memory (3x RTX 3090)
RAM_SHARE = 0.9              # of the RAM available now, the most a timed batch may take (as the decode sweep)
STRATEGY_OF = {"none": "resident", "prefill": "resident", "both": "hot_cache"}     # per config (`CONFIGS`)




@dataclass(frozen=True)
class Fit:
    config: str
    per_request_bytes: int     # device bytes each request adds
    shared_bytes: int          # weights + workspace + one prefill's working set
    n_device: int              # requests the cap holds
    n_host: int | None         # requests the host RAM holds (offloaded decode only)
    requests: int              # min of the two

    def row(self) -> dict:
        return {"config": self.config, "per_request_bytes": self.per_request_bytes, "shared_bytes": self.shared_bytes,
                "n_device": self.n_device, "n_host": self.n_host, "requests": self.requests}


def request_bytes(shape: ModelShape, ctx: int, config: str, budget: int, hot_capacity: int) -> int:
    """Device bytes one decoding request holds in `config` (module docstring)."""
    st, cv = dn_state_shapes(shape)
    dn = shape.deltanet_layers * (math.prod(st) * 4 + math.prod(cv) * 2)
    index = shape.attn_layers * ctx * shape.index_key_bytes
    staging = min(budget, ctx) * shape.row_bytes
    if config == "both":
        kv = HotCache.device_bytes(shape.attn_layers, 1, hot_capacity, ctx, shape.row_bytes)
    else:
        kv = shape.attn_layers * ctx * shape.row_bytes
    return dn + index + staging + kv


def shared_bytes(shape: ModelShape, ctx: int, config: str, workspace: float) -> int:
    prefill = (shape.row_bytes * ctx if config == "none"          # sync: the prefix read back, one layer
               else rotating_buffer_bytes(ctx, shape.row_bytes, shape.attn_layers))
    return shape.weight_bytes() + int(workspace) + prefill


def fit(shape: ModelShape, ctx: int, cap: float, config: str, budget: int = 2048, hot_capacity: int = 4096,
        host_cap: float | None = None, workspace: float = 2 * 2**30) -> Fit:
    per, shared = request_bytes(shape, ctx, config, budget, hot_capacity), shared_bytes(shape, ctx, config, workspace)
    n_dev = max(0, int((cap - shared) // per))
    n_host = None
    if config == "both":
        n_host = int(host_cap // (ctx * shape.kv_bytes_per_token())) if host_cap is not None else None
    n = n_dev if n_host is None else min(n_dev, n_host)
    return Fit(config, per, shared, n_dev, n_host, n)


def check(p: dict) -> CapacityPlan:
    """Decide the "auto" ones for this device and check what the SPEC cannot declare: the machine's memory,
    what crosses parameters, the files named (one line before anything is allocated); returns the plan."""
    p = dict(p)
    dev = resolve_device(p["device"])
    p["device"] = str(dev)
    fill_auto(SPEC, p, dev.type)      # shape, context_len, max_batch; then the declared bounds and choices
    if p["mem_cap_gib"] == 0:      # sized to the machine: never a cap the device does not have
        have = (torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda"
                else psutil.virtual_memory().available / 4)
        p["mem_cap_gib"] = round(min(REFERENCE_CAP_GIB, have / 2**30), 2)
    host = p["host_cap_gib"] * 2**30 if p["host_cap_gib"] > 0 else psutil.virtual_memory().total / 2
    plan = CapacityPlan.from_params({**p, "host_cap_gib": round(host / 2**30, 2)})
    shape = planned_shape(plan.shape)
    if not plan.configs:
        raise BadInput(f"configs: none given; choose from {', '.join(CONFIGS)}")
    check_cap(plan.mem_cap_gib, shape, dev)
    try:
        check_settings(plan.hot_capacity, plan.hot_policy)
    except ValueError as ex:
        raise BadInput(str(ex)) from None
    check_selection(plan.selection)
    for run_dir, key, table in ((plan.replay_run, "replay_run", "hot_replay.parquet"),
                                (plan.decode_run, "decode_run", "metrics.parquet")):
        if run_dir and not (Path(run_dir) / table).is_file():
            raise BadInput(f"{key}={run_dir}: not a run folder with {table}")
    fits = [fit(shape, plan.context_len, plan.mem_cap_gib * 2**30, c, plan.budget, plan.hot_capacity, host,
                plan.workspace_gib * 2**30) for c in plan.configs]
    for f in fits:
        if f.requests <= 0:
            why = (f"the cap leaves {gib(plan.mem_cap_gib * 2**30 - f.shared_bytes)} after weights, workspace and "
                   f"prefill buffers ({gib(f.shared_bytes)}); one request needs {gib(f.per_request_bytes)}")
            if f.n_host == 0:
                why = (f"host_cap_gib={plan.host_cap_gib} holds no request of "
                       f"{gib(plan.context_len * shape.kv_bytes_per_token())} KV")
            raise BadInput(f"config {f.config}: no request of {plan.context_len} tokens fits a "
                           f"{plan.mem_cap_gib:g} GiB cap: {why}")
    if plan.measure:
        check_host_memory(plan, shape, dev, fits_of(plan, shape))
    return plan


def fits_of(plan: CapacityPlan, shape: ModelShape) -> list[Fit]:
    """What the cap holds per config, for a checked plan (pure arithmetic on the shape)."""
    return [fit(shape, plan.context_len, plan.mem_cap_gib * 2**30, c, plan.budget, plan.hot_capacity,
                plan.host_cap_gib * 2**30, plan.workspace_gib * 2**30) for c in plan.configs]


def host_bytes(shape: ModelShape, ctx: int, f: Fit, batch: int, dev: torch.device) -> int:
    """Host RAM that timing `batch` requests of `f.config` takes: the pinned KV pool when decode is
    offloaded, and on a CPU everything the "device" holds (weights, workspace, prefill, the requests)."""
    kv = batch * ctx * shape.kv_bytes_per_token() if STRATEGY_OF[f.config] == "hot_cache" else 0
    device = f.shared_bytes + batch * f.per_request_bytes if dev.type != "cuda" else 0
    return kv + device


def check_host_memory(plan: CapacityPlan, shape: ModelShape, dev: torch.device, fits: list[Fit]) -> None:
    """Every configuration's timed batch must fit the RAM available now (one pool in memory at a time), as
    the decode sweep checks its pools: one line before anything is allocated, not a failed row after."""
    avail = psutil.virtual_memory().available
    for f in fits:
        batch = _batches_to_try(f.requests, plan.max_batch)
        need = host_bytes(shape, plan.context_len, f, batch, dev)
        if need > RAM_SHARE * avail:
            raise BadInput(f"config {f.config}: timing {batch:,} requests of {plan.context_len} tokens needs {gib(need)} "
                           f"of host RAM; {gib(avail)} is available now: lower mem_cap_gib or max_batch "
                           f"(measure=false gives the capacities alone)")


def _batches_to_try(n: int, max_batch: int) -> int:
    return min(n, max_batch) if max_batch > 0 else n


def _reusing_caches(stages, grid):
    """The decode sweep's `Caches`, except that a cache of more slots serves a smaller batch (a runner
    uses slots [0, batch)): a TPOT-bound retry does not allocate, pin and fill the host pool again."""
    class Reuse(Caches):
        def get(self, medium, conc, ctx):
            have = self.cache.get(medium)
            if have and have[0].n_slots >= conc:
                return have
            return super().get(medium, conc, ctx)

    return Reuse(stages, grid)


def decode_plan(given: dict):
    """The decode sweep's grid of one point (checked as `labkit run decode` checks it)."""
    return derive(plan_experiment("decode", given))


def measure_config(session, f: Fit, plan: CapacityPlan, batch: int, caches=None):
    """One decode point (the decode sweep's measure_decode) for `f.config` at `batch` requests."""
    strat = STRATEGY_OF[f.config]
    grid = decode_plan({"shape": plan.shape, "device": plan.device, "strategies": strat,
                        "context_lens": plan.context_len, "budgets": plan.budget, "concurrency": batch,
                        "repeats": plan.repeats, "steps": plan.steps, "prefill_lens": "", "probe": False,
                        "anatomy": False, "selection": plan.selection, "seed": plan.seed,
                        **{s.param: getattr(plan, s.param) for s in settings_of("hot_cache")}})
    caches = caches if caches is not None else _reusing_caches(session.stages, grid)
    caches.grid = grid             # sizes a new cache for this batch (the plan's only concurrency)
    return measure_decode(session.stages, caches, Point(batch, plan.context_len, plan.budget, strat, "context"),
                          grid, session.tel)


def run(plan: CapacityPlan, progress_bar: bool = True) -> Run:
    """Capacities, then the decode step of each config's batches, into a run folder (a checked plan)."""
    shape, dev = ModelShape.from_name(plan.shape), torch.device(plan.device)
    fits = fits_of(plan, shape)
    apply_cap(plan.mem_cap_gib, dev)
    r = sweep.open_run(plan.params, EXPERIMENT)
    base = {"device": plan.device, "gpu_name": r.manifest.get("gpu_name") or "cpu", "shape": shape.name,
            "context_len": plan.context_len, "budget": plan.budget, "mem_cap_bytes": int(plan.mem_cap_gib * 2**30),
            "tpot_ms_limit": plan.tpot_ms, "selection": plan.selection}
    r.update_manifest(weight_bytes=shape.weight_bytes(), fits=[f.row() for f in fits])
    if not plan.measure:
        for f in fits:
            r.add({**base, "experiment": EXPERIMENT, "status": "ok", "error": None, **f.row()})
        r.finish()
        sweep.headline(sweep.summary_lines(lambda: headline(fits, None, plan)), progress_bar, EXPERIMENT)
        return r
    grid = decode_plan({"shape": plan.shape, "device": plan.device, "strategies": "resident",
                        "context_lens": plan.context_len, "budgets": plan.budget, "concurrency": 1, "prefill_lens": "",
                        "probe": False, "seed": plan.seed})
    done: dict[tuple[str, int], dict] = {}     # none and prefill decode alike: time a batch once
    with DecodeSession(grid) as session, sweep.bar(len(fits), f"{EXPERIMENT} {shape.name}", progress_bar) as bar:
        caches = {}
        for f in fits:
            bar.set_postfix_str(f"{f.config}: {f.requests} requests")
            batch = _batches_to_try(f.requests, plan.max_batch)
            strat = STRATEGY_OF[f.config]
            for other in [k for k in caches if k != strat]:      # one medium's pool in memory at a time
                caches.pop(other).release()
            if strat not in caches:
                caches[strat] = _reusing_caches(session.stages, session.grid)
            tried = []
            for _ in range(3):      # capacity, then what a TPOT-bound scheduler would admit (twice at most)
                key = (STRATEGY_OF[f.config], batch)
                if key not in done:      # a batch that does not fit after all is a row, not the end
                    done[key] = sweep.attempt(lambda: measure_config(session, f, plan, batch, caches[strat]),
                                              on_fail=lambda ex: caches[strat].release(), strategy=strat)
                rec = done[key]
                tpot = rec.get("step_ms_median") if rec.get("status") == "ok" else None
                good = tpot is not None and tpot <= plan.tpot_ms
                tried.append((batch, tpot, good, rec))
                bar.set_postfix_str(f"{f.config} batch {batch}: " + (f"TPOT {tpot:.2f} ms" if tpot else "failed"))
                if good or batch == 1:
                    break
                if tpot is None:         # out of memory after all (workspaces the arithmetic misses): 10% fewer
                    if "memory" not in str(rec.get("error", "")).lower():
                        break
                    batch = max(1, batch - max(1, batch // 10))
                    continue
                batch = max(1, min(batch - 1, int(batch * plan.tpot_ms / tpot)))
            for b, tpot, good, rec in tried:
                rec = {k: v for k, v in rec.items() if k not in ("concurrency",)} | {"concurrency": b}
                rec = {**rec, **base, **f.row(), "experiment": EXPERIMENT, "batch": b, "tpot_ms": tpot, "good": good,
                       "goodput_tok_s": b / (tpot / 1e3) if good else 0.0}
                r.add(rec)
            bar.update()
    df = r.metrics()
    ok = df[df["status"] == "ok"]
    summary = []
    for f in fits:
        # `requests` is the arithmetic's count; `good_batch` the largest batch timed under the TPOT limit
        mine = ok[ok["config"] == f.config]
        best = mine.loc[mine["goodput_tok_s"].idxmax()] if len(mine) else None
        summary.append({"config": f.config, "requests": f.requests, "n_device": f.n_device, "n_host": f.n_host,
                        "good_batch": int(best["batch"]) if best is not None and best["goodput_tok_s"] > 0 else 0,
                        "tpot_ms": float(best["tpot_ms"]) if best is not None else None,
                        "goodput_tok_s": float(best["goodput_tok_s"]) if best is not None else 0.0})
    none = next((s["goodput_tok_s"] for s in summary if s["config"] == "none"), 0.0)
    for s in summary:
        s["goodput_vs_none"] = s["goodput_tok_s"] / none if none else None
    sdf = pd.DataFrame(summary)
    r.write_table("goodput", sdf)
    r.write_csv("goodput", sdf)
    r.write_csv("metrics", df.drop(columns=[c for c in df.columns if c.startswith("anat_")]))
    r.finish()
    sweep.headline(sweep.summary_lines(lambda: headline(fits, summary, plan)), progress_bar, EXPERIMENT)
    return r


def headline(fits, summary: list[dict] | None, plan: CapacityPlan) -> list[str]:
    """Per config: the requests the cap holds, and (when timed) the goodput under the TPOT limit."""
    by = {s["config"]: s for s in summary or []}
    lines = [f"{plan.context_len} tokens a request under {plan.mem_cap_gib:g} GiB, TPOT <= {plan.tpot_ms:g} ms:"]
    for f in fits:
        s = by.get(f.config)
        if s is None:
            good = ""
        elif not s["good_batch"]:
            good = "; no timed batch within the TPOT limit"
        else:
            good = (f"; goodput {s['goodput_tok_s']:,.0f} tok/s at batch {s['good_batch']}"
                    + (f" ({s['goodput_vs_none']:.2f}x none)" if s.get("goodput_vs_none") else ""))
        where = f"device {f.n_device}" + (f", host {f.n_host}" if f.n_host else "")
        lines.append(f"  {f.config}: {f.requests} requests held ({where}){good}")
    return lines
