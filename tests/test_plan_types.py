"""Each experiment's plan is a frozen dataclass made once from its SPEC: a typed field per parameter (its Param, with
help, unit and choices, in the field's metadata), read as attributes; the manifest records the same plan as a dict,
and every committed run's recorded parameters load back into today's plan. Planning and JSON only (seconds)."""
from __future__ import annotations

import dataclasses
import json
import re
import typing

import pytest

from browser_util import REPO
from labkit import experiments
from labkit.experiments import EXPERIMENTS
from labkit.params import Param, Plan, plan_type

TOY = [Param("budgets", "list[int]", [64], "rows kept", gt=0, unit="rows"),
       Param("steps", "int", 20, "decode steps", gt=0),
       Param("selection", "str", "indexer", "where selections come from", choices=("indexer", "trace"))]


def test_a_plan_type_has_one_typed_field_per_parameter():
    kind = plan_type("toy_walk", TOY)
    assert kind.__name__ == "ToyWalkPlan" and issubclass(kind, Plan) and kind.experiment == "toy_walk"
    hints = typing.get_type_hints(kind)
    assert hints["budgets"] == tuple[int, ...] and hints["steps"] is int and hints["selection"] is str
    assert kind.field_param("budgets").unit == "rows" and kind.field_param("selection").choices == ("indexer", "trace")
    plan = kind.from_params({"budgets": [2048, 256], "steps": 5, "selection": "indexer"})
    assert plan.budgets == (2048, 256) and plan.steps == 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.steps = 6
    assert plan.params == {"budgets": [2048, 256], "steps": 5, "selection": "indexer"}     # as a manifest records it
    assert dataclasses.replace(plan, steps=7).steps == 7 and plan.steps == 5
    assert dataclasses.replace(plan, budgets=[8]).budgets == (8,) and kind(budgets=[4]).budgets == (4,)  # lists held as tuples
    with pytest.raises(ValueError, match="missing \\['steps'\\]"):
        kind.from_params({"budgets": [1], "selection": "indexer"})
    with pytest.raises(ValueError, match="unknown \\['budget'\\]"):
        kind.from_params({**plan.params, "budget": 1})


def test_every_experiment_plans_its_own_type_and_it_round_trips():
    """A CPU plan of each experiment that plans without a server or a trace file of its own: its type's fields are
    the SPEC's names (derived values after them), and JSON (what a notebook receives) and the manifest's dict give
    the same plan back."""
    for name, exp in EXPERIMENTS.items():
        kind = exp.plan_type
        names = [f.name for f in dataclasses.fields(kind)]
        assert names[:len(exp.spec)] == [p.name for p in exp.spec], name
        given = {"device": "cpu"} if any(p.name == "device" for p in exp.spec) else {}
        plan = experiments.plan(name, given)
        assert type(plan) is kind
        assert kind.from_params(plan.params) == plan, name
        assert kind(**json.loads(plan.to_json())["params"]) == plan, name       # as `experiments.run` reads the JSON
        assert json.loads(plan.to_json())["params"] == plan.params


def committed_manifests():
    for path in sorted(REPO.glob("results/**/manifest.json")):
        mf = json.loads(path.read_text())
        if experiments.experiment_name(mf.get("experiment", "")) in EXPERIMENTS:
            yield path, {**mf, "experiment": experiments.experiment_name(mf["experiment"])}


def test_every_committed_run_loads_into_todays_plan():
    """The parameters a run recorded come back unchanged from its plan; a parameter added since takes its default,
    and one since removed is returned beside the plan, never silently dropped."""
    seen = 0
    for path, mf in committed_manifests():
        plan, gone = experiments.plan_of_run(mf)
        recorded = mf.get("parameters") or {}
        kept = {k: v for k, v in recorded.items() if k not in gone}
        assert {k: plan.params[k] for k in kept} == kept, path
        assert set(gone) | set(kept) == set(recorded)
        assert type(plan).from_params(plan.params) == plan
        seen += 1
    assert seen >= 100


# the experiments whose measuring code reads the plan's fields, and the modules it is in
MOVED = {name: [f"{name}/__init__.py", f"{name}/measure.py"]
         for name in ("decode", "probe", "hot_replay", "multigpu", "capacity", "pulse_blocks", "pulse_switch",
                      "pulse_scaling", "quality", "prefill", "pulse", "pulse_ladder", "serve_sweep",
                      "prefill_throughput", "crossmodel")}
MOVED["decode"].append("decode_session.py")
MOVED["crossmodel"].append("crossmodel/seeded.py")
KEYED = re.compile(r"""\b(p|params|pl\.params)\[["']""")


def without(src: str, names: tuple[str, ...]) -> str:
    """`src` without the top-level functions `names` (a check decides the "auto" values on the resolved dict; a
    closing line reads the manifest's)."""
    for name in names:
        if f"\ndef {name}(" in src:
            head, rest = src.split(f"\ndef {name}(", 1)
            nxt = re.search(r"\n(def |class |[A-Z_]+ = )", rest)
            src = head + (rest[nxt.start():] if nxt else "")
    return src


def test_a_moved_experiments_measuring_code_reads_the_plans_fields():
    """Past its `check`, a moved experiment reads no parameter by its key: `plan.budgets`, `pt.budget`, what a
    reader, an editor's "go to definition" and a type checker follow."""
    root = REPO / "labkit" / "experiments"
    for name, files in MOVED.items():
        for f in files:
            body = without((root / f).read_text(), ("check", "headline"))
            assert not KEYED.findall(body), f"{f} reads parameters by key"
            assert "dict(plan.params)" not in body, f
    assert KEYED.findall(without("def run(p):\n    p['steps']\n", ("check",)))      # the test can fail
