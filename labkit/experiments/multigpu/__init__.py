"""`labkit run multigpu`: the model's layers split over several GPUs (pipeline stages) against one GPU, with
pipelined micro-batches, the zero-copy gather's scaling when every GPU pulls over its own link, and the
activation hand-off between stages. Code: `labkit.experiments.multigpu.measure`."""
from __future__ import annotations

from ...engine.transfer import STRATEGIES
from ...params import OUT_DIR, SEED, SHAPE, Param
from ...shapes import REFERENCE_BUDGET
from ... import lazy
from .. import planner

NAME = "multigpu"

SPEC = [
    Param("devices", "str", "auto", "devices to split over (auto: every GPU; cpu,cpu on a CPU)"),
    SHAPE.but(help="model shape preset or .json file (auto: qwen3.8-flash-next on CUDA, tiny on CPU)"),
    Param("strategies", "list[str]", ["resident", "zero_copy"], "transfer strategies",
          choices=lambda: tuple(STRATEGIES)),
    Param("context_lens", "list[int]", "auto", "context lengths (tokens; 64K, 1M accepted)", gt=0,
          auto={"cuda": [64 << 10, 1 << 20], "cpu": [256, 1024]}),
    Param("concurrency", "list[int]", [1, 4, 8], "concurrent requests per decode step", gt=0),
    Param("micro_batches", "list[int]", [2], "the pipelined layouts: micro-batches in flight (0: none)", ge=0),
    Param("budget", "int", "auto", f"indexer budget (auto: {REFERENCE_BUDGET} on CUDA, 64 on CPU)", gt=0,
          auto={"cuda": REFERENCE_BUDGET, "cpu": 64}),
    Param("repeats", "int", 3, "timed repeats of `steps` steps", gt=0),
    Param("steps", "int", 10, "decode steps per repeat", gt=0),
    Param("gather_pool_gib", "float", 0.0, "per-GPU pinned pool of the gather rows (0: 8 GiB on CUDA, 0.05 on CPU)",
          gt=0, auto={"cuda": 8.0, "cpu": 0.05}),
    Param("gather_repeats", "int", 20, "timed gather steps per GPU and mode", gt=0),
    Param("anatomy", "bool", False, "the step anatomy of 1gpu and split points (costs ~8 steps a point)"),
    SEED,
    OUT_DIR,
]


measuring = lazy.module(".measure", __package__)     # imported once the parameters resolved
plan = planner(NAME, SPEC, measuring, derived=[
    Param("device_list", "list[str]", [], "the devices the layers are split over, one stage each"),
    Param("layouts", "table", {}, "each layout's checked decode plan (1gpu, split): name -> its parameters")])
MultigpuPlan = plan.type     # the checked plan: plan.device_list, plan.layouts, plan.concurrency, ...


def run(plan: MultigpuPlan, progress_bar: bool = True):
    return measuring.run(plan, progress_bar=progress_bar)
