"""Files a user names and tables a run holds, when they are not what they should be: a plan that is not UTF-8 or
not a regular file, a calibration that is too big, not an object, or holds NaN, a run's table with text where
numbers belong. Each is one line (BadInput, exit 2) before anything is computed, and one malformed run never
hides the others from the explorer. Each test runs in well under two seconds on the shipped reference run."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from labkit import costmodel as C
from labkit.cli import main, predict_default_run
from labkit import nightly
from labkit.params import BadInput

REF_RUN = Path(predict_default_run())       # the published shape's reference run, tracked in results/


def _run_copy(dest: Path, column: str | None = None, value=None) -> Path:
    """A copy of the reference run, with `column`'s last decode row set to `value` (the column then text)."""
    shutil.copytree(REF_RUN, dest)
    if column:
        m = pd.read_parquet(dest / "metrics.parquet")
        i = m.index[m["experiment"] == "decode"][-1]
        if isinstance(value, str):
            m[column] = m[column].astype(object).where(m[column].isna(), m[column].astype(str))
        m.loc[i, column] = value
        m.to_parquet(dest / "metrics.parquet")
    return dest


# ---------------------------------------------------------------- plans

def test_a_plan_not_utf8_is_one_line(tmp_path):
    p = tmp_path / "plan.toml"
    p.write_bytes(b'description = "\xff\xfe"\n')
    with pytest.raises(BadInput, match=r"plan .*plan.toml: not UTF-8 text"):
        nightly.load_plan(p, cuda=False)


def test_a_plan_that_is_a_fifo_or_too_big_is_one_line_without_waiting(tmp_path, capsys):
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)                               # never opened for writing: a blocking read would hang here
    with pytest.raises(BadInput, match="cannot be read .not a regular file"):
        nightly.load_plan(fifo, cuda=False)
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (nightly.PLAN_CAP + 1))
    with pytest.raises(BadInput, match="over the"):
        nightly.load_plan(big, cuda=False)
    assert main(["nightly", "--plan", str(fifo), "--dry-run"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_plan_reached_through_a_link_is_read(tmp_path):
    p = tmp_path / "plan.toml"
    p.write_text('[[entry]]\nname = "t"\ntests = "-q tests/test_params.py"\n')
    (tmp_path / "link.toml").symlink_to(p)
    assert [e.name for e in nightly.load_plan(tmp_path / "link.toml", cuda=False)] == ["t"]


# ---------------------------------------------------------------- predict: calibrations and tables

@pytest.mark.parametrize("body,said", [
    ('[1, 2]', "not a JSON object"),
    ('{"gpu_name": "x", "hbm_read_gbps": NaN, "link_gbps": 20}', "`hbm_read_gbps` must be a finite number > 0"),
    ('{"gpu_name": "x", "hbm_read_gbps": 900, "link_gbps": Infinity}', "`link_gbps` must be a finite number > 0"),
    ('{"gpu_name": "x", "hbm_read_gbps": "900", "link_gbps": 20}', "`hbm_read_gbps` must be a finite number"),
    ('{"gpu_name": "x", "hbm_read_gbps": 900, "link_gbps": 20, "allreduce_us": -1}', "`allreduce_us` must be"),
    (b'{"gpu_name": "\xff"}', "not UTF-8 text"),
    ("big", "over the"),
])
def test_a_bad_calibration_file_is_one_line(tmp_path, capsys, body, said):
    f = tmp_path / "cal.json"
    if body == "big":           # a valid object past the cap: read no further than the cap
        f.write_text('{"gpu_name": "x", "hbm_read_gbps": 900, "link_gbps": 20}' + " " * C.CALIBRATION_CAP)
    elif isinstance(body, bytes):
        f.write_bytes(body)
    else:
        f.write_text(body)
    with pytest.raises(ValueError, match=said):
        C.Calibration.load(f)
    assert main(["predict", "--calibration", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said.split("`")[0] in err[0]


def test_a_calibration_that_is_a_device_or_fifo_is_not_read(tmp_path):
    fifo = tmp_path / "cal.json"
    os.mkfifo(fifo)
    for p in ("/dev/zero", fifo):
        with pytest.raises(ValueError, match="not a regular file"):
            C.Calibration.load(p)


def test_a_calibration_run_with_text_rates_is_one_line_not_compared_as_text(tmp_path, capsys):
    """Text rates compared as text would pick "9.5" over "10.2": the run's probe rates must be numbers."""
    cal = _run_copy(tmp_path / "cal")
    m = pd.read_parquet(cal / "metrics.parquet")
    m["gbps"] = m["gbps"].astype(object).where(m["gbps"].isna(), m["gbps"].astype(str))
    m.loc[m.index[m["experiment"] == "probe"][0], "gbps"] = "fast"
    m.to_parquet(cal / "metrics.parquet")
    assert main(["predict", "--calibration", str(cal)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--calibration: " in err[0] and "column `gbps` holds 'fast'" in err[0], err


@pytest.mark.parametrize("column,value,said", [
    ("context_len", "abc", "column `context_len` holds 'abc', not a number"),
    ("anat_weights_ms", "fast", "column `anat_weights_ms` holds 'fast'"),
    ("concurrency", np.inf, "a decode point's `concurrency` is inf"),
    ("budget", np.nan, "a decode point's `budget` is nan"),
])
def test_predict_on_a_run_with_text_or_no_number_in_its_table_is_one_line(tmp_path, capsys, column, value, said):
    run = _run_copy(tmp_path / "run", column, value)
    assert main(["predict", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err


@pytest.mark.parametrize("host_option", [[], ["--host-gbps", "20"]])
@pytest.mark.parametrize("value", ["abc", float("nan"), -5])
def test_a_host_bandwidth_in_the_manifest_that_is_no_number_is_one_line(tmp_path, capsys, value, host_option):
    run = _run_copy(tmp_path / "run")
    mf = json.loads((run / "manifest.json").read_text())
    mf["host_memory_bandwidth"]["copy_all_gbps"] = value
    (run / "manifest.json").write_text(json.dumps(mf))
    assert main(["predict", str(run), *host_option]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "host_memory_bandwidth.copy_all_gbps is" in err[0], err


def test_the_host_bandwidth_check_a_caller_makes_before_dividing_by_it():
    assert C.check_host_gbps(None) is None and C.check_host_gbps(35.5) == 35.5
    for bad in ("abc", [1], float("nan"), float("inf"), -1, True):
        with pytest.raises(BadInput, match="copy_all_gbps is"):
            C.check_host_gbps(bad)


def test_numbers_written_as_text_are_read_as_numbers():
    m = pd.DataFrame({"context_len": ["65536.0", "1024"], "strategy": ["a", "b"]})
    out = C.numeric_metrics(m)
    assert out["context_len"].tolist() == [65536.0, 1024.0] and m["context_len"].tolist() == ["65536.0", "1024"]


# ---------------------------------------------------------------- compare and the explorer's run list

@pytest.mark.parametrize("column", ["tok_s", "step_ms_min", "step_ms_median"])
def test_compare_with_text_in_a_number_column_is_one_line_nothing_written(tmp_path, capsys, column):
    bad = _run_copy(tmp_path / "bad", column, "abc")
    out = tmp_path / "cmp.html"
    assert main(["compare", str(REF_RUN), str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"bad/metrics.parquet: column `{column}` holds 'abc'" in err[0], err
    assert not out.exists()


def test_one_malformed_run_never_hides_the_others_from_the_explorer(tmp_path):
    from labkit.explore import decode_runs
    root = tmp_path / "results"
    _run_copy(root / "good")
    _run_copy(root / "text", "context_len", "abc")
    _run_copy(root / "inf", "context_len", np.inf)
    _run_copy(root / "str-tok", "tok_s", "abc")
    (root / "zero").mkdir()
    (root / "zero" / "manifest.json").symlink_to("/dev/zero")
    (root / "list").mkdir()
    (root / "list" / "manifest.json").write_text(json.dumps([1, 2]))
    runs = decode_runs(root)
    assert [k.split(" · ")[0] for k in runs] == ["good"]
    assert runs[next(iter(runs))][1]["context_len"].dtype.kind == "i"


@pytest.mark.parametrize("routing, said", [
    ("zipf:nan", "finite exponent"), ("zipf:inf", "finite exponent"), ("zipf:-1", "finite exponent"),
    ("zipf:x", "finite exponent"), ("file:/dev/zero", "not a regular file"), ("file:{d}/list.json", "not a JSON object"),
    ("file:{d}/nan.json", "not a JSON object"), ("file:{d}/short.json", "8 x 15 frequencies"),
    ("file:{d}/missing.json", "No such file"), ("bogus", "unknown routing"),
])
def test_a_routing_that_is_no_distribution_is_one_line_before_anything_is_built(tmp_path, routing, said):
    """`routing` read and checked when the plan is made (a FIFO or /dev/zero never read, nan or inf never a
    popularity exponent), against the plan's shape (tiny-moe: 8 layers of 16 experts)."""
    from labkit.experiments import plan
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "nan.json").write_text('{"experts": [NaN, 1]}')
    (tmp_path / "short.json").write_text(json.dumps({"experts": [1.0] * 15}))
    with pytest.raises(BadInput, match=said):
        plan("decode", {"shape": "tiny-moe", "device": "cpu", "routing": routing.format(d=tmp_path)})


def test_a_recorded_routing_of_the_shapes_size_plans_and_biases_the_router(tmp_path):
    from labkit.engine.model.hybrid import routing_biases
    from labkit.experiments import plan
    from labkit.shapes import ModelShape
    freq = [float(i + 1) for i in range(16)]
    (tmp_path / "ok.json").write_text(json.dumps({"experts": freq}))
    p = plan("decode", {"shape": "tiny-moe", "device": "cpu", "routing": f"file:{tmp_path}/ok.json"})
    assert p.params["routing"].startswith("file:")
    b = routing_biases(ModelShape.from_name("tiny-moe"), p.params["routing"], 0)
    assert b.shape == (8, 16) and bool((b[:, 15] > b[:, 0]).all())      # the more often chosen, the larger


def test_a_float_parameter_takes_no_nan_and_inf_only_where_inf_is_its_default():
    from labkit.params import Param, parse_value
    with pytest.raises(BadInput, match="'nan' is not a finite number"):
        parse_value(Param("x", "float", 1.0, ""), "nan")
    with pytest.raises(BadInput, match="'inf' is not a finite number"):
        parse_value(Param("x", "list[float]", [1.0], ""), "1,inf")
    assert parse_value(Param("rate", "float", float("inf"), ""), "inf") == float("inf")   # "no limit" there


def test_the_shipped_traces_plan_and_read_from_any_working_directory(tmp_path, monkeypatch):
    """hot_replay's "auto" traces are named as the repository names them (`labkit/data/...`, the same in every
    manifest) and found from a working directory outside it."""
    from labkit.experiments import plan
    from labkit.experiments.hot_replay.measure import trace_path
    from labkit.quality.traces import load_trace
    monkeypatch.chdir(tmp_path)
    p = plan("hot_replay", {"context_lens": "128K"})
    assert p.params["traces"] and all(t.startswith("labkit/data/") for t in p.params["traces"])
    assert load_trace(trace_path(p.params["traces"][0])).budget > 0
    with pytest.raises(BadInput, match="does not exist"):
        plan("hot_replay", {"context_lens": "128K", "traces": "labkit/data/none.npz"})
