"""`labkit run multigpu`: the model's layers split over several GPUs (pipeline stages) against one GPU, with
pipelined micro-batches, the zero-copy gather's scaling when every GPU pulls over its own link, and the
activation hand-off between stages. Code: `labkit.experiments.multigpu.measure`."""
from __future__ import annotations

from ...params import Param, Plan
from .. import checked

NAME = "multigpu"

SPEC = [
    Param("devices", "str", "auto", "devices to split over (auto: every GPU; cpu,cpu on a CPU)"),
    Param("shape", "str", "auto", "model shape preset or .json file (auto: qwen3.8-flash-next on CUDA, tiny on CPU)"),
    Param("strategies", "list[str]", ["resident", "zero_copy"], "transfer strategies"),
    Param("context_lens", "list[int]", "auto", "context lengths (tokens; 64K, 1M accepted)"),
    Param("concurrency", "list[int]", [1, 4, 8], "concurrent requests per decode step"),
    Param("micro_batches", "list[int]", [2], "the pipelined layouts: micro-batches in flight (0: none)"),
    Param("budget", "int", "auto", "indexer budget (auto: 2048 on CUDA, 64 on CPU)"),
    Param("repeats", "int", 3, "timed repeats of `steps` steps"),
    Param("steps", "int", 10, "decode steps per repeat"),
    Param("gather_pool_gib", "float", 0.0, "per-GPU pinned pool of the gather rows (0: 8 GiB on CUDA, 0.05 on CPU)"),
    Param("gather_repeats", "int", 20, "timed gather steps per GPU and mode"),
    Param("anatomy", "bool", False, "the step anatomy of 1gpu and split points (costs ~8 steps a point)"),
    Param("seed", "int", 0, "weights and cache contents"),
    Param("out_dir", "str", "", "run folder (empty: results/<run-id>)"),
]


def plan(given: dict) -> Plan:
    def check():          # the measuring module, imported once the parameters resolved
        from .measure import check
        return check
    return checked(NAME, SPEC, given, check)


def run(plan: Plan, progress_bar: bool = True):
    from . import measure as multigpu
    return multigpu.run(dict(plan.params), progress_bar=progress_bar)
