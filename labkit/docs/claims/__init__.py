"""Do the published figures hold? One row per published headline of the four systems, each tested from
committed runs and given a verdict by a declared rule.

    labkit docs --write     # writes docs/claims.md (block `claims`) and the README's block `claims-summary`
    card()                  # the rows, as `Claim` objects (the notebook notebooks/claims.ipynb draws them)

Each row holds the published figure and its setup and up to three of ours:

- **in the published terms**: the same quantity with the same baseline and the same ratio definition, as close
  to the published setup as one H200 allows (what still differs is said);
- **against our strongest baseline**: what the lab measures today against the best it has (e.g. PulseInfer's
  switching against our own offload lane, which already coalesces its transfers);
- **the cost model's figure for the published hardware** (`labkit predict RUN --gpu rtx3090 --gpus 3`) where
  the published figure is an absolute one on hardware we do not have.

The verdict (`judge`) uses the first of these that exists: the published-terms figure, then the cost model's,
then a stand-in (a figure of ours in other terms, named in the row); a verdict from the last two is marked
provisional, and the row names the run that would settle it. Rows with none of the three cannot be tested here.

Runs that settle rows are picked up from `docs/runs.toml` (`[runs]`) by name, with no code change:

- `pulse_ladder_decode`, else `pulse_ladder`: PulseInfer's ladder on the trace windows (the first on a decode
  instance, `disaggregated: true`, the published regime); metrics rows with `rung`, `window`,
  `output_throughput` and `tpot_ms_p99` (`status == "ok"`). Rungs in order: `per_head` (per-head 8 KiB units, one
  copy each, no switching: the published baseline), `coalesced`, `retrieval_head`, `switching`, `adaptive` (full
  PulseInfer), and the arm `no_offload` (resident only, under the same device-memory cap). Integer rungs are read
  in their numeric order (lowest = baseline, highest = full).
- `link_rate`: decode at several host-link rates; rows with `link_gbps`, `predicted_step_ms` and
  `step_ms_median`. When every point is within `LINK_CHECK_TOLERANCE` at >= `LINK_CHECK_RATES` rates, the cost
  model's transfer term counts as checked and its worst error there is the spread of the 3x RTX 3090 rows.
- `prefill_throughput`: FlashOffloading's prefill throughput; rows with `config` in none / prefill / both and
  `prompts_per_s` (optional `prompts_per_s_min` / `_max`).
- `xfer_ttft_32k`: cross-model TTFT at 32K; rows as `labkit run crossmodel` writes them (`kind == "ttft"`, `strategy`
  large_prefill / mapped, `context_len`, `concurrency`, `ttft_ms_median/min/max`, `speedup`); rows at concurrency
  8 settle the concurrency row too.
- `xfer_modern_prose`: cross-model quality on modern English prose (`labkit run crossmodel` with `pydoc` among its
  corpora; its `quality_summary` table); the perplexity row shows it beside Shakespeare's.

The card is a package, one module per system beside the rule they share:

- `rule.py`: the verdict rule (its thresholds, `judge`, `decide`, `rule_text`) and the row's types (`Published`,
  `Figure`, `Verdict`, `Claim`);
- `common.py`: the published setups and the figures of ours read from committed runs, shared by the systems;
- `sparse.py` (sparse offload of Qwen3.8-Flash-Next, with the cost model for its published box), `flash.py`
  (FlashOffloading), `pulse.py` (PulseInfer), `xfer.py` (cross-model KV transfer): each system's rows;
- `card.py`: every row in one list (`card`), the generated blocks and the card drawn (`figure`).

The card's public names (the rule and its types, each system's published figures and rows, the card and its
blocks) are importable from `labkit.docs.claims` itself.
"""
from __future__ import annotations

from ..runs import RUNS
from .card import (BUILDERS, blocks, card, claims_block, figure, link_rate_block, summary_block, table, tallies)
from .common import (BOX_GPU, BOX_GPUS, PUBLISHED_CONTEXT, PUBLISHED_SHAPE, PUBLISHED_TPOT_MS, PUBLISHED_UNIT_BYTES,
                     PUBLISHED_XFER_CONCURRENCY, PUBLISHED_XFER_CONTEXT)
from .flash import FLASH_DECODE, FLASH_DENSE, FLASH_PREFILL, flash_claims
from .pulse import LADDER, NO_OFFLOAD_ARM, ladder_ratios, pulse_claims
from .rule import (APPROX_TOLERANCE, COLOURS, CONSTRUCTION, EFFECT_SHARE, FAILS, HOLDS, LINK_CHECK_RATES,
                   LINK_CHECK_TOLERANCE, MIN_EFFECT, NO_EFFECT, OUT_OF_REGIME, PART, PART_FACTOR, SCALED_TERMS, SYSTEMS,
                   TOLERANCE, UNTESTED, VERDICTS, Claim, Figure, Published, Verdict, checked_terms, contrast, decide,
                   judge, rule_text, tolerance)
from .sparse import (BELOW_BUDGET, BYTES_STEP, DECODE_BELOW, DECODE_C4, DECODE_FLAT, DECODE_PAST, INDEX_BYTES,
                     LINK_AT_80, LINK_PENDING, LINK_SETTLE, ONE_M_BOX, PCIE_HIDES, PREFILL_248K, PREFILL_SETTLE,
                     box_prediction, link_check, prefill_prediction, sparse_claims)
from .xfer import XFER_PPL, xfer_claims

__all__ = [
    # the rule and the row's types
    "TOLERANCE", "APPROX_TOLERANCE", "EFFECT_SHARE", "PART_FACTOR", "NO_EFFECT", "MIN_EFFECT", "LINK_CHECK_TOLERANCE",
    "LINK_CHECK_RATES", "SCALED_TERMS", "HOLDS", "PART", "FAILS", "CONSTRUCTION", "OUT_OF_REGIME", "UNTESTED",
    "VERDICTS", "COLOURS", "SYSTEMS", "rule_text", "Published", "Figure", "Verdict", "Claim", "contrast", "tolerance",
    "judge", "decide", "checked_terms",
    # the published setups, and the runs docs/runs.toml names
    "BOX_GPU", "BOX_GPUS", "PUBLISHED_CONTEXT", "PUBLISHED_SHAPE", "PUBLISHED_TPOT_MS", "PUBLISHED_UNIT_BYTES", "PUBLISHED_XFER_CONTEXT",
    "PUBLISHED_XFER_CONCURRENCY", "RUNS",
    # sparse offload of Qwen3.8-Flash-Next, and the cost model for its box
    "link_check", "box_prediction", "prefill_prediction", "LINK_SETTLE", "DECODE_BELOW", "DECODE_PAST", "DECODE_FLAT",
    "DECODE_C4", "PREFILL_248K", "BYTES_STEP", "LINK_AT_80", "INDEX_BYTES", "ONE_M_BOX", "BELOW_BUDGET",
    "LINK_PENDING", "PREFILL_SETTLE", "PCIE_HIDES", "sparse_claims",
    # FlashOffloading
    "FLASH_PREFILL", "FLASH_DENSE", "FLASH_DECODE", "flash_claims",
    # PulseInfer
    "LADDER", "NO_OFFLOAD_ARM", "ladder_ratios", "pulse_claims",
    # cross-model KV transfer
    "XFER_PPL", "xfer_claims",
    # the card, its blocks, drawn
    "BUILDERS", "card", "table", "tallies", "claims_block", "summary_block", "link_rate_block", "blocks", "figure",
]
