"""The decode sweep (sparse offload of Qwen3.8-Flash-Next): decode speed against context length, budget and concurrency for
each transfer strategy, plus prefill speed, with engine-counted H2D bytes next to NVML's PCIe counters
and, for every point, the step's anatomy (where its time goes).

Grid: `context_lens x concurrency x strategies` at `budgets[0]` (the main table), plus `budgets[1:] x
strategies` at `budget_context` (default: the largest context) and `concurrency[0]` (the budget axis),
plus one prefill per `prefill_lens` entry. A decode point fills its requests' caches with seeded random
rows and index keys (decode time does not depend on the values); prefill is measured on its own.

    plan = experiments.plan("decode", {"context_lens": "8K,1M"})   # checked once; nothing allocated yet
    grid = derive(plan)                          # the grid it implies
    run = run_sweep(grid)                        # measures every point into a run folder

`check` decides the machine's values on the resolved parameters (a dict) and makes the plan once from them; everything
after it reads the plan's fields (`grid.plan.steps`).

A point is measured through `labkit.experiments.decode_session` (`DecodeSession`, `measure_decode`), which the
capacity and multigpu runs share; this module is the sweep: its checks, the link probe and
emulated links, prefill, the estimate and the closing lines.
"""
from __future__ import annotations

import gc
import time
from dataclasses import replace

import psutil
import torch
import pandas as pd

from ... import envs
from ...engine import Engine, OffloadCache, get_strategy
from ...engine.model.cache import PAGE_SIZE
from ...engine.drive.pipeline import staged_prefill
from ...engine.transfer import STRATEGIES, setting_names
from ...results import Run
from ...shapes import ModelShape, planned_shape
from ...telemetry import Sampler
from ...params import BadInput, check_positive, fill_auto, gib, one_line, resolve_device
from ..decode_session import ANATOMY_STEPS, EXPERIMENT, DecodeGrid, DecodeSession, Point, derive
from ..device_rates import emulated_link, hbm_read_gbps, link_rates, run_link_probe
from ... import sweep
from .. import check_selection
from . import SPEC, DecodePlan
from ...costmodel import GPU, CostModel, gpu_for_name


def check(p: dict) -> DecodePlan:
    """Validate resolved parameters against this machine and decide the "auto" ones; returns the plan. Raises
    BadInput with one line before anything is allocated (`experiments.decode.plan`). The device, the "auto" values
    and the defaults that follow from other values are decided on the dict the SPEC resolved, and the plan is made
    once from it; every check after that reads the plan's fields."""
    p = dict(p)
    devs = _devices(p["device"])
    p["device"] = ",".join(str(d) for d in devs)
    fill_auto(SPEC, p, devs[0].type)     # shape, contexts, budgets, prompts; then the declared bounds and choices
    envs.check_switch_params(p)          # the engine switches' values in their canonical form
    if not p["strategies"]:
        raise BadInput(f"strategies: none given; choose from {', '.join(STRATEGIES)}")
    if not p["context_lens"] or not p["budgets"] or not p["concurrency"]:
        raise BadInput("context_lens, budgets and concurrency need at least one value each")
    p["micro_batches"] = p["micro_batches"] or [1]
    p["budget_context"] = p["budget_context"] or max(p["context_lens"])
    plan = DecodePlan(**p)
    shape = planned_shape(plan.shape)
    for name in ("gather_rows_per_prog", "gather_num_warps"):       # zero_copy's settings, declared beside it
        check_positive(name, [getattr(plan, name)])
    settings = {k: getattr(plan, k) for k in setting_names()}
    for s in plan.strategies:
        try:
            get_strategy(s, **settings)
        except ValueError as ex:
            raise BadInput(str(ex)) from None
    if "hot_cache" in plan.strategies:
        _check_hot_capacity(plan, shape, devs[0])
    if any(budget % plan.select_block for budget in plan.budgets) or PAGE_SIZE % plan.select_block:
        raise BadInput(f"select_block must divide every budget and the page size {PAGE_SIZE}, got {plan.select_block}")
    check_selection(plan.selection)
    if len(devs) > shape.layers:
        raise BadInput(f"{len(devs)} devices for a shape of {shape.layers} layers")
    if plan.link_gbps and "zero_copy" not in plan.strategies:
        raise BadInput("link_gbps emulates the link under zero_copy's gather: add zero_copy to strategies")
    grid = derive(plan)
    # Host RAM: the biggest concurrency group's pool must fit in this machine's RAM at all.
    total = psutil.virtual_memory().total
    need = max(q.concurrency for q in grid.points) * (max(q.context_len for q in grid.points) + grid.margin) \
        * shape.kv_bytes_per_token()
    if any(STRATEGIES[s].medium == "host" for s in plan.strategies) or not grid.cuda:
        if need > total:
            raise BadInput(f"context {max(plan.context_lens)} x concurrency {max(plan.concurrency)} needs "
                           f"{gib(need)} of host KV ({shape.kv_bytes_per_token()} B/token); this machine has {gib(total)} of RAM")
    return plan


def _devices(device: str) -> list[torch.device]:
    """`device` may list several devices ("cuda:0,cuda:1,cuda:2", or "cpu,cpu" to exercise the split on a CPU):
    the layers are then split over them, one pipeline stage per device."""
    devs = [resolve_device(d.strip()) for d in str(device).split(",") if d.strip()] or [resolve_device("auto")]
    if len({d.type for d in devs}) > 1:
        raise BadInput(f"device={device}: mix of device types; use cuda:N,... or cpu,...")
    if len(devs) > 1 and devs[0].type == "cuda" and len(set(devs)) < len(devs):
        raise BadInput(f"device={device}: a GPU is listed twice")
    return devs


def _check_hot_capacity(plan: DecodePlan, shape: ModelShape, dev: torch.device) -> None:
    """The hot cache's slots of the largest batch must fit the device (RAM on a CPU) at all."""
    need = plan.hot_capacity * max(plan.concurrency) * shape.attn_layers * shape.row_bytes
    have = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else psutil.virtual_memory().total
    if need > have:
        raise BadInput(f"hot_capacity={plan.hot_capacity} x concurrency {max(plan.concurrency)} needs {gib(need)} "
                       f"of device slots; the device has {gib(have)}")


def measure_prefill(stages: list, n_tokens: int, strategy: str, grid: DecodeGrid) -> dict:
    strat = get_strategy(strategy, **grid.settings)
    dev = stages[0].device
    chunk = 8192 if dev.type == "cuda" else 512
    budget = grid.plan.budgets[0]          # the main table's
    engines = [Engine(st, OffloadCache.allocate(st, strat.medium, 1, n_tokens), get_strategy(strategy, **grid.settings),
                      budget, prefill_chunk=chunk) for st in stages]
    g = torch.Generator().manual_seed(grid.plan.seed)
    tokens = torch.randint(0, stages[0].shape.vocab, (n_tokens,), generator=g)

    def sync():
        for st in stages:
            sweep.sync(st.device)

    staged_prefill(engines, 0, tokens[: min(n_tokens, 2 * chunk)])     # warm-up: kernels, workspaces
    sync()
    t0 = time.perf_counter()
    staged_prefill(engines, 0, tokens)
    sync()
    dt = time.perf_counter() - t0
    on_dev = strat.medium == "device"
    kv = n_tokens * stages[0].shape.kv_bytes_per_token()
    return {"experiment": "prefill", "status": "ok", "error": None, "strategy": strat.name,
            "context_len": n_tokens, "budget": budget, "concurrency": 1, "repeats": 1, "steps": 1,
            "step_ms_median": dt * 1e3, "step_ms_min": dt * 1e3, "step_ms_max": dt * 1e3,
            "tok_s": n_tokens / dt, "prefill_chunk": chunk, "device_kv_bytes": kv if on_dev else 0,
            "host_kv_bytes": 0 if on_dev else kv,
            "device_index_bytes": n_tokens * stages[0].shape.index_key_bytes * stages[0].shape.attn_layers}


def _link_variants(grid: DecodeGrid, run: Run, base: dict) -> list[tuple[dict, dict]]:
    """The native link, then one emulated link per `link_gbps`: (strategy settings, row tags). The zero-copy
    gather's rate per program count is measured here for every load size of the grid (budget x concurrency
    rows a layer: a program that reads more rows per load reads them faster), the probe rows kept
    (experiment=link_probe); each target is met by the program count nearest it at the first point's load.
    What it emulates: the rate at which selected rows arrive. What it does not: a slower link's latency per
    transaction, and the SMs a full-rate gather would occupy (fewer programs leave more free)."""
    dev, plan = grid.devices[0], grid.plan
    loads = sorted({q.budget * q.concurrency for q in grid.points if q.strategy == "zero_copy"})
    rates = {n: link_rates(dev, n, repeats=10, pool_gib=2.0 if grid.cuda else 0.02) for n in loads}
    for n, r in rates.items():
        for q, g in r.items():
            run.add({**base, "experiment": "link_probe", "status": "ok", "strategy": "zero_copy", "rows_per_load": n,
                     "gather_programs": q, "gbps": g})
    first = plan.budgets[0] * plan.concurrency[0]           # the first point's rows a load
    out = [({}, {"link_gbps": 0.0, "link_gbps_measured": rates[first][0], "link": "native"})]
    for target in plan.link_gbps:
        q, got = emulated_link(rates[first], target)
        out.append(({"gather_programs": q}, {"link_gbps": float(target), "link_gbps_measured": got, "link": "emulated"}))
    run.update_manifest(link_emulation={
        "programs_gbps": {str(n): {str(q): round(g, 3) for q, g in r.items()} for n, r in rates.items()},
        "targets": {str(t): s_["gather_programs"] for (s_, _), t in zip(out[1:], plan.link_gbps)}})
    return out


def _predict_link_rows(run: Run, grid: DecodeGrid) -> None:
    """`predicted_step_ms` for each emulated-link zero_copy row: the cost model fitted on the native grid's row
    of the same context and concurrency (its link rate measured at that row's load), its transfer term scaled by
    the emulated over the native rate at the predicted row's own load. The check of the model's transfer term at
    other link rates, point by point."""
    m = pd.DataFrame(run.records)
    rates = {(int(r.rows_per_load), int(r.gather_programs)): float(r.gbps)
             for r in m[m["experiment"] == "link_probe"].itertuples()}
    fit_rows = m[~((m["experiment"] == "decode") & (m["link"] == "emulated"))]     # the native grid + the probes
    source = gpu_for_name(run.manifest.get("gpu_name")) or GPU("this", "cpu", 1.0, 5, 16, 1, 1e9)
    b0 = grid.plan.budgets[0]            # the main table's budget
    for rec in run.records:
        if rec.get("experiment") != "decode" or rec.get("link") != "emulated" or rec.get("strategy") != "zero_copy" \
                or rec.get("status") != "ok":
            continue
        c, ctx, n = int(rec["concurrency"]), int(rec["context_len"]), int(rec["budget"]) * int(rec["concurrency"])
        q = int(rec.get("gather_programs") or 0)
        try:
            model = CostModel.fit(fit_rows, grid.shape, "zero_copy", ctx, c, source, link_gbps=rates[(b0 * c, 0)])
            scale = rates[(n, q)] / rates[(n, 0)]
            pred = model.predict(source, ctx, c, int(rec["budget"]), link_scale=scale)
        except (ValueError, KeyError) as ex:
            rec["predict_error"] = one_line(ex)
            continue
        rec["predicted_step_ms"] = pred.step_ms
        rec["predicted_transfer_ms"] = pred.phases_ms["transfer"]
        rec["link_gbps_at_load"] = rates[(n, q)]
        rec["predicted_error"] = pred.step_ms / rec["step_ms_median"] - 1     # relative to the measured step
    run.write_table("metrics", run.metrics())


def _sweep_once(grid: DecodeGrid, run: Run, base: dict, prefill: list, tel: Sampler, bar) -> None:
    """The grid's points and the prefill lengths, with the engine as it is now configured."""
    with DecodeSession(grid, tel) as session:
        if session.stage_layers:
            run.update_manifest(stage_layers=[list(r) for r in session.stage_layers])
        for pt in grid.points:
            bar.set_postfix_str(f"{pt.strategy} ctx={pt.context_len} c={pt.concurrency} b={pt.budget}")
            run.add({**base, **session.measure(pt)})
            bar.update()
        session.caches.release()
        for n, s in prefill:
            bar.set_postfix_str(f"prefill {s} {n}")
            rec = sweep.attempt(lambda: measure_prefill(session.stages, n, s, grid), {"experiment": "prefill"},
                                strategy=s, context_len=n)
            run.add({**base, **rec})
            gc.collect()
            bar.update()


def run_sweep(grid: DecodeGrid, run: Run | None = None, progress_bar: bool = True) -> Run:
    """Measure every point of a checked plan's grid into a run folder; a failing point becomes a failed row."""
    plan, shape, dev = grid.plan, grid.shape, grid.devices[0]
    if run is None:
        run = sweep.open_run(plan.params, EXPERIMENT)        # the manifest records the plan as a dict
    base = {"device": plan.device, "gpu_name": run.manifest.get("gpu_name") or "cpu", "shape": shape.name}
    # Prefill is measured once per length, with the KV pool where the offloaded strategies keep it.
    # (plain rows, no mirror of them to keep up to date; a graphable one first: the prefill path the sweep's
    # offloaded strategies share)
    host = sorted((s for s in plan.strategies if STRATEGIES[s].medium == "host" and not STRATEGIES[s].mirrors),
                  key=lambda s: not STRATEGIES[s].graphable)
    prefill = [(n, (host or plan.strategies)[0]) for n in plan.prefill_lens]
    variants = envs.variants(plan.params)       # envs reads the switch parameters by their names
    n_zc = sum(q.strategy == "zero_copy" for q in grid.points) * len(plan.link_gbps)
    bar = sweep.bar((len(grid.points) + n_zc + len(prefill)) * len(variants), f"{EXPERIMENT} {shape.name}", progress_bar)
    tel = Sampler(gpus=[d.index or 0 for d in grid.devices] if grid.cuda else [])
    run.update_manifest(telemetry=tel.reason or "nvml", weight_bytes=shape.weight_bytes(), shape_info=shape.summary())
    try:
        # The link probe runs before the NVML sampler thread starts: the thread's reads (and the GIL it
        # takes) slowed the host-side gathers of an in-sweep probe by up to 3x.
        if plan.probe:
            bar.set_postfix_str("link probe")
            with sweep.point(run, {**base, "experiment": "probe"}):
                # the link only: the weight products are `labkit run probe`'s (they would add their GEMV
                # compiles to every sweep)
                for r in run_link_probe(str(dev), pool_gib=8.0 if grid.cuda else 0.05, repeats=10):
                    run.add({**base, **r})
            gc.collect()
        if grid.cuda:   # the roofline's denominator, measured in this run whether or not the probe ran
            run.add({**base, **hbm_read_gbps(dev)})
        tel.start()
        # Engine switches given as parameters: the whole grid once per combination, the model rebuilt under
        # each (its kernels and layout are chosen when it is built), rows tagged with the combination.
        links = _link_variants(grid, run, base) if plan.link_gbps else [({}, {})]
        for variant in variants:
            before = envs.apply(variant)
            tag = {"engine_variant": envs.variant_name(variant), **variant} if variant else {}
            try:
                for settings, link_tag in links:
                    # an emulated link changes zero_copy's gather alone: the other strategies ran on the native pass
                    on_link = replace(grid, settings={**grid.settings, **settings},
                                      points=tuple(q for q in grid.points if q.strategy == "zero_copy")) \
                        if settings else grid
                    _sweep_once(on_link, run, {**base, **tag, **link_tag}, prefill if not settings else [], tel, bar)
            finally:
                envs.apply(before)
        if plan.link_gbps:
            _predict_link_rows(run, grid)
    finally:
        bar.close()
        tel.stop()
        tf = tel.frame()
        run.write_table("telemetry", tf)
        if not tf.empty and "pcie_gen" in tf and tf["pcie_gen"].notna().any():
            # Idle links drop generation: record the link as seen under load.
            run.update_manifest(pcie_gen=int(tf["pcie_gen"].max()), pcie_width=int(tf["pcie_width"].max()),
                                nvml_max_counter_gap_s=round(tel.max_gap_s, 4))
        run.finish()        # the shared rule; an exception in flight (Ctrl-C included) decides too
    sweep.headline(sweep.summary_lines(lambda: headline(run.metrics(), plan.params, run.manifest)), progress_bar,
                   EXPERIMENT)
    return run


# ---------------------------------------------------------------------------------------------- how long
CALIBRATE_FROM = 2e8      # token-steps (requests x context x steps, summed) below which no CPU met took ten minutes
ANATOMY_STEP_COST = 2 * ANATOMY_STEPS + 2     # steps an anatomy adds to a point (runner.anatomy advances this many)


def _point_steps(q: Point, plan: DecodePlan) -> int:
    """Decode steps a point runs: warm-up, the timed ones, its anatomy (a slow strategy: fewer, none)."""
    if STRATEGIES[q.strategy].slow:
        return 1 + plan.per_row_steps
    return 2 + plan.repeats * plan.steps + (ANATOMY_STEP_COST if plan.anatomy else 0)


def _calibrate(grid: DecodeGrid) -> tuple[float, float, float]:
    """This CPU now, timed on the plan's own shape: (ms a step costs a request, ms per context token a request,
    ms per cache token filled), from two short points at 2K and 32K tokens."""
    lens = [2048, 32768]
    plan = grid.plan
    strat = next((s for s in plan.strategies if not STRATEGIES[s].slow), plan.strategies[0])
    cal = derive(replace(plan, context_lens=lens, concurrency=[1], strategies=[strat], repeats=1, steps=3,
                         anatomy=False, probe=False, prefill_lens=[], link_gbps=[], budgets=plan.budgets[:1]))
    ms, walls = [], []
    with DecodeSession(cal) as s:
        for q in cal.points:
            t = time.perf_counter()
            rec = s.measure(q)
            walls.append((time.perf_counter() - t) * 1e3)
            if rec.get("status") != "ok":
                raise RuntimeError(rec.get("error"))
            ms.append(float(rec["step_ms_median"]))
    per_token = max(0.0, (ms[1] - ms[0]) / (lens[1] - lens[0]))
    fixed = max(0.0, ms[0] - per_token * lens[0])
    fill = max(0.0, walls[0] - (2 + 3) * ms[0]) / (lens[1] + cal.margin)     # the first point built the cache
    return fixed, per_token, fill


def _seconds(grid: DecodeGrid, cost: tuple[float, float, float], **change) -> tuple[float, dict]:
    """Seconds the plan (with `change`d parameters) is expected to take at `cost`, and seconds per context."""
    if change:
        grid = derive(replace(grid.plan, **change))
    plan = grid.plan
    fixed, per_token, fill = cost
    by_ctx: dict[int, float] = {}
    for q in grid.points:
        t = _point_steps(q, plan) * q.concurrency * (fixed + per_token * q.context_len) / 1e3
        by_ctx[q.context_len] = by_ctx.get(q.context_len, 0.0) + t
    media = {STRATEGIES[s].medium for s in plan.strategies}
    for c in plan.concurrency:                 # each group's caches, built once per medium at its largest context
        largest = grid.group_context(c)
        by_ctx[largest] = by_ctx.get(largest, 0.0) + len(media) * c * (largest + grid.margin) * fill / 1e3
    for n in plan.prefill_lens:                # a prompt of n tokens: about n steps of one request over its prefix
        by_ctx[n] = by_ctx.get(n, 0.0) + n * (fixed + per_token * n / 2) / 1e3 / 8
    return sum(by_ctx.values()) + (30.0 if plan.probe else 0.0) + 20.0, by_ctx      # the probe; kernel and report


def _format_size(v: int) -> str:
    return f"{v >> 20}M" if v >= 1 << 20 and not v % (1 << 20) else f"{v >> 10}K" if v >= 1024 and not v % 1024 else str(v)


def estimate(grid: DecodeGrid):
    """How long this sweep is expected to take on this machine (`sweep.Estimate`), timed on the CPU it runs on
    (about two seconds, only for sweeps big enough to matter); None where the lab does not estimate it (a GPU:
    its points cost compiles and graph captures a short timing does not see; a shape too big to build twice)."""
    plan = grid.plan
    if grid.cuda or len(grid.devices) > 1 or grid.shape.weight_bytes() > 1 << 30:
        return None
    work = sum(q.concurrency * q.context_len * _point_steps(q, plan) for q in grid.points)
    if work < CALIBRATE_FROM:
        return None
    cost = _calibrate(grid)
    total, by_ctx = _seconds(grid, cost)
    top = max(by_ctx, key=by_ctx.get)
    heaviest = f"the {_format_size(top)}-token points take {by_ctx[top] / total:.0%} of it" if len(by_ctx) > 1 else ""
    shrink = []
    largest = max(plan.context_lens)
    smaller = [c for c in plan.context_lens if c != largest]
    if smaller:
        budget_context = max(smaller) if plan.budget_context == largest else plan.budget_context
        shrink.append((f"-p context_lens={','.join(_format_size(c) for c in smaller)}",
                       _seconds(grid, cost, context_lens=smaller, budget_context=budget_context)[0]))
    elif largest >= 16 << 10:        # one context: a quarter of it
        q = largest // 4
        shrink.append((f"-p context_lens={_format_size(q)}", _seconds(grid, cost, context_lens=[q], budget_context=q)[0]))
    if plan.repeats * plan.steps > 10:
        shrink.append(("-p repeats=2 -p steps=5", _seconds(grid, cost, repeats=2, steps=5)[0]))
    if max(plan.concurrency) > 1:
        shrink.append(("-p concurrency=1", _seconds(grid, cost, concurrency=[1])[0]))
    return sweep.Estimate(total, f"{len(grid.points)} points; from a timing of this CPU just now", heaviest, shrink)


def headline(m, p: dict, mf: dict | None = None) -> list[str]:
    """What `make sweep` closes with: where it ran (a CPU's timings are that CPU's, never a GPU's), tok/s per
    strategy at the largest context of the main table (its largest concurrency, first budget) with each one's
    slowest..fastest repeat, whether those ranges overlap (then the order among them is noise), the prefill's tok/s
    at its longest prompt, and the busy machine's caveat (`sweep.machine_busy`), as the report says them."""
    mf = mf or {}
    d = m[(m["experiment"] == EXPERIMENT) & (m["status"] == "ok") & (m["axis"] == "context")]
    gpu = mf.get("gpu_name")
    if gpu:
        link = f"PCIe gen {mf['pcie_gen']:g} x{mf['pcie_width']:g}" if isinstance(mf.get("pcie_gen"), (int, float)) \
            and isinstance(mf.get("pcie_width"), (int, float)) else "PCIe link not read"
        lines = [f"on {gpu} ({link}), shape {p['shape']}"]
    else:
        lines = [f"on a CPU ({mf.get('cpu_count') or '?'} cores, no GPU: \"host\" and \"device\" are both RAM), shape "
                 f"{p['shape']}: a check that the pipeline runs; these timings are this CPU's, never a GPU's"]
    if len(d):
        ctx = int(d["context_len"].max())
        at = d[d["context_len"] == ctx]
        conc = int(at["concurrency"].max())
        at = at[at["concurrency"] == conc].sort_values("tok_s").groupby("strategy", sort=False).tail(1)
        at = at.set_index("strategy").loc[[s for s in dict.fromkeys(d["strategy"]) if s in set(at["strategy"])]]
        slow = conc / (at["step_ms_max"] / 1e3)
        fast = conc / (at["step_ms_min"] / 1e3)
        lines.append(f"at {ctx} tokens x {conc} request(s), tok/s (slowest..fastest repeat): " + ", ".join(
            f"{s} {v:,.0f} ({lo:,.0f}..{hi:,.0f})" for s, v, lo, hi in zip(at.index, at["tok_s"], slow, fast)))
        order = list(at["tok_s"].sort_values(ascending=False).index)
        overlap = [(a, b) for a, b in zip(order, order[1:]) if slow[a] <= fast[b]]
        if overlap:
            lines.append("their ranges overlap (" + ", ".join(f"{a} and {b}" for a, b in overlap) + "): the order "
                         "between those is noise, not a finding")
    pre = m[(m["experiment"] == "prefill") & (m["status"] == "ok")]
    if len(pre):
        r = pre.loc[pre["context_len"].idxmax()]
        lines.append(f"prefill of {int(r['context_len'])} tokens ({r['strategy']}): {r['tok_s']:,.0f} tok/s")
    if len(d):
        busy = sweep.machine_busy(mf, d["step_ms_max"] / d["step_ms_min"])
        if busy:
            lines.append(f"busy machine ({busy}): these timings measured other work too; run again on a quiet "
                         "machine before reading anything into them")
    failed = int((m["status"] == "failed").sum())
    if failed:
        lines.append(f"{failed} point(s) failed (their errors are in the report)")
    return lines
