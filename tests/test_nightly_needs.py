"""A nightly on a machine that lacks what one entry needs (no vLLM here): that entry is skipped with its
reason and the rest run; `--only` plans only the entries asked for. vLLM's absence is real: the test points
LABKIT_VLLM_PYTHON at a file that does not exist, which is how labkit is told where vLLM lives."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from browser_util import REPO
from labkit.cli import main
from labkit.nightly import load_plan, run_plan
from labkit.params import BadInput


@pytest.fixture
def no_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_VLLM_PYTHON", str(tmp_path / "no-vllm-python"))


def test_default_plan_dry_run_without_vllm_skips_serve_and_lists_the_rest(no_vllm, capsys):
    rc = main(["nightly", "--plan", str(REPO / "nightly" / "plan.toml"), "--dry-run"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = {ln.split(":", 1)[0]: ln for ln in out.splitlines()}
    assert "skipped here" in lines["serve"] and "LABKIT_VLLM_PYTHON" in lines["serve"]
    assert "skipped" not in lines["probe"] and "probe.ipynb" in lines["probe"]


def test_only_plans_just_the_entries_asked_for(no_vllm, tmp_path, capsys):
    entries = load_plan(REPO / "nightly" / "plan.toml", cuda=False, only=["probe"])
    assert [(e.name, e.skip) for e in entries] == [("probe", "")] and entries[0].plan is not None
    # a value another entry gets wrong does not stop the entry asked for; its names are still checked
    plan = tmp_path / "plan.toml"
    plan.write_text('[[entry]]\nname = "p"\nexperiment = "probe"\n'
                    '[[entry]]\nname = "d"\nexperiment = "decode"\n[entry.parameters]\nbudgets = "0"\n')
    assert [e.name for e in load_plan(plan, only=["p"])] == ["p"]
    with pytest.raises(BadInput, match="budgets must be > 0"):
        load_plan(plan, only=["d"])
    plan.write_text(plan.read_text() + "budgetz = 4\n")
    with pytest.raises(BadInput, match="has no parameter"):
        load_plan(plan, only=["p"])
    assert main(["nightly", "--plan", str(REPO / "nightly" / "plan.toml"), "--dry-run", "--only", "nope"]) == 2
    assert "no entry named nope" in capsys.readouterr().err


def test_a_skipped_entry_is_recorded_and_the_rest_run(no_vllm, tmp_path, capsys):
    plan = tmp_path / "plan.toml"
    plan.write_text('[[entry]]\nname = "serve"\nexperiment = "serve"\n'
                    '[[entry]]\nname = "quick"\ntests = "tests/test_params.py"\n')
    root = tmp_path / "results"
    rc = main(["nightly", "--plan", str(plan), "--root", str(root), "--date", "2026-01-05"])
    out = capsys.readouterr().out
    night = root / "nightly-2026-01-05"
    rec = json.loads((night / "nightly.json").read_text())
    st = {e["name"]: e for e in rec["entries"]}
    assert st["serve"]["status"] == "skipped" and "LABKIT_VLLM_PYTHON" in st["serve"]["error"]
    assert st["quick"]["status"] == "ok" and (night / "quick" / "tests.txt").is_file()     # the rest ran
    assert "skipped serve: LABKIT_VLLM_PYTHON" in out and "1 of 2 entries done" in out
    assert "serve: skipped" in (night / "nightly.log").read_text()
    assert not (night / "serve").exists()
    assert rc == 0                                # a missing need is not a failed night


def test_the_schedule_steps_install_what_the_plan_needs():
    docs = (REPO / "docs" / "nightly.md").read_text()
    steps = docs[docs.index("## Scheduling"):]
    assert steps.index("make venv vllm-venv") < steps.index("install_schedule.sh")
    script = (REPO / "nightly" / "install_schedule.sh").read_text()
    body = script[script.index("if [ \"$MODE\" = cron ]"):]
    # both ways of installing (cron and systemd) build the venvs before the first night
    assert "make -C \"$REPO\" venv vllm-venv" in script and body.count("\n  deps\n") == 1 and "\ndeps\n" in body
