"""`labkit run prefill`: prompt tokens per second with the KV kept resident, written back to host RAM as it is
made (`sync`), or through four rotating layer-sized device buffers (`rotating`, FlashOffloading's prefill);
a device-memory cap shows what fits. Code: `labkit.experiments.prefill.measure`."""
from __future__ import annotations

from ...params import Param, Plan
from .. import checked

NAME = "prefill"

SPEC = [
    Param("shape", "str", "auto", "model shape (auto: qwen3.8-flash-next on CUDA, tiny on CPU)"),
    Param("device", "str", "auto", "auto, cpu, cuda, cuda:N"),
    Param("context_lens", "list[int]", "auto", "prompt lengths (248K, 1M accepted)"),
    Param("modes", "list[str]", ["resident", "sync", "rotating"], "resident, sync, rotating"),
    Param("chunk", "int", 0, "prefill chunk in tokens (0: 8192 on CUDA, 64 on CPU)"),
    Param("tail_tokens", "int", 0, "compute only the last N tokens over a cached random prefix (0: whole prompt)"),
    Param("mem_cap_gib", "float", 0.0, "device memory cap in GiB (0: none)"),
    Param("warmup_tokens", "int", 0, "warm-up prompt per mode (0: two chunks)"),
    Param("seed", "int", 0, "weights and prompt"),
    Param("out_dir", "str", "", "run folder (empty: results/<run-id>)"),
]


def plan(given: dict) -> Plan:
    def check():          # the measuring module, imported once the parameters resolved
        from .measure import check
        return check
    return checked(NAME, SPEC, given, check)


def run(plan: Plan, progress_bar: bool = True):
    from . import measure as prefill
    return prefill.run(dict(plan.params), progress=print if progress_bar else (lambda *a: None))
