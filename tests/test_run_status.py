"""One status rule for every experiment: ok only when every point is ok, partial when some failed, failed when
nothing was measured, interrupted on a signal, stale when the process died without a word; the CLI exits
non-zero with one line whenever a run is not ok; `labkit runs` prints short lines."""
import ast
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

from labkit.results import Run, derive_status, effective_status, list_runs, machine_id, writer_entry

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


@pytest.mark.parametrize("points,kw,want", [
    (["ok", "ok"], {}, "ok"),
    (["ok", "failed"], {}, "partial"),
    (["failed", "failed"], {}, "failed"),
    ([], {}, "failed"),
    (["ok"], {"error": True}, "partial"),
    ([], {"error": True}, "failed"),
    (["ok", "ok"], {"interrupted": True}, "interrupted"),
    ([], {"interrupted": True}, "interrupted"),
])
def test_the_rule(points, kw, want):
    assert derive_status(points, **kw) == want


def _run(tmp_path, name="r"):
    return Run.create(tmp_path / name, "probe", {})


def test_finish_derives_status_from_rows(tmp_path):
    r = _run(tmp_path)
    r.add({"status": "ok"})
    r.add({"status": "failed", "error": "x"})
    assert r.finish() == "partial"
    assert json.loads((r.path / "manifest.json").read_text())["status"] == "partial"
    r2 = _run(tmp_path, "r2")
    assert r2.finish() == "failed"            # nothing measured is not ok


def test_finish_in_flight_exception_decides(tmp_path):
    """A `finally: run.finish()` sees the exception that propagates: Ctrl-C -> interrupted, else not ok."""
    r = _run(tmp_path)
    r.add({"status": "ok"})
    with pytest.raises(KeyboardInterrupt):
        try:
            raise KeyboardInterrupt
        finally:
            r.finish()
    assert r.manifest["status"] == "interrupted"
    r2 = _run(tmp_path, "r2")
    r2.add({"status": "ok"})
    with pytest.raises(TypeError):
        try:
            raise TypeError("bad config")
        finally:
            r2.finish()
    assert r2.manifest["status"] == "partial" and "TypeError: bad config" in r2.manifest["error"]


def test_every_experiment_finishes_through_the_rule():
    """No experiment names its own final status: every `.finish(` call in the experiments passes none
    (the shared rule derives it from the rows and the exception in flight)."""
    files = sorted((REPO / "labkit" / "experiments").rglob("*.py"))     # the cross-model studies among them
    calls = 0
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "finish" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in ("run", "r"):
                calls += 1
                assert not node.args and not any(k.arg == "status" for k in node.keywords), \
                    f"{f.name}:{node.lineno} names a status instead of deriving it"
    assert calls >= 10


def test_stale_when_writers_are_gone(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mf = {"status": "running", "host": socket.gethostname(), "machine_id": machine_id(),
              "writers": [writer_entry(child.pid)]}
        assert effective_status(mf) == "running"
    finally:
        child.kill()
        child.wait()
    assert effective_status(mf) == "stale"
    # a reused pid is not the writer: same pid, another start time
    assert effective_status({**mf, "writers": [{"pid": os.getpid(), "started": 1.0}]}) == "stale"
    assert effective_status({**mf, "machine_id": "elsewhere"}) == "running"      # cannot be checked here
    assert effective_status({**mf, "status": "ok"}) == "ok"


def test_runs_and_index_show_stale(tmp_path):
    r = _run(tmp_path, "20260101-000000-probe")
    assert r.manifest["writers"][0]["pid"] == os.getpid()
    r.update_manifest(writers=[{"pid": 999_999_999, "started": 1.0}])    # a process that is gone
    assert list(list_runs(tmp_path)["status"]) == ["stale"]
    from labkit.report.index import collect
    runs, _, _ = collect(tmp_path)
    assert list(runs["status"]) == ["stale"]


def test_a_run_written_elsewhere_reads_as_its_points(tmp_path):
    """A committed run whose manifest still says running was written on another machine (GPU boxes are all
    called `vm`): its processes cannot be checked here, so it is not `stale` but what its points are."""
    r = _run(tmp_path, "20260101-000000-probe")
    for st in ("ok", "ok"):
        r.add({"status": st})
    elsewhere = {k: v for k, v in r.manifest.items() if k != "machine_id"}
    elsewhere["writers"] = [{"pid": 517, "started": 1.0}]          # a process of another machine, long gone
    (r.path / "manifest.json").write_text(json.dumps(elsewhere))
    assert list(list_runs(tmp_path)["status"]) == ["ok"]
    from labkit.report.index import collect
    assert list(collect(tmp_path)[0]["status"]) == ["ok"]
    (r.path / "manifest.json").write_text(json.dumps({**elsewhere, "machine_id": "0123456789abcdef"}))
    r.add({"status": "failed", "error": "x"})
    assert list(list_runs(tmp_path)["status"]) == ["partial"]
    # written here (this machine's id) by a process that is gone: stale, as before
    (r.path / "manifest.json").write_text(json.dumps({**elsewhere, "machine_id": machine_id()}))
    assert list(list_runs(tmp_path)["status"]) == ["stale"]


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True, text=True, cwd=REPO, env=ENV,
                          timeout=timeout)


def test_runs_lines_short_and_bad_root(tmp_path):
    r = _run(tmp_path, "20260101-000000-probe")
    r.update_manifest(pcie_gen=5.0, pcie_width=16.0, gpu_name="NVIDIA H200")
    r.finish()
    out = _cli("runs", "--root", str(tmp_path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].split() == ["RUN", "EXPERIMENT", "STATUS", "KIND", "MACHINE", "LINK", "SHA", "NAME"]
    assert lines[1].split()[3] == "h200"          # grouped by machine kind: the GPU's kind on a local run
    run, rest = lines[1].split(" ", 1)
    assert len(lines) == 2 and len(rest.strip()) <= 80 and run == str(tmp_path / "20260101-000000-probe"), lines
    assert "5 x16" in lines[1] and "5.0" not in lines[1] and lines[1].count("20260101-000000-probe") == 1
    bad = _cli("runs", "--root", str(tmp_path / "nonexistent"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "nonexistent" in bad.stderr


def test_error_line_never_ends_in_a_bare_colon():
    from papermill.exceptions import PapermillExecutionError

    from labkit.execute import error_line
    err = PapermillExecutionError(0, 1, "", "KeyboardInterrupt", "", [])
    assert error_line(err) == "KeyboardInterrupt: interrupted by a signal"
    assert not error_line(KeyboardInterrupt()).endswith(":")


# ------------------------------------------------------------------ real papermill runs of `labkit run`
CAPACITY_LONG = ["-p", "device=cpu", "-p", "mem_cap_gib=0.5", "-p", "workspace_gib=0.1", "-p", "configs=none", "-p", "max_batch=1", "-p", "steps=100000", "-p", "repeats=2"]


MULTIGPU_LONG = ["-p", "concurrency=1", "-p", "micro_batches=0", "-p", "repeats=100000", "-p", "steps=10"]


class _Started:
    """A `labkit run` in the background, its stderr read as it comes (the progress bar says when the
    measurement has begun; `err` is everything it wrote once it has ended)."""

    def __init__(self, out: Path, *params, experiment="capacity"):
        self.out, self.experiment, self._err = out, experiment, []
        self.proc = subprocess.Popen([sys.executable, "-m", "labkit", "run", experiment, *params, "--out", str(out)],
                                     cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=lambda: self._err.extend(self.proc.stderr), daemon=True)
        self._reader.start()

    def measuring(self) -> bool:
        """The kernel has made the run (a manifest with writers) and drawn the sweep's bar: it is measuring."""
        try:
            if not json.loads((self.out / "manifest.json").read_text()).get("writers"):
                return False
        except (OSError, ValueError):
            return False
        return any(ln.startswith(f"{self.experiment} ") and "%|" in ln for ln in list(self._err))

    def wait_measuring(self, timeout=120) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline and self.proc.poll() is None:
            if self.measuring():
                return
            time.sleep(0.1)
        if self.proc.poll() is not None:
            self._reader.join(10)
        raise AssertionError(f"run never began measuring: {self.err()[-2000:]}")

    def wait(self, timeout) -> str:
        """Its exit, then all it wrote to stderr."""
        self.proc.wait(timeout)
        self._reader.join(10)
        return self.err()

    def err(self) -> str:
        return "".join(self._err)


@pytest.mark.parametrize("experiment,params,sig", [("capacity", CAPACITY_LONG, signal.SIGINT),
                                                   ("capacity", CAPACITY_LONG, signal.SIGTERM),
                                                   ("capacity", CAPACITY_LONG, signal.SIGHUP),     # terminal closed
                                                   ("multigpu", MULTIGPU_LONG, signal.SIGINT)])
def test_signal_during_labkit_run_leaves_interrupted(tmp_path, experiment, params, sig):
    """`timeout -s INT 90 labkit run capacity ...`: the manifest ends interrupted (capacity left it running,
    multigpu `ok` over the rows measured so far), the CLI exits non-zero with one line that says so, and no
    kernel is left."""
    out = tmp_path / "run"
    run = _Started(out, *params, experiment=experiment)
    proc = run.proc
    try:
        run.wait_measuring()
        proc.send_signal(sig)
        err = run.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    mf = json.loads((out / "manifest.json").read_text())
    assert mf["status"] == "interrupted", mf
    assert proc.returncode == 128 + sig            # the shell's word for it: 130 for Ctrl-C, 143 for SIGTERM
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("labkit:")]
    name = signal.Signals(sig).name
    assert lines and lines[-1].startswith(f"labkit: {experiment} run stopped by {name}"), err[-2000:]
    assert not lines[-1].rstrip().endswith(":")
    for w in mf["writers"]:
        assert effective_status({**mf, "status": "running"}) == "stale", f"writer {w} still alive"


def test_kill_9_of_the_cli_leaves_stale(tmp_path):
    out = tmp_path / "run"
    run = _Started(out, *CAPACITY_LONG)
    proc = run.proc
    try:
        run.wait_measuring()
        proc.kill()
        proc.wait(10)
        deadline = time.time() + 30           # the kernel notices its parent is gone within a few seconds
        mf = json.loads((out / "manifest.json").read_text())
        while effective_status(mf) != "stale" and time.time() < deadline:
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert mf["status"] == "running" and effective_status(mf) == "stale"
    assert "stale" in _cli("runs", "--root", str(tmp_path)).stdout


def test_an_ok_run_exits_zero(tmp_path):
    """The same path, run to the end with every point ok: status ok, exit 0."""
    out = tmp_path / "run"
    r = _cli("run", "capacity", "-p", "device=cpu", "-p", "mem_cap_gib=0.5", "-p", "workspace_gib=0.1", "-p", "configs=none", "-p", "steps=2",
             "-p", "repeats=1", "-p", "measure=false", "--out", str(out), timeout=300)
    mf = json.loads((out / "manifest.json").read_text())
    m = pd.read_parquet(out / "metrics.parquet")
    assert (m["status"] == "ok").all() and mf["status"] == "ok" and r.returncode == 0, r.stderr
