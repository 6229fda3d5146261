"""`labkit runs` as a newcomer reads it: a header, a first column that `labkit report` takes, ids never cut,
and a pipe closed early (`| head`) is the end of the listing, not a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


# ------------------------------------------------------------------ one bad folder never hides the others
BAD_MANIFESTS = {
    "created-number": ({"created": 5}, "created is a number (5), expected string"),
    "writers-text": ({"writers": "x"}, 'writers is a string ("x"), expected array'),
    "status-odd": ({"status": "done"}, 'status is "done", expected one of ok, partial'),
    "pcie-text": ({"pcie_gen": "4"}, 'pcie_gen is a string ("4"), expected integer or null'),
    "cluster-list": ({"cluster": ["h200"]}, "cluster is a list"),
}


def _bad_root(tmp_path):
    """A results folder of two good runs and every kind of bad manifest (wrong types, a list, not JSON, not
    UTF-8, half a file), each beside the good ones."""
    from labkit.results import Run
    root = tmp_path / "results"
    for name in ("good-a", "good-b"):
        r = Run.create(root / name, "probe", {"repeats": 1})
        r.add({"experiment": "probe", "status": "ok", "strategy": "contiguous", "gbps": 20.0, "bytes": 1 << 20})
        r.finish()
    for name, (fields, _) in BAD_MANIFESTS.items():
        Run.create(root / name, "probe", {}).finish(status="ok")
        mf = root / name / "manifest.json"
        mf.write_text(json.dumps({**json.loads(mf.read_text()), **fields}))
    for name, text in (("a-list", b"[1, 2, 3]"), ("not-json", b"{oops"), ("not-utf8", b"\xff\xfe{}"),
                       ("no-run-id", b'{"created": "2026-01-01T00:00:00+00:00"}')):
        (root / name).mkdir()
        (root / name / "manifest.json").write_bytes(text)
    return root


def test_one_bad_manifest_never_hides_the_others(tmp_path):
    """`labkit runs`: every good run listed with its status, every bad one `unreadable` with why, in one line each,
    nothing on stderr; the index is rebuilt and lists them the same way."""
    root = _bad_root(tmp_path)
    r = _sh(f"{sys.executable} -m labkit runs --root {root}")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    lines = {Path(ln.split()[0]).name: ln for ln in r.stdout.splitlines()[1:]}
    assert len(lines) == 2 + len(BAD_MANIFESTS) + 4, r.stdout
    assert " ok " in lines["good-a"] and " ok " in lines["good-b"]
    for name, (_, why) in BAD_MANIFESTS.items():
        assert " unreadable " in lines[name] and why in lines[name], lines[name]
    assert "the manifest is a list" in lines["a-list"] and "not valid JSON" in lines["not-json"]
    assert "not UTF-8" in lines["not-utf8"] and "lacks run_id" in lines["no-run-id"]

    from labkit.report.index import rebuild_index
    page = rebuild_index(root).read_text()
    assert page.count("unreadable") >= len(BAD_MANIFESTS) + 4 and "good-a" in page and "good-b" in page
    assert "created is a number (5), expected string" in page


def test_report_of_a_bad_folder_is_one_line(tmp_path):
    """`labkit report` on a wrong-typed manifest, and on a run whose metrics.parquet is garbage: one line naming
    the file and why, exit 2, no traceback, no half-made notebook or report left behind."""
    root = _bad_root(tmp_path)
    r = _sh(f"{sys.executable} -m labkit report {root / 'created-number'}")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "manifest.json: created is a number (5)" in r.stderr
    (root / "good-a" / "metrics.parquet").write_bytes(b"not a parquet file")
    r = _sh(f"{sys.executable} -m labkit report {root / 'good-a'}")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "metrics.parquet: not a readable table" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in (root / "good-a").iterdir()) == ["manifest.json", "metrics.parquet"]
