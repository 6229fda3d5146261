"""`labkit runs` as a newcomer reads it: a header, a first column that `labkit report` takes, ids never cut,
and a pipe closed early (`| head`) is the end of the listing, not a traceback."""
from __future__ import annotations

import os
import subprocess
import sys

from browser_util import REPO
from labkit.cli import run_folder

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _sh(cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, cwd=REPO, env=ENV,
                          timeout=120)


def test_header_and_first_column_is_a_run_labkit_report_takes():
    out = _sh(f"{sys.executable} -m labkit runs")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["RUN", "EXPERIMENT", "STATUS"]
    ids = [ln.split()[0] for ln in lines[1:]]
    assert len(ids) == len(set(ids)), "two runs listed under one id"
    folders = {p.parent.relative_to(REPO / "results").as_posix() for p in (REPO / "results").glob("**/manifest.json")
               if p.parent.name != "_assets"}
    assert set(ids) == folders                 # every id whole, none cut to a column's width
    for run in ids:
        old_cwd = os.getcwd()
        os.chdir(REPO)
        try:
            assert (run_folder(run) / "manifest.json").is_file(), run
        finally:
            os.chdir(old_cwd)


def test_committed_runs_read_as_they_are_and_machines_are_whole():
    out = _sh(f"{sys.executable} -m labkit runs")
    assert out.returncode == 0, out.stderr
    lines = {ln.split()[0]: ln for ln in out.stdout.splitlines()[1:]}
    stale = [run for run, ln in lines.items() if ln.split()[2] == "stale"]
    assert not stale, f"committed runs listed as stale (their writers ran on another machine): {stale}"
    cpu = lines.get("20261129-hot-replay-cpu")
    if cpu is not None:                       # its host is a description, not a name: shown whole, said once
        assert "CPU (developer machine, 2 cores)" in cpu and "CPU CPU" not in cpu, cpu


def test_a_closed_pipe_ends_quietly():
    for cmd in ("runs", "docs"):
        out = _sh(f"{sys.executable} -m labkit {cmd} | head -1")
        assert out.returncode == 0 and out.stderr == "" and len(out.stdout.splitlines()) == 1, (cmd, out.stderr[-500:])
