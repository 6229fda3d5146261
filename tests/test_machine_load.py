"""A run's manifest says how loaded the machine was: load averages and the busiest other processes at the
start and at the end (a real CPU-bound neighbour process is seen)."""
import subprocess
import sys
import time

from labkit.results import Run, load_run
from labkit.telemetry import machine_load


def test_a_busy_neighbour_is_named_and_the_manifest_records_load(tmp_path):
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        run = Run.create(tmp_path / "r", "decode", {"shape": "tiny"})
        before = load_run(run.path).manifest["machine_load_before"]
        assert len(before["load_avg"]) == 3 and before["cpu_count"] >= 1
        assert hog.pid in [p["pid"] for p in before["busy_processes"]], before
        assert all(p["cpu_percent"] >= 1 for p in before["busy_processes"])
    finally:
        hog.kill()
        hog.wait()
    run.finish("ok")
    mf = load_run(run.path).manifest
    after = mf["machine_load_after"]
    assert after["at"] >= before["at"] and hog.pid not in [p["pid"] for p in after["busy_processes"]]
    assert mf["cpu_model"]


def test_machine_load_leaves_out_the_caller():
    import os
    assert os.getpid() not in [p["pid"] for p in machine_load()["busy_processes"]]
