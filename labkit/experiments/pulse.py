"""`labkit run pulse`: PulseInfer's scheduling on a real request trace (Mooncake conversations): labkit's
engine serves the trace with a resident and an offload lane, with and without switching batches at layer
boundaries, once per placement policy. Code: `labkit.bench.pulse_trace`."""
from __future__ import annotations

from ..engine.transfer import strategy_params
from ..params import Param, Plan
from . import checked

NAME = "pulse"

SPEC = [
    Param("device", "str", "auto", "auto, cpu, cuda, cuda:N"),
    Param("shape", "str", "auto", "model shape (auto: qwen3.8-flash-next on CUDA, tiny on CPU)"),
    Param("trace", "str", "", "Mooncake-format trace (empty: the trace's first 1,000 requests, labkit/data)"),
    Param("n_requests", "int", "auto", "first N requests of the trace (auto: 64 on CUDA, 8 on CPU)"),
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
    Param("policies", "list[str]", ["adaptive", "threshold:4096", "threshold:16384", "noswitch:4096"],
          "placement policies to compare"),
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
    return checked(NAME, SPEC, given, "labkit.bench.pulse_trace")


def run(plan: Plan, progress_bar: bool = True):
    from ..bench import pulse_trace
    return pulse_trace.run(dict(plan.params), progress_bar=progress_bar)
