"""`labkit run prefill`: prompt tokens per second with the KV kept resident, written back to host RAM as it is
made (`sync`), or through four rotating layer-sized device buffers (`rotating`, FlashOffloading's prefill);
a device-memory cap shows what fits. Code: `labkit.experiments.prefill.measure`."""
from __future__ import annotations

from ... import lazy
from ... import envs
from ...params import DEVICE, OUT_DIR, SEED, SHAPE, Param
from ...shapes import MODEL_PARAMS
from .. import planner

NAME = "prefill"

MODES = ("resident", "sync", "rotating")     # KV kept resident, written back as made, rotating layer buffers

SPEC = [
    SHAPE,
    DEVICE,
    *MODEL_PARAMS,
    Param("context_lens", "list[int]", "auto", "prompt lengths (248K, 1M accepted)", gt=0,
          auto={"cuda": [248 << 10], "cpu": [512]}),
    Param("modes", "list[str]", list(MODES), ", ".join(MODES), choices=MODES),
    Param("chunk", "int", 0, "prefill chunk in tokens (0: 8192 on CUDA, 64 on CPU)", gt=0,
          auto={"cuda": 8192, "cpu": 64}),
    Param("prefill_attention", "list[str]", ["dense"], "dense (every query over its whole prefix) and/or sparse "
          "(QSA's rule: the indexer's top `budget` rows per query)", choices=("dense", "sparse")),
    Param("budget", "int", "auto", "rows a query keeps in sparse prefill (auto: 2048 on CUDA, 16 on CPU)", gt=0,
          auto={"cuda": 2048, "cpu": 16}),
    Param("tail_tokens", "int", 0, "compute only the last N tokens over a cached random prefix (0: whole prompt)",
          ge=0),
    Param("mem_cap_gib", "float", 0.0, "device memory cap in GiB (0: none)"),
    Param("warmup_tokens", "int", 0, "warm-up prompt per mode (0: two chunks)"),
    Param("anatomy", "bool", True, "time each chunk's phases against their bounds (a GEMM peak and read-bandwidth "
          "probe first, on CUDA)"),
    *envs.switch_params(),     # the engine's switches: -p prefill_attn=split,sdpa measures both in this run
    SEED.but(help="weights and prompt"),
    OUT_DIR,
]

measuring = lazy.module(".measure", __package__)     # imported once the parameters resolved


plan = planner(NAME, SPEC, measuring)
PrefillPlan = plan.type       # the checked plan: plan.context_lens, plan.modes, plan.chunk, plan.budget, ...


def run(plan: PrefillPlan, progress_bar: bool = True):
    return measuring.run(plan, progress_bar=progress_bar)
