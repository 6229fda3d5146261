"""`labkit run pulse_blocks`: how block-granular selections cross the link — one copy per unit, a CPU gather
into staging then one copy, the gather pipelined with chunked copies (PulseInfer's coalesced transfers),
batched DMA (`cuMemcpyBatchAsync`), the zero-copy kernel — against one contiguous copy of the same bytes,
every result checked against the rows it should hold. Code: `labkit.experiments.pulse_blocks.measure`.
"""
from __future__ import annotations

from ...shapes import REFERENCE_BUDGET
from ...params import DEVICE, OUT_DIR, SEED, SHAPE, Param
from ... import lazy
from .. import planner

NAME = "pulse_blocks"

SPEC = [
    SHAPE,
    DEVICE,
    Param("context", "int", "auto", "tokens a request's selection is drawn from (auto: 64K on CUDA, 4K on CPU)",
          auto={"cuda": 64 << 10, "cpu": 4096}),
    Param("budget", "int", "auto", "rows selected per request and QSA layer (auto: 2048 on CUDA, 256 on CPU)",
          auto={"cuda": REFERENCE_BUDGET, "cpu": 256}),
    Param("blocks", "list[int]", [16], "positions per selected block (1: per token)", ge=1),
    Param("requests", "list[int]", [1], "requests' selections moved per transfer", ge=1),
    Param("repeats", "int", "auto", "timed calls per variant (auto: 20 on CUDA, 3 on CPU)", ge=1,
          auto={"cuda": 20, "cpu": 3}),
    Param("threads", "int", 0, "CPU gather threads (0: all cores)", ge=0),
    Param("chunk_bytes", "int", 8 << 20, "coalesced pipeline: bytes gathered per copy", gt=0),
    Param("dma_split", "list[int]", [128, 512], "batched DMA split into calls of N units (one variant each)", ge=1),
    SEED.but(help="selections"),
    OUT_DIR,
]


measuring = lazy.module(".measure", __package__)     # imported once the parameters resolved
plan = planner(NAME, SPEC, measuring)
PulseBlocksPlan = plan.type   # the checked plan: plan.context, plan.budget, plan.blocks, plan.requests, ...


def run(plan: PulseBlocksPlan, progress_bar: bool = True):
    return measuring.run(plan, progress_bar=progress_bar)
