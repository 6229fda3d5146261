"""PulseInfer's ladder (`labkit run pulse_ladder`) at toy size on CPU: every rung replays every window, the rung
order turns with the window, the three all-offloaded rungs move the same bytes in copies of different sizes
(per_head: per-head units; coalesced and retrieval_head: larger), no_offload holds fewer requests at once
under the device-memory cap, every rung gives every request the same tokens, and ratios are to per_head
within a window. Bad input is one line before anything is allocated."""
import json

import pandas as pd
import pytest

from labkit import experiments
from labkit.experiments.pulse_ladder import measure as L
from labkit.params import BadInput

# 2 windows of 2 requests that arrive together (the trace's first 4), the prefetch baseline replayed (on CPU it is
# off unless asked), the switching rung's threshold and the
# adaptive constants given (no calibration window); a cap of 64 tokens (4 pages of 16) holds one of window 0's
# requests at a time (each 39 tokens: 3 pages), where the offloaded rungs hold both
SMALL = {"device": "cpu", "windows": "2", "window_size": "2", "calibration_windows": "0", "thresholds": "40",
         "adaptive_min_tokens": "16", "rate": "20", "max_output": "3", "warmup": "false", "resident_slots": "2",
         "offload_slots": "2", "device_kv_tokens": "64", "timeline_every": "1", "prefetch": "true"}
ALL = [*L.RUNGS, L.NO_OFFLOAD]


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    out = tmp_path_factory.mktemp("ladder") / "20260101-000000-pulse-ladder-cpu"
    path = experiments.measure("pulse_ladder", {**SMALL, "out_dir": str(out)}, progress_bar=False).path
    return path, pd.read_parquet(path / "metrics.parquet"), json.loads((path / "manifest.json").read_text())


def test_every_rung_replays_every_window_in_a_turned_order(ladder):
    path, m, mf = ladder
    assert mf["status"] == "ok" and mf["rungs"] == ALL and mf["device_kv_cap_tokens"] == 64
    assert (m["status"] == "ok").all() and (m["experiment"] == "pulse_ladder").all()
    assert sorted(map(tuple, m[["window", "rung"]].values.tolist())) == sorted((w, r) for w in (0, 1) for r in ALL)
    order = {w: list(g.sort_values("position")["rung"]) for w, g in m.groupby("window")}
    assert order[0] != order[1] and order[0][0] != order[1][0]
    assert order[1] == order[0][1:] + order[0][:1]            # turned by one: no rung always first
    assert (m["completed"] == 2).all()


def test_offloaded_rungs_move_the_same_bytes_in_copies_of_their_own_size(ladder):
    path, m, mf = ladder
    unit = mf["per_head_unit_bytes"]
    assert unit == 1024                                     # tiny: 16 positions x 32 head dims x 2 B, one head's K or V
    for w, g in m.groupby("window"):
        r = g.set_index("rung")
        off = r.loc[["per_head", "coalesced", "retrieval_head"]]
        assert (off["share_offloaded"] == 1).all() and off["h2d_bytes_total"].nunique() == 1
        assert r.loc["per_head", "bytes_per_copy"] <= unit  # a unit, or less (a partly filled last block)
        assert r.loc["retrieval_head", "bytes_per_copy"] > r.loc["per_head", "bytes_per_copy"]
        assert r.loc["coalesced", "bytes_per_copy"] > 4 * unit
        assert r.loc["per_head", "copies_per_step"] > r.loc["retrieval_head", "copies_per_step"]
        assert r.loc["no_offload", "h2d_bytes_total"] == 0 and r.loc["no_offload", "share_offloaded"] == 0
        assert pd.isna(r.loc["no_offload", "bytes_per_copy"])
        assert r.loc["per_head", "dma_unit_rows"] == 4 and r.loc["retrieval_head", "dma_unit_rows"] == 0
        # prefetch: only the guess's misses cross (its hits need a batch that lasts: the next test)
        assert r.loc["prefetch", "share_offloaded"] == 1
        assert 0 < r.loc["prefetch", "h2d_bytes_total"] <= r.loc["per_head", "h2d_bytes_total"]


def test_no_offload_holds_fewer_requests_under_the_cap(ladder):
    path, m, mf = ladder
    r = m.set_index(["window", "rung"])
    for w in (0, 1):
        assert r.loc[(w, "no_offload"), "device_kv_tokens"] == 64 and r.loc[(w, "per_head"), "device_kv_tokens"] == 0
        assert r.loc[(w, "no_offload"), "max_running"] <= r.loc[(w, "per_head"), "max_running"]
    assert r.loc[(0, "no_offload"), "max_running"] == 1 < r.loc[(0, "per_head"), "max_running"]


def test_every_rung_gives_every_request_the_same_tokens(ladder):
    path, m, mf = ladder
    q = pd.read_parquet(path / "requests.parquet")
    assert len(q) == 2 * 2 * len(ALL) and q["output_sha"].notna().all()
    per = q.groupby(["window", "request_id"])["output_sha"].nunique()
    assert (per == 1).all(), per[per > 1]
    assert set(q.loc[q["rung"] == "per_head", "lane"]) == {"offload"}
    assert set(q.loc[q["rung"] == "no_offload", "lane"]) == {"resident"}


def test_ratios_are_to_per_head_within_a_window_and_the_headline_says_them(ladder):
    path, m, mf = ladder
    t = pd.read_parquet(path / "window_ratios.parquet")
    assert set(t["arm"]) == set(ALL) and len(t) == 2 * len(ALL)
    ph = t[t["arm"] == "per_head"]
    assert (ph["throughput_ratio"] == 1).all() and (ph["tpot_p99_ratio"] == 1).all()
    for w, g in t.groupby("window"):
        x = g.set_index("arm")
        mine = m[(m["window"] == w)].set_index("rung")
        assert x.loc["adaptive", "throughput_ratio"] == pytest.approx(
            mine.loc["adaptive", "output_throughput"] / mine.loc["per_head", "output_throughput"])
        assert x.loc["no_offload", "throughput_vs_no_offload"] == pytest.approx(1)
    s = pd.read_parquet(path / "window_summary.parquet")
    assert list(s["arm"]) == ALL and (s["test_windows"] == "0,1").all()
    lines = L.headline(path)
    assert "against per_head" in lines[0] and "no_offload under the same cap" in lines[1]
    assert "per_head 1.0 KiB" in lines[2] or "per_head 0." in lines[2]


def test_bad_input_is_one_line_before_anything_is_allocated():
    with pytest.raises(BadInput, match="holds no request"):
        experiments.plan("pulse_ladder", {**SMALL, "device_kv_tokens": "16"})
    with pytest.raises(BadInput, match="set by the rungs"):
        experiments.plan("pulse_ladder", {**SMALL, "dma_unit_rows": "2"})
    with pytest.raises(BadInput, match="one value"):
        experiments.plan("pulse_ladder", {**SMALL, "thresholds": "40,80"})
    with pytest.raises(BadInput, match="2 x n_kv_heads"):
        experiments.plan("pulse_ladder", {**SMALL, "select_block": "2", "budget": "32"})
    with pytest.raises(BadInput, match="host_kv_tokens"):
        experiments.plan("pulse_ladder", {**SMALL, "host_kv_tokens": "64"})
    with pytest.raises(BadInput, match="block_strategy"):
        experiments.plan("pulse_ladder", {**SMALL, "block_strategy": "per_row"})


def test_a_run_cut_at_its_deadline_is_continued_by_whole_windows(tmp_path, monkeypatch):
    """The pieces of a GPU run: a call that stops at deadline_s leaves a partial run (here after the calibration
    window); resume=auto finds it, keeps that window and its choice, and replays the test window, every rung.
    The candidates replayed on the calibration window are no rung (`candidate_for`): per window, the rungs are
    the chosen ones on test windows only."""
    tiny = {**SMALL, "window_size": "1", "max_output": "2", "device_kv_tokens": "256", "calibration_windows": "1"}
    a = experiments.measure("pulse_ladder", {**tiny, "deadline_s": "0.001", "out_dir": str(tmp_path / "results" / "a")},
                            progress_bar=False).path
    ma = json.loads((a / "manifest.json").read_text())
    assert ma["status"] == "partial" and ma["complete_windows"] == [0] and "window 1" in ma["error"]
    monkeypatch.setattr("labkit.results.REPO", tmp_path)
    plan = experiments.plan("pulse_ladder", {**tiny, "resume": "auto", "out_dir": str(tmp_path / "b")})
    assert plan.resume == str(a)
    b = experiments.run(plan, progress_bar=False).path
    mb = json.loads((b / "manifest.json").read_text())
    assert mb["status"] == "ok" and mb["kept_windows"] == [0] and mb["measured_windows"] == [1]
    assert mb["chosen"] == {"threshold (fitted)": "threshold:40", "adaptive (fitted)": "adaptive:16:1"}
    m = pd.read_parquet(b / "metrics.parquet")
    assert not m.duplicated(["window", "policy"]).any()
    cal, test = m[m.window == 0], m[m.window == 1]
    assert sorted(cal["rung"].dropna()) == sorted(L.FIXED) and sorted(cal["candidate_for"].dropna()) == ["adaptive", "switching"]
    assert sorted(test["rung"]) == sorted(ALL) and test["candidate_for"].isna().all()
    assert set(cal.measured_in) == {"a"} and set(test.measured_in) == {"b"}
    assert list(pd.read_parquet(b / "window_summary.parquet")["test_windows"].unique()) == ["1"]
    assert sorted(pd.read_parquet(b / "requests.parquet")["window"].unique()) == [0, 1]
    with pytest.raises(BadInput, match="not a pulse_ladder run of these parameters"):
        experiments.plan("pulse_ladder", {**tiny, "max_output": "3", "resume": str(a)})


def prefetch_against_per_head(plan, device: str) -> dict:
    """Window 0 replayed by the per_head and prefetch rungs: per rung, (each round's batch and bytes, the
    requests' token hashes sorted, the handovers)."""
    from labkit.engine.model.hybrid import HybridModel
    from labkit.experiments import trace_replay as R
    from labkit.shapes import ModelShape
    model = HybridModel(ModelShape.from_name(plan.shape), device, seed=plan.seed)
    specs = L.window_requests(plan, 0)
    got = {}
    for rung in ("per_head", "prefetch"):
        how, placement = L.rung_params(rung, plan, 64)
        out = R.replay_policy(placement, how, specs, model)
        got[rung] = ([(sum(r["batch"].values()), r["h2d_bytes"]) for r in out["stats"]["rounds"]],
                     sorted(r["output_sha"] for r in out["stats"]["records"]), out["stats"]["handovers"])
    assert L.rung_params("prefetch", plan, 64)[0].settings["hot_capacity"] == plan.budget
    assert got["prefetch"][1:] == got["per_head"][1:]             # the same tokens, the same handovers
    assert 0 < sum(b for _, b in got["prefetch"][0]) < sum(b for _, b in got["per_head"][0])
    return got


def test_the_prefetch_baseline_moves_only_what_the_last_steps_selection_missed():
    """The prefetch rung on one window whose batch lasts several steps: its first step of a batch moves what
    per_head moves (no guess yet), the steps after move less (the guess's hits stay on the device), and every
    request's tokens are per_head's (the rows attended are the same, only where they come from differs)."""
    got = prefetch_against_per_head(experiments.plan("pulse_ladder", {**SMALL, "max_output": "8"}), "cpu")
    ph, pf = got["per_head"][0], got["prefetch"][0]
    assert [b for b, _ in pf] == [b for b, _ in ph]
    firsts = [i for i in range(len(pf)) if i == 0 or pf[i][0] != pf[i - 1][0]]     # a batch's first step
    assert all(pf[i][1] == ph[i][1] for i in firsts)
    later = [i for i in range(len(pf)) if i not in firsts]
    assert later and all(pf[i][1] < ph[i][1] for i in later)
