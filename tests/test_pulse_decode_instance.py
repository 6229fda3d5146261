"""PulseInfer's ladder on a decode instance (`labkit run pulse_ladder -p disaggregated=true`) at toy size on CPU:
requests arrive with their KV prefilled elsewhere, so no prefill forward runs and TTFT is absent; outputs are
the trace's own lengths (scaled); the pressure rule caps the device so no_offload holds at most a third of a
window's requests; mean and p99 TPOT are both in the rows and the ratios; the strongest arm is chosen on the
calibration windows alone."""
import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from labkit import experiments
from labkit.engine.drive.scheduler import AllTo, Request, Scheduler, make_lanes
from labkit.experiments import trace_replay as R
from labkit.experiments.pulse_ladder import measure as L
from labkit.params import BadInput
from labkit.serving.latency import summarize

REPO = Path(__file__).resolve().parents[1]

# one window of the trace's first 3 requests (outputs 500, 490, 794 in the trace; x 0.01: 5, 5, 8 tokens), the
# switching and adaptive constants given; the auto cap holds one request at a time
DECODE = {"device": "cpu", "windows": "1", "window_size": "3", "calibration_windows": "0", "thresholds": "40",
          "adaptive_min_tokens": "16", "rate": "20", "warmup": "false", "resident_slots": "3", "offload_slots": "3",
          "disaggregated": "true", "max_output": "0", "output_scale": "0.01", "prefetch": "true"}


def test_handed_over_requests_run_no_prefill_and_decode_the_same_tokens_in_either_pool():
    """The scheduler places a handed-over request's KV (device pool or host pool) with its clock stopped and
    decodes it from there: no prefill forward, every token asked for, TTFT absent, TPOT from the admission."""
    tokens = {}
    for lane in ("resident", "offload"):
        lanes = make_lanes("tiny", "cpu", resident_slots=2, offload_slots=2, capacity=256, budget=32,
                           strategy="block_dma", page_size=16, select_block=16, prefill_chunk=64)
        sched = Scheduler(lanes, AllTo(lane), switching=False)
        reqs = [Request(list(range(5, 5 + n)), out, id=str(i), prefilled=True)
                for i, (n, out) in enumerate([(100, 4), (40, 1), (150, 3)])]
        done = sched.run(reqs)
        assert sched.prefill_forwards == 0 and sched.handovers == 3 and sched.handover_s >= 0
        recs = [r.record() for r in done]
        assert [r["output_len"] for r in recs] == [4, 1, 3] and {r["status"] for r in recs} == {"ok"}
        assert all(r["ttft_s"] is None and r["decode_start_s"] is not None for r in recs)
        s = summarize(recs)
        assert s["ttft_ms_mean"] is None and s["tpot_ms_mean"] > 0 and s["tpot_ms_p99"] > 0
        tokens[lane] = [r.tokens for r in done]
    assert tokens["resident"] == tokens["offload"]
    # a prompt prefilled here still runs its prefill forwards
    lanes = make_lanes("tiny", "cpu", resident_slots=1, capacity=256, budget=32, page_size=16, prefill_chunk=64)
    sched = Scheduler(lanes)
    sched.run([Request(list(range(5, 105)), 2)])
    assert sched.prefill_forwards == 2


def test_the_pressure_rule_holds_a_third_or_the_longest_request():
    p = replace(experiments.plan("pulse_ladder", DECODE), device_kv_tokens="auto", page_size=16)
    # 6 requests of 2, 2, 2, 3, 3, 4 pages: a third of the 16 pages is 5, the 3 shortest need 6: cap 5 pages,
    # above the longest's 4, and 2 requests (a third) fit it together
    six, = L.window_caps(p, [[16 * k - 3 for k in (2, 2, 2, 3, 3, 4)]])
    assert six["device_kv_cap_tokens"] == 5 * 16 and six["most_held"] == 2 and six["third_held"]
    # one long request: it must fit alone, so it sets the cap, and the bound says it no longer holds
    skew, = L.window_caps(p, [[16, 16, 16, 16 * 10]])
    assert skew["device_kv_cap_tokens"] == 160 and skew["most_held"] == 3 and not skew["third_held"]
    given, = L.window_caps(replace(p, device_kv_tokens=64), [[16, 16, 16]])
    assert given["device_kv_cap_tokens"] == 64 and given["device_kv_share"] == pytest.approx(64 / 48)


def test_uncapped_outputs_are_the_traces_lengths_scaled():
    p = experiments.plan("pulse_ladder", {**DECODE, "output_scale": "1", "capacity": "4096",
                                          "host_kv_tokens": "16384"})
    assert p.max_output == 0 and p.device_kv_tokens == "auto"
    assert [s.output_len for s in L.window_requests(p, 0)] == [500, 490, 794]
    assert [s.output_len for s in L.window_requests(replace(p, output_scale=0.01), 0)] == [5, 5, 8]
    assert [s.output_len for s in L.window_requests(replace(p, output_scale=0.01, max_output=6), 0)] == [5, 5, 6]
    assert [s.output_len for s in R.requests(p, 0, output_scale=0.01)] == [5, 5, 8]     # the shared replay's own
    # the committed runs' way: max_output caps, nothing scaled
    assert [s.output_len for s in L.window_requests(replace(p, max_output=64, output_scale=1.0), 0)] == [64, 64, 64]
    assert experiments.plan("pulse_ladder", {**DECODE, "max_output": "auto"}).max_output == 6


@pytest.fixture(scope="module")
def decode_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("decode") / "20260101-000000-pulse-ladder-decode-cpu"
    path = experiments.measure("pulse_ladder", {**DECODE, "out_dir": str(out)}, progress_bar=False).path
    return path, pd.read_parquet(path / "metrics.parquet"), json.loads((path / "manifest.json").read_text())


def test_a_decode_instance_ladder_times_decode_alone(decode_run):
    path, m, mf = decode_run
    assert mf["status"] == "ok" and mf["disaggregated"] is True and mf["parameters"]["disaggregated"] is True
    assert (m["status"] == "ok").all() and set(m["rung"]) == {*L.RUNGS, L.NO_OFFLOAD}
    assert (m["prefill_forwards"] == 0).all() and (m["handovers"] == 3).all() and (m["handover_s"] >= 0).all()
    assert m["ttft_ms_mean"].isna().all() and m["ttft_ms_p99"].isna().all()        # absent, not 0
    assert m["tpot_ms_mean"].notna().all() and m["tpot_ms_p99"].notna().all() and (m["tpot_ms_mean"] > 0).all()
    q = pd.read_parquet(path / "requests.parquet")
    assert (q["output_len"] == q["output_len_requested"]).all()
    assert sorted(q.groupby("request_id")["output_len"].first()) == [5, 5, 8]           # the trace's, x 0.01
    assert (q.groupby(["request_id"])["output_sha"].nunique() == 1).all()


def test_no_offload_holds_at_most_a_third_under_the_auto_cap(decode_run):
    path, m, mf = decode_run
    caps = mf["device_kv_caps"]
    assert len(caps) == 1 and caps[0]["third_held"] and mf["parameters"]["device_kv_tokens"] == "auto"
    r = m.set_index("rung")
    assert r.loc["no_offload", "max_running"] <= 1 and r.loc["no_offload", "max_waiting"] >= 1
    assert r.loc["no_offload", "held_share"] <= 1 / 3
    assert r.loc["no_offload", "device_kv_tokens"] == caps[0]["device_kv_cap_tokens"] == r.loc["per_head", "device_kv_cap_tokens"]
    assert r.loc["per_head", "max_running"] == 3                  # the host pool holds the window
    assert (r.loc[["per_head", "no_offload"], "dma_unit_rows"] == [4, 0]).all()


def test_mean_and_p99_tpot_ratios_and_the_calibration_choice(decode_run):
    path, m, mf = decode_run
    s = pd.read_parquet(path / "window_summary.parquet")
    assert {"tpot_mean_ratio", "tpot_p99_ratio", "throughput_ratio"} <= set(s.columns)
    assert s["tpot_mean_ratio"].notna().all()
    assert mf["strongest_rung"] == "adaptive" and "no calibration window" in mf["strongest_rule"]
    lines = L.headline(path)
    assert "mean TPOT" in lines[0] and "p99 TPOT" in lines[0] and "decode instance (0 prefill forwards)" in lines[-1]


def test_the_docs_table_says_how_a_decode_instance_ladder_was_made(decode_run):
    from labkit.experiments.pulse_ladder.tables import pulse_ladder_table
    text = pulse_ladder_table(str(decode_run[0]))
    for words in ("Decode instance", "no prefill in the timed window", "by the pressure rule", "the trace's output "
                  "lengths × 0.01", "mean TPOT ratio median", "waiting at the most", "(`adaptive`) / `no_offload`"):
        assert words in text, words


def test_the_strongest_arm_is_read_off_the_calibration_figures():
    sel = pd.DataFrame([
        {"arm": "threshold (fitted)", "policy": "threshold:40", "chosen": True, "acceptable": True,
         "throughput_ratio": 1.4, "tpot_p99_ratio": 0.7},
        {"arm": "adaptive (fitted)", "policy": "adaptive:16:1", "chosen": True, "acceptable": True,
         "throughput_ratio": 1.2, "tpot_p99_ratio": 0.6},
        {"arm": "adaptive (fitted)", "policy": "adaptive:64:1", "chosen": False, "acceptable": True,
         "throughput_ratio": 3.0, "tpot_p99_ratio": 0.5}])
    assert L.strongest(sel)[0] == "switching"
    sel.loc[0, "acceptable"] = False                     # over the p99 limit: not the strongest
    assert L.strongest(sel)[0] == "adaptive"


def test_bad_decode_instance_input_is_one_line():
    with pytest.raises(BadInput, match="in process"):
        experiments.plan("pulse_ladder", {**DECODE, "transport": "http"})
    with pytest.raises(BadInput, match="whole number"):
        experiments.plan("pulse_ladder", {**DECODE, "per_head_unit_bytes": "1000"})
    assert experiments.plan("pulse_ladder", {**DECODE, "transport": "auto"}).transport == "inprocess"


def test_per_head_unit_bytes_sets_the_per_head_rungs_copies():
    p = experiments.plan("pulse_ladder", {**DECODE, "per_head_unit_bytes": "1024"})   # tiny: 256 B rows
    assert L.unit_rows(p) == 4 == L.unit_rows(replace(p, per_head_unit_bytes="auto"))   # auto: one head's K or V
    assert L.rung_params("per_head", replace(p, per_head_unit_bytes=2048), 64)[0].settings["dma_unit_rows"] == 8


def test_labkit_run_decode_instance_under_papermill(tmp_path):
    out = tmp_path / "pulse_ladder"
    args = [a for k, v in DECODE.items() for a in ("-p", f"{k}={v}")]
    r = subprocess.run([sys.executable, "-m", "labkit", "run", "pulse_ladder", *args, "--out", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1].endswith("report.html")
    summary = [x for x in r.stdout.splitlines() if x.startswith("pulse_ladder: ")]
    assert 1 <= len(summary) <= 4 and any("decode instance" in x for x in summary), r.stdout[-2000:]
    mf = json.loads((out / "manifest.json").read_text())
    assert mf["status"] == "ok" and mf["parameters"]["disaggregated"] is True
    nb = json.loads(next(out.glob("*.ipynb")).read_text())
    assert not [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert "Traceback" not in (out / "report.html").read_text()
    assert re.search(r"pulse_ladder[^\n]*100%\|", r.stderr), r.stderr[-2000:]
