"""`labkit run multigpu` on CPU stand-ins (`cpu,cpu`): the notebook runs under papermill, every row kind is
there, the bytes add up per stage, and the report holds its figures. The same run on the x2 host:
results/20261130-070629-multigpu-h200x2."""
import subprocess
import sys

import pandas as pd
import papermill as pm
import pytest

from labkit import experiments
from labkit.experiments.multigpu import measure as G
from labkit.params import BadInput


def test_bad_input_is_one_line_before_anything_runs(tmp_path):
    with pytest.raises(BadInput):
        experiments.plan("multigpu", {"devices": "cpu"})                      # a split needs two devices
    with pytest.raises(BadInput):
        experiments.plan("multigpu", {"devices": "cpu,cpu", "micro_batches": "-1"})
    r = subprocess.run([sys.executable, "-m", "labkit", "run", "multigpu", "-p", "devices=cpu,cpu", "-p", "strategies=nope",
                        "--out", str(tmp_path / "never")], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "nope" in r.stderr
    assert not (tmp_path / "never").exists()


def test_labkit_run_multigpu_notebook(tmp_path):
    from browser_util import figures_in_notebook_report
    from labkit.execute import run_experiment
    out, err = run_experiment("multigpu", {"devices": "cpu,cpu", "context_lens": "256", "concurrency": "1,2",
                                         "micro_batches": "2", "steps": "2", "repeats": "1", "gather_repeats": "3"},
                            out_dir=tmp_path / "run", log_output=False, timeout=600)
    assert err is None, err
    m = pd.read_parquet(out / "metrics.parquet")
    assert set(m["status"]) == {"ok"}, m[m["status"] != "ok"]["error"].tolist()
    assert {"gather", "handoff", "decode"} <= set(m["experiment"])
    d = m[m["experiment"] == "decode"]
    assert set(d["layout"]) == {"1gpu", "split", "pipelined"}
    assert set(d[d.layout == "pipelined"].concurrency) == {2}               # one request is never split
    s = d[d.layout != "1gpu"]
    assert (s.h2d_bytes_per_step_stage0 + s.h2d_bytes_per_step_stage1 == s.h2d_bytes_per_step).all()
    one = d[d.layout == "1gpu"].set_index(["strategy", "concurrency"]).h2d_bytes_per_step
    split = d[d.layout == "split"].set_index(["strategy", "concurrency"]).h2d_bytes_per_step
    assert one.sort_index().equals(split.sort_index())                      # the split moves the same rows
    g = m[m["experiment"] == "gather"]
    assert g["correct"].all() and (g["gbps"] > 0).all()
    tl = pd.read_parquet(out / "timeline.parquet")
    assert set(tl["layout"]) == {"split", "pipelined"} and (tl.end_ms >= tl.start_ms).all()
    assert figures_in_notebook_report(out) == 5
    assert (out / "report.html").exists()
