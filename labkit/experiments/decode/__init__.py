"""`labkit run decode`: decode speed, link bytes and where the step's time goes, against context length,
budget and concurrency, per transfer strategy (sparse offload of Qwen3.8-Flash-Next at up to 1M tokens),
plus prefill speed. The measuring code is `labkit.experiments.decode.measure`.

    plan = experiments.plan("decode", {"context_lens": "8K,1M", "concurrency": "1,4"})   # a DecodePlan
    plan.budgets, plan.context_lens                            # (2048, 256, ...), (8192, 1048576): typed fields
    run = experiments.run(plan)
"""
from __future__ import annotations

from ... import envs
from ...engine.transfer import STRATEGIES, strategy_params
from ...params import DEVICE, OUT_DIR, SEED, SHAPE, Param
from ...shapes import MODEL_PARAMS, REFERENCE_BUDGET
from ... import lazy
from .. import planner

NAME = "decode"

SPEC = [
    SHAPE.but(help="model shape preset or .json file (auto: qwen3.8-flash-next on CUDA, tiny on CPU)"),
    DEVICE.but(help="auto, cpu, cuda, cuda:N; several (cuda:0,cuda:1) split the layers over them"),
    *MODEL_PARAMS,
    Param("strategies", "list[str]", ["resident", "per_row", "host_gather", "zero_copy"], "transfer strategies",
          choices=lambda: tuple(STRATEGIES)),     # plugins register theirs on import
    Param("context_lens", "list[int]", "auto", "context lengths (tokens; 8K, 1M accepted)", gt=0, unit="tokens",
          auto={"cuda": [8 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20],
                "cpu": [256, 1024, 4096]}),
    Param("budgets", "list[int]", "auto", "indexer budgets: rows kept per request and QSA layer; the first is the "
          "main table's", gt=0, unit="rows",
          auto={"cuda": [REFERENCE_BUDGET, 256, 512, 1024, 4096, 8192], "cpu": [64, 16, 256]}),
    Param("concurrency", "list[int]", [1, 4], "concurrent requests per decode step", gt=0, unit="requests"),
    Param("micro_batches", "list[int]", [1], "split each batch into this many micro-batches, pipelined over "
          "the devices of a layer split (1: the stages take turns); main table only", gt=0),
    # a CPU's default sized to about 5 min on 2 quiet cores: the lab's estimate (measure.estimate) puts 3 repeats at
    # 0.67 of 5, which measured 6 min 51 s there; the axes stay those of a GPU sweep (concurrency 1 and 4 included)
    Param("repeats", "int", "auto", "timed repeats of `steps` steps", gt=0, auto={"cuda": 5, "cpu": 3}),
    Param("steps", "int", 20, "decode steps per repeat", gt=0),
    Param("prefill_lens", "list[int]", "auto", "prompt lengths for the prefill measurement (empty: none)", gt=0,
          unit="tokens",
          auto={"cuda": [248 << 10], "cpu": [2048]}),
    Param("budget_context", "int", 0, "context of the budget axis (0: the largest context)", unit="tokens"),
    Param("selection", "str", "indexer", "indexer, or trace:PATH to replay recorded selections"),
    Param("per_row_steps", "int", 3, "steps (1 repeat) for slow strategies (per_row: ~0.4 s a step per request)"),
    Param("anatomy", "bool", True, "per point, where the step's time goes (phases marked inside one extra graph)"),
    *strategy_params(),        # each strategy's own settings, declared beside it
    Param("select_block", "int", 1, "select whole aligned blocks of N positions (16: PulseInfer's; block_dma's units)",
          ge=1),
    Param("probe", "bool", True, "measure the link limits first (contiguous, host_gather, zero_copy): the plots' bounds"),
    Param("link_gbps", "list[float]", [], "emulate slower host links: the zero-copy gather's reading programs cut "
          "until it moves a step's rows at this rate (GB/s, calibrated by a probe in this run; e.g. 25 for the "
          "3090 box's PCIe 4.0); the grid once per rate after the native link, rows with predicted_step_ms", gt=0,
          unit="GB/s"),
    *envs.switch_params(),     # the engine's A/B switches: -p gemv=auto,off measures both in this run
    SEED,
    OUT_DIR,
]


measuring = lazy.module(".measure", __package__)     # imported once the parameters resolved
plan = planner(NAME, SPEC, measuring)
DecodePlan = plan.type       # the checked plan: one typed field per parameter above (plan.budgets, plan.steps, ...)


def estimate(plan: DecodePlan):
    """How long this sweep is expected to take here (`sweep.Estimate`), or None where it is not estimated."""
    return measuring.estimate(measuring.derive(plan))


def run(plan: DecodePlan, progress_bar: bool = True):
    return measuring.run_sweep(measuring.derive(plan), progress_bar=progress_bar)
