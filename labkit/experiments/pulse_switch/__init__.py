"""`labkit run pulse_switch`: PulseInfer's switched round — a normal batch (KV resident) and an offloaded batch
(KV in host RAM) interleaved at layer boundaries, each offloaded load on a side stream while the normal
batch computes — against the two steps in turn, with the bound the measured parts allow and one round's
timeline. Code: `labkit.experiments.pulse_switch.measure.switching_point`.
"""
from __future__ import annotations

from ...engine.transfer import strategy_params
from ...shapes import REFERENCE_BUDGET
from ...params import DEVICE, OUT_DIR, SEED, SHAPE, Param
from ... import lazy
from .. import planner

NAME = "pulse_switch"

SPEC = [
    SHAPE,
    DEVICE,
    Param("contexts", "list[int]", "auto", "offloaded batch's context (auto: 64K on CUDA, 1K on CPU)", gt=0,
          auto={"cuda": [64 << 10], "cpu": [1024]}),
    Param("offload_batches", "list[int]", [4], "requests in the offloaded batch", gt=0),
    Param("normal_batch", "int", 4, "requests in the resident batch", gt=0),
    Param("normal_context", "int", "auto", "resident batch's context (auto: 8K on CUDA, 256 on CPU)", gt=0,
          auto={"cuda": 8 << 10, "cpu": 256}),
    Param("budget", "int", "auto", "indexer budget (auto: 2048 on CUDA, 64 on CPU)", gt=0,
          auto={"cuda": REFERENCE_BUDGET, "cpu": 64}),
    Param("strategy", "str", "zero_copy", "the offloaded batch's transfer strategy"),
    Param("steps", "int", 10, "timed rounds per mode", gt=0),
    Param("graphs", "bool", True, "replay CUDA graphs (CUDA only)"),
    Param("lookahead", "int", 2, "blocks the normal batch runs ahead between checks of a transfer", gt=0),
    Param("select_block", "int", 1, "the offloaded batch selects whole aligned blocks of N positions", gt=0),
    Param("compute_ref", "bool", True, "also time the offloaded batch with its rows on the device (the bound)"),
    *strategy_params(),
    SEED,
    OUT_DIR,
]


measuring = lazy.module(".measure", __package__)     # imported once the parameters resolved
plan = planner(NAME, SPEC, measuring)
PulseSwitchPlan = plan.type   # the checked plan: plan.contexts, plan.offload_batches, plan.budget, ...


def run(plan: PulseSwitchPlan, progress_bar: bool = True):
    return measuring.run(plan, progress_bar=progress_bar)
