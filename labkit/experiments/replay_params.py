"""The parameters PulseInfer's two trace replays declare alike (`pulse`, `pulse_ladder`): which trace, how fast,
when to stop and resume, goodput's limit and the engine's paging, chunking, graphs and compile. Light (params
only): a SPEC module imports it before any parameter is resolved."""
from __future__ import annotations

from ..params import Param

TRACE = Param("trace", "str", "", "Mooncake-format trace (empty: the trace's first 1,000 requests, labkit/data)")
RATE = Param("rate", "float", 1.0, "arrival-rate multiplier (2: twice as fast as the trace)", gt=0)
DEADLINE = Param("deadline_s", "float", 0.0, "start no window that would end past this many seconds (0: none); "
                 "the run is then partial and resume continues it", ge=0)
RESUME = Param("resume", "str", "", "continue a partial run of the same parameters: its folder, or auto (the "
               "newest such run under results/); its complete windows are kept, not replayed")
TPOT_SLO = Param("tpot_slo_ms", "float", "auto", "goodput's TPOT limit (auto: 50 on CUDA, 2000 on CPU)",
                 auto={"cuda": 50.0, "cpu": 2000.0})
PAGING = [
    Param("page_size", "int", "auto", "KV page (auto: 256 on CUDA, 16 on CPU)", gt=0, auto={"cuda": 256, "cpu": 16}),
    Param("prefill_chunk", "int", "auto", "prefill chunk (auto: 8192 on CUDA, 64 on CPU)", gt=0,
          auto={"cuda": 8192, "cpu": 64}),
    Param("graphs", "bool", False, "CUDA graphs per batch composition (CUDA only)"),
    Param("compile", "bool", False, "torch.compile the block pieces (CUDA; one compile per batch size seen)"),
]
# what a replay's check adds: the trace file's identity, recorded beside its path
TRACE_SHA = Param("trace_sha", "str", "", "the trace file's sha256 (its first 16 hex digits), read when planned")
