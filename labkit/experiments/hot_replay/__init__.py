"""`labkit run hot_replay`: FlashOffloading's hot cache on selections a real model made (traces recorded by the
quality lab, shipped in labkit/data), scaled to the engine's context and budget and run through the cache's
own bookkeeping on the CPU: hit rate and link bytes against zero_copy's, per capacity and eviction policy.
No GPU needed: what comes out is what a GPU run counts. Code: `labkit.experiments.hot_replay.measure`.
"""
from __future__ import annotations

from pathlib import Path

from ...shapes import REFERENCE_BUDGET
from ...params import BadInput, Param, Plan, resolve

NAME = "hot_replay"
DATA = Path(__file__).resolve().parents[2] / "data"

SPEC = [
    Param("traces", "list[str]", "auto", "selection traces (.npz; auto: every trace shipped in labkit/data)"),
    Param("context_lens", "list[int]", [128 << 10, 1 << 20], "contexts the traces are scaled to"),
    Param("budget", "int", REFERENCE_BUDGET, "rows selected per step and QSA layer"),
    Param("capacity_x", "list[float]", [0.5, 1.0, 1.5, 2.0, 3.0], "hot-cache capacities, in budgets"),
    Param("policies", "list[str]", ["lru", "lfu", "lrfu"], "eviction policies"),
    Param("shape", "str", "qwen3.8-flash-next", "model shape whose layers the traces are spread over"),
    Param("out_dir", "str", "", "run folder (empty: results/<run-id>)"),
]


def plan(given: dict) -> Plan:
    from ...engine.transfer.hot_cache import POLICIES
    from ...shapes import PRESETS
    p = resolve(SPEC, given, NAME)
    if p["traces"] == "auto":
        p["traces"] = sorted(str(t.relative_to(DATA.parent.parent)) for t in DATA.glob("*.npz"))
    missing = [t for t in p["traces"] if not Path(t).is_file()]
    if missing or not p["traces"]:
        raise BadInput(f"trace {missing[0] if missing else '(none)'} does not exist")
    bad = [x for x in p["policies"] if x not in POLICIES]
    if bad or not p["policies"]:
        raise BadInput(f"unknown policy {bad[0] if bad else '(none)'}: choose from {', '.join(POLICIES)}")
    if p["shape"] not in PRESETS:
        raise BadInput(f"unknown shape {p['shape']!r}: choose from {', '.join(PRESETS)}")
    if p["budget"] <= 0 or any(c < p["budget"] for c in p["context_lens"]) or not p["context_lens"]:
        raise BadInput(f"budget must be > 0 and no larger than every context, got {p['budget']}")
    if any(x <= 0 for x in p["capacity_x"]) or not p["capacity_x"]:
        raise BadInput(f"capacity_x must be > 0, got {p['capacity_x']}")
    return Plan(NAME, p)


def run(plan: Plan, progress_bar: bool = True):
    from .measure import replay_sweep, summary_markdown
    from ...results import Run
    p = dict(plan.params)
    run = Run.create(p["out_dir"] or None, NAME, p)

    def keep(df):        # after every replay set: the rows so far on disk (an interrupt keeps them)
        run.write_table("hot_replay", df)        # the table the capacity report draws from a replay run
        run.records = [{"run_id": run.run_id, "experiment": NAME, "status": "ok", "error": None,
                        "shape": p["shape"], **r} for r in df.to_dict("records")]
        run.write_table("metrics", run.metrics())

    try:
        df = replay_sweep(p["traces"], p["context_lens"], p["budget"], p["capacity_x"], p["policies"], p["shape"],
                          log=print if progress_bar else None, on_rows=keep)
        keep(df)
        (run.path / "summary.md").write_text(summary_markdown(df, p))
    finally:
        run.finish()          # interrupted / partial / ok from the rows kept (the one rule)
    return run
