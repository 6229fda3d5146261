"""`make sweep`'s closing lines carry what the report says beside its numbers: where it ran (a CPU's timings are
that CPU's), each strategy's slowest..fastest repeat and whether their ranges overlap (then their order is noise),
and the busy machine's caveat when the sweep core's busy rule says so."""
from __future__ import annotations

from browser_util import cpu_run
from labkit.experiments.decode.measure import headline
from labkit.results import load_run

QUIET = {"load_avg": [0.2, 0.2, 0.2], "busy_processes": []}


def _lines(mf_changes: dict) -> list[str]:
    run = load_run(cpu_run())
    mf = {**run.manifest, "machine_load_before": QUIET, "machine_load_after": QUIET, **mf_changes}
    return headline(run.metrics, run.manifest["parameters"], mf)


def test_a_cpu_sweep_says_it_is_a_cpu_and_gives_each_strategy_its_range():
    lines = _lines({})
    assert lines[0].startswith("on a CPU (") and "never a GPU's" in lines[0] and "shape tiny" in lines[0]
    m = load_run(cpu_run()).metrics
    top = m[(m["experiment"] == "decode") & (m["context_len"] == 1024)]
    speeds = next(line for line in lines if line.startswith("at 1024 tokens x 1 request(s)"))
    for r in top.itertuples():
        assert f"{r.strategy} {r.tok_s:,.0f} ({1e3 / r.step_ms_max:,.0f}..{1e3 / r.step_ms_min:,.0f})" in speeds
    slow = {r.strategy: 1e3 / r.step_ms_max for r in top.itertuples()}
    fast = {r.strategy: 1e3 / r.step_ms_min for r in top.itertuples()}
    a, b = sorted(slow, key=lambda s: -float(top[top["strategy"] == s]["tok_s"].iloc[0]))
    assert any("overlap" in line for line in lines) == (slow[a] <= fast[b])
    # with the load quiet, only the points' own spreads can make this real run busy
    d = m[m["experiment"] == "decode"]
    wide = ((d["step_ms_max"] / d["step_ms_min"]) > 3).any()
    assert any(line.startswith("busy machine") for line in lines) == wide


def test_a_busy_machine_is_said_in_the_closing_lines():
    lines = _lines({"cpu_count": 2, "machine_load_before": {"load_avg": [3.1, 2.0, 1.0],
                                                             "busy_processes": [{"name": "cc1", "cpu_percent": 180.0}]}})
    busy = [line for line in lines if line.startswith("busy machine")]
    assert len(busy) == 1 and "other processes used 1.8 of 2 cores at the start" in busy[0]
    assert "load average was 3.1 on 2 cores" in busy[0]


def test_a_gpu_run_names_its_gpu_and_link():
    run = load_run(cpu_run())
    mf = {**run.manifest, "gpu_name": "NVIDIA H200", "pcie_gen": 5, "pcie_width": 16,
          "machine_load_before": QUIET, "machine_load_after": QUIET}
    assert headline(run.metrics, run.manifest["parameters"], mf)[0] == "on NVIDIA H200 (PCIe gen 5 x16), shape tiny"
