"""Two-batch switching against running the batches one after the other (PulseInfer).

    labkit run pulse_switch -p shape=qwen3.8-flash-next -p contexts=64K -p offload_batches=4 \
        -p normal_batch=4 -p normal_context=8K -p steps=20

One point: a normal batch (KV resident on the device) and an offloaded batch (KV in pinned host RAM,
`strategy`), both at random seeded contents (`OffloadCache.fill_random_`: decode time does not depend
on the values). Measured, each with `steps` rounds after `warmup`, eager (no CUDA graphs):
- `normal_only`, `offload_only`: one batch's step alone (C_n; C_o + T);
- `sequential`: both steps in turn, loads inline (the "no switching" baseline: C_n + C_o + T);
- `switched`: `switching.switched_round` (loads on a side stream, event queries at block boundaries).
Bound: a switched round cannot beat the GPU work of both batches, C_n + C_o (`normal_only_ms` +
`offload_compute_ms`, the offloaded batch's step with the same rows on the device: no link), nor the
offloaded batch's own chain of layer -> selection -> transfer -> attention (`offload_only_ms`):
`bound_ms = max(C_n + C_o, offload_only_ms)`; the sequential round is C_n + offload_only_ms. Switching
therefore pays at most `min(C_n, T)` per round (T = offload_only - C_o, the transfer time the offloaded
batch waits): nothing when the transfers are negligible, and it re-reads the weights once per batch
where one merged batch would read them once. One round's timeline is kept.
"""
from __future__ import annotations

import statistics

import pandas as pd
import torch

from ... import sweep
from ...engine import Engine, HybridModel, OffloadCache, get_strategy
from ...engine.drive.dispatch import warm_up
from ...engine.drive.runner import DecodeState
from ...engine.drive.switching import Loader, Timeline, capture_pieces, replay, replay_inline, sequential_round, switched_round
from ...engine.transfer import check_host_strategy, setting_names, strategy_params
from ...params import BadInput, check_positive, kv_pairs, parse_value
from ...shapes import ModelShape
from ...sweep import wall_ms
from .. import for_this_machine
from . import SPEC, PulseSwitchPlan

EXPERIMENT = "pulse_switch"


def check(p: dict) -> PulseSwitchPlan:
    """Decide the "auto" ones for this device and check what crosses parameters (one BadInput line before anything
    is allocated); returns the plan."""
    plan = PulseSwitchPlan.from_params(for_this_machine(SPEC, p))       # the declared bounds checked there
    check_host_strategy(plan.strategy, "the offloaded batch needs one")
    check_positive("contexts", plan.contexts or [0])            # none given
    check_positive("offload_batches", plan.offload_batches or [0])
    if plan.budget % plan.select_block or any(c < plan.budget for c in plan.contexts):
        raise BadInput(f"budget {plan.budget} must be a multiple of select_block {plan.select_block} and "
                       f"no larger than every context")
    return plan


def _lane(model, strategy, batch, ctx, budget, steps, seed, compile=False, select_block=1, settings=None):
    st = get_strategy(strategy, **(settings or {}))
    cache = OffloadCache.allocate(model, st.medium, batch, ctx + steps + 8, page_size=256)
    cache.fill_random_([ctx] * batch, seed=seed)
    e = Engine(model, cache, st, budget, compile=compile, select_block=select_block)
    s = DecodeState(e, batch, None, steps + 8)
    st.bind(cache, batch, s.k)
    return e, s


@torch.inference_mode()
def switching_point(shape: ModelShape, device: str = "cuda", context: int = 65536, offload_batch: int = 4,
                    normal_batch: int = 4, normal_context: int = 8192, budget: int = 2048,
                    strategy: str = "zero_copy", steps: int = 10, warmup: int = 2, seed: int = 0,
                    graphs: bool = True, lookahead: int = 2, compute_ref: bool = True,
                    compile: bool | None = None, select_block: int = 1, settings: dict | None = None) -> dict:
    """One measured point (see the module doc). With `graphs` (CUDA, graphable strategy): every mode
    replays CUDA graphs: whole steps for the single and sequential modes, steps cut at block
    boundaries (normal) and at loads (offloaded) for `switched`, paced `lookahead` blocks ahead.
    `select_block`: the offloaded batch (and its compute reference) selects whole aligned blocks of
    that many positions (`block_dma` then moves one 32 KiB unit per block of the reference shape)."""
    dev = torch.device(device)
    graphs = graphs and dev.type == "cuda"        # a host strategy's step: graph pieces with its loads between
    # torch.compile'd block pieces on CUDA (as DecodeRunner): un-fused, a graph replay of the reference
    # step is ~9 ms of small kernels against 3.1 ms of weight reads, and would flatter the overlap
    compile = dev.type == "cuda" if compile is None else compile
    model = HybridModel(shape, dev, seed=seed)
    total = 8 * (steps + warmup) + 16          # every mode and capture advances the lengths
    n_e, n_s = _lane(model, "resident", normal_batch, normal_context, budget, total, seed, compile)
    o_e, o_s = _lane(model, strategy, offload_batch, context, budget, total, seed + 10, compile, select_block,
                     settings)
    lanes = {"n": (n_e, n_s), "o": (o_e, o_s)}
    if compute_ref:     # the offloaded batch's rows on the device: its compute without the link
        lanes["r"] = _lane(model, "resident", offload_batch, context, budget, total, seed + 10, compile, select_block)
    loader = Loader(o_e)
    last = {}
    if graphs:
        warm_up(lambda: sequential_round(list(lanes.values())), model.device)
        full_pool = torch.cuda.graph_pool_handle()
        full = {k: capture_pieces(e, s_, "none" if e.strategy.graphable else "loads", full_pool)
                for k, (e, s_) in lanes.items()}
        # separate pools: pieces of the two batches interleave, so neither may reuse the other's memory
        n_pieces = capture_pieces(n_e, n_s, "blocks", torch.cuda.graph_pool_handle())
        o_pieces = capture_pieces(o_e, o_s, "loads", torch.cuda.graph_pool_handle())
        torch.cuda.synchronize()

        def seq(keys):
            def run():
                for k in keys:          # a host strategy's loads inline (sync) between its pieces
                    replay_inline(full[k], lanes[k][0])
            return run

        def sw(tl=None):
            last["stats"] = switched_round(n_e, n_s, o_e, o_s, loader, tl, n_gen=replay(n_pieces),
                                           o_gen=replay(o_pieces), lookahead=lookahead)
    else:
        def seq(keys):
            return lambda: last.__setitem__("stats", sequential_round([lanes[k] for k in keys]))

        def sw(tl=None):
            last["stats"] = switched_round(n_e, n_s, o_e, o_s, loader, tl)

    modes = {"normal_only": seq("n"), "offload_only": seq("o"), "sequential": seq("no"), "switched": sw}
    if compute_ref:
        modes["offload_compute"] = seq("r")
    out = {"shape": shape.name, "device": str(dev), "gpu_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "strategy": strategy, "context_len": context, "offload_batch": offload_batch, "normal_batch": normal_batch,
           "normal_context": normal_context, "budget": budget, "select_block": select_block, "steps": steps,
           **o_e.strategy.settings(),
           "graphs": graphs, "compile": compile,
           "lookahead": lookahead if graphs else 0}
    for name, fn in modes.items():
        ms = wall_ms(fn, steps, dev, warmup=warmup)
        out[f"{name}_ms"] = statistics.median(ms)
        out[f"{name}_ms_min"] = min(ms)
        if name == "switched":
            s = last["stats"]
            out.update(switches=s.switches, stalls=s.stalls, checks=s.checks,
                       h2d_bytes_per_round=sum(int(r.h2d_bytes) for r in s.loads_offloaded))
    if compute_ref:
        out["bound_ms"] = max(out["normal_only_ms"] + out["offload_compute_ms"], out["offload_only_ms"])
        out["bound_speedup"] = out["sequential_ms"] / out["bound_ms"]
    out["speedup_vs_sequential"] = out["sequential_ms"] / out["switched_ms"]
    tokens = normal_batch + offload_batch
    out["tok_s_sequential"] = tokens / out["sequential_ms"] * 1e3
    out["tok_s_switched"] = tokens / out["switched_ms"] * 1e3
    tl = Timeline(dev.type == "cuda")
    sw(tl)
    out["timeline"] = tl.spans()
    out["overlap_ms"] = overlap_ms(out["timeline"])
    return out


def overlap_ms(spans: list[dict]) -> float:
    """Time during which an offloaded transfer was in flight while the normal batch computed."""
    tr = [(s["start_ms"], s["end_ms"]) for s in spans if s["kind"] == "transfer"]
    nc = [(s["start_ms"], s["end_ms"]) for s in spans if s["kind"] == "compute" and s["batch"] == "normal"]
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in tr for b0, b1 in nc)


def strategy_settings(pairs: list[str]) -> dict:
    """`--set KEY=VALUE` pairs as strategy settings, each parsed by the decode sweep's declared type
    (the benches and the sweep take the same names); an unknown key is refused in one line."""
    spec = {p.name: p for p in strategy_params()}
    out = {}
    for k, v in kv_pairs(pairs).items():
        if k not in spec:
            raise BadInput(f"--set {k}: not a strategy setting (choose from {', '.join(spec)})")
        out[k] = parse_value(spec[k], v)
    return out


def headline(m) -> list[str]:
    """Per point: the two batches switched against run in turn, and the bound of perfect overlap."""
    ok = m[(m["experiment"] == "pulse_switch") & (m["status"] == "ok")]
    lines = []
    for r in ok.to_dict("records")[:3]:
        bound = r.get("bound_speedup")
        lines.append(f"{int(r['offload_batch'])} offloaded at {int(r['context_len'])} + {int(r['normal_batch'])} resident: "
                     f"switched {r['switched_ms']:.2f} ms vs in turn {r['sequential_ms']:.2f} ms "
                     f"({r['speedup_vs_sequential']:.2f}x" + (f", bound {bound:.2f}x)" if bound == bound and bound is not None else ")"))
    return lines


def run(plan: PulseSwitchPlan, progress_bar: bool = True):
    """Measure a checked plan into a run folder; returns the Run."""
    run = sweep.open_run(plan.params, EXPERIMENT)
    settings = {k: getattr(plan, k) for k in setting_names()}
    spans = []
    points = sweep.grid(ctx=plan.contexts, ob=plan.offload_batches)
    with sweep.bar(len(points), EXPERIMENT, progress_bar) as bar:
        for pt in points:
            ctx, ob = pt["ctx"], pt["ob"]
            bar.set_postfix_str(f"{ob} offloaded at {ctx}")
            with sweep.point(run, {"experiment": EXPERIMENT}, context_len=ctx, offload_batch=ob, strategy=plan.strategy):
                r = switching_point(ModelShape.from_name(plan.shape), plan.device, ctx, ob, plan.normal_batch,
                                    plan.normal_context, plan.budget, plan.strategy, plan.steps, seed=plan.seed,
                                    graphs=plan.graphs, lookahead=plan.lookahead, compute_ref=plan.compute_ref,
                                    select_block=plan.select_block, settings=settings)
                spans += [{**s, "context_len": ctx, "offload_batch": ob} for s in r.pop("timeline")]
                run.add({"experiment": EXPERIMENT, "status": "ok", "error": None, "device": plan.device,
                         "gpu_name": run.manifest.get("gpu_name") or "cpu", "shape": plan.shape,
                         "strategy": plan.strategy, "context_len": ctx, "budget": plan.budget,
                         "concurrency": ob + plan.normal_batch, "offload_batch": ob, **r})
            bar.update()
    run.write_table("timeline", pd.DataFrame(spans))
    run.finish()                 # the shared rule over the rows
    sweep.headline(sweep.summary_lines(lambda: headline(run.metrics())), progress_bar, EXPERIMENT)
    return run
