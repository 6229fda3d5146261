"""`labkit run pulse_switch`: PulseInfer's switched round — a normal batch (KV resident) and an offloaded batch
(KV in host RAM) interleaved at layer boundaries, each offloaded load on a side stream while the normal
batch computes — against the two steps in turn, with the bound the measured parts allow and one round's
timeline. Code: `labkit.experiments.pulse.switch_measure.switching_point`.
"""
from __future__ import annotations

from ...engine.transfer import strategy_params
from ...shapes import REFERENCE_BUDGET
from ...params import DEVICE, OUT_DIR, SEED, SHAPE, BadInput, Param, Plan, check_positive
from .. import for_this_machine

NAME = "pulse_switch"

SPEC = [
    SHAPE,
    DEVICE,
    Param("contexts", "list[int]", "auto", "offloaded batch's context (auto: 64K on CUDA, 1K on CPU)"),
    Param("offload_batches", "list[int]", [4], "requests in the offloaded batch"),
    Param("normal_batch", "int", 4, "requests in the resident batch"),
    Param("normal_context", "int", "auto", "resident batch's context (auto: 8K on CUDA, 256 on CPU)"),
    Param("budget", "int", "auto", "indexer budget (auto: 2048 on CUDA, 64 on CPU)"),
    Param("strategy", "str", "zero_copy", "the offloaded batch's transfer strategy"),
    Param("steps", "int", 10, "timed rounds per mode"),
    Param("graphs", "bool", True, "replay CUDA graphs (CUDA only)"),
    Param("lookahead", "int", 2, "blocks the normal batch runs ahead between checks of a transfer"),
    Param("select_block", "int", 1, "the offloaded batch selects whole aligned blocks of N positions"),
    Param("compute_ref", "bool", True, "also time the offloaded batch with its rows on the device (the bound)"),
    *strategy_params(),
    SEED,
    OUT_DIR,
]
AUTO = {"cuda": dict(shape="qwen3.8-flash-next", contexts=[64 << 10], normal_context=8 << 10, budget=REFERENCE_BUDGET),
        "cpu": dict(shape="tiny", contexts=[1024], normal_context=256, budget=64)}


def plan(given: dict) -> Plan:
    from ...engine.transfer import STRATEGIES
    p = for_this_machine(SPEC, given, NAME, AUTO)
    if p["strategy"] not in STRATEGIES or STRATEGIES[p["strategy"]].medium != "host":
        raise BadInput(f"strategy {p['strategy']!r}: the offloaded batch needs a host strategy "
                       f"({', '.join(n for n, c in STRATEGIES.items() if c.medium == 'host')})")
    for k in ("contexts", "offload_batches"):
        check_positive(k, p[k] or [0])
    for k in ("normal_batch", "normal_context", "budget", "steps", "lookahead", "select_block"):
        check_positive(k, [p[k]])
    if p["budget"] % p["select_block"] or any(c < p["budget"] for c in p["contexts"]):
        raise BadInput(f"budget {p['budget']} must be a multiple of select_block {p['select_block']} and "
                       f"no larger than every context")
    return Plan(NAME, p)


def run(plan: Plan, progress_bar: bool = True):
    import pandas as pd

    from .switch_measure import switching_point
    from ...params import one_line
    from ...results import Run
    from ...shapes import ModelShape
    from ...engine.transfer import setting_names
    p = dict(plan.params)
    run = Run.create(p["out_dir"] or None, NAME, p)
    settings = {k: p[k] for k in setting_names()}
    spans = []
    for ctx in p["contexts"]:
        for ob in p["offload_batches"]:
            try:
                r = switching_point(ModelShape.from_name(p["shape"]), p["device"], ctx, ob, p["normal_batch"],
                                    p["normal_context"], p["budget"], p["strategy"], p["steps"], seed=p["seed"],
                                    graphs=p["graphs"], lookahead=p["lookahead"], compute_ref=p["compute_ref"],
                                    select_block=p["select_block"], settings=settings)
                spans += [{**s, "context_len": ctx, "offload_batch": ob} for s in r.pop("timeline")]
                run.add({"experiment": NAME, "status": "ok", "error": None, "device": p["device"],
                         "gpu_name": run.manifest.get("gpu_name") or "cpu", "shape": p["shape"],
                         "strategy": p["strategy"], "context_len": ctx, "budget": p["budget"],
                         "concurrency": ob + p["normal_batch"], "offload_batch": ob, **r})
            except Exception as ex:           # one failed point is a row; the sweep goes on
                run.add({"experiment": NAME, "status": "failed", "error": one_line(ex), "context_len": ctx,
                         "offload_batch": ob, "strategy": p["strategy"]})
    run.write_table("timeline", pd.DataFrame(spans))
    run.finish()                 # the shared rule over the rows
    return run
