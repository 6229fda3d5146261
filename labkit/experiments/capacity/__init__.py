"""`labkit run capacity`: how many requests a device-memory cap holds with no offload, offloaded prefill, and
offloaded prefill + a device hot cache (FlashOffloading), and the goodput of each under a TPOT limit.
Code: `labkit.experiments.capacity.measure`."""
from __future__ import annotations

from ...shapes import REFERENCE_BUDGET
from ...engine.transfer import strategy_params
from ...params import DEVICE, OUT_DIR, SEED, SHAPE, Param
from ... import lazy
from .. import planner

NAME = "capacity"
CONFIGS = ("none", "prefill", "both")      # no offload, offloaded prefill, offloaded prefill + a hot cache
CPU_MAX_BATCH = 16           # a CPU steps a batch of thousands of tiny requests far too slowly to time

SPEC = [
    SHAPE,
    DEVICE,
    Param("context_len", "int", 0, "tokens per request (0: 32K on CUDA, 256 on CPU)", gt=0,
          auto={"cuda": 32 << 10, "cpu": 256}),
    Param("mem_cap_gib", "float", 0.0, "device memory cap (GiB; 0: 24 or the GPU's memory if less; on CPU a "
                                        "quarter of the RAM available)", ge=0),
    Param("host_cap_gib", "float", 0.0, "pinned host KV allowed (GiB; 0: half the RAM)"),
    Param("workspace_gib", "float", 2.0, "device reserve for activations, graphs, cuBLAS (GiB)", ge=0),
    Param("configs", "list[str]", list(CONFIGS), ", ".join(CONFIGS), choices=CONFIGS),
    Param("budget", "int", REFERENCE_BUDGET, "indexer budget (rows per request and QSA layer)", gt=0),
    *strategy_params(["hot_cache"]),     # the hot cache of config `both`, its settings declared beside it
    Param("selection", "str", "indexer", "indexer, or trace:PATH (recorded selections)"),
    Param("tpot_ms", "float", 30.0, "TPOT limit of a good request (ms)", gt=0),
    Param("max_batch", "int", 0, f"largest batch timed (0: the capacity on CUDA, {CPU_MAX_BATCH} on CPU)", ge=0,
          auto={"cpu": CPU_MAX_BATCH}),
    Param("steps", "int", 10, "decode steps per repeat", gt=0),
    Param("repeats", "int", 2, "timed repeats", gt=0),
    Param("measure", "bool", True, "time the decode step (false: capacities only)"),
    SEED,
    OUT_DIR,
    # the report's companions (nothing is measured from them): the hot cache's other figures in one report
    Param("replay_run", "str", "", "report: a hot_replay run folder (hit rate and bytes vs capacity per policy)"),
    Param("decode_run", "str", "", "report: a decode run with hot_cache rows (step anatomy per strategy)"),
]


measuring = lazy.module(".measure", __package__)     # imported once the parameters resolved
plan = planner(NAME, SPEC, measuring)
CapacityPlan = plan.type      # the checked plan: plan.context_len, plan.mem_cap_gib, plan.configs, ...


def run(plan: CapacityPlan, progress_bar: bool = True):
    return measuring.run(plan, progress_bar=progress_bar)
