"""The decode sweep end to end on CPU: run-folder contract, bytes against the formula, a failing point
recorded while the sweep goes on, bad input rejected in one line before anything is written."""
import json
import subprocess
import sys

import pandas as pd
import pytest
import torch

from labkit import experiments
from labkit.experiments import decode_session
from labkit.params import BadInput
from labkit.results import METRIC_COLUMNS, load_run
from labkit.shapes import PRESETS

SMALL = dict(device="cpu", shape="tiny", context_lens="128,512", budgets="64,16", concurrency="1,2",
             repeats=2, steps=2, prefill_lens="256", probe=False, per_row_steps=1)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "sweep"
    return load_run(experiments.measure("decode", {**SMALL, "out_dir": str(out)}, progress_bar=False).path)


def test_run_folder_contract(run):
    m = run.metrics
    assert set(METRIC_COLUMNS) <= set(m.columns)
    mf = run.manifest
    for k in ("run_id", "created", "git_sha", "host", "gpu_name", "driver", "cuda", "torch", "pcie_gen",
              "pcie_width", "labkit", "parameters"):
        assert k in mf, k
    assert mf["status"] == "ok"
    assert (run.path / "telemetry.parquet").is_file()
    dec = m[m["experiment"] == "decode"]
    # 2 contexts x 2 concurrency x 4 strategies + 1 extra budget x 4 strategies
    assert len(dec) == 2 * 2 * 4 + 4
    assert (dec["status"] == "ok").all()
    assert (m[m["experiment"] == "prefill"]["tok_s"] > 0).all()


def test_bytes_and_memory_columns_follow_the_formula(run):
    s = PRESETS["tiny"]
    d = run.metrics[run.metrics["experiment"] == "decode"]
    for _, r in d.iterrows():
        ctx, c, b = int(r["context_len"]), int(r["concurrency"]), int(r["budget"])
        want = 0 if r["strategy"] == "resident" else c * min(b, ctx + 64) * s.row_bytes * s.attn_layers
        if ctx >= b:
            assert r["h2d_bytes_per_step"] == want, r.to_dict()
        kv = c * ctx * s.kv_bytes_per_token()
        assert r["device_kv_bytes"] == (kv if r["strategy"] == "resident" else 0)
        assert r["host_kv_bytes"] == (0 if r["strategy"] == "resident" else kv)
        assert r["device_index_bytes"] == c * ctx * s.index_key_bytes * s.attn_layers
        assert r["step_ms_min"] <= r["step_ms_median"] <= r["step_ms_max"]
        assert abs(r["tok_s"] - c / (r["step_ms_median"] / 1e3)) < 1e-6 * r["tok_s"]


def test_failed_point_is_recorded_and_sweep_continues(tmp_path, monkeypatch):
    real = decode_session.measure_decode

    def flaky(model, caches, pt, p, tel, timeline=None):
        if pt.strategy == "host_gather" and pt.context_len == 512:
            raise RuntimeError("injected failure\nsecond line")
        return real(model, caches, pt, p, tel, timeline)

    monkeypatch.setattr(decode_session, "measure_decode", flaky)
    r = load_run(experiments.measure("decode", {**SMALL, "concurrency": "1", "budgets": "64", "out_dir": str(tmp_path / "f")},
                                  progress_bar=False).path)
    m = r.metrics[r.metrics["experiment"] == "decode"]
    bad = m[m["status"] == "failed"]
    assert len(bad) == 1 and bad["error"].iloc[0] == "RuntimeError: injected failure"
    assert (m["status"] == "ok").sum() == len(m) - 1          # the others were measured
    assert r.manifest["status"] == "partial"


@pytest.mark.parametrize("arg,msg", [
    ("budgets=0", "budgets must be > 0"),
    ("budgets=-5", "budgets must be > 0"),
    ("shape=nope", "unknown shape"),
    ("strategies=resident,warp", "strategies must be one of resident, per_row"),
    ("device=cuda", "no CUDA GPU"),
    ("context_lens=64M", "of host KV"),
    ("bogus=1", "unknown parameter"),
    ("concurrency=two", "parameter concurrency: 'two' is not a whole number"),
    ("select_block=3", "select_block must divide every budget"),
])
def test_bad_input_one_line_nothing_written(tmp_path, monkeypatch, capsys, arg, msg):
    """`labkit run decode -p ARG`, its command line run in this process (torch is loaded once, not per case;
    tests/test_cli.py runs bad input in a process of its own and checks it fails before anything heavy loads)."""
    from labkit.cli import main
    out = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    if arg == "device=cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    rc = main(["run", "decode", "-p", arg, "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and msg in lines[0], err
    assert "Traceback" not in err
    assert not out.exists() and not (tmp_path / "results").exists()


def test_plan_rejects_budget_in_notebook_values():
    with pytest.raises(BadInput):
        experiments.plan("decode", {"device": "cpu", "budgets": [0]})


def test_sweep_with_layers_split_over_devices(tmp_path):
    """`device=cpu,cpu,cpu`: the layers are split into three stages (CPU stand-ins for three GPUs); every
    point runs and moves the same bytes as on one device."""
    small = {**SMALL, "concurrency": "1", "budgets": "64", "prefill_lens": "256"}
    one = load_run(experiments.measure("decode", {**small, "out_dir": str(tmp_path / "one")}, progress_bar=False).path).metrics
    three = load_run(experiments.measure("decode", {**small, "device": "cpu,cpu,cpu", "out_dir": str(tmp_path / "three")},
                                      progress_bar=False).path)
    m = three.metrics
    assert (m["status"] == "ok").all(), m[m["status"] != "ok"]["error"].tolist()
    ranges = three.manifest["stage_layers"]
    assert len(ranges) == 3 and ranges[0][0] == 0 and ranges[-1][1] == PRESETS["tiny"].layers
    dec = m[m["experiment"] == "decode"]
    assert set(dec["devices"]) == {"cpu,cpu,cpu"}
    key = ["strategy", "context_len"]
    a = one[one["experiment"] == "decode"].set_index(key)["h2d_bytes_per_step"]
    b = dec.set_index(key)["h2d_bytes_per_step"]
    assert a.sort_index().equals(b.sort_index())


def test_sweep_pipelines_micro_batches_over_split_layers(tmp_path):
    """`micro_batches=1,2` over `device=cpu,cpu`: each point of the main table once per micro-batch count,
    the same bytes either way, each stage's engine-counted bytes beside the total, and the timeline's
    overlap columns for every split point."""
    small = {**SMALL, "concurrency": "1,2", "budgets": "64", "prefill_lens": "", "strategies": "zero_copy,resident",
             "micro_batches": "1,2"}
    m = load_run(experiments.measure("decode", {**small, "device": "cpu,cpu", "out_dir": str(tmp_path / "two")},
                                  progress_bar=False).path).metrics
    assert (m["status"] == "ok").all(), m[m["status"] != "ok"]["error"].tolist()
    d = m[m["experiment"] == "decode"]
    assert set(d[d.concurrency == 1].micro_batches) == {1}          # one request cannot be split
    assert set(d[d.concurrency == 2].micro_batches) == {1, 2}
    assert (d.h2d_bytes_per_step_stage0 + d.h2d_bytes_per_step_stage1 == d.h2d_bytes_per_step).all()
    by = d[d.concurrency == 2].set_index(["strategy", "context_len", "micro_batches"]).h2d_bytes_per_step.unstack()
    assert (by[1] == by[2]).all()
    assert d.bubble_share.between(0, 1).all() and (d.cycle_ms > 0).all()
    assert d[d.micro_batches == 2].anat_closure.isna().all()        # no phase anatomy of overlapped work


def test_sweep_with_block_selection_and_block_dma(tmp_path):
    """`select_block=16` with `block_dma` beside `zero_copy`: every point runs and both move the bytes
    the formula says (block selection keeps the budget's count of rows)."""
    small = {**SMALL, "strategies": "zero_copy,block_dma", "concurrency": "1", "budgets": "64", "prefill_lens": "",
             "select_block": 16, "out_dir": str(tmp_path / "r")}
    m = load_run(experiments.measure("decode", small, progress_bar=False).path).metrics
    dec = m[m["experiment"] == "decode"]
    assert (dec["status"] == "ok").all(), dec[dec["status"] != "ok"]["error"].tolist()
    by = dec.set_index(["strategy", "context_len"])["h2d_bytes_per_step"]
    for ctx in (128, 512):
        assert by["block_dma", ctx] == by["zero_copy", ctx] == PRESETS["tiny"].h2d_bytes_per_step(64, [ctx])


def test_predict_refuses_a_cpu_run_in_one_line(run):
    """`labkit predict` scales a GPU's step anatomy; a CPU run has no GPU to scale from, so it is refused
    (an empty GPU name used to match the first GPU of the spec list and print a prediction)."""
    p = subprocess.run([sys.executable, "-m", "labkit", "predict", str(run.path), "--gpu", "rtx3090"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "CPU" in lines[0], p.stderr
    assert "PREDICTED" not in p.stdout and "RTX 3090" not in p.stdout
