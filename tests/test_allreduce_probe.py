"""The probe's all-reduce stage and what `labkit predict --calibration` takes from it.

This machine has no GPU, so `gloo` on CPU tensors stands in for NCCL: the same harness (one process a rank, a
real all_reduce, the sum checked, the rows the probe writes), only the backend and the clock differ (the host's
clock, not CUDA events). Three ranks, not two: the bus bandwidth's 2 (n - 1) / n is 1 at two and would not tell it
from bytes / time. The sizes are tiny and the repeats few: the whole file takes a few seconds on 2 cores."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from labkit import costmodel as C
from labkit.cli import main, predict_default_run
from labkit.experiments.device_rates import rate_row
from labkit.experiments.probe import allreduce as AR
from labkit.experiments.probe.measure import allreduce_line, headline, probe_allreduce, probe_stages
from labkit.params import BadInput
from labkit.results import Run
from labkit.shapes import PRESETS

HIDDEN, LARGE, RANKS, REPEATS = 64, (4096,), 3, 3


@pytest.fixture(scope="module")
def gloo_rows():
    return probe_allreduce(REPEATS, backend="gloo", hidden=HIDDEN, ranks=RANKS, large=LARGE, inner=2)


def test_gloo_ranks_sum_for_real_and_time_every_size():
    got = AR.measure([2, 2 * 1000], 2, backend="gloo", ranks=RANKS, inner=1)
    assert got["ranks"] == RANKS and got["expected_sum"] == 1 + 2 + 3
    assert got["sums"] == {2: [6.0, 6.0], 2000: [6.0, 6.0]}           # every element, every rank's rank + 1
    assert {b: len(ts) for b, ts in got["times_ms"].items()} == {2: 2, 2000: 2}
    assert all(t > 0 for ts in got["times_ms"].values() for t in ts)


def test_the_rows_are_the_probes_at_a_decode_steps_sizes(gloo_rows):
    want = [c * HIDDEN * 2 for c in AR.CONCURRENCY] + list(LARGE)
    assert [r["bytes"] for r in gloo_rows] == want
    assert [r["concurrency"] for r in gloo_rows] == [*AR.CONCURRENCY, None]
    for r in gloo_rows:
        assert r["experiment"] == "probe" and r["strategy"] == "allreduce" and r["status"] == "ok"
        assert r["ranks"] == RANKS and r["gpus"] == 0 and r["backend"] == "gloo" and r["correct"] is True
        assert r["repeats"] == REPEATS and r["dtype"] == "bf16"
        assert r["latency_us_min"] <= r["latency_us_median"] <= r["latency_us_max"]
        assert r["latency_us_median"] == pytest.approx(r["step_ms_median"] * 1e3)
        algbw = r["bytes"] / r["step_ms_median"] / 1e6
        assert r["algbw_gbps"] == pytest.approx(algbw)
        assert r["gbps"] == pytest.approx(algbw * 2 * (RANKS - 1) / RANKS)      # bus: what each ring link carries
    assert gloo_rows[-1]["size_mib"] == LARGE[0] / 2**20 and gloo_rows[0]["size_mib"] is None


def test_the_default_sizes_are_the_published_shapes_step():
    hidden = PRESETS["qwen3.8-flash-next"].hidden
    sizes = AR.step_sizes()
    assert sizes[:5] == [(c, c * hidden * 2) for c in (1, 2, 4, 8, 16)]
    assert sizes[5:] == [(None, 1 << 20), (None, 16 << 20)]


@pytest.mark.parametrize("kw,said", [({"backend": "mpi"}, "backend must be one of nccl, gloo"),
                                     ({"backend": "gloo", "ranks": 1}, "needs 2 or more ranks"),
                                     ({"backend": "gloo", "sizes": [3]}, "even byte counts"),
                                     ({"backend": "gloo", "repeats": 0}, "must be >= 1"),
                                     ({"backend": "nccl", "ranks": 2}, "2 NCCL ranks need 2 GPUs")])
def test_bad_input_is_one_line_before_any_process_starts(kw, said):
    args = {"sizes": [2], "repeats": 1, **kw}
    with pytest.raises(BadInput, match=said) as ex:
        AR.measure(**args)
    assert len(str(ex.value).splitlines()) == 1


def test_fewer_than_two_gpus_skip_the_stage_with_the_reason(monkeypatch):
    assert AR.skipped(torch.device("cpu")).startswith("skipped: no CUDA GPU")
    assert "allreduce" not in [n for n, _ in probe_stages("cpu", 0.01, 1, allreduce=True)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert AR.skipped(torch.device("cuda", 0)) == ("skipped: 1 CUDA GPU visible here; an all-reduce between GPUs "
                                                   "needs 2 or more")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    assert AR.skipped(torch.device("cuda", 0)) == "skipped: this torch build has no NCCL"
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert AR.skipped(torch.device("cuda", 0)) is None


def test_the_closing_lines_say_the_latency_the_skip_or_the_failure(gloo_rows):
    m = pd.DataFrame(gloo_rows)
    line = allreduce_line(m)
    first = gloo_rows[0]
    assert f"{first['latency_us_median']:.1f} µs for one decode step at concurrency 1" in line
    assert f"{gloo_rows[-1]['gbps']:.1f} GB/s at {LARGE[0] / 2**20:g} MiB" in line and "among 3 gloo ranks" in line
    nccl = allreduce_line(m.assign(backend="nccl", gpus=RANKS, nccl_version="2.21.5"))
    assert nccl.startswith("all-reduce among 3 GPUs (NCCL 2.21.5): ")
    skip = AR.skipped(torch.device("cpu"))
    empty = pd.DataFrame([{"experiment": "probe", "strategy": "contiguous", "status": "ok", "gbps": 1.0,
                           "direction": "h2d"}])
    assert headline(empty, skip)[-1] == f"all-reduce among the GPUs {skip}"
    assert allreduce_line(empty) is None
    failed = pd.concat([empty, pd.DataFrame([{"experiment": "probe", "status": "failed", "stage": "allreduce",
                                              "error": "TimeoutError: the ranks did not finish"}])])
    assert allreduce_line(failed) == "all-reduce among the GPUs failed: TimeoutError: the ranks did not finish"


def _probe_rows(ar_rows, ranks=None, scale=1.0):
    """A probe run's rows as a box with GPUs writes them: its link and read rates, then the all-reduce rows (their
    latencies scaled, and their rank count set, to tell one probe's rows from another's)."""
    out = [rate_row("hbm_read", 1 << 30, [1.0]), rate_row("zero_copy", 48 << 20, [2.0])]
    return out + [{**r, "step_ms_median": r["step_ms_median"] * scale, "ranks": ranks or r["ranks"]} for r in ar_rows]


def test_the_calibration_takes_the_concurrency_one_latency_among_the_most_gpus(gloo_rows):
    m = pd.DataFrame(_probe_rows(gloo_rows))
    cal = C.Calibration.from_metrics(m, "target")
    assert cal.allreduce_us == pytest.approx(gloo_rows[0]["step_ms_median"] * 1e3)
    assert cal.hbm_read_gbps == pytest.approx((1 << 30) / 1e6) and cal.link_gbps == pytest.approx((48 << 20) / 2e6)
    two = pd.DataFrame(_probe_rows(gloo_rows) + _probe_rows(gloo_rows, ranks=RANKS + 1, scale=7.0)[2:])
    assert C.Calibration.from_metrics(two, "target").allreduce_us == pytest.approx(cal.allreduce_us * 7.0)
    plain = m[m["strategy"] != "allreduce"]
    assert C.Calibration.from_metrics(plain, "target").allreduce_us is None       # a probe of one GPU: the band


def _reference_run_or_skip():
    if not Path(predict_default_run()).is_dir():
        pytest.skip("the reference run folder is not in this checkout")


def _resident_step(out: str) -> str:
    return next(ln.split() for ln in out.splitlines() if ln.split()[:1] == ["resident"])[3]


def test_predict_with_a_probe_folder_prints_one_number_not_the_band(gloo_rows, tmp_path, capsys):
    """The 3090 owner's path: `labkit run probe` on the box, then `labkit predict --gpus 4 --split tensor
    --calibration THAT_FOLDER`. The folder is written as the probe writes it (Run.add, finish)."""
    _reference_run_or_skip()
    run = Run.create(tmp_path / "probe", "probe", {"repeats": REPEATS})
    for r in _probe_rows(gloo_rows):
        run.add({"device": "cuda:0", "gpu_name": "NVIDIA GeForce RTX 3090", **r})
    run.finish(status="ok")
    us = gloo_rows[0]["step_ms_median"] * 1e3
    args = ["predict", "--gpus", "4", "--split", "tensor", "--context", "4K", "--concurrency", "1",
            "--calibration", str(tmp_path / "probe")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "band over" not in out and f"all-reduce latency {us:g} µs, measured (the --calibration" in out, out
    step = _resident_step(out)
    assert "–" not in step                       # one number, not lo–hi
    assert main([*args, "--allreduce-us", repr(us)]) == 0      # the same latency given by hand: the same step
    assert _resident_step(capsys.readouterr().out) == step
    assert main([*args, "--allreduce-us", repr(us + 100.0)]) == 0
    later = float(_resident_step(capsys.readouterr().out))
    assert later - float(step) == pytest.approx(2 * 48 * 0.1, abs=0.02)     # 48 layers, two all-reduces each
