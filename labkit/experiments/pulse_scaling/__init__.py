"""`labkit run pulse_scaling`: every request's KV in host RAM at long context; one batch of N requests against
two batches switched at layer boundaries (PulseInfer), with the resident compute of each, the measured link,
the bound they allow and where switching can start to pay. Code: `labkit.experiments.pulse_scaling.measure`.
"""
from __future__ import annotations

from ...engine.transfer import strategy_params
from ...shapes import REFERENCE_BUDGET
from ...params import DEVICE, OUT_DIR, SEED, SHAPE, Param
from ... import lazy
from .. import planner

NAME = "pulse_scaling"

SPEC = [
    SHAPE,
    DEVICE,
    Param("context", "int", "auto", "tokens per request (auto: 1M on CUDA, 1K on CPU)", gt=0,
          auto={"cuda": 1 << 20, "cpu": 1024}),
    Param("requests", "list[int]", "auto", "request counts (auto: 1,2,4,6,8,12,16 on CUDA, 1,2,4 on CPU)", gt=0,
          auto={"cuda": [1, 2, 4, 6, 8, 12, 16], "cpu": [1, 2, 4]}),
    Param("budget", "int", "auto", "indexer budget (auto: 2048 on CUDA, 64 on CPU)",
          auto={"cuda": REFERENCE_BUDGET, "cpu": 64}),
    Param("strategy", "str", "zero_copy", "the offloaded requests' transfer strategy"),
    Param("steps", "int", 10, "timed steps per mode", gt=0),
    Param("page_size", "int", "auto", "KV page size in tokens (auto: 256 on CUDA, 16 on CPU)", gt=0,
          auto={"cuda": 256, "cpu": 16}),
    Param("graphs", "bool", True, "replay CUDA graphs (CUDA only)"),
    Param("compile", "bool", False, "torch.compile the block pieces (one compile per batch size)"),
    Param("select_block", "int", 1, "select whole aligned blocks of N positions", gt=0),
    *strategy_params(),
    SEED,
    OUT_DIR,
]


measuring = lazy.module(".measure", __package__)     # imported once the parameters resolved
plan = planner(NAME, SPEC, measuring)
PulseScalingPlan = plan.type  # the checked plan: plan.context, plan.requests, plan.budget, ...


def run(plan: PulseScalingPlan, progress_bar: bool = True):
    return measuring.run(plan, progress_bar=progress_bar)
