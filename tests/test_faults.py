"""Faults a run must survive and say in one line: an interrupted replay sweep keeps its rows, a signal stops
the whole nightly (recorded, resumable), a read-only results folder, a full disk (every file whole or absent,
the status saying what happened), a truncated manifest (listed as unreadable), the nightly lock's mode.

The file-system faults are real: a read-only tmpfs and a 1 MiB tmpfs mounted for the test (that needs root;
without it those tests are skipped with that reason)."""
from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import nbformat
import pandas as pd
import pytest

from labkit.cli import main
from labkit.results import Run, list_runs

REPO = Path(__file__).resolve().parent.parent
TRACE = "labkit/data/smollm2-135m-prose-indexer-b64.npz"
SMALL_REPLAY = ["-p", f"traces={TRACE}", "-p", "context_lens=4096", "-p", "budget=64", "-p", "capacity_x=1.5",
                "-p", "policies=lru"]


@contextmanager
def tmpfs(where: Path, options: str):
    """A tmpfs mounted at `where` for the test (skip, with the reason, where this machine cannot)."""
    if os.geteuid() != 0:
        pytest.skip("file-system fault: needs root to mount a small tmpfs")
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"file-system fault: cannot mount a tmpfs here ({r.stderr.strip()})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(folder: Path) -> Path:
    """Write a ballast file until the file system is full."""
    ballast = folder / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for size in (1 << 16, 4096, 512, 1):
            try:
                while os.write(fd, b"\0" * size):
                    pass
            except OSError as ex:
                assert ex.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return ballast


def stray_tmp(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.name.endswith(".tmp"))


def one_line(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ----------------------------------------------------------------------------- an interrupted replay sweep
def test_hot_replay_interrupted_mid_sweep_keeps_the_rows_measured(tmp_path):
    """SIGINT once the first replay sets are done: their rows are on disk (metrics and hot_replay tables)
    and the run says `interrupted`, not nothing at all."""
    from labkit.experiments import measure
    out = tmp_path / "run"
    ctxs = ",".join(str(4096 * (i + 1)) for i in range(40))        # 40 sets of ~0.3 s: far longer than needed

    measuring = threading.Event()
    measuring.set()

    def interrupt_after_first_rows():
        end = time.monotonic() + 300                   # a loaded machine may take long to reach the first rows
        while time.monotonic() < end:
            if (out / "metrics.parquet").is_file():
                if measuring.is_set():         # never a stray Ctrl-C to pytest once the sweep has returned
                    os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    # SIGINT as a terminal's Ctrl-C finds it, whatever an earlier test in this process left
    sigint = signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    t = threading.Thread(target=interrupt_after_first_rows, daemon=True)
    t.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            measure("hot_replay", {"traces": TRACE, "context_lens": ctxs, "budget": "64", "capacity_x": "1.5",
                                   "policies": "lru", "out_dir": str(out)}, progress_bar=False)
    finally:
        measuring.clear()
        signal.signal(signal.SIGINT, sigint)
    t.join()
    m = pd.read_parquet(out / "metrics.parquet")
    h = pd.read_parquet(out / "hot_replay.parquet")
    assert 1 <= len(m) < 40 and len(h) == len(m) and (m["status"] == "ok").all()
    assert json.loads((out / "manifest.json").read_text())["status"] == "interrupted"
    assert not stray_tmp(out)


# ------------------------------------------------------------------------------------ a stopped nightly
def _notebook(path: Path, code: str) -> Path:
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("x = 0")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(code)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


@pytest.mark.slow
def _driver_tracebacks(err: str) -> list[str]:
    """The tracebacks in `err` that pass through labkit's code (the driver failing). The kernel shares the driver's
    stderr, and ipykernel, interrupted while papermill shuts it down, can print its own ZMQ traceback ("Socket
    operation on non-socket", seen on a loaded machine); that one names no labkit frame and is not the driver's."""
    blocks = err.split("Traceback (most recent call last):")[1:]
    frames = [re.findall(r'File "([^"]+)"', b) for b in blocks]
    return [b for b, fs in zip(blocks, frames)
            if any("/labkit/" in f and "site-packages" not in f for f in fs) or not fs]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_stops_the_whole_nightly_records_why_and_resumes(tmp_path, sig):
    """SIGINT / SIGTERM / SIGHUP (the SSH session that started it closed) while the first entry runs: the
    night stops (the second entry never starts), the first is `interrupted`, nightly.json and nightly.log say
    which signal stopped it and what is not done, the lock is gone, exit 128 + signal; the same command then
    resumes it (SIGTERM and SIGHUP cases)."""
    marker = tmp_path / "hold"
    marker.touch()
    _notebook(tmp_path / "sleepy.ipynb", f"import os, time\nprint('started', flush=True)\n"
                                         f"while os.path.exists({str(marker)!r}):\n    time.sleep(0.2)\n")
    _notebook(tmp_path / "after.ipynb", "print('after ran')\n")
    plan = tmp_path / "plan.toml"
    plan.write_text('[[entry]]\nname = "sleepy"\nnotebook = "sleepy.ipynb"\n\n'
                    '[[entry]]\nname = "after"\nnotebook = "after.ipynb"\n')
    root = tmp_path / "results"
    night = root / "nightly-2026-02-03"
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "nightly", "--plan", str(plan), "--date", "2026-02-03",
                             "--root", str(root)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            log = night / "sleepy" / "log.txt"
            if log.is_file() and "started" in log.read_text():
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        else:
            raise AssertionError("the first entry did not start in 60 s")
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig, (out, err)
    assert not _driver_tracebacks(err) and f"stopped by {name}" in err, err
    rec = json.loads((night / "nightly.json").read_text())
    assert rec["stopped"]["signal"] == name and rec["stopped"]["entry"] == "sleepy"
    assert rec["stopped"]["not_done"] == ["sleepy", "after"] and rec["finished"] is None
    assert [(e["name"], e["status"]) for e in rec["entries"]] == [("sleepy", "interrupted")]
    assert not (night / "after").exists(), "the entry after the signal must not run"
    assert f"stopped by {name} during sleepy" in (night / "nightly.log").read_text()
    assert not (night / ".lock").exists() and not stray_tmp(night)
    if sig == signal.SIGINT:
        return
    from labkit.nightly import run_plan
    marker.unlink()
    rec = run_plan(plan, date="2026-02-03", root=root, echo=lambda *a: None)
    st = {e["name"]: e for e in rec["entries"]}
    assert st["sleepy"]["status"] == "ok" and st["after"]["status"] == "ok"
    assert st["sleepy"]["earlier_attempts"] == ["sleepy.attempt-1"] and rec["finished"] and "stopped" not in rec
    assert rec["earlier_stops"][0]["signal"] == name


def test_the_nightly_lock_is_not_executable(tmp_path):
    from labkit.nightly import _Lock
    with _Lock(tmp_path / ".lock") as lock:
        assert lock.path.stat().st_mode & 0o777 == 0o644
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert not (tmp_path / ".lock").exists()


# ----------------------------------------------------------------------------------- file-system faults
def test_a_read_only_out_or_root_is_one_line(tmp_path, capsys):
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        assert main(["run", "hot_replay", *SMALL_REPLAY, "--out", str(ro / "run")]) == 2
        line = one_line(capsys.readouterr().err)
        assert line.startswith("labkit: --out") and "Read-only file system" in line
        assert main(["nightly", "--plan", str(REPO / "nightly" / "test_plan.toml"), "--root", str(ro)]) == 2
        line = one_line(capsys.readouterr().err)
        assert line.startswith("labkit: --root") and "Read-only file system" in line
        assert main(["runs", "--root", str(ro)]) == 0


def test_disk_full_mid_measurement_keeps_whole_files_and_says_so(tmp_path):
    """The disk fills between two points: the table write fails with no stray temporary file and the table
    still holds the first point whole; the run's final status is written (in place: no room for a new
    file) and says what happened; `labkit runs` lists it so."""
    with tmpfs(tmp_path / "full", "size=1m") as full:
        run = Run.create(full / "run", "probe", {"repeats": 1})
        run.add({"experiment": "probe", "status": "ok", "tok_s": 1.0})
        fill(full)
        try:
            run.add({"experiment": "probe", "status": "ok", "tok_s": 2.0})
            raise AssertionError("the disk was expected to be full")
        except OSError as ex:
            assert ex.errno == errno.ENOSPC
            status = run.finish()
        assert status == "partial"
        assert not stray_tmp(full)
        assert len(pd.read_parquet(full / "run" / "metrics.parquet")) == 1
        mf = json.loads((full / "run" / "manifest.json").read_text())
        assert mf["status"] == "partial" and "No space left on device" in mf["error"]
        assert list(list_runs(full)["status"]) == ["partial"]


@pytest.mark.slow
def test_disk_full_at_the_report_write_is_one_line_and_no_half_file(tmp_path):
    """`labkit run` on a 1 MiB tmpfs: the measurement and the executed notebook fit, the report (plotly.js
    embedded, the folder being outside a results folder) does not.
    One line (no traceback); no half-written notebook, no stray temporary file; the status says partial with
    the reason, and `labkit runs` says the same (not ok)."""
    with tmpfs(tmp_path / "full", "size=1m") as full:
        p = subprocess.run([sys.executable, "-m", "labkit", "run", "hot_replay", *SMALL_REPLAY, "--out",
                            str(full / "run")], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
        assert "hot_replay run partial" in p.stderr and "No space left on device" in p.stderr
        assert not stray_tmp(full)
        for f in (full / "run").iterdir():           # every file there is whole
            if f.suffix in (".json", ".ipynb"):
                json.loads(f.read_text())
            elif f.suffix == ".parquet":
                pd.read_parquet(f)
        mf = json.loads((full / "run" / "manifest.json").read_text())
        assert mf["status"] == "partial" and "No space left on device" in mf["error"]
        r = subprocess.run([sys.executable, "-m", "labkit", "runs", "--root", str(full)], cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
        assert " partial " in r.stdout and " ok " not in r.stdout, r.stdout


def test_a_truncated_manifest_is_listed_as_unreadable(tmp_path, capsys):
    for name in ("good", "cut"):
        Run.create(tmp_path / name, "probe", {}).finish(status="ok")
    mf = tmp_path / "cut" / "manifest.json"
    mf.write_text(mf.read_text()[:100])
    df = list_runs(tmp_path)
    st = dict(zip(df["run_id"], df["status"]))
    assert st == {"good": "ok", "cut": "unreadable"}
    assert main(["runs", "--root", str(tmp_path)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.split() and Path(ln.split()[0]).name == "cut")
    assert "unreadable" in line and "manifest.json unreadable" in line


@pytest.mark.parametrize("how", ["replacing", "open_replacing"])
def test_a_ctrl_c_as_the_temp_file_is_made_leaves_no_temp_file_and_a_taken_name_stays(tmp_path, monkeypatch, how):
    """Ctrl-C (KeyboardInterrupt) landing the moment the temporary file exists, before any write: it propagates,
    the target is unchanged and no `.tmp` stays (it once did when the interrupt came between the file's creation
    and the `try` that removes it). A temporary name already taken (FileExistsError) leaves that file alone."""
    from labkit import atomic
    target = tmp_path / "manifest.json"
    target.write_text("before")
    made = atomic._create

    def create_then(exc):
        def create(dfd, tmp):
            fd = made(dfd, tmp)
            os.close(fd)
            if exc is FileExistsError:          # someone else's file at the name: ours never made
                raise FileExistsError(errno.EEXIST, "taken", tmp)
            raise exc()
        return create

    def write():
        if how == "replacing":
            with atomic.replacing(target) as p:
                Path(p).write_text("after")
        else:
            with atomic.open_replacing(target) as f:
                f.write("after")
    monkeypatch.setattr(atomic, "_create", create_then(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        write()
    assert target.read_text() == "before" and not stray_tmp(tmp_path)
    monkeypatch.setattr(atomic, "_create", create_then(FileExistsError))
    with pytest.raises(FileExistsError):
        write()
    assert target.read_text() == "before" and len(stray_tmp(tmp_path)) == 1    # the taken name's file stays
