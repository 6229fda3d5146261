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


def _ok_rows(out: Path) -> int:
    try:
        m = pd.read_parquet(out / "metrics.parquet")
        return int((m["status"] == "ok").sum())
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
        while _ok_rows(out) < 1 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert proc.poll() is None and _ok_rows(out) >= 1, "no point measured in time"
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
    n = _ok_rows(out)
    html = (out / "report.html").read_text()
    text = _text(html)
    assert "This run stopped early: interrupted" in text and f"{n} point" in text and "drawn below" in text, text[:600]
    assert "An Exception was encountered" not in html and "Traceback" not in html
    assert html.count('class="plotly-graph-div"') >= 1                     # the measured points, drawn
    last = [ln for ln in err.splitlines() if ln.startswith("labkit:")][-1]
    assert "interrupted" in last and f"{n} points measured" in last and "--rerun" not in last   # drawn: no hint


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
    assert "cell [1], starting the kernel" in banner and "after 20 s" in banner and "nothing was measured" in banner
    shown = json.dumps([c.get("outputs", []) for c in nb.cells])
    assert "rfc3987" not in shown and "interrupted by a signal (Ctrl-C)" in shown
