"""The measured tables in README.md and docs/*.md, generated from committed run folders (never typed).

    labkit docs            # print every block
    labkit docs --write    # rewrite every block between its markers, in the file that holds it

A block sits between `<!-- BEGIN generated:NAME -->` and `<!-- END generated:NAME -->` in the one file that
`docs/runs.toml` names for it (`[files]`); the same file names the runs behind every table (`[runs]`). Tests
check that every file holds exactly what this module generates from the committed runs, and that every block
sits in exactly one file.

This module only assembles: which function makes each block, from which runs (`producers`), and where the blocks
are written. An experiment's tables sit beside it (labkit/experiments/NAME/tables.py); the blocks that span
several experiments are labkit/docs/'s (headlines.py, roofline_tables.py, reference_tables.py, claims/).
"""
from __future__ import annotations

import re
from functools import partial
from pathlib import Path
from typing import Callable

from ..experiments.capacity import tables as capacity
from ..experiments.crossmodel import tables as crossmodel
from ..experiments.decode import tables as decode
from ..experiments.hot_replay import tables as hot_replay
from ..experiments.multigpu import tables as multigpu
from ..experiments.prefill import tables as prefill
from ..experiments.probe import tables as probe
from ..experiments.pulse import tables as pulse
from ..experiments.pulse_blocks import tables as pulse_blocks
from ..experiments.pulse_ladder import tables as pulse_ladder
from ..experiments.pulse_scaling import tables as pulse_scaling
from ..experiments.pulse_switch import tables as pulse_switch
from ..experiments.quality import tables as quality
from ..experiments.serve_sweep import tables as serve_sweep
from ..results import REPO
from . import box
from .claims import blocks as claims_blocks
from .headlines import headlines
from .reference_tables import producers as reference_producers
from .roofline_tables import producers as roofline_producers
from .runs import RUNS, RUNS_FILE, TOML as _TOML    # noqa: F401  (RUNS_FILE: the tests')

BLOCK_FILES: dict[str, str] = {b: f for f, names in _TOML["files"].items() for b in names}


def _labelled(key: str) -> list[tuple]:
    """A docs/runs.toml list of [run, label] pairs as tuples (TOML has arrays only)."""
    return [tuple(x) for x in RUNS[key]]


def producers() -> dict[str, Callable[[], str]]:
    """Every generated block but the claims card's, in the order `labkit docs` prints them: the function that
    makes it, bound to the runs docs/runs.toml names for it (a `partial`, never a lambda, so that where the
    function lives is known: tests/test_layout.py checks it sits beside its experiment, or in labkit/docs/ when
    the block spans several)."""
    r = RUNS
    return {"headlines": partial(headlines),
            "serve-crosscheck-cpu": partial(serve_sweep.crosscheck_block, r["serve_crosscheck"]),
            "hot-density-cpu": partial(hot_replay.hot_density_table, r["hot_density"]),
            "hot-decode-h200": partial(decode.hot_decode_table, _labelled("hot_decode")),
            "pulse-blocks-h200": partial(pulse_blocks.pulse_blocks_table, r["pulse_blocks"]),
            "pulse-coalesced-h200": partial(pulse_blocks.pulse_coalesced_table, r["pulse_coalesced"]),
            "pulse-switch-h200": partial(pulse_switch.pulse_switch_table, _labelled("pulse_switch")),
            "pulse-scaling-h200": partial(pulse_scaling.pulse_scaling_table, r["pulse_scaling"]),
            "pulse-scaling-compiled-h200": partial(pulse_scaling.pulse_scaling_compiled_table,
                                                   _labelled("pulse_scaling_compiled")),
            # the selection table joins the block run with the last compiled scaling run and the quality run at blocks
            "pulse-selection-h200": partial(pulse_blocks.pulse_selection_table, r["pulse_selection_blocks"],
                                            r["pulse_scaling_compiled"][-1][0], r["quality_blocks"][1][0]),
            "pulse-trace-h200": partial(pulse.pulse_trace_table, r["pulse_trace"], r.get("pulse_trace_windows", "")),
            "pulse-ladder-h200": partial(pulse_ladder.pulse_ladder_table, r.get("pulse_ladder", "")),
            "pulse-ladder-decode-h100": partial(pulse_ladder.pulse_ladder_table, r.get("pulse_ladder_decode", "")),
            "quality-blocks-cpu": partial(quality.quality_blocks_table, r["quality"]),
            "quality-cpu": partial(quality.quality_table, r["quality"]),
            "quality-sparse-prefill-cpu": partial(quality.quality_sparse_prefill_table, r["quality_sparse_prefill"]),
            "multigpu-h200x2": partial(multigpu.multigpu_table, *r["multigpu"]),
            "prefill-h200": partial(prefill.prefill_table, r["prefill"]),
            "prefill-anatomy-h200": partial(prefill.prefill_anatomy_table, r["prefill_anatomy"]),
            "prefill-kernels-h200": partial(prefill.prefill_kernels_table, r["prefill_kernels"]),
            "sparse-prefill-h200": partial(prefill.sparse_prefill_table, r["sparse_prefill_kernels"],
                                           r["sparse_prefill_kernels_before"], r["prefill_anatomy"], r["prefill_now"],
                                           r["prefill_sparse"]),
            "hot-conc-h200": partial(decode.hot_conc_table, r["hot_conc"]),
            "capacity-h200": partial(capacity.capacity_table, r["capacity"]),
            "decode-h200": partial(decode.decode_tables, r["decode"]),
            "targets-h200": partial(decode.targets_table, r["decode"]),
            "anatomy-h200": partial(decode.anatomy_table, r["decode"]),
            "selection-h200": partial(probe.selection_table, r["decode"]),     # the decode run's probe rows
            "agreement-h200": partial(probe.agreement_table, r["probe"]),
            "decode-trace-h200": partial(decode.decode_trace_table, _labelled("decode_trace")),
            **xfer_producers(),
            "predict-rtx3090": partial(box.box_block, r["decode"]),
            "costmodel-h200": partial(decode.validation_summary, r["decode"]),
            **roofline_producers(r), **reference_producers(r)}


def xfer_producers() -> dict[str, Callable[[], str]]:
    """The cross-model blocks whose runs are committed (a run named in docs/runs.toml but not here yet: no block)."""
    x, r = crossmodel, RUNS
    out = {}
    for name, fn, run, *more in (("xfer-frontier-cpu", x.xfer_frontier_table, r["xfer_frontier"]),
                                 ("xfer-n10-cpu", x.xfer_n10_table, r["xfer_n10"]),
                                 ("xfer-rank-cpu", x.xfer_rank_table, r["xfer_rank"]),
                                 ("xfer-run-cpu", x.xfer_run_table, r["xfer_full"]),
                                 # the vLLM rank run's rows join the TTFT table where that run is committed too
                                 ("xfer-ttft-cpu", x.xfer_ttft_table, r["xfer_ttft"], r["xfer_vllm_rank"]),
                                 ("xfer-ablation-cpu", x.xfer_ablation_table, r["xfer_ablation"]),
                                 ("xfer-vllm-ttft-cpu", x.xfer_vllm_ttft_table, r["xfer_vllm_ttft"]),
                                 ("xfer-prose-cpu", x.xfer_prose_table, r.get("xfer_modern_prose", ""))):
        if run and (REPO / run).is_dir():
            out[name] = partial(fn, [run, *more]) if more else partial(fn, run)
    return out


def blocks() -> dict[str, str]:
    """Every generated block by name: the tables, then the claims card's blocks (one card makes all of them)."""
    return {**{name: make() for name, make in producers().items()}, **claims_blocks()}


MARKER = re.compile(r"<!-- BEGIN generated:([\w.-]+) -->")


def markers(text: str) -> list[str]:
    """The names of the generated blocks a text holds, in order."""
    return MARKER.findall(text)


def rewrite(text: str, generated: dict[str, str], where: str = "the file") -> str:
    for name, body in generated.items():
        pat = re.compile(rf"(<!-- BEGIN generated:{re.escape(name)} -->\n)(?:.*?\n)?(<!-- END generated:{re.escape(name)} -->)", re.S)
        if not pat.search(text):
            raise ValueError(f"{where} has no block generated:{name}")
        text = pat.sub(lambda mt: mt.group(1) + body + "\n" + mt.group(2), text)
    return text


def by_file(generated: dict[str, str]) -> dict[str, dict[str, str]]:
    """The generated blocks grouped by the file that holds them; a block with no file is refused."""
    unmapped = sorted(set(generated) - set(BLOCK_FILES))
    if unmapped:
        raise ValueError(f"no file for generated block(s) {', '.join(unmapped)}: add them to [files] in docs/runs.toml")
    out: dict[str, dict[str, str]] = {}
    for name, body in generated.items():
        out.setdefault(BLOCK_FILES[name], {})[name] = body
    return out


def write(generated: dict[str, str], repo: Path = REPO) -> list[Path]:
    """Rewrite every block in the file that holds it; every file is checked before any is written."""
    new = {}
    for rel, gen in by_file(generated).items():
        p = repo / rel
        new[p] = rewrite(p.read_text(), gen, where=rel)
    for p, text in new.items():
        p.write_text(text)
    return list(new)


def main(write_files: bool = False) -> int:
    """`labkit docs`: print every block; `labkit docs --write`: rewrite them where they sit."""
    gen = blocks()
    if write_files:
        for p in write(gen):
            print(f"rewrote {sum(BLOCK_FILES[n] == str(p.relative_to(REPO)) for n in gen)} blocks in {p.relative_to(REPO)}")
    else:
        for k, v in gen.items():
            print(f"<!-- {k} -->\n{v}\n")
    return 0

