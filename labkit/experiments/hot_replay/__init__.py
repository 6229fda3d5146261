"""`labkit run hot_replay`: FlashOffloading's hot cache on selections a real model made (traces recorded by the
quality lab, shipped in labkit/data), scaled to the engine's context and budget and run through the cache's
own bookkeeping on the CPU: hit rate and link bytes against zero_copy's, per capacity and eviction policy.
No GPU needed: what comes out is what a GPU run counts. Code: `labkit.experiments.hot_replay.measure`.
"""
from __future__ import annotations

from pathlib import Path

from ... import lazy
from ...engine.transfer.hot_cache import POLICIES
from ...params import OUT_DIR, Param
from ...shapes import PRESETS, REFERENCE_BUDGET
from .. import planner

measuring = lazy.module(".measure", __package__)     # imported once the parameters resolved: this module stays light
sweep = lazy.module("...sweep", __package__)         # sweep imports pandas

NAME = "hot_replay"
DATA = Path(__file__).resolve().parents[2] / "data"



def _presets():
    return list(PRESETS)


SPEC = [
    Param("traces", "list[str]", "auto", "selection traces (.npz; auto: every trace shipped in labkit/data)"),
    Param("context_lens", "list[int]", [128 << 10, 1 << 20], "contexts the traces are scaled to", unit="tokens"),
    Param("budget", "int", REFERENCE_BUDGET, "rows selected per step and QSA layer", gt=0, unit="rows"),
    Param("capacity_x", "list[float]", [0.5, 1.0, 1.5, 2.0, 3.0], "hot-cache capacities, in budgets", gt=0,
          unit="budgets"),
    Param("policies", "list[str]", list(POLICIES), "eviction policies (the hot cache's)", choices=POLICIES),
    Param("shape", "str", "qwen3.8-flash-next", "model shape whose layers the traces are spread over",
          choices=_presets),
    OUT_DIR,
]


plan = planner(NAME, SPEC, measuring)
HotReplayPlan = plan.type     # the checked plan: plan.traces, plan.context_lens, plan.budget, ...


def run(plan: HotReplayPlan, progress_bar: bool = True):
    run = sweep.open_run(plan.params, NAME)

    def keep(df):        # after every replay set: the rows so far on disk (an interrupt keeps them)
        run.write_table("hot_replay", df)        # the table the capacity report draws from a replay run
        run.records = [{"run_id": run.run_id, "experiment": NAME, "status": "ok", "error": None,
                        "shape": plan.shape, **r} for r in df.to_dict("records")]
        run.write_table("metrics", run.metrics())

    try:
        with sweep.bar(len(plan.traces) * len(plan.context_lens), NAME, progress_bar) as bar:
            df = measuring.replay_sweep(plan.traces, plan.context_lens, plan.budget, plan.capacity_x, plan.policies,
                                        plan.shape, log=None, on_rows=keep, bar=bar)
        keep(df)
        run.write_file("summary.md", measuring.summary_markdown(df, plan.params))
    finally:
        run.finish()          # interrupted / partial / ok from the rows kept (the one rule)
    sweep.headline(sweep.summary_lines(lambda: measuring.headline(df)), progress_bar, NAME)
    return run
