"""`labkit run prefill_throughput`: prompts prefilled per second for a batch of long prompts under a device-memory
cap that cannot hold them all resident, with no offload (`none`), prefill-only offload (`prefill`) and offload in
both stages (`both`): FlashOffloading's prefill-throughput comparison. Each configuration takes the largest
chunk and in-flight count the cap allows (byte formulas: `fit.py`); with `batched`, several prompts' chunks go
in one forward under the largest token budget (vLLM's `max_num_batched_tokens`) the cap allows. Code: `labkit.experiments.prefill_throughput.measure`."""
from __future__ import annotations

from ... import lazy
from ...params import DEVICE, OUT_DIR, SEED, SHAPE, Param
from ...shapes import MODEL_PARAMS
from .. import planner

NAME = "prefill_throughput"

CONFIGS = ("none", "prefill", "both")      # no offload, offloaded prefill, prefill and decode offloaded

SPEC = [
    SHAPE,
    DEVICE,
    *MODEL_PARAMS,
    Param("context_lens", "list[int]", "auto", "prompt lengths, each a batch of `prompts` prompts", gt=0,
          auto={"cuda": [64 << 10], "cpu": [512]}),
    Param("prompts", "int", 0, "prompts in a batch, N (0: 4)", gt=0, auto={"cuda": 4, "cpu": 4}),
    Param("configs", "list[str]", list(CONFIGS), ", ".join(CONFIGS), choices=CONFIGS),
    Param("mem_cap_gib", "float", 0.0, "device memory cap in GiB (0: the cap at which none holds half the prompts "
                                       "of the longest length, rounded up, at the largest chunk)", ge=0),
    Param("chunk", "int", 0, "largest prefill chunk in tokens a config may take (0: 8192 on CUDA, 64 on CPU)", gt=0,
          auto={"cuda": 8192, "cpu": 64}),
    Param("batched", "bool", False, "prefill several prompts' chunks in one forward (Engine.prefill_batch, first "
          "come, first served), each config under the largest token budget per forward its cap allows"),
    Param("max_num_batched_tokens", "int", 0, "batched: the most tokens one forward may take, as vLLM names its "
          "budget; at least chunk (0: prompts x chunk, a chunk of every prompt in each forward)", ge=0),
    Param("reserve_gib", "float", 0.0, "device memory left for what the byte formulas do not count: cuBLAS, the "
                                       "allocator's rounding (0: 1 on CUDA, none on CPU)", ge=0,
          auto={"cuda": 1.0, "cpu": 0.0}),
    Param("repeats", "int", 2, "timed batches per config (median, min, max)", gt=0),
    Param("warmup_tokens", "int", 0, "warm-up prompt per config (0: two chunks)", ge=0),
    SEED.but(help="weights and prompts"),
    OUT_DIR,
]

measuring = lazy.module(".measure", __package__)     # imported once the parameters resolved


plan = planner(NAME, SPEC, measuring)
PrefillThroughputPlan = plan.type      # the checked plan: one typed field per parameter above


def run(plan: PrefillThroughputPlan, progress_bar: bool = True):
    return measuring.run(plan, progress_bar=progress_bar)
