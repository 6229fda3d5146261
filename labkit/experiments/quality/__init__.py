"""`labkit run quality`: what top-k selection costs a real model (SmolLM2-135M ships with the lab): perplexity
and recall against dense attention per selection policy (oracle, shared oracle, a trained indexer, retrieval
heads), budget and granularity (tokens, blocks of 16), on code, prose and structured YAML, with 95% bootstrap
intervals over the evaluation sequences, with the prefix prefilled densely or under the same selection, plus the selection traces the engine and the hot cache replay.
Code: `labkit.experiments.quality.measure` (figures: `figures.py`), over the quality lab `labkit.quality`."""
from __future__ import annotations

from ...params import DEVICE, OUT_DIR, SEED, Param
from ... import lazy
from .. import planner

NAME = "quality"

SPEC = [
    Param("model", "str", "smollm2-135m", "preset name or local HF checkpoint folder / .gguf file"),
    Param("corpora", "list[str]", ["code", "prose", "yaml"],
          "code (CPython stdlib), prose (Shakespeare), yaml (PyTorch's ATen operator registry, shipped in the torch wheel), "
          "pydoc (Python's documentation topics, shipped with the interpreter: modern English prose)"),
    Param("budgets", "list[int]", [64, 256, 1024], "top-k budgets (the dense 'full' reference is always measured)"),
    Param("policies", "list[str]", ["oracle", "oracle_shared", "indexer", "retrieval_head"], "selection policies"),
    Param("protocol", "list[str]", ["dense_prefill"],
          "dense_prefill: the prefix prefilled densely, the last eval_tokens decoded with the policy; sparse_prefill: "
          "the prefix prefilled with the same policy and budget too (each row attends to its top-budget past)"),
    Param("seq_len", "int", 2048, "tokens per evaluation sequence (2K-8K; 2K keeps 48 sequences near 40 min of 2 CPU cores)"),
    Param("n_sequences", "int", 16, "evaluation sequences per corpus, drawn from the eval split (>= 2: intervals are over sequences)"),
    SEED.but(help="seed of the evaluation-sequence draw (recorded; one seed, one set of sequences)"),
    Param("eval_tokens", "int", 128, "tokens at the end of each sequence decoded sparsely (the rest is dense prefill)"),
    Param("calib_sequences", "int", 2, "calibration sequences per corpus (indexer fit, retrieval heads)", ge=1),
    Param("sink_window", "int", 16, "positions at the start kept by retrieval_head and excluded from mid share",
          ge=0),
    Param("recent_window", "int", 64, "last positions kept by retrieval_head and excluded from mid share", ge=1),
    Param("block", "int", 1, "select whole blocks of this many tokens (PulseInfer: 16); 1: single tokens", ge=1),
    Param("block_variants", "list[int]", [16], "also select in blocks of these sizes (every policy, at block_budgets); empty: none"),
    Param("block_budgets", "list[int]", [256], "budgets at which the block_variants are measured"),
    Param("trace_policies", "list[str]", ["indexer", "retrieval_head", "oracle_shared"], "layer-shared policies traced"),
    Param("trace_budgets", "list[int]", [256, 2048], "budgets traced"),
    Param("trace_steps", "int", 32, "greedy decode steps per trace", ge=0),
    Param("trace_prompt_len", "int", 8000, "prompt tokens before the traced decode steps"),
    DEVICE,
    Param("dtype", "str", "auto", "auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16",
          choices=("float32", "bfloat16", "float16"), auto={"cuda": "bfloat16", "cpu": "float32"}),
    OUT_DIR,
]


measuring = lazy.module(".measure", __package__)     # imported once the parameters resolved
plan = planner(NAME, SPEC, measuring, declared=SPEC)    # its per-device dtype decided there
QualityPlan = plan.type       # the checked plan: plan.model, plan.corpora, plan.budgets, plan.policies, ...


def run(plan: QualityPlan, progress_bar: bool = True):
    return measuring.run_quality(plan, log=print if progress_bar else None)
