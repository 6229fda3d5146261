"""Concurrency scaling with every request offloaded: one batch vs two batches switched (PulseInfer).

    labkit run pulse_scaling --out DIR -p context=1M -p requests=1,2,4,8,12,16

For N requests at `context` tokens, all with their KV in pinned host RAM (`strategy`, default zero_copy):
- `no_switch`: one batch of N; at every QSA layer the batch's selected rows cross the link while the GPU
  waits (the indexer needs that layer's query before it knows which rows to fetch);
- `switched`: two batches of ceil(N/2) and floor(N/2), `switching.pingpong_round`: each computes while
  the other's rows travel;
- `resident` at N, ceil(N/2), floor(N/2): the same steps with the rows in HBM, i.e. the compute C(B);
- the link: one contiguous pinned copy of a request's step of rows (GB/s), and HBM: a device copy.

Every request's KV is the *same* host rows (one pool of `context` tokens; every slot's page table maps
to it): 16 distinct 1M-token contexts would need 412 GB of host RAM, and decode time does not depend
on the values. The link still carries each request's rows separately (bytes counted from the loads).

The bound (`two_batch_bound`, derived in its docstring) is drawn from the measured C(B) and the measured
link rate; `crossover_requests` gives the N above which switching can pay from the physics alone
(weight bytes / HBM bandwidth vs a request's selected-row bytes / link bandwidth).
Run folder: `metrics.parquet` (one row per N and mode), `timeline.parquet` (one switched round per N).
"""
from __future__ import annotations

import dataclasses
import statistics

import pandas as pd
import torch

from ... import sweep
from ...engine.model.cache import OffloadCache
from ...engine.transfer import check_host_strategy, setting_names
from ...params import BadInput, check_positive
from ...shapes import ModelShape
from ...sweep import failed_row, wall_ms
from ...engine import Engine, HybridModel, get_strategy
from ...engine.drive.dispatch import warm_up
from ...engine.drive.runner import DecodeState
from ...engine.drive.switching import Timeline, Loader, capture_pieces, pingpong_round, replay, replay_inline, sequential_round
from ...engine.model.kv import KVPool
from .. import for_this_machine
from . import SPEC, PulseScalingPlan

EXPERIMENT = "pulse_scaling"


def check(p: dict) -> PulseScalingPlan:
    """Decide the "auto" ones for this device and check what crosses parameters (one BadInput line before anything
    is allocated); returns the plan."""
    plan = PulseScalingPlan.from_params(for_this_machine(SPEC, p))       # the declared bounds checked there
    check_host_strategy(plan.strategy, "every request is offloaded")
    check_positive("requests", plan.requests or [0])      # none given
    if not 1 <= plan.budget <= plan.context:
        raise BadInput(f"budget {plan.budget} must be in [1, context {plan.context}]")
    if plan.budget % plan.select_block or plan.page_size % plan.select_block:
        raise BadInput(f"select_block must divide budget and page_size, got {plan.select_block}")
    return plan


# ------------------------------------------------------------------------------------------ the bound
def two_batch_bound(c_full: float, c_a: float, c_b: float, t_a: float, t_b: float) -> dict:
    """Step times (ms per round of one token for every request) from measured parts.

    c_full: compute of one step of the merged batch (rows already on the device); c_a, c_b: compute of
    one step of each half; t_a, t_b: link time of each half's selected rows in one step.

    - one batch, no switching: each QSA layer's rows are requested only once that layer's query exists
      and the next layer needs them, so compute and transfer add: `no_switch = c_full + t_a + t_b`;
    - two batches switched cannot beat (a) the GPU's work, both halves' compute, each of which reads
      every weight once: `c_a + c_b`, (b) the link carrying both halves' rows one after another:
      `t_a + t_b`, (c) either half's own chain of compute and transfer: `c_x + t_x`. So
      `switched >= max(c_a + c_b, t_a + t_b, c_a + t_a, c_b + t_b)`.
    With C(B) = W + B c (W the weight read, c per request) and T = t_a + t_b, switching can only win when
    max(2W + N c, T, ...) < W + N c + T, i.e. when T > W (`c_a + c_b - c_full = W`): the transfer of the
    merged batch must outweigh one extra read of the weights. The best it can do is hide the smaller of
    the two: the gain is at most `no_switch / max(c_a + c_b, t_a + t_b)`."""
    no_switch = c_full + t_a + t_b
    floor = max(c_a + c_b, t_a + t_b, c_a + t_a, c_b + t_b)
    return {"no_switch_model_ms": no_switch, "switched_floor_ms": floor, "gain_bound": no_switch / floor,
            "extra_weight_ms": c_a + c_b - c_full, "transfer_ms": t_a + t_b}


def crossover_requests(weight_bytes: float, hbm_gbps: float, row_bytes_per_request: float, link_gbps: float) -> float:
    """N above which two switched batches can beat one: the merged batch's transfer N * t must exceed
    the extra weight read W (see `two_batch_bound`): N* = (weight_bytes / HBM) / (row bytes / link)."""
    if min(weight_bytes, hbm_gbps, row_bytes_per_request, link_gbps) <= 0:
        raise ValueError("weight bytes, bandwidths and row bytes must be > 0")
    return (weight_bytes / hbm_gbps) / (row_bytes_per_request / link_gbps)


# ------------------------------------------------------------------------------------ the measurement
def _link_probe(pool, nbytes: int, dev, repeats: int = 10) -> dict:
    """Contiguous pinned H2D of `nbytes` from the pool (the link's reference) and a device-to-device
    copy of the same size (HBM: read + write counted)."""
    words = nbytes // 8
    src = pool.data.view(-1)[:words]
    dst = torch.empty(words, dtype=torch.int64, device=dev)
    d2 = torch.empty_like(dst)
    h2d = wall_ms(lambda: dst.copy_(src, non_blocking=True), repeats, dev)
    d2d = wall_ms(lambda: d2.copy_(dst), repeats, dev)
    return {"link_gbps": nbytes / statistics.median(h2d) / 1e6, "hbm_gbps": 2 * nbytes / statistics.median(d2d) / 1e6}


@torch.inference_mode()
def scaling(shape, device: str = "cuda", context: int = 1 << 20, requests=(1, 2, 4, 8, 16), budget: int = 2048,
            strategy: str = "zero_copy", steps: int = 10, warmup: int = 2, graphs: bool = True,
            compile: bool = False, page_size: int = 256, seed: int = 0, log=print, select_block: int = 1,
            settings: dict | None = None, bar=None):
    """Rows (one per N and mode) and one switched round's timeline per N; see the module doc. `bar` (a
    `sweep.bar`) advances per request count."""
    requests = sorted(set(int(n) for n in requests))
    if not requests or requests[0] < 1:
        raise BadInput(f"requests must be >= 1, got {requests}")
    if budget > context:
        raise BadInput(f"budget {budget} exceeds context {context}")
    dev = torch.device(device)
    settings = settings or {}
    st_off = get_strategy(strategy, **settings)
    if st_off.medium != "host":
        raise BadInput(f"strategy {strategy} keeps KV on the device; choose an offload strategy")
    # a host strategy (block_dma, coalesced) runs its steps as graph pieces cut at its loads, loads between
    graphs = graphs and dev.type == "cuda"
    n_max, half = requests[-1], -(-requests[-1] // 2)
    rounds = len(requests) * 8 * (steps + warmup + 2) + 16        # every mode advances the lengths
    capacity = context + rounds
    model = HybridModel(shape, dev, seed=seed)
    host, full, ca, cb, res_full = _caches(model, shape, dev, n_max, half, context, capacity, page_size, seed)
    req_bytes = budget * shape.row_bytes * model.n_attn
    probe = _link_probe(host, req_bytes, dev) if dev.type == "cuda" else {"link_gbps": None, "hbm_gbps": None}
    weight_bytes = model.step_weight_bytes()
    base = {"experiment": "pulse_scaling", "status": "ok", "error": None, "device": str(dev),
            "gpu_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "shape": shape.name,
            "strategy": strategy, "context_len": context, "budget": budget, "graphs": graphs, "compile": compile,
            "select_block": select_block, **st_off.settings(),
            "weight_bytes": weight_bytes, "row_bytes_per_request": req_bytes, **probe}
    if probe["link_gbps"]:
        base["crossover_physics"] = crossover_requests(weight_bytes, probe["hbm_gbps"], req_bytes, probe["link_gbps"])
    rows, spans = [], []
    for n in requests:
        na, nb = -(-n // 2), n // 2
        if bar is not None:
            bar.set_postfix_str(f"{n} request(s)")
        try:
            kw = dict(compile=compile, select_block=select_block)
            lanes = {"no_switch": (Engine(model, full, st_off, budget, **kw), n),
                     "resident": (Engine(model, res_full, get_strategy("resident"), budget, **kw), n),
                     "resident_a": (Engine(model, res_full, get_strategy("resident"), budget, **kw), na)}
            if nb:
                lanes["resident_b"] = (Engine(model, res_full, get_strategy("resident"), budget, **kw), nb)
                lanes["a"] = (Engine(model, ca, get_strategy(strategy, **settings), budget, **kw), na)
                lanes["b"] = (Engine(model, cb, get_strategy(strategy, **settings), budget, **kw), nb)
            states = {}
            for k, (e, b) in lanes.items():
                s = DecodeState(e, b, None, rounds)
                e.strategy.bind(e.cache, b, s.k)
                states[k] = (e, s)
            timed, sw = _timed_rounds(states, graphs, nb, model.device)
            ms = {}
            for k, fn in timed.items():
                t = wall_ms(fn, steps, dev, warmup=warmup)
                ms[k] = (statistics.median(t), min(t), max(t))
            rows += _point_rows(base, ms, n, na, nb, req_bytes, probe["link_gbps"], log)
            if nb:
                tl = Timeline(dev.type == "cuda")
                stats = sw(tl)
                rows[-2]["h2d_bytes_per_step_counted"] = sum(int(r.h2d_bytes) for r in stats.loads_offloaded)
                spans += [{"concurrency": n, **s} for s in tl.spans()]
        except Exception as ex:      # noqa: BLE001 - a failed point is a row, the sweep goes on
            rows.append(failed_row(ex, {**base, "mode": "failed", "concurrency": n}))
            log(f"N={n}: {rows[-1]['error']}")
        finally:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            if bar is not None:
                bar.update()
    return rows, spans


def _caches(model, shape, dev, n_max: int, half: int, context: int, capacity: int, page_size: int, seed: int):
    """One host pool behind three caches (all n_max requests; the halves a and b) and the full cache's slots on a
    device pool (rows in HBM: the same compute without the link). Returns (host, full, a, b, resident_full)."""
    n_pages = -(-capacity // page_size)
    host = KVPool("host", model.n_attn, n_pages, page_size, shape.row_bytes, dev)
    host.fill_random_(seed)
    devpool = KVPool("device", model.n_attn, n_pages, page_size, shape.row_bytes, dev)
    devpool.fill_random_(seed)
    full = OffloadCache.aliased(model, host, n_max, context, capacity, page_size, seed)
    ca = OffloadCache.aliased(model, host, half, context, capacity, page_size, seed + 10)
    cb = OffloadCache.aliased(model, host, half, context, capacity, page_size, seed + 20)
    return host, full, ca, cb, dataclasses.replace(full, pool=devpool)


def _timed_rounds(states: dict, graphs: bool, nb: int, device):
    """Per lane but a and b, one decode round as a callable (graph pieces replayed inline, or the eager round);
    with two batches (nb > 0) also the switched round of lanes a and b, `sw(timeline=None)`, as `timed["switched"]`.
    Returns (timed, sw); sw is None with one batch."""
    timed, sw = {}, None
    if graphs:
        warm_up(lambda: sequential_round(list(states.values())), device)
        pool = torch.cuda.graph_pool_handle()
        whole = {k: capture_pieces(e, s, "none" if e.strategy.graphable else "loads", pool)
                 for k, (e, s) in states.items() if k not in ("a", "b")}
        if nb:
            pa = capture_pieces(*states["a"], "loads", torch.cuda.graph_pool_handle())
            pb = capture_pieces(*states["b"], "loads", torch.cuda.graph_pool_handle())
        torch.cuda.synchronize()
        for k, pieces in whole.items():
            timed[k] = (lambda p=pieces, e=states[k][0]: replay_inline(p, e))
        if nb:
            la, lb = Loader(states["a"][0]), Loader(states["b"][0])

            def sw(tl=None):
                return pingpong_round(*states["a"], *states["b"], (la, lb), tl, replay(pa), replay(pb))
    else:
        for k, es in states.items():
            if k not in ("a", "b"):
                timed[k] = (lambda es=es: sequential_round([es]))
        if nb:
            la, lb = Loader(states["a"][0]), Loader(states["b"][0])

            def sw(tl=None):
                return pingpong_round(*states["a"], *states["b"], (la, lb), tl)
    if nb:
        timed["switched"] = sw
    return timed, sw


def _point_rows(base: dict, ms: dict, n: int, na: int, nb: int, req_bytes: int, link, log) -> list[dict]:
    """One row per mode measured at n requests (no_switch, switched, resident, in that order), each with the
    two-batch bound from the compute times and the link's rate."""
    rows = []
    t_req = req_bytes / link / 1e6 if link else None
    c_full = ms["resident"][0]
    c_a = ms["resident_a"][0]
    c_b = ms["resident_b"][0] if nb else 0.0
    bound = two_batch_bound(c_full, c_a, c_b, na * t_req, nb * t_req) if t_req else {}
    for mode in ("no_switch", "switched", "resident"):
        if mode not in ms:
            continue
        med, lo, hi = ms[mode]
        rows.append({**base, "mode": mode, "concurrency": n, "batch_a": na if mode == "switched" else n,
                     "batch_b": nb if mode == "switched" else 0, "step_ms_median": med, "step_ms_min": lo,
                     "step_ms_max": hi, "tok_s": n / med * 1e3, "compute_full_ms": c_full,
                     "compute_a_ms": c_a, "compute_b_ms": c_b,
                     "h2d_bytes_per_step": 0 if mode == "resident" else n * req_bytes, **bound})
        log(f"N={n:2d} {mode:9s} {med:8.2f} ms  {n / med * 1e3:8.1f} tok/s"
            + (f"  (bound: no-switch {bound['no_switch_model_ms']:.2f}, switched >= {bound['switched_floor_ms']:.2f})"
               if bound and mode != "resident" else ""))
    return rows


def headline(m) -> list[str]:
    """tok/s of one batch against two switched, per request count, and where switching starts to pay."""
    ok = m[(m["experiment"] == "pulse_scaling") & (m["status"] == "ok")]
    t = ok.pivot_table(index="concurrency", columns="mode", values="tok_s", aggfunc="max")
    def vs(r) -> str:
        v = r.get("switched")
        return "" if v is None or v != v else f" vs {v:,.0f}"
    parts = [f"{n}: {r['no_switch']:,.0f}{vs(r)}" for n, r in t.to_dict("index").items()]
    lines = [f"tok/s one batch vs two switched, by requests ({ok['strategy'].iloc[0]}, {int(ok['context_len'].iloc[0])} "
             "tokens each): " + "; ".join(parts)]
    if "switched" in t:
        wins = t.index[t["switched"] > t["no_switch"]]
        lines.append(f"switching pays from {int(wins.min())} requests" if len(wins) else "switching did not pay at any count")
    return lines


def run(plan: PulseScalingPlan, progress_bar: bool = True):
    """Measure a checked plan into a run folder; returns the Run."""
    run = sweep.open_run(plan.params, EXPERIMENT)
    try:
        with sweep.bar(len(plan.requests), EXPERIMENT, progress_bar) as bar:
            rows, spans = scaling(ModelShape.from_name(plan.shape), plan.device, plan.context, plan.requests,
                                  plan.budget, plan.strategy, plan.steps, graphs=plan.graphs, compile=plan.compile,
                                  page_size=plan.page_size, seed=plan.seed, select_block=plan.select_block,
                                  settings={k: getattr(plan, k) for k in setting_names()}, log=lambda *a: None,
                                  bar=bar)
    except Exception as ex:      # before any point (the model, the pools): the run's one failed row
        run.add(sweep.failed_row(ex, {"experiment": EXPERIMENT}))
        run.finish(error=ex)
        return run
    for r in rows:
        run.add(r)
    run.write_table("timeline", pd.DataFrame(spans))
    run.finish()                 # the shared rule over the rows
    sweep.headline(sweep.summary_lines(lambda: headline(run.metrics())), progress_bar, EXPERIMENT)
    return run
