"""Host RAM bandwidth (`labkit.hostmem`, STREAM's kernels and counting) measured on this machine, kept once per host
and recorded in every run's manifest; the probe's host rows and, on CPU, the link-under-load part skipped and
said; the cost model splitting a CPU-staged transfer (host_gather) into its host-RAM gather and its link copy, on
a committed H200 decode run with its step anatomy."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from labkit import costmodel as C
from labkit import hostmem
from labkit.shapes import shape_for_run

REPO = Path(__file__).resolve().parents[1]
STAGED_RUN = REPO / "results" / "20261129-153810-decode-h200"        # host_gather with its step anatomy


def test_stream_counting_and_thread_counts():
    rec = hostmem.measure(16, repeats=2, cap_mib=16)
    times = rec.pop("_times")
    n = rec["array_mib"] << 20
    assert set(times) == {f"{k}_{t}" for k in hostmem.KERNELS for t in ("1t", "all")} or rec["threads_all"] == 1
    for key, (threads, moved, ts) in times.items():
        kernel = key.split("_")[0]
        assert moved == hostmem.WORDS[kernel] * n and len(ts) == 2 and threads in (1, rec["threads_all"])
        tag = key.split("_", 1)[1]
        assert rec[f"{kernel}_{tag}_gbps"] == pytest.approx(moved / min(ts) / 1e9, abs=0.01)
        assert rec[f"{kernel}_{tag}_gbps"] >= rec[f"{kernel}_{tag}_gbps_median"] > 0     # best, then median
    assert torch.get_num_threads() >= 1


def test_kept_once_per_host_and_recorded_in_every_manifest(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    first = hostmem.for_manifest()                                  # nothing kept: a quick measurement, kept
    assert first["how"].startswith("quick") and first["copy_1t_gbps"] > 0 and hostmem.cache_path().is_file()
    t0 = time.perf_counter()
    assert hostmem.for_manifest() == first and time.perf_counter() - t0 < 0.5    # read back, not measured again
    other = dict(first, host_key="another-machine", how="elsewhere")
    hostmem.cache_path().write_text(json.dumps(other))
    assert hostmem.cached() is None                                 # another machine's record is not this one's
    from labkit.results import Run
    again = hostmem.for_manifest()
    run = Run.create(tmp_path / "run", "probe", {})
    # measured again for this host, not the planted record taken (the timestamps have one-second steps: a quick
    # measurement can land in the first one's second, so they cannot tell the two apart)
    assert run.manifest["host_memory_bandwidth"] == again
    assert again["host_key"] == first["host_key"] and again["how"].startswith("quick") and again["copy_1t_gbps"] > 0
    assert "_times" not in json.loads(hostmem.cache_path().read_text())


def test_probe_on_cpu_measures_the_host_and_says_the_link_part_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    from labkit.experiments import measure
    run = measure("probe", {"device": "cpu", "repeats": "2", "pool_gib": "0.02", "out_dir": str(tmp_path / "run")},
                  progress_bar=False)
    m, mf = run.metrics(), run.manifest
    host = m[m["strategy"].isin(["host_read", "host_write", "host_copy", "host_triad"])]
    want = {1, os.cpu_count()}
    assert len(host) == 4 * len(want) and set(host["threads"]) == want
    assert (host["gbps"] > 0).all() and (host["status"] == "ok").all()
    copy1 = host[(host["strategy"] == "host_copy") & (host["threads"] == 1)].iloc[0]
    assert copy1["bytes"] == 2 * copy1["array_mib"] * 2**20
    assert mf["host_memory_bandwidth"]["how"] == "labkit run probe"            # the full measurement, kept
    assert hostmem.cached()["how"] == "labkit run probe"
    assert mf["link_under_host_load"].startswith("skipped: no CUDA GPU")
    assert not m["strategy"].str.endswith("_under_host_load").any()
    from labkit.experiments.probe.measure import headline
    assert any("link under a host-memory load: skipped" in ln for ln in headline(m))
    # no GPU, so no all-reduce between GPUs: no rows, and the manifest and the closing lines say why
    assert mf["allreduce"].startswith("skipped: no CUDA GPU") and "allreduce" not in set(m["strategy"])
    assert headline(m, mf["allreduce"])[-1] == f"all-reduce among the GPUs {mf['allreduce']}"


def _fit(host_gbps=None):
    m = pd.read_parquet(STAGED_RUN / "metrics.parquet")
    mf = json.loads((STAGED_RUN / "manifest.json").read_text())
    shape, src = shape_for_run(mf["parameters"]["shape"], mf.get("shape_rev")), C.gpu_for_name(mf["gpu_name"])
    ctx, c = C.fit_point(m, "host_gather")
    return m, shape, src, ctx, c, C.CostModel.fit(m, shape, "host_gather", ctx, c, src, host_gbps=host_gbps)


def test_cost_model_splits_a_cpu_staged_transfer_by_the_measured_host_bandwidth():
    m, shape, src, ctx, c, cm = _fit(host_gbps=100.0)
    _, _, _, _, _, plain = _fit()
    assert plain.staged is None and cm.staged is not None
    r = m[(m["experiment"] == "decode") & (m["strategy"] == "host_gather") & (m["context_len"] == ctx)
          & (m["concurrency"] == c) & (m["axis"] == "context")].iloc[0]
    budget = int(r["budget"])
    nbytes = C.phase_bytes(shape, "host_gather", ctx, c, budget)["transfer"]
    same = cm.predict(src, ctx, c, budget)
    assert same.phases_ms["transfer"] == pytest.approx(r["anat_transfer_ms"], rel=1e-6)   # closes on its fit point
    dma = nbytes / (cm.staged.dma_gbps * 1e6)
    faster_host = cm.predict(src, ctx, c, budget, host_scale=2.0).phases_ms["transfer"]
    assert faster_host == pytest.approx(dma + (r["anat_transfer_ms"] - dma) / 2, rel=1e-6)   # only the gather halves
    box = C.gpu("rtx3090")
    ratio = src.link_gbps / box.link_gbps
    staged_3090 = cm.predict(box, ctx, c, budget).phases_ms["transfer"]
    plain_3090 = plain.predict(box, ctx, c, budget).phases_ms["transfer"]
    assert staged_3090 == pytest.approx(r["anat_transfer_ms"] - dma + dma * ratio, rel=1e-6)
    assert plain_3090 == pytest.approx(r["anat_transfer_ms"] * ratio, rel=1e-6)      # all of it on the link: before
    assert any("CPU-staged" in w and "100.0 GB/s" in w for w in cm.predict(box, ctx, c, budget).reasoning)


def test_predict_takes_the_target_hosts_bandwidth_from_the_command_line(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(STAGED_RUN, run, ignore=shutil.ignore_patterns("*.html", "*.ipynb"))
    cmd = [sys.executable, "-m", "labkit", "predict", str(run), "--gpu", "rtx3090", "--host-gbps", "20"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 2 and "record its host's RAM bandwidth" in r.stderr and r.stderr.count("\n") == 1
    mf = json.loads((run / "manifest.json").read_text())
    mf["host_memory_bandwidth"] = {"copy_all_gbps": 40.0, "how": "test: a host measured at 40 GB/s"}
    (run / "manifest.json").write_text(json.dumps(mf))
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "x0.50 of this host's" in r.stdout and "of its measured RAM copy 40.0 GB/s" in r.stdout


@pytest.mark.gpu
def test_link_under_a_host_memory_load_on_cuda():
    from labkit.experiments.probe.measure import probe_link_under_host_load
    rows = probe_link_under_host_load(torch.device("cuda"), 1.0, 5)
    assert {r["strategy"] for r in rows} == {"contiguous_under_host_load", "zero_copy_under_host_load"}
    assert all(r["gbps"] > 0 and r["host_load_gbps"] > 0 and r["host_load_threads"] >= 1 for r in rows)


def test_the_summary_line_and_the_chart_both_say_median_of_the_repeats():
    """The probe's header line (`hostmem.line`) shows the medians its chart draws, and says so; a record kept before
    medians were kept says "best repeat"; the chart's title names the repeats."""
    from labkit.experiments.probe.figures import host_memory_bars
    rec = {"array_mib": 192, "threads_all": 2, "repeats": 3, "copy_1t_gbps": 13.4, "copy_1t_gbps_median": 12.9,
           "copy_all_gbps": 20.0, "copy_all_gbps_median": 19.0, "triad_1t_gbps": 14.0, "triad_1t_gbps_median": 13.0,
           "triad_all_gbps": 21.0, "triad_all_gbps_median": 20.5}
    text = hostmem.line(rec)
    assert "12.9 GB/s on 1 core, 19.0 on 2" in text and "median of 3 repeats" in text
    old = {k: v for k, v in rec.items() if not k.endswith("_median")}
    assert "13.4 GB/s" in hostmem.line(old) and "best repeat" in hostmem.line(old)
    rows = pd.DataFrame([{"experiment": "probe", "status": "ok", "strategy": s, "threads": t, "gbps": 10.0 + t,
                          "repeats": 3} for s in ("host_copy", "host_triad") for t in (1, 2)])
    assert "median of 3 repeats" in host_memory_bars(rows).layout.title.text
