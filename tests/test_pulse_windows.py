"""The trace replay over disjoint windows (`labkit.experiments.trace_windows`): windows that are disjoint and cover
what they say, thresholds and adaptive constants chosen on calibration windows only, ratios within a window
(the reference's is 1), bad input as one line before anything is allocated, a run cut at its deadline
continued by whole windows, the fitted adaptive rule equal to the engine's at the engine's constants, the
docs table per window, and the device plan on the committed serving."""
import json
import shutil
import subprocess
import sys

import pandas as pd
import pytest

from labkit import experiments
from labkit.experiments.pulse import measure as P
from labkit.experiments.pulse.tables import pulse_trace_table
from labkit.experiments import trace_windows as W
from labkit.params import BadInput
from labkit.results import REPO

# a CPU replay small enough for tests: 3 windows of 2 requests, window 0 calibrates one threshold and a
# 2-point adaptive grid
SMALL = {"device": "cpu", "windows": "3", "window_size": "2", "calibration_windows": "1", "rate": "20",
         "transport": "inprocess", "thresholds": "40", "adaptive_min_tokens": "16,64", "max_output": "3"}


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("pw") / "20260101-000000-pulse-windows-cpu"
    return experiments.measure("pulse", {**SMALL, "out_dir": str(out)}, progress_bar=False).path


def test_windows_are_disjoint_and_cover_what_they_say():
    b = W.window_bounds(1000, 8, 32, 2)
    assert [x["role"] for x in b] == ["calibration"] * 2 + ["test"] * 6
    spans = [set(range(x["first"], x["last"] + 1)) for x in b]
    assert all(len(s) == 32 for s in spans)
    assert set().union(*spans) == set(range(256)) and sum(map(len, spans)) == 256      # disjoint, no gap
    # the requests a window replays are the trace's requests of that window, ids = trace indices
    plan = experiments.plan("pulse", {"device": "cpu", "windows": "5", "window_size": "3"})
    from labkit.serving.workload import load_trace
    rows = load_trace(plan.trace)
    seen = []
    for w in range(5):
        specs = P.requests(plan, w)
        assert [s.index for s in specs] == list(range(3 * w, 3 * w + 3))
        assert [s.meta["trace_input_length"] for s in specs] == [r["input_length"] for r in rows[3 * w:3 * w + 3]]
        assert specs[0].arrival_s == 0.0          # each window's arrivals count from its own first request
        seen += [s.index for s in specs]
    assert sorted(seen) == list(range(15))


def test_a_run_replays_each_window_on_its_own_requests(small_run):
    mf = json.loads((small_run / "manifest.json").read_text())
    assert mf["status"] == "ok", mf.get("error")
    assert mf["calibration"] == [0] and mf["test"] == [1, 2]
    assert [(x["first"], x["last"], x["role"]) for x in mf["windows"]] == [(0, 1, "calibration"), (2, 3, "test"), (4, 5, "test")]
    q = pd.read_parquet(small_run / "requests.parquet")
    for (w, pol), g in q.groupby(["window", "policy"]):
        assert sorted(g["request_id"].astype(int)) == [2 * w, 2 * w + 1], (w, pol)
    m = pd.read_parquet(small_run / "metrics.parquet")
    assert set(m["status"]) == {"ok"} and m["first_round_s"].notna().all()
    assert mf["warmup_s"] > 0           # untimed replays ran before the first measured one
    # the calibration window replays every candidate, the test windows only what was chosen
    assert set(m[m.window == 0].policy) == {"noswitch:40", "threshold:40", "adaptive:16:1", "adaptive:64:1"}
    for w in (1, 2):
        assert set(m[m.window == w].policy) == {"noswitch:40", *mf["chosen"].values()}


def test_the_reference_ratio_is_one_in_every_window(small_run):
    r = pd.read_parquet(small_run / "window_ratios.parquet")
    m = pd.read_parquet(small_run / "metrics.parquet")
    ref = r[r["arm"] == W.REFERENCE]
    assert sorted(ref["window"]) == [0, 1, 2]
    assert (ref["throughput_ratio"] == 1.0).all() and (ref["tpot_p99_ratio"] == 1.0).all()
    # every other ratio is the policy's figure over the reference's of the same window
    for _, x in r.iterrows():
        mine = m[(m.window == x.window) & (m.policy == x.policy)].iloc[0]
        base = m[(m.window == x.window) & (m.policy == "noswitch:40")].iloc[0]
        assert x.throughput_ratio == pytest.approx(mine.output_throughput / base.output_throughput)
        assert x.tpot_p99_ratio == pytest.approx(mine.tpot_ms_p99 / base.tpot_ms_p99)
    s = pd.read_parquet(small_run / "window_summary.parquet").set_index("arm")
    assert s.loc[W.REFERENCE, "throughput_ratio"] == 1.0 and s.loc[W.REFERENCE, "test_windows"] == "1,2"
    fitted = r[(r["arm"] == W.STATIC) & (r["role"] == "test")]["throughput_ratio"]
    assert s.loc[W.STATIC, "throughput_ratio"] == pytest.approx(fitted.median())
    assert s.loc[W.STATIC, "throughput_ratio_min"] == pytest.approx(fitted.min())
    assert s.loc[W.STATIC, "throughput_ratio_lo"] <= s.loc[W.STATIC, "throughput_ratio"] <= s.loc[W.STATIC, "throughput_ratio_hi"]


# ---- the choice sees the calibration windows only ----------------------------------------------------------
POL = W.Protocol(reference="noswitch:4096", thresholds=[4096, 8192], adaptive_min_tokens=[2048, 8192],
                 adaptive_hide=[1.0], p99_limit=1.0, policies=[], deadline_s=0)


def _truth(windows: int) -> dict:
    """A throughput and p99 per (window, policy) in which threshold:8192 and adaptive:8192:1 win everywhere."""
    t = {}
    for w in range(windows):
        t[w] = {"noswitch:4096": (100.0, 300.0), "threshold:4096": (120.0, 280.0), "threshold:8192": (140.0, 250.0),
                "adaptive:2048:1": (110.0, 290.0), "adaptive:8192:1": (130.0, 260.0)}
    return t


def _replay_from(truth):
    def replay(w, pol):
        tput, p99 = truth[w][pol]
        return {"status": "ok", "output_throughput": tput, "tpot_ms_p99": p99}
    return replay


def _choose_with(truth, windows=6, calibration=2):
    bounds = W.window_bounds(1000, windows, 32, calibration)
    return W.replay_windows(POL, bounds, _replay_from(truth), lambda row: None)


def test_thresholds_are_never_chosen_on_test_windows():
    """The replay itself is a table here (the property is the orchestration's, not the engine's): a test
    window on which other candidates win by far leaves the choice as it was; the same change on a
    calibration window moves it (so the check can see a choice that looks at a window)."""
    base = _choose_with(_truth(6))
    assert base["chosen"] == {W.STATIC: "threshold:8192", W.ADAPTIVE: "adaptive:8192:1"}
    flipped = _truth(6)
    for w in (2, 3, 4, 5):                  # test windows: threshold:4096 and adaptive:2048:1 now win there
        flipped[w]["threshold:4096"] = (400.0, 100.0)
        flipped[w]["adaptive:2048:1"] = (400.0, 100.0)
    assert _choose_with(flipped)["chosen"] == base["chosen"]
    control = _truth(6)
    for w in (0, 1):
        control[w]["threshold:4096"] = (400.0, 100.0)
        control[w]["adaptive:2048:1"] = (400.0, 100.0)
    assert _choose_with(control)["chosen"] == {W.STATIC: "threshold:4096", W.ADAPTIVE: "adaptive:2048:1"}
    # and the choice is made before any test window runs: every calibration replay comes first
    order = [w for w, _ in base["order"]]
    assert order == sorted(order) and order[:10] == [0] * 5 + [1] * 5
    # within a window the order turns: the reference is not always the first replay (the process's first
    # replay pays for compiles)
    firsts = [next(p for w2, p in base["order"] if w2 == w) for w in range(6)]
    assert firsts[0] == "noswitch:4096" and len(set(firsts)) > 1
    # choose() itself drops whatever rows of other windows it is handed
    rows = pd.DataFrame([{"window": w, "policy": p, "status": "ok", "output_throughput": v[0], "tpot_ms_p99": v[1]}
                         for w, d in flipped.items() for p, v in d.items()])
    assert W.choose(rows, POL, [0, 1])[0] == base["chosen"]


def test_p99_limit_rules_out_a_faster_candidate():
    t = _truth(4)
    for w in (0, 1):
        t[w]["threshold:8192"] = (200.0, 330.0)           # faster, but its p99 is 1.1x the reference's
    r = _choose_with(t, windows=4)
    assert r["chosen"][W.STATIC] == "threshold:4096"
    sel = r["selection"].set_index("policy")
    assert not sel.loc["threshold:8192", "acceptable"] and sel.loc["threshold:4096", "chosen"]


# ---- bad input ------------------------------------------------------------------------------------------
def test_bad_window_input_is_one_line_before_anything_is_allocated(tmp_path):
    with pytest.raises(BadInput, match=r"windows x window_size = 40 x 32 = 1280 requests, but the trace holds 1000"):
        experiments.plan("pulse", {"device": "cpu", "windows": "40", "window_size": "32"})
    with pytest.raises(BadInput, match="calibration_windows must be >= 0 and below windows"):
        experiments.plan("pulse", {"device": "cpu", "windows": "4", "calibration_windows": "4"})
    with pytest.raises(BadInput, match="adaptive:MIN_TOKENS:HIDE"):
        experiments.plan("pulse", {"device": "cpu", "policies": "adaptive:many"})
    with pytest.raises(BadInput, match="not a run folder"):
        experiments.plan("pulse", {"device": "cpu", "resume": str(tmp_path / "nothing")})
    for args in (["-p", "windows=40", "-p", "window_size=32"], ["-p", "windows=3", "-p", "calibration_windows=5"]):
        r = subprocess.run([sys.executable, "-m", "labkit", "run", "pulse", "-p", "device=cpu", *args,
                            "--out", str(tmp_path / "never")], capture_output=True, text=True, cwd=REPO)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not (tmp_path / "never").exists()


# ---- a call cut at its deadline, continued by whole windows ---------------------------------------------
def test_deadline_then_resume_by_whole_windows(tmp_path, monkeypatch):
    given = {**SMALL, "deadline_s": "0.001"}
    a = experiments.measure("pulse", {**given, "out_dir": str(tmp_path / "results" / "a")}, progress_bar=False).path
    ma = json.loads((a / "manifest.json").read_text())
    assert ma["status"] == "partial" and ma["complete_windows"] == [0] and "windows 1, 2 not replayed" in ma["error"]
    # resume=auto finds the newest run of these parameters that did not finish ok (results/ of the repo)
    monkeypatch.setattr("labkit.results.REPO", tmp_path)
    shutil.copytree(a, tmp_path / "results" / "other")       # not these parameters: never picked
    mo = json.loads((tmp_path / "results" / "other" / "manifest.json").read_text())
    mo["parameters"]["max_output"] = 4
    (tmp_path / "results" / "other" / "manifest.json").write_text(json.dumps(mo))
    plan = experiments.plan("pulse", {**SMALL, "resume": "auto", "out_dir": str(tmp_path / "b")})
    assert plan.resume == str(a)
    b = experiments.run(plan, progress_bar=False).path
    mb = json.loads((b / "manifest.json").read_text())
    assert mb["status"] == "ok" and mb["complete_windows"] == [0, 1, 2]
    assert mb["kept_windows"] == [0] and mb["measured_windows"] == [1, 2]
    assert [x["run_id"] for x in mb["resumed_from"]] == ["a"] and mb["resumed_from"][0]["created"] == ma["created"]
    m = pd.read_parquet(b / "metrics.parquet")
    assert not m.duplicated(["window", "policy"]).any()
    assert set(m[m.window == 0].measured_in) == {"a"} and set(m[m.window > 0].measured_in) == {"b"}
    assert sorted(pd.read_parquet(b / "requests.parquet")["window"].unique()) == [0, 1, 2]
    with pytest.raises(BadInput, match="not a pulse run of these parameters"):
        experiments.plan("pulse", {**SMALL, "max_output": "5", "resume": str(a)})


# ---- the adaptive rule with its constants as values -----------------------------------------------------
def test_fitted_adaptive_is_the_engines_rule_at_its_constants():
    import random

    from labkit.engine.drive.policies import FittedAdaptive
    from labkit.engine.drive.scheduler import Adaptive, Costs, Request, Scheduler, make_lanes
    lanes = make_lanes("tiny", "cpu", resident_slots=3, offload_slots=3, capacity=256, budget=16, page_size=16,
                       prefill_chunk=64)
    disagree = {"engine": 0, "other": 0}

    class Both:
        def __init__(self, costs):
            self.engine, self.same = Adaptive(costs), FittedAdaptive(costs, 16, 1.0)
            self.other = FittedAdaptive(costs, 64, 0.5)

        def place(self, req, sched):
            a = self.engine.place(req, sched)
            disagree["engine"] += a != self.same.place(req, sched)
            disagree["other"] += a != self.other.place(req, sched)
            return a

    rng = random.Random(0)
    # the edges too: prompts of exactly the budget, a transfer exactly as long as the compute it hides behind
    for costs in (Costs(1.0, 0.1, 0.5, 0.2), Costs(0.2, 0.0, 3.0, 1.0), Costs(1.0, 0.0, 0.5, 0.5)):
        sched = Scheduler(lanes, Both(costs))
        reqs = [Request([rng.randrange(1, 500) for _ in range(rng.choice([4, 15, 16, 17, 40, 90, 160]))], rng.choice([2, 4]),
                        arrival=0.0, id=str(i)) for i in range(14)]
        sched.run(reqs)
    assert disagree["engine"] == 0
    assert disagree["other"] > 0


# ---- the docs table per window --------------------------------------------------------------------------
def test_docs_table_per_window_with_the_one_window_run_as_a_row(small_run, tmp_path):
    one = tmp_path / "20260101-000001-pulse-trace-one-cpu"
    experiments.measure("pulse", {**SMALL, "windows": "1", "calibration_windows": "0", "policies": "threshold:40",
                                  "out_dir": str(one)}, progress_bar=False)
    text = pulse_trace_table([str(one)], str(small_run))
    s = pd.read_parquet(small_run / "window_summary.parquet").set_index("arm")
    assert "windows 0 calibrate" in text and "windows 1–2 are test windows" in text
    line = next(x for x in text.splitlines() if x.startswith(f"| {W.STATIC} |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2] == "test 1–2 (2)"
    assert cells[3:6] == [f"{s.loc[W.STATIC, c]:.2f}" for c in ("throughput_ratio", "throughput_ratio_min", "throughput_ratio_max")]
    assert any(x.startswith("| threshold:40 (run 000001") and "0 alone (1)" in x for x in text.splitlines())
    assert "Every one-window replay" in text
    assert "test windows" not in pulse_trace_table([str(one)], "")


def test_device_plan_replays_the_committed_graphs_on_serving():
    """plans/pulseinfer-windows.toml checks as a plan and serves the trace as the committed graphs-on
    one-window replay did, so that replay's window 0 is a row beside the windows."""
    from labkit.nightly import load_plan
    (e,) = load_plan(REPO / "plans" / "pulseinfer-windows.toml", cuda=False)
    raw = e.raw["parameters"]
    assert raw["windows"] - raw["calibration_windows"] >= 8 and 0 < raw["calibration_windows"]
    committed = json.loads((REPO / "results" / "20261130-152407-pulse-trace-split512-h200" / "manifest.json").read_text())
    prm = committed["parameters"]
    for k in ("length_scale", "max_output", "capacity", "strategy", "select_block", "dma_units_per_call", "graphs",
              "transport"):
        assert raw[k] == prm[k], k
    assert prm["n_requests"] % raw["window_size"] == 0 and W.is_first_window_of(prm, {**prm, **raw})
    assert not W.is_first_window_of({**prm, "n_requests": raw["window_size"] + 1}, {**prm, **raw})
    assert raw["deadline_s"] > 0 and raw["resume"] == "auto" and e.timeout_s > raw["deadline_s"]


def test_ratio_figure_one_point_per_window_and_policy_calibration_drawn_open(small_run):
    from labkit.experiments.pulse.window_figures import ratio_figure, window_table
    r = pd.read_parquet(small_run / "window_ratios.parquet")
    single = W.single_window(pd.read_parquet(small_run / "metrics.parquet").query("window == 0")
                             .query("policy in ['noswitch:40', 'threshold:40']"))
    fig = ratio_figure(r, "noswitch:40", system="CPU", single=single, single_label="one-window run")
    left = [t for t in fig.data if t.xaxis == "x"]
    points = {(t.name, int(x)) for t in left for x in t.x}
    fitted = r[r["arm"] != W.REFERENCE]
    assert len(points) == len(fitted) + 1 == sum(len(t.x) for t in left)      # the one-window run: one cross
    for t in left:
        sym = t.marker.symbol
        assert sym == ("circle-open" if "calibration" in t.name else "x" if t.name == "one-window run" else "circle"), t.name
    assert not [t for t in fig.data if W.REFERENCE in (t.name or "")] and "CPU" in fig.layout.title.text
    tab = window_table(r)
    assert list(tab.index) == ["0 (calibration)", "1 (test)", "2 (test)"] and W.REFERENCE not in tab.columns
