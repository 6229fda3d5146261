"""`labkit run pulse`: PulseInfer's scheduling on a real request trace (Mooncake conversations): labkit's
engine serves disjoint windows of the trace with a resident and an offload lane, with and without switching
batches at layer boundaries, once per placement policy; the static threshold and the adaptive policy's
constants are chosen on calibration windows and reported on the others. Code: `labkit.experiments.pulse.replay_measure`,
`labkit.stats.windows`."""
from __future__ import annotations

from ...engine.transfer import strategy_params
from ...params import Param, Plan
from .. import checked

NAME = "pulse"

SPEC = [
    Param("device", "str", "auto", "auto, cpu, cuda, cuda:N"),
    Param("shape", "str", "auto", "model shape (auto: qwen3.8-flash-next on CUDA, tiny on CPU)"),
    Param("trace", "str", "", "Mooncake-format trace (empty: the trace's first 1,000 requests, labkit/data)"),
    Param("windows", "int", 8, "disjoint windows of window_size consecutive trace requests, from the first"),
    Param("window_size", "int", "auto", "requests per window (auto: 32 on CUDA, 4 on CPU)"),
    Param("calibration_windows", "int", 2, "the first N windows choose the threshold and fit the adaptive "
          "constants; the others are test windows (0: no fitting, the policies as given)"),
    Param("rate", "float", 1.0, "arrival-rate multiplier (2: twice as fast as the trace)"),
    Param("length_scale", "float", "auto", "multiply input lengths (auto: 1.0 on CUDA, 1/200 on CPU)"),
    Param("max_output", "int", "auto", "cap output lengths (auto: 128 on CUDA, 6 on CPU)"),
    Param("resident_slots", "int", 8, "requests with KV on the device"),
    Param("offload_slots", "int", 8, "requests with KV in host RAM"),
    Param("capacity", "int", "auto", "tokens per request slot (auto: 131072 on CUDA, 512 on CPU)"),
    Param("resident_pool_tokens", "int", 0, "device KV pool in tokens (0: slots x capacity)"),
    Param("budget", "int", "auto", "indexer budget (auto: 2048 on CUDA, 16 on CPU)"),
    Param("strategy", "str", "zero_copy", "the offload lane's strategy (block_dma: one batched DMA a layer)"),
    Param("select_block", "int", 1, "decode selects whole aligned blocks of N positions (16: PulseInfer's)"),
    *strategy_params(),        # the offload lane's strategy settings, declared beside each strategy
    Param("reference", "str", "auto", "the policy every ratio is to, within a window (auto: noswitch:4096 on "
          "CUDA, noswitch:40 on CPU)"),
    Param("thresholds", "list[int]", "auto", "static threshold candidates, chosen on the calibration windows "
          "(auto: 4096,8192 on CUDA, 40,80 on CPU)"),
    Param("adaptive_min_tokens", "list[int]", "auto", "adaptive grid: prompt length from which a request is "
          "offloaded when its transfer hides (the engine's rule: the budget; auto: 2048,8192 on CUDA, 16,64 on CPU)"),
    Param("adaptive_hide", "list[float]", [1.0], "adaptive grid: a transfer hides when transfer <= HIDE x the "
          "normal batch's compute (the engine's rule: 1)"),
    Param("p99_limit", "float", 1.0, "a candidate is acceptable when its median p99 TPOT over the calibration "
          "windows is at most this times the reference's"),
    Param("policies", "list[str]", [], "more policies replayed as given on every window (not fitted): "
          "threshold:N, noswitch:N, adaptive, adaptive:MIN:HIDE, resident, offload"),
    Param("warmup", "bool", True, "untimed short replays first (the first replay of a process pays for kernel "
          "compiles: the reference always did in the one-window runs)"),
    Param("deadline_s", "float", 0.0, "start no window that would end past this many seconds (0: none); "
          "the run is then partial and resume continues it"),
    Param("resume", "str", "", "continue a partial run of the same parameters: its folder, or auto (the "
          "newest such run under results/); its complete windows are kept, not replayed"),
    Param("tpot_slo_ms", "float", "auto", "goodput's TPOT limit (auto: 50 on CUDA, 2000 on CPU)"),
    Param("timeline_every", "int", 10, "record the switching timeline every N decode rounds"),
    Param("page_size", "int", "auto", "KV page (auto: 256 on CUDA, 16 on CPU)"),
    Param("prefill_chunk", "int", "auto", "prefill chunk (auto: 8192 on CUDA, 64 on CPU)"),
    Param("graphs", "bool", False, "CUDA graphs per batch composition (CUDA only)"),
    Param("compile", "bool", False, "torch.compile the block pieces (CUDA; one compile per batch size seen)"),
    Param("transport", "str", "http", "http: labkit serve + the load generator; inprocess: the scheduler's own "
          "clock, no server (a GPU host without fastapi/uvicorn/httpx); auto: http when importable"),
    Param("seed", "int", 0, "model weights"),
    Param("out_dir", "str", "", "run folder (empty: results/<run-id>)"),
]


def plan(given: dict) -> Plan:
    def check():          # the measuring module, imported once the parameters resolved
        from .replay_measure import check
        return check
    return checked(NAME, SPEC, given, check)


def run(plan: Plan, progress_bar: bool = True):
    from . import replay_measure as pulse_trace
    return pulse_trace.run(dict(plan.params), progress_bar=progress_bar)
