"""`labkit run crossmodel` (once `xfer`, still accepted): cross-model KV transfer — a small model prefills, a learned mapper turns its states into
the large model's K/V, the large model decodes: quality against its own prefill, token agreement, and time to
first token through transformers or vLLM with labkit's KV connector. With `weights=seeded`: time to first token
only, at the published pair's shapes (Qwen3-0.6B prefills, Qwen3-1.7B decodes) with seeded random weights, on a
GPU (`seeded.py`). Code: `measure.py` (figures: `figures.py`), over the cross-model library
`labkit.crossmodel`; the mapper studies beside it (`ablation.py`, `frontier.py`, `attribution.py`: `labkit study
crossmodel-ablation` ...)."""
from __future__ import annotations

from ...params import DEVICE, OUT_DIR, SEED, Param
from ... import lazy
from .. import planner

NAME = "crossmodel"

SPEC = [
    Param("large", "str", "smollm2-135m", "the model that decodes: preset or local HF checkpoint (weights=seeded: a "
          "published shape, qwen3-1.7b)"),
    Param("small", "str", "first:8", "the model that prefills: first:N (the large model's first N layers) or a checkpoint "
          "(weights=seeded: a published shape, qwen3-0.6b)"),
    Param("weights", "str", "checkpoint", "checkpoint: real weights, every stage; seeded: the shapes of "
          "labkit.experiments.crossmodel.seeded.SHAPES with seeded random weights, TTFT only (ttft_lens x concurrency, dtype, device)"),
    SEED.but(help="seed of the seeded weights, mapper fit and prompts (weights=seeded)"),
    DEVICE.but(default="cpu", help="cpu, cuda, cuda:N: where weights=seeded runs (real checkpoints run on the CPU)"),
    Param("layer_table", "str", "", "large:small,... alignment entries (empty: proportional / deepest layer for first:N)"),
    Param("features", "str", "h:-1,h:0,h:-1@-1,h:-2", "small-model features: h:i, kv:i, h:aligned, kv:aligned, suffix @-k or @avg (default: the ablation's best at its cost)"),
    Param("rank", "int", 0, "reduced-rank mapper: one projection of the features to `rank` dimensions shared by the mapped layers, then per-layer maps (0: full ridge)",
          ge=0),
    Param("exact_prefix", "int", 1, "first tokens whose K/V the large model computes itself (a k-token forward): position 0 is the attention sink the mapper predicts worst",
          ge=0),
    Param("rope", "str", "pre", "pre: map keys before RoPE and rotate at the target positions; post: map rotated keys",
          choices=("pre", "post")),
    Param("mapper", "str", "", "mapper .safetensors to use (empty: cached fit for these parameters, fitted if missing)"),
    Param("calib_tokens", "int", 32768, "calibration tokens per corpus (calibration split; 1 in 5 documents held out for lambda)"),
    Param("calib_val", "str", "document", "what lambda is chosen on: document (whole held-out calibration documents) or chunk (1 in 5 chunks, as mappers were fitted before)",
          choices=("document", "chunk")),
    Param("calib_seq_len", "int", 512, "tokens per calibration chunk",
          ge=16),
    Param("corpora", "list[str]", ["code", "prose"], "code (CPython stdlib), prose (Shakespeare), pydoc (Python's documentation topics: modern English prose), as in the quality lab"),
    Param("n_sequences", "int", 16, "evaluation sequences per corpus: windows of eval documents outside the calibration's families (labkit.crossmodel.heldout)",
          ge=1),
    Param("eval_seed", "int", 20261201, "seed of the evaluation draw (documents and offsets); recorded in the manifest",
          ge=0),
    Param("prompt_len", "int", 1025, "prompt tokens of a quality sequence (the cache covers prompt_len - 1)"),
    Param("cont_len", "int", 128, "continuation tokens scored for perplexity"),
    Param("agree_tokens", "int", 32, "greedy tokens of the true cache for top-1 agreement",
          ge=1),
    Param("modes", "list[str]", ["mapped", "zeros", "copy_last"], "mapped, and the ablations zeros, copy_last"),
    Param("backend", "str", "transformers", "transformers, vllm, or both",
          choices=("transformers", "vllm", "both")),
    Param("ttft_lens", "list[int]", [1024, 2048, 4096, 8064], "prompt lengths for TTFT (up to the model's context)"),
    Param("concurrency", "list[int]", [1, 4], "concurrent requests for the vLLM TTFT (weights=seeded: requests arriving "
          "together, served in order on one GPU)", ge=1),
    Param("repeats", "int", 3, "timed repeats per point after one warm-up",
          ge=1),
    Param("dtype", "str", "float32", "float32 or bfloat16 for the transformers models",
          choices=("float32", "bfloat16")),
    OUT_DIR,
]


measuring = lazy.module(".measure", __package__)                 # imported once the parameters resolved
seeded = lazy.module(".seeded", __package__)                    # weights=seeded: the same, at the published shapes
plan = planner(NAME, SPEC, measuring)                           # weights=seeded checked by seeded.check from there


CrossmodelPlan = plan.type     # the checked plan: plan.large, plan.small, plan.weights, plan.ttft_lens, ...


def run(plan: CrossmodelPlan, progress_bar: bool = True):
    log = print if progress_bar else None
    if plan.weights == "seeded":
        return seeded.run_seeded(plan, log=log)
    return measuring.run_crossmodel(plan, log=log)
