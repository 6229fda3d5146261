"""`labkit run pulse`: PulseInfer's scheduling on a real request trace (Mooncake conversations): labkit's
engine serves disjoint windows of the trace with a resident and an offload lane, with and without switching
batches at layer boundaries, once per placement policy; the static threshold and the adaptive policy's
constants are chosen on calibration windows and reported on the others. Code: `labkit.experiments.pulse.measure`,
`labkit.experiments.trace_windows`."""
from __future__ import annotations

from ...engine.transfer import strategy_params
from ...shapes import REFERENCE_BUDGET
from ...params import DEVICE, OUT_DIR, SEED, SHAPE, Param
from ... import lazy
from .. import planner
from ..replay_params import DEADLINE, PAGING, RATE, RESUME, TPOT_SLO, TRACE, TRACE_SHA

NAME = "pulse"

SPEC = [
    DEVICE,
    SHAPE,
    TRACE,
    Param("windows", "int", 8, "disjoint windows of window_size consecutive trace requests, from the first"),
    Param("window_size", "int", "auto", "requests per window (auto: 32 on CUDA, 4 on CPU)", gt=0,
          auto={"cuda": 32, "cpu": 4}),
    Param("calibration_windows", "int", 2, "the first N windows choose the threshold and fit the adaptive "
          "constants; the others are test windows (0: no fitting, the policies as given)"),
    RATE,
    Param("length_scale", "float", "auto", "multiply input lengths (auto: 1.0 on CUDA, 1/200 on CPU)", gt=0,
          auto={"cuda": 1.0, "cpu": 1 / 200}),
    Param("max_output", "int", "auto", "cap output lengths (auto: 128 on CUDA, 6 on CPU)", gt=0,
          auto={"cuda": 128, "cpu": 6}),
    Param("resident_slots", "int", 8, "requests with KV on the device"),
    Param("offload_slots", "int", 8, "requests with KV in host RAM"),
    Param("capacity", "int", "auto", "tokens per request slot (auto: 131072 on CUDA, 512 on CPU)", gt=0,
          auto={"cuda": 131072, "cpu": 512}),
    Param("resident_pool_tokens", "int", 0, "device KV pool in tokens (0: slots x capacity)"),
    Param("budget", "int", "auto", "indexer budget (auto: 2048 on CUDA, 16 on CPU)", gt=0,
          auto={"cuda": REFERENCE_BUDGET, "cpu": 16}),
    Param("strategy", "str", "zero_copy", "the offload lane's strategy (block_dma: one batched DMA a layer)"),
    Param("select_block", "int", 1, "decode selects whole aligned blocks of N positions (16: PulseInfer's)"),
    *strategy_params(),        # the offload lane's strategy settings, declared beside each strategy
    # thresholds are in the scaled lengths: on CPU inputs are x1/200, so 40 there stands where ~4096 stands
    # at x0.5 on the GPU (a trace request of ~8K tokens)
    Param("reference", "str", "auto", "the policy every ratio is to, within a window (auto: noswitch:4096 on "
          "CUDA, noswitch:40 on CPU)", auto={"cuda": "noswitch:4096", "cpu": "noswitch:40"}),
    Param("thresholds", "list[int]", "auto", "static threshold candidates, chosen on the calibration windows "
          "(auto: 4096,8192 on CUDA, 40,80 on CPU)", auto={"cuda": [4096, 8192], "cpu": [40, 80]}),
    Param("adaptive_min_tokens", "list[int]", "auto", "adaptive grid: prompt length from which a request is "
          "offloaded when its transfer hides (the engine's rule: the budget; auto: 2048,8192 on CUDA, 16,64 on CPU)",
          auto={"cuda": [REFERENCE_BUDGET, 8192], "cpu": [16, 64]}),
    Param("adaptive_hide", "list[float]", [1.0], "adaptive grid: a transfer hides when transfer <= HIDE x the "
          "normal batch's compute (the engine's rule: 1)"),
    Param("p99_limit", "float", 1.0, "a candidate is acceptable when its median p99 TPOT over the calibration "
          "windows is at most this times the reference's", gt=0),
    Param("policies", "list[str]", [], "more policies replayed as given on every window (not fitted): "
          "threshold:N, noswitch:N, adaptive, adaptive:MIN:HIDE, resident, offload"),
    Param("warmup", "bool", True, "untimed short replays first (the first replay of a process pays for kernel "
          "compiles: the reference always did in the one-window runs)"),
    DEADLINE,
    RESUME,
    TPOT_SLO,
    Param("timeline_every", "int", 10, "record the switching timeline every N decode rounds"),
    *PAGING,
    Param("transport", "str", "http", "http: labkit serve + the load generator; inprocess: the scheduler's own "
          "clock, no server (a GPU host without fastapi/uvicorn/httpx); auto: http when importable",
          choices=("http", "inprocess", "auto")),
    SEED.but(help="model weights"),
    OUT_DIR,
]


measuring = lazy.module(".measure", __package__)     # imported once the parameters resolved
plan = planner(NAME, SPEC, measuring, derived=[TRACE_SHA], declared=SPEC)      # its "auto" values are decided there
PulsePlan = plan.type         # the checked plan: plan.windows, plan.window_size, plan.reference, plan.policies, ...


def run(plan: PulsePlan, progress_bar: bool = True):
    return measuring.run(plan, progress_bar=progress_bar)
