"""`labkit run pulse` on CPU: the trace replay through `labkit serve` and the shared load generator,
its notebook under papermill, and one-line errors on bad input before anything runs."""
import json
import subprocess
import sys

import pandas as pd
import pytest

from labkit import experiments
from labkit.experiments.pulse import measure as P
from labkit.params import BadInput


def _plan(given):
    return experiments.plan("pulse", given)


def _trace(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


GOOD = [{"timestamp": 0, "input_length": 6000, "output_length": 20, "hash_ids": [1, 2]},
        {"timestamp": 50, "input_length": 12000, "output_length": 9, "hash_ids": [1, 3]},
        {"timestamp": 120, "input_length": 3000, "output_length": 30, "hash_ids": [4]},
        {"timestamp": 160, "input_length": 20000, "output_length": 5, "hash_ids": [5]}]


ONE = dict(windows=1, calibration_windows=0)         # one window, the policies as given: no fitting


def test_bad_input_is_one_line_before_anything_runs(tmp_path):
    base = dict(device="cpu", window_size=4, **ONE)
    missing = _trace(tmp_path / "m.jsonl", [{"timestamp": 0, "output_length": 3}])
    with pytest.raises(BadInput, match="not a trace record"):
        _plan({**base, "trace": missing})
    neg = _trace(tmp_path / "n.jsonl", [{**GOOD[0], "timestamp": -5}])
    with pytest.raises(BadInput, match="negative time"):
        _plan({**base, "trace": neg, "window_size": 1})
    with pytest.raises(BadInput, match="but the trace holds 1"):              # a window longer than the trace
        _plan({**base, "trace": neg})
    good = _trace(tmp_path / "g.jsonl", GOOD)
    with pytest.raises(BadInput, match="rate must be > 0"):
        _plan({**base, "trace": good, "rate": 0})
    with pytest.raises(BadInput, match="dma_units_per_call applies to strategy block_dma"):
        _plan({**base, "trace": good, "dma_units_per_call": 4})
    with pytest.raises(BadInput, match="policy"):
        _plan({**base, "trace": good, "policies": "fastest"})
    specs = P.requests(_plan({**base, "trace": good, "length_scale": 0.01, "capacity": 100, "max_output": 8}), 0)
    assert [len(s.prompt) for s in specs] == [60, 92, 30, 95]                # scaled, then capped to the slot
    assert [s.output_len for s in specs] == [8, 8, 8, 5]
    assert all(len(s.prompt) + s.output_len <= 100 for s in specs)
    assert [s.arrival_s for s in specs] == [0.0, 0.05, 0.12, 0.16]
    r = subprocess.run([sys.executable, "-m", "labkit", "run", "pulse", "-p", f"trace={neg}", "-p", "device=cpu",
                        "-p", "windows=1", "-p", "window_size=1", "-p", "calibration_windows=0", "--out", str(tmp_path / "never")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "negative time" in r.stderr
    assert not (tmp_path / "never").exists()


def test_labkit_run_pulse_notebook(tmp_path):
    from labkit.execute import run_experiment
    good = _trace(tmp_path / "g.jsonl", GOOD)
    out, err = run_experiment("pulse", {"device": "cpu", "trace": good, "window_size": "4", "windows": "1",
                                      "calibration_windows": "0", "rate": "10",
                                      "reference": "noswitch:60", "policies": "threshold:60", "resident_slots": "2",
                                      "offload_slots": "2", "timeline_every": "1", "strategy": "block_dma",
                                      "select_block": "16", "dma_units_per_call": "3"},
                            out_dir=tmp_path / "run", log_output=False, timeout=300)
    assert err is None, err
    # every notebook parameter reaches the experiment (select_block was once dropped between the two)
    prm = json.loads((out / "manifest.json").read_text())["parameters"]
    assert (prm["strategy"], prm["select_block"], prm["dma_units_per_call"]) == ("block_dma", 16, 3)
    m = pd.read_parquet(out / "metrics.parquet")
    assert list(m["policy"]) == ["noswitch:60", "threshold:60"] and set(m["status"]) == {"ok"}
    assert (m["completed"] == 4).all() and (m["output_throughput"] > 0).all() and m["tpot_ms_p99"].notna().all()
    assert list(m["switching"]) == [False, True]
    sw, ns = m.iloc[1], m.iloc[0]
    assert sw["switched_rounds"] > 0 and ns["switched_rounds"] == 0
    assert 0 < sw["share_offloaded"] < 1
    tl = pd.read_parquet(out / "timeline.parquet")
    assert {"transfer", "compute"} <= set(tl["kind"]) and (tl["mode"] == "switched").any()
    assert len(pd.read_parquet(out / "loads.parquet")) > 0
    assert (out / "report.html").stat().st_size > 100_000                    # plotly embedded, figures in


def test_default_trace_travels_with_the_package_and_pool_check(tmp_path):
    """The default trace is the committed first 1,000 Mooncake requests (a GPU host gets only the tree);
    a resident pool smaller than one request slot is one line before anything is allocated, from the
    plain-Python entry point too (no papermill on the GPU host)."""
    p = _plan({"device": "cpu"})
    assert (p.windows, p.window_size, p.calibration_windows) == (8, 4, 2)
    assert p.trace.endswith("labkit/data/mooncake-conversation-first1000.jsonl")
    from labkit.serving.workload import load_trace
    rows = load_trace(p.trace)
    assert len(rows) == 1000 and rows[0]["input_length"] == 6758 and rows[-1]["timestamp"] == 330000
    with pytest.raises(BadInput, match="resident_pool_tokens"):
        _plan({"device": "cpu", "capacity": 512, "resident_pool_tokens": 256})
    r = subprocess.run([sys.executable, "-m", "labkit", "run", "pulse", "-p", "device=cpu", "-p", "rate=-1",
                        "--out", str(tmp_path / "never")], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == ["labkit: rate must be > 0, got -1.0"]
    assert not (tmp_path / "never").exists()


def test_inprocess_transport_same_tables(tmp_path):
    """`transport=inprocess` (a GPU host without the ASGI stack): the same scheduler on its own clock,
    the same run-folder tables and metrics, switching still on for `threshold:N`."""
    good = _trace(tmp_path / "g.jsonl", GOOD)
    run = experiments.measure("pulse", {"device": "cpu", "trace": good, "window_size": "4", "windows": "1",
                                        "calibration_windows": "0", "rate": "10", "reference": "noswitch:60",
                                        "transport": "inprocess", "policies": "threshold:60",
                                        "resident_slots": "2", "offload_slots": "2", "timeline_every": "1",
                                        "out_dir": str(tmp_path / "run")})
    m = pd.read_parquet(run.path / "metrics.parquet")
    assert list(m["policy"]) == ["noswitch:60", "threshold:60"] and set(m["status"]) == {"ok"}
    assert (m["completed"] == 4).all() and set(m["transport"]) == {"inprocess"}
    assert m.iloc[1]["switched_rounds"] > 0 and m.iloc[0]["switched_rounds"] == 0
    assert (m["tpot_ms_p99"] > 0).all() and (m["output_throughput"] > 0).all()
    r = pd.read_parquet(run.path / "requests.parquet")
    assert set(r["lane"]) == {"resident", "offload"} and len(r) == 8
    assert len(pd.read_parquet(run.path / "timeline.parquet")) > 0
    assert _plan({"device": "cpu", "transport": "auto"}).transport in ("http", "inprocess")
    with pytest.raises(BadInput, match="transport"):
        _plan({"device": "cpu", "transport": "pigeon"})


def test_load_size_figure_counts_every_load_once():
    """The transfer-size figure: one bar per (policy, size) whose heights add up to that policy's loads,
    at the sizes in MiB; a handful of numbers whatever the number of loads."""
    from labkit.experiments.pulse.figures import load_sizes
    loads = pd.DataFrame({"policy": ["a"] * 5000 + ["b"] * 3,
                          "bytes": [4 << 20] * 3000 + [12 << 20] * 2000 + [8 << 20] * 3})
    fig = load_sizes(loads)
    bars = {t.name: dict(zip(t.x, t.y)) for t in fig.data}
    assert bars == {"a": {4.0: 3000, 12.0: 2000}, "b": {8.0: 3}}
    assert sum(len(t.x) for t in fig.data) == 3
