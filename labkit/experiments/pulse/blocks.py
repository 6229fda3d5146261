"""`labkit run pulse_blocks`: how block-granular selections cross the link — one copy per unit, a CPU gather
into staging then one copy, the gather pipelined with chunked copies (PulseInfer's coalesced transfers),
batched DMA (`cuMemcpyBatchAsync`), the zero-copy kernel — against one contiguous copy of the same bytes,
every result checked against the rows it should hold. Code: `labkit.experiments.pulse.blocks_measure`.
"""
from __future__ import annotations

from ...shapes import REFERENCE_BUDGET
from ...params import DEVICE, OUT_DIR, SEED, SHAPE, BadInput, Param, Plan
from .. import for_this_machine

NAME = "pulse_blocks"

SPEC = [
    SHAPE,
    DEVICE,
    Param("context", "int", "auto", "tokens a request's selection is drawn from (auto: 64K on CUDA, 4K on CPU)"),
    Param("budget", "int", "auto", "rows selected per request and QSA layer (auto: 2048 on CUDA, 256 on CPU)"),
    Param("blocks", "list[int]", [16], "positions per selected block (1: per token)"),
    Param("requests", "list[int]", [1], "requests' selections moved per transfer"),
    Param("repeats", "int", "auto", "timed calls per variant (auto: 20 on CUDA, 3 on CPU)"),
    Param("threads", "int", 0, "CPU gather threads (0: all cores)"),
    Param("chunk_bytes", "int", 8 << 20, "coalesced pipeline: bytes gathered per copy"),
    Param("dma_split", "list[int]", [128, 512], "batched DMA split into calls of N units (one variant each)"),
    SEED.but(help="selections"),
    OUT_DIR,
]
AUTO = {"cuda": dict(shape="qwen3.8-flash-next", context=64 << 10, budget=REFERENCE_BUDGET, repeats=20),
        "cpu": dict(shape="tiny", context=4096, budget=256, repeats=3)}


def plan(given: dict) -> Plan:
    p = for_this_machine(SPEC, given, NAME, AUTO)
    for b in p["blocks"]:
        if b < 1 or p["budget"] % b or p["context"] % b or not 0 < p["budget"] <= p["context"]:
            raise BadInput(f"budget {p['budget']} and context {p['context']} must be multiples of block {b}, "
                           "0 < budget <= context")
    if not p["requests"] or min(p["requests"]) < 1 or p["chunk_bytes"] <= 0 or p["threads"] < 0 or p["repeats"] < 1:
        raise BadInput("requests and repeats must be >= 1, chunk_bytes > 0, threads >= 0")
    if any(n < 1 for n in p["dma_split"]):
        raise BadInput(f"dma_split: units per call must be >= 1, got {p['dma_split']}")
    return Plan(NAME, p)


def run(plan: Plan, progress_bar: bool = True):
    from .blocks_measure import block_probe
    from ...params import one_line
    from ...results import Run
    from ...shapes import ModelShape
    p = dict(plan.params)
    run = Run.create(p["out_dir"] or None, NAME, p)
    gpu = run.manifest.get("gpu_name") or "cpu"
    for req in p["requests"]:
        for b in p["blocks"]:
            try:
                for r in block_probe(ModelShape.from_name(p["shape"]), p["device"], p["context"], p["budget"], b,
                                     p["repeats"], p["threads"], seed=p["seed"], requests=req,
                                     chunk_bytes=p["chunk_bytes"], dma_split_units=tuple(p["dma_split"])):
                    run.add({**r, "gpu_name": gpu})
            except Exception as ex:
                run.add({"experiment": NAME, "status": "failed", "error": one_line(ex), "block": b, "requests": req})
    run.finish()                 # the shared rule over the rows
    return run
