"""`labkit run pulse_ladder`: PulseInfer's published comparison rebuilt as a ladder on the Mooncake trace
windows. The same server (labkit's engine, the same seeded model) replays each window once per rung, every
rung adding one of PulseInfer's pieces to the one before:

1. `per_head`: the published baseline (ArkVale / InfiniGen / PQCache as PulseInfer describes them): every
   request's KV in host RAM, the selected blocks moved as per-head units, one copy per unit (~8 KiB for the
   reference shape), no batch switching;
   `prefetch` beside it (`prefetch=true`): the same offloaded requests with the previous step's selection of each
   layer kept on the device as the guess for this step's, only its misses crossing (InfiniGen's next-layer
   prefetch at its best); "the best offload system" is, per window, the better of the two;
2. `coalesced`: + coalesced transfers (a CPU gather into pinned staging, large copies);
3. `retrieval_head`: + one retrieval head's blocks serving every head of the layer (whole blocks, one unit
   each: `block_strategy`);
4. `switching`: + a resident and an offloaded batch switched at layer boundaries (a static threshold,
   chosen on the calibration windows);
5. `adaptive`: + adaptive admission (the fitted adaptive policy) = full PulseInfer;

and the arm `no_offload`: resident only, under the same device-memory cap (`device_kv_tokens`), so it
holds fewer requests at once and the rest wait.

`disaggregated=true` replays the windows on a decode instance of a disaggregated deployment, PulseInfer's
published regime: every request arrives with its prompt's KV prefilled elsewhere (placed in its lane's pool
when it gets a slot, off the clock), so every timed step is decode and TTFT is absent; with `max_output=0`
(the trace's own output lengths, times `output_scale`) and the `device_kv_tokens=auto` pressure rule. What each rung is, and what still differs from the
published setup, is in `labkit.experiments.pulse_ladder.measure` and docs/pulseinfer.md. Code:
`labkit.experiments.pulse_ladder.measure`, `labkit.experiments.trace_windows`.
"""
from __future__ import annotations

from ...engine.transfer import strategy_params
from ...shapes import MODEL_PARAMS, REFERENCE_BUDGET
from ...params import DEVICE, OUT_DIR, SEED, SHAPE, Param
from ... import lazy
from .. import planner
from ..replay_params import DEADLINE, PAGING, RATE, RESUME, TPOT_SLO, TRACE, TRACE_SHA

NAME = "pulse_ladder"

# the strategies that move whole blocks: the block_strategy choices, each checked registered when a plan is made
BLOCK_STRATEGIES = ("block_dma", "coalesced")

SPEC = [
    DEVICE,
    SHAPE,
    *MODEL_PARAMS,
    TRACE,
    Param("windows", "int", "auto", "disjoint windows of window_size consecutive trace requests, from the first "
          "(auto: 10 on CUDA, 3 on CPU)", auto={"cuda": 10, "cpu": 3}),
    Param("window_size", "int", "auto", "requests per window (auto: 16 on CUDA, 3 on CPU)", gt=0,
          auto={"cuda": 16, "cpu": 3}),
    Param("calibration_windows", "int", 2, "the first N windows choose the switching rung's threshold and fit "
          "the adaptive constants (0: thresholds and the adaptive grid hold one value each, used as given)"),
    RATE,
    Param("length_scale", "float", "auto", "multiply input lengths (auto: 0.5 on CUDA, 1/200 on CPU)", gt=0,
          auto={"cuda": 0.5, "cpu": 1 / 200}),
    Param("disaggregated", "bool", False, "a decode instance of a disaggregated deployment: requests arrive with "
          "their prompt's KV prefilled elsewhere (placed in the lane's pool on admission, the clock stopped: no "
          "prefill in the timed window; TTFT absent, TPOT from the admission); in-process transport only"),
    Param("max_output", "int", "auto", "cap output lengths (auto: 256 on CUDA, 6 on CPU; 0: uncapped, the trace's "
          "own output lengths x output_scale, at most capacity - 1)", ge=0),
    Param("output_scale", "float", 1.0, "multiply the trace's output lengths (before max_output's cap; at least 1 "
          "token)", gt=0),
    Param("resident_slots", "int", 8, "switching rungs: requests with KV on the device", gt=0),
    Param("offload_slots", "int", 8, "switching rungs: requests with KV in host RAM (the all-offloaded rungs and "
          "no_offload hold resident_slots + offload_slots requests)", gt=0),
    Param("capacity", "int", "auto", "tokens per request slot (auto: 65536 on CUDA, 512 on CPU)", gt=0,
          auto={"cuda": 65536, "cpu": 512}),
    Param("device_kv_tokens", "int", "auto", "the device-memory cap, in KV tokens: the switching rungs' "
          "resident pool and no_offload's whole pool (auto: 131072 on CUDA, 256 on CPU; with disaggregated, "
          "per window: the pressure rule, a cap below a third of the window's KV and below what its n // 3 + 1 "
          "shortest requests need together, so no_offload holds at most a third of them at once, but never "
          "below the window's longest request, which must fit alone)", gt=0),
    Param("host_kv_tokens", "int", "auto", "the offload lane's host pool, in KV tokens: every window's requests "
          "fit it together, so host RAM makes none wait (auto: 262144 on CUDA, 1024 on CPU)", gt=0,
          auto={"cuda": 262144, "cpu": 1024}),
    Param("budget", "int", "auto", "indexer budget (auto: 2048 on CUDA, 32 on CPU)", gt=0,
          auto={"cuda": REFERENCE_BUDGET, "cpu": 32}),
    Param("select_block", "int", 16, "positions per selected block, every rung (PulseInfer's 16)", gt=0),
    Param("per_head_unit_bytes", "int", "auto", "per_head rung: bytes per copy, a whole number of KV rows (auto: "
          "one KV head's K or V of a select_block block, select_block x head_dim x 2 B: 8 KiB for the reference "
          "shape, as the published baselines' per-head units)", gt=0),
    Param("prefetch", "bool", "auto", "replay the prefetch baseline beside per_head: the previous step's selection "
          "of each layer kept on the device as the guess for this step's, only the rows it missed read over the "
          "link (auto: on CUDA yes, on CPU no)", auto={"cuda": True, "cpu": False}),
    Param("block_strategy", "str", "block_dma", "how the retrieval_head, switching and adaptive rungs move whole "
          "blocks (block_dma: one DMA per block; coalesced: gathered as the coalesced rung)",
          choices=BLOCK_STRATEGIES),
    *strategy_params(),        # the transfers' settings (host_threads, dma_units_per_call, ...), beside each strategy
    Param("thresholds", "list[int]", "auto", "switching rung: static threshold candidates, chosen on the "
          "calibration windows (auto: 4096,8192 on CUDA, 40,80 on CPU)", auto={"cuda": [4096, 8192], "cpu": [40, 80]}),
    Param("adaptive_min_tokens", "list[int]", "auto", "adaptive rung's grid: prompt length from which a request is "
          "offloaded when its transfer hides (auto: 2048,8192 on CUDA, 16,64 on CPU)",
          auto={"cuda": [REFERENCE_BUDGET, 8192], "cpu": [16, 64]}),
    Param("adaptive_hide", "list[float]", [1.0], "adaptive rung's grid: a transfer hides when transfer <= HIDE x "
          "the normal batch's compute"),
    Param("p99_limit", "float", 1.0, "a candidate is acceptable when its median p99 TPOT over the calibration "
          "windows is at most this times the per_head rung's", gt=0),
    Param("warmup", "bool", True, "untimed short replays of every rung first (kernel compiles, first allocations)"),
    DEADLINE,
    RESUME,
    TPOT_SLO,
    Param("timeline_every", "int", 10, "record the switching timeline every N decode rounds (GPU idle: the "
          "stall share of those rounds)"),
    *PAGING,
    Param("transport", "str", "inprocess", "inprocess: the scheduler's own clock, no server; http: labkit serve "
          "+ the load generator; auto: http when importable", choices=("http", "inprocess", "auto")),
    SEED.but(help="model weights"),
    OUT_DIR,
]


measuring = lazy.module(".measure", __package__)     # imported once the parameters resolved
plan = planner(NAME, SPEC, measuring, derived=[TRACE_SHA], declared=SPEC)
PulseLadderPlan = plan.type   # the checked plan: plan.windows, plan.device_kv_tokens, plan.block_strategy, ...


def run(plan: PulseLadderPlan, progress_bar: bool = True):
    return measuring.run(plan, progress_bar=progress_bar)
