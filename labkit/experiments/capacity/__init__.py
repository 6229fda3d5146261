"""`labkit run capacity`: how many requests a device-memory cap holds with no offload, offloaded prefill, and
offloaded prefill + a device hot cache (FlashOffloading), and the goodput of each under a TPOT limit.
Code: `labkit.experiments.capacity.measure`."""
from __future__ import annotations

from ...shapes import REFERENCE_BUDGET
from ...engine.transfer import strategy_params
from ...params import Param, Plan
from .. import checked

NAME = "capacity"

SPEC = [
    Param("shape", "str", "auto", "model shape (auto: qwen3.8-flash-next on CUDA, tiny on CPU)"),
    Param("device", "str", "auto", "auto, cpu, cuda, cuda:N"),
    Param("context_len", "int", 0, "tokens per request (0: 32K on CUDA, 256 on CPU)"),
    Param("mem_cap_gib", "float", 0.0, "device memory cap (GiB; 0: 24 or the GPU's memory if less; on CPU a "
                                        "quarter of the RAM available)"),
    Param("host_cap_gib", "float", 0.0, "pinned host KV allowed (GiB; 0: half the RAM)"),
    Param("workspace_gib", "float", 2.0, "device reserve for activations, graphs, cuBLAS (GiB)"),
    Param("configs", "list[str]", ["none", "prefill", "both"], "none, prefill, both"),
    Param("budget", "int", REFERENCE_BUDGET, "indexer budget (rows per request and QSA layer)"),
    *strategy_params(["hot_cache"]),     # the hot cache of config `both`, its settings declared beside it
    Param("selection", "str", "indexer", "indexer, or trace:PATH (recorded selections)"),
    Param("tpot_ms", "float", 30.0, "TPOT limit of a good request (ms)"),
    Param("max_batch", "int", 0, "largest batch timed (0: the capacity on CUDA, 16 on CPU)"),
    Param("steps", "int", 10, "decode steps per repeat"),
    Param("repeats", "int", 2, "timed repeats"),
    Param("measure", "bool", True, "time the decode step (false: capacities only)"),
    Param("seed", "int", 0, "weights and cache contents"),
    Param("out_dir", "str", "", "run folder (empty: results/<run-id>)"),
    # the report's companions (nothing is measured from them): the hot cache's other figures in one report
    Param("replay_run", "str", "", "report: a hot_replay run folder (hit rate and bytes vs capacity per policy)"),
    Param("decode_run", "str", "", "report: a decode run with hot_cache rows (step anatomy per strategy)"),
]


def plan(given: dict) -> Plan:
    def check():          # the measuring module, imported once the parameters resolved
        from .measure import check
        return check
    return checked(NAME, SPEC, given, check)


def run(plan: Plan, progress_bar: bool = True):
    from . import measure as capacity
    return capacity.run(dict(plan.params), progress=print if progress_bar else (lambda *a: None))
