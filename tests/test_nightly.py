"""The nightly runner: plans checked before anything runs; one kernel per entry; a failing entry is
recorded and the rest still run; a second run of the same night skips what is done."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from browser_util import REPO, nightly_record, nightly_root
from labkit.params import BadInput
from labkit.cli import main
from labkit.nightly import load_plan, run_plan

TEST_PLAN = REPO / "nightly" / "test_plan.toml"
NIGHT = "nightly-2026-01-02"


def _plan(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "plan.toml"
    p.write_text(body)
    return p


GOOD = '[[entry]]\nname = "p"\nexperiment = "probe"\n[entry.parameters]\nrepeats = 2\n'


@pytest.mark.parametrize("body, message", [
    ('[[entry]]\nname = "p"\nexperiment = "probe"\n[entry.parameters]\nrepeatz = 2\n',
     "probe has no parameter(s) repeatz"),
    ('[[entry]]\nname = "q"\nnotebook = "notebooks/nope.ipynb"\n', "notebook notebooks/nope.ipynb is missing"),
    ('[[entry]]\nname = "q"\nexperiment = "warp"\n', "unknown experiment 'warp'"),
    ('[[entry]]\nname = "q"\nexperiment = "decode"\n[entry.parameters]\nout_dir = "/tmp/x"\n', "set by the nightly runner"),
    ('[[entry]]\nname = "q"\nexperiment = "decode"\n[entry.cpu]\nbudgetz = 4\n', "has no parameter(s) budgetz"),
    ('[[entry]]\nname = "q"\nexperiment = "decode"\n[entry.parameters]\nbudgets = "0"\n', "budgets must be > 0"),
    ('[[entry]]\nname = "q"\nexperiment = "decode"\n[entry.parameters]\nstrategies = "teleport"\n', "strategies must be one of resident"),
    (GOOD + GOOD, "name used twice"),
    ('[[entry]]\nname = "../up"\nexperiment = "probe"\n', "folder-safe"),
    ('[[entry]]\nname = "q"\nexperiment = "probe"\nnotebook = "notebooks/probe.ipynb"\n', "exactly one of"),
    ('[[entry]]\nname = "q"\nexperiment = "probe"\nretries = 3\n', "unknown key(s) retries"),
    ('[[entry]\nname = "q"\n', "not valid TOML"),
    ('title = "no entries"\n', "no [[entry]] tables"),
])
def test_bad_plan_is_one_line_and_nothing_is_written(tmp_path, capsys, body, message):
    # a good entry first: a bad one later must still stop the plan before the good one runs
    plan = _plan(tmp_path, (GOOD.replace('"p"', '"first"') if "[[entry]]" in body and "name used twice" not in message
                            and "TOML" not in message else "") + body)
    root = tmp_path / "results"
    with pytest.raises(BadInput) as ex:
        run_plan(plan, date="2026-01-01", root=root)
    assert message in str(ex.value)
    assert "\n" not in str(ex.value)
    assert not root.exists(), "bad input must stop the plan before anything is written"
    rc = main(["nightly", "--plan", str(plan), "--root", str(root), "--date", "2026-01-01"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("labkit: ") and len(err.splitlines()) == 1 and message in err
    assert not root.exists()


def test_missing_plan_and_bad_date(tmp_path):
    with pytest.raises(BadInput, match="does not exist"):
        load_plan(tmp_path / "nope.toml")
    with pytest.raises(BadInput, match="expected YYYY-MM-DD"):
        run_plan(_plan(tmp_path, GOOD), date="yesterday", root=tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_shipped_plans_validate():
    default = load_plan(REPO / "nightly" / "plan.toml", cuda=False)
    names = {e.name for e in default}
    assert {"probe", "decode"} <= names
    # the default plan covers every experiment notebook that exists (explore.ipynb is interactive, not a sweep)
    covered = {e.notebook.name for e in default}
    on_disk = {p.name for p in (REPO / "notebooks").glob("*.ipynb")} - {"explore.ipynb"}
    assert on_disk <= covered, f"notebooks missing from nightly/plan.toml: {sorted(on_disk - covered)}"
    load_plan(REPO / "nightly" / "plan.toml", cuda=True)      # the [entry.cuda] tables' names are checked too
    load_plan(TEST_PLAN, cuda=True)
    test = load_plan(TEST_PLAN, cuda=False)
    assert [e.name for e in test] == ["probe", "deliberately-fails", "decode-small"]


def test_nightly_failure_recorded_rest_still_ran():
    root, rec = nightly_root(), nightly_record()
    night = root / NIGHT
    st = {e["name"]: e for e in rec["entries"]}
    assert st["probe"]["status"] == "ok" and st["decode-small"]["status"] == "ok", st
    assert st["deliberately-fails"]["status"] == "failed"
    assert "Timeout" in st["deliberately-fails"]["error"]
    # the entry after the failure ran after it
    assert st["decode-small"]["started"] >= st["deliberately-fails"]["started"]
    for e in st.values():
        assert e["wall_s"] > 0
    on_disk = json.loads((night / "nightly.json").read_text())
    assert [e["status"] for e in on_disk["entries"]] == ["ok", "failed", "ok"]
    err = (night / "deliberately-fails" / "error.txt").read_text()
    assert "CellTimeoutError" in err and "log.txt" in err
    assert not (night / "probe" / "error.txt").exists()
    for ok in ("probe", "decode-small"):
        assert (night / ok / "report.html").is_file() and (night / ok / "manifest.json").is_file()
        assert f"entry {ok}:" in (night / ok / "log.txt").read_text()
    m = json.loads((night / "decode-small" / "manifest.json").read_text())
    assert m["parameters"]["shape"] == "tiny" and m["parameters"]["context_lens"] == [256, 1024]   # [entry.cpu] applied
    idx = (root / "index.html").read_text()
    assert "deliberately-fails" in idx and "nightly-2026-01-02/decode-small/report.html" in idx


def test_resume_skips_done_entries_and_keeps_the_failed_attempt():
    root = nightly_root()
    night = root / NIGHT
    before = {n: (night / n / "report.html").stat().st_mtime_ns for n in ("probe", "decode-small")}
    lines = []
    rec = run_plan(TEST_PLAN, date="2026-01-02", root=root, echo=lines.append)
    st = {e["name"]: e for e in rec["entries"]}
    assert st["probe"].get("skipped_on_resume") and st["decode-small"].get("skipped_on_resume")
    assert st["probe"]["status"] == "ok"
    assert any("probe: already done" in ln for ln in lines)
    for n, t in before.items():
        assert (night / n / "report.html").stat().st_mtime_ns == t, f"{n} was re-run"
    # the failed entry ran again; its first attempt was moved aside, not overwritten
    assert st["deliberately-fails"]["status"] == "failed"
    assert st["deliberately-fails"]["earlier_attempts"] == ["deliberately-fails.attempt-1"]
    assert (night / "deliberately-fails.attempt-1" / "error.txt").is_file()
    assert (night / "deliberately-fails" / "error.txt").is_file()
    assert not (night / ".lock").exists()


def test_a_second_nightly_on_the_same_folder_is_refused(tmp_path):
    night = tmp_path / "results" / "nightly-2026-01-03"
    night.mkdir(parents=True)
    (night / ".lock").write_text(str(os.getpid()))      # this process is alive: "another nightly"
    with pytest.raises(BadInput, match="another nightly"):
        run_plan(_plan(tmp_path, GOOD), date="2026-01-03", root=tmp_path / "results")
    assert sorted(p.name for p in night.iterdir()) == [".lock"]
