"""A run stopped part-way (Ctrl-C) as a newcomer meets it: the report draws what was measured and says where
it stopped, in words (no papermill exception cell, no traceback), the manifest records the real wall time and
the machine, and a Ctrl-C before any measurement says so in one line. Real `labkit run` processes, real
signals."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pandas as pd
import pytest

from browser_util import REPO
from labkit.report.notebook import mark_stopped

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
# many small decode points on the CPU: rows land one by one, and the sweep is far from done at the first
DECODE_MANY = ["-p", "device=cpu", "-p", "strategies=resident", "-p", "context_lens=256,512,1K,2K,4K,8K,16K,32K",
               "-p", "concurrency=1", "-p", "budgets=64", "-p", "repeats=2", "-p", "steps=2", "-p", "anatomy=false",
               "-p", "prefill_lens="]


def _ok_rows(out: Path, points_only: bool = False) -> int:
    """Rows measured ok; `points_only`: the sweep's points, not the probe's rows for the plots' bounds."""
    try:
        m = pd.read_parquet(out / "metrics.parquet")
        ok = m["status"] == "ok"
        if points_only:
            ok &= ~m["experiment"].isin(["probe", "link_probe"])
        return int(ok.sum())
    except Exception:
        return 0


def _text(html: str) -> str:
    import re
    return " ".join(re.sub(r"<[^>]+>", " ", html).split())


@pytest.mark.slow
def test_ctrl_c_mid_run_draws_what_was_measured(tmp_path):
    out = tmp_path / "run"
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "run", "decode", *DECODE_MANY, "--out", str(out)],
                            cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 150
        while _ok_rows(out, points_only=True) < 1 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None and _ok_rows(out, points_only=True) >= 1, "no point measured in time"
        proc.send_signal(signal.SIGINT)
        stopped_at = time.time() - t0
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    mf = json.loads((out / "manifest.json").read_text())
    assert mf["status"] == "interrupted" and mf["host"] and mf.get("cpu_count")
    # from the run's start in the driver (after planning), not from when the kernel got to write a manifest
    assert stopped_at - 15 < mf["wall_s"] < stopped_at + 30, (mf["wall_s"], stopped_at)
    n = _ok_rows(out, points_only=True)
    assert _ok_rows(out) > n          # the link probe's rows: kept, never counted as points of the sweep
    total = 8                         # DECODE_MANY's eight contexts, one strategy, no prefill
    html = (out / "report.html").read_text()
    text = _text(html)
    assert f"This run stopped early: interrupted (by SIGINT (Ctrl-C)). It stopped after " in text, text[:600]
    assert f"{n} of {total} points measured, drawn below" in text and "while measuring point" in text, text[:600]
    assert ". after" not in text
    assert "An Exception was encountered" not in html and "Traceback" not in html
    assert html.count('class="plotly-graph-div"') >= 1                     # the measured points, drawn
    last = [ln for ln in err.splitlines() if ln.startswith("labkit:")][-1]
    assert proc.returncode == 130, err[-2000:]
    assert last.startswith("labkit: decode run stopped by SIGINT (Ctrl-C) after "), last
    assert f"while measuring point {n + 1} of {total} (resident ctx=" in last, last
    assert f"{n} of {total} points measured" in last and "--rerun" not in last, last     # drawn: no hint


def test_a_stopped_notebook_shows_no_heading_after_the_stop(tmp_path):
    """A nightly entry stopped before it measured anything: the report ends at the cell that stopped, not with
    every heading of the sections that never ran."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "manifest.json").write_text(json.dumps({"run_id": "run", "status": "interrupted", "wall_s": 3.0,
                                                   "stopped_by": "SIGTERM"}))
    nb = nbformat.read(REPO / "notebooks" / "decode_sweep.ipynb", as_version=4)
    headings = sum(c.cell_type == "markdown" and c.source.lstrip().startswith("#") for c in nb.cells)
    assert headings > 3
    setup = next(c for c in nb.cells if "setup" in c.metadata.get("tags", []))
    setup.execution_count = 1
    setup.outputs = [nbformat.v4.new_output("error", ename="KeyboardInterrupt", evalue="", traceback=["KeyboardInterrupt"])]
    assert mark_stopped(nb, run)
    assert nb.cells[-1] is setup                    # nothing after the cell that stopped
    banner = next(c.source for c in nb.cells if "stopped early" in c.source)
    assert banner.startswith("**This run stopped early: interrupted** (by SIGTERM). It stopped after 3 s, in cell [1]")
    assert banner.endswith("; nothing measured.")


def test_ctrl_c_before_anything_was_measured_says_so(tmp_path):
    """The kernel stopped while importing: the report says where, in words, and nothing else; the chained
    import error a Ctrl-C in an import leaves (jsonschema's optional rfc3987) is not shown as a failure."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "manifest.json").write_text(json.dumps({"run_id": "run", "status": "interrupted", "wall_s": 20.4,
                                                   "error": "KeyboardInterrupt: interrupted by a signal"}))
    nb = nbformat.read(REPO / "notebooks" / "probe.ipynb", as_version=4)
    marker = nbformat.v4.new_markdown_cell('<span style="color:red">An Exception was encountered at In [1]</span>')
    marker.metadata["tags"] = ["papermill-error-cell-tag"]
    setup = next(c for c in nb.cells if "setup" in c.metadata.get("tags", []))
    setup.execution_count = 1
    setup.outputs = [nbformat.v4.new_output("error", ename="KeyboardInterrupt", evalue="", traceback=[
        "ModuleNotFoundError: No module named 'rfc3987'",
        "During handling of the above exception, another exception occurred:", "KeyboardInterrupt"])]
    nb.cells.insert(0, marker)
    assert mark_stopped(nb, run)
    md = [c.source for c in nb.cells if c.cell_type == "markdown"]
    assert not any("An Exception was encountered" in s for s in md)
    banner = next(s for s in md if "stopped early" in s)
    assert "cell [1], starting the kernel" in banner and "after 20 s" in banner and "nothing measured" in banner
    shown = json.dumps([c.get("outputs", []) for c in nb.cells])
    assert "rfc3987" not in shown and "interrupted by a signal (Ctrl-C)" in shown


def _as_a_terminal_starts_it():
    """A child's SIGINT as a terminal's command has it: the default action, unblocked. Ignored and blocked signals
    are inherited across exec, and Python installs its Ctrl-C handler only where SIGINT starts at the default:
    `labkit report` (no handler of its own, unlike `labkit run`) started from a test process that an earlier test
    left ignoring SIGINT would run to its end and exit 0, the likely reason a fresh-clone make test saw exactly that
    twice (never with the file alone)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_ctrl_c_on_any_other_command_is_the_same_words_and_130(tmp_path):
    """`labkit report RUN --rerun` (the run's notebook executed again on its tables) stopped by Ctrl-C: the one stop
    message and the shell's 130, as `labkit run` and the nightly give, no traceback."""
    import shutil
    run = tmp_path / "results" / "20261203-060711-decode-64k-h200"
    shutil.copytree(REPO / "results" / run.name, run, ignore=shutil.ignore_patterns("report*.html", "*.ipynb"))
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "report", run.name, "--rerun"], cwd=tmp_path, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_a_terminal_starts_it)
    try:
        deadline = time.time() + 120
        while not list(run.glob("*.ipynb")) and time.time() < deadline and proc.poll() is None:
            time.sleep(0.1)                        # papermill has begun the notebook
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == "labkit: report stopped by SIGINT (Ctrl-C)"
