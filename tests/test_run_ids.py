"""A run named as `labkit runs` prints it is taken by every command that takes a run (`report`, `compare`,
`predict`), from the folder the listing was made in; a name that is no run is one line and exit 2."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from browser_util import REPO

ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
# two committed GPU decode runs with step anatomies (what `labkit predict` scales); their tables only
RUNS = ("20261203-060711-decode-64k-h200", "20261202-171653-decode-64k-h200")


def labkit(cwd, *args):
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True, text=True, env=ENV, cwd=cwd)


@pytest.fixture(scope="module")
def here(tmp_path_factory):
    """A folder with a results/ of two runs, as a newcomer's checkout has after copying runs in."""
    root = tmp_path_factory.mktemp("checkout")
    for name in RUNS:
        shutil.copytree(REPO / "results" / name, root / "results" / name,
                        ignore=shutil.ignore_patterns("report*.html", "*.ipynb"))
    return root


def listed_ids(cwd) -> list[str]:
    r = labkit(cwd, "runs")
    assert r.returncode == 0, r.stderr
    return [line.split()[0] for line in r.stdout.splitlines()[1:]]


def test_compare_and_predict_take_the_ids_labkit_runs_prints(here):
    ids = listed_ids(here)
    assert sorted(ids) == sorted(RUNS) and not any("/" in i for i in ids)
    r = labkit(here, "compare", ids[0], ids[1], "--out", str(here / "cmp.html"))
    assert r.returncode == 0, r.stderr
    assert (here / "cmp.html").is_file()
    r = labkit(here, "predict", ids[0], "--gpu", "rtx3090", "--gpus", "3")
    assert r.returncode == 0, r.stderr
    assert "PREDICTED (not measured) on 3 x" in r.stdout


def test_report_takes_the_id_too(here):
    ids = listed_ids(here)
    # no executed notebook in the copy: the report is drawn again from its tables (papermill, no measuring)
    r = labkit(here, "report", ids[0])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith(f"results/{ids[0]}/report.html")


@pytest.mark.parametrize("cmd", [["compare", "NOPE", RUNS[0]], ["predict", "NOPE"], ["report", "NOPE"]])
def test_a_name_that_is_no_run_is_one_line(here, cmd):
    r = labkit(here, *cmd)
    assert r.returncode == 2 and r.stderr.strip() == (
        "labkit: NOPE is not a run: no folder NOPE, nor results/NOPE (`labkit runs` lists the runs)")
