"""A run the lab expects to take more than ten minutes here says so before it starts, with the ways to shrink it
(timed on this CPU, not guessed); a small one says nothing; and the progress bar's clock keeps moving while a point
measures instead of freezing until the point ends."""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time

from browser_util import REPO
from labkit import experiments, sweep

ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}


def test_a_long_cpu_sweep_says_how_long_before_it_starts(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "run", "decode", "-p", "device=cpu", "-p", "context_lens=1M",
                             "-p", "repeats=50", "--out", str(out)], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()           # the first thing it says
        measured_before = (out / "metrics.parquet").exists()
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert line.startswith("labkit: this decode run is expected to take about "), line + rest[-2000:]
    assert not measured_before
    took = re.search(r"about (?:(\d+) h )?(\d+) min", line)
    assert took and int(took.group(1) or 0) * 60 + int(took.group(2)) >= 10, line
    assert "from a timing of this CPU just now" in line and "To shrink it: -p context_lens=256K (about " in line
    assert "-p repeats=2 -p steps=5 (about " in line and "-p concurrency=1 (about " in line, line
    assert line.rstrip().endswith("Ctrl-C stops it and keeps what was measured.")
    assert proc.returncode == 130


def test_the_default_cpu_sweep_is_not_held_up_by_an_estimate():
    """`make sweep`'s grid on a CPU: well inside ten minutes by the work it does, so nothing is timed or said."""
    plan = experiments.plan("decode", {"device": "cpu"})
    t = time.perf_counter()
    assert experiments.estimate(plan) is None
    assert time.perf_counter() - t < 1.0


def test_the_estimate_scales_with_the_work_asked(monkeypatch):
    """The same timing of this CPU, two plans: ten times the steps take about ten times as long."""
    from labkit.experiments.decode import measure as M
    cost = (2.0, 1e-4, 1e-4)                       # ms a step, ms per context token, ms per cache token filled
    monkeypatch.setattr(M, "_calibrate", lambda pl: cost)
    small = M.derive(experiments.plan("decode", {"device": "cpu", "context_lens": "256K", "repeats": 5,
                                                  "probe": False, "anatomy": False}))
    big = M.derive(dataclasses.replace(small.plan, repeats=50))
    s, b = M._seconds(small, cost)[0], M._seconds(big, cost)[0]
    assert 7 < (b - 20) / (s - 20) < 10.5          # the fixed start-up apart
    est = M.estimate(big)
    assert est.seconds == b and est.heaviest.startswith("the 256K-token points take ")
    assert est.shrink[0][0] == "-p context_lens=64K" and est.shrink[0][1] < b / 3


def test_the_bar_clock_moves_while_a_point_measures(monkeypatch, capsys):
    from labkit import progress
    monkeypatch.setattr(progress, "PLAIN_TICK_S", 0.3)
    monkeypatch.setenv("LABKIT_PLAIN_PROGRESS", "1")
    bar = progress.progress(total=3, desc="toy")
    bar.set_postfix_str("a long point")
    time.sleep(2.5)                                  # no update: the point is still measuring
    bar.close()
    err = capsys.readouterr().err
    clocks = set(re.findall(r"\[(\d\d:\d\d)<", err))
    assert {"00:00", "00:01", "00:02"} <= clocks, err[-500:]


def test_the_long_run_threshold_is_ten_minutes():
    assert sweep.LONG_RUN_S == 600
    line = sweep.estimate_line("decode", sweep.Estimate(6120, "17 points", "", [("-p repeats=2", 700)]))
    assert line == ("labkit: this decode run is expected to take about 1 h 42 min on this machine (17 points). "
                    "To shrink it: -p repeats=2 (about 11 min 40 s). Ctrl-C stops it and keeps what was measured.")
