"""The claims card (labkit/docs/claims/: the rule, one module per system, the card): every published headline has
a row with a verdict from the declared set; the verdict rule gives each of the four outcomes where it should; runs
named later in docs/runs.toml are picked up with no code change; docs/claims.md and the README block say what
`labkit docs --write` writes; the notebook draws the card under papermill."""
import json
import math
from pathlib import Path

import pandas as pd
import pytest

from labkit.docs import claims as C
from labkit.docs.readme_tables import BLOCK_FILES, rewrite
from labkit.results import REPO, load_run

# Every figure the four publications give: (row key, system key, how the row's published text writes it). Kept here,
# by hand, so that a row dropped from the card fails this test.
HEADLINES = [
    ("sparse-decode-below-budget", "sparse", "~80 tok/s"), ("sparse-decode-c1", "sparse", "~60 tok/s"),
    ("sparse-decode-flat", "sparse", "flat"), ("sparse-decode-c4", "sparse", "~150 tok/s"),
    ("sparse-pcie4-hides", "sparse", "PCIe 4.0 x16 hides the transfer"),
    ("sparse-prefill-248k", "sparse", "3,701 tok/s"), ("sparse-bytes-step", "sparse", "48 MiB"),
    ("sparse-link-at-80", "sparse", "~3.9 GB/s at 80 tok/s"), ("sparse-index-bytes", "sparse", "66 B"),
    ("sparse-1m-box", "sparse", "1M context on 3× RTX 3090 without KV quantization"),
    ("flash-prefill-throughput", "flash", "1.38×"), ("flash-prefill-dense", "flash", "dense attention"),
    ("flash-decode-goodput", "flash", "1.91×"), ("flash-same-tokens", "flash", "attended tokens"),
    ("pulse-throughput", "pulse", "2.6×"), ("pulse-tpot", "pulse", "76% lower TPOT"), ("pulse-vs-no-offload", "pulse", "4.7×"),
    ("pulse-small-transfers", "pulse", "~6 GB/s"), ("pulse-longbench", "pulse", "LongBench"),
    ("pulse-threshold", "pulse", "static length threshold"),
    ("xfer-ttft-32k", "xfer", "2.22×"), ("xfer-perplexity", "xfer", "~10% worse"),
    ("xfer-concurrency-8", "xfer", "2,393 vs 3,928 ms"), ("xfer-zero-failures", "xfer", "zero failures"),
    ("xfer-short-prompts", "xfer", "short prompts"), ("xfer-hellaswag", "xfer", "94%"),
    ("xfer-nvidia-pair", "xfer", "17–25×"),
]


@pytest.fixture(scope="module")
def rows():
    return C.card()


def test_every_published_figure_has_a_row(rows):
    by = {c.key: c for c in rows}
    for key, system, text in HEADLINES:
        assert key in by, f"{system}: {text} has no row"
        assert by[key].system == C.SYSTEMS[system]
        assert text in by[key].published.text, (text, by[key].published.text)
    assert len(rows) == len(HEADLINES), [c.published.text for c in rows]
    assert len({c.key for c in rows}) == len(rows)


def test_every_row_has_a_verdict_from_the_declared_set_and_says_why(rows):
    for c in rows:
        assert c.verdict.verdict in C.VERDICTS, c.key
        assert c.verdict.reason, c.key
        if c.verdict.verdict == C.UNTESTED:
            assert c.terms is None and c.model is None and c.stand_in is None, c.key
        elif c.verdict.verdict == C.CONSTRUCTION:
            assert c.construction is not None and c.construction.how == "arithmetic", c.key
        else:   # the deciding figure carries its spread
            f = c.terms or c.model or c.stand_in
            assert f.lo <= f.value <= f.hi and f.how, c.key
        if c.verdict.provisional or c.verdict.verdict in (C.UNTESTED, C.OUT_OF_REGIME):
            assert c.settle, f"{c.key}: no run named that would settle it"
        assert c.runs() or c.verdict.verdict == C.UNTESTED, c.key


def test_rows_read_the_figures_the_readme_states(rows):
    """Spot checks against the committed runs: the bytes per step are the layout's 48 MiB; the FlashOffloading
    goodput row is the capacity runs' own both / none ratio at their 30 ms TPOT limit."""
    by = {c.key: c for c in rows}
    assert by["sparse-bytes-step"].terms.value == pytest.approx(48.0)
    assert by["sparse-bytes-step"].verdict.verdict == C.CONSTRUCTION
    g = by["flash-decode-goodput"].terms
    assert 1.5 < g.value < 2.0 and g.lo <= g.value <= g.hi and "30 ms" in g.what
    assert by["xfer-hellaswag"].verdict.verdict == C.UNTESTED


def test_the_rows_read_their_regime_and_range_from_the_runs(rows):
    """Points the lab's own model says cannot show the effect, limits that never bind and colocated windows are not
    in the published regime; the decode figures are judged over the published context range; perplexity is
    decided on the pooled corpora."""
    by = {c.key: c for c in rows}
    for key in ("flash-prefill-throughput", "flash-prefill-dense", "flash-decode-goodput"):
        assert by[key].verdict.verdict == C.OUT_OF_REGIME, key
    # PulseInfer's rows read the decode-instance ladder (`disaggregated: true`): judged in the published terms
    for key in ("pulse-throughput", "pulse-tpot", "pulse-vs-no-offload"):
        assert by[key].verdict.verdict != C.OUT_OF_REGIME and by[key].verdict.basis == "published terms", key
        assert C.RUNS["pulse_ladder_decode"] in by[key].runs(), key
    assert "~1.0×" in by["flash-prefill-throughput"].verdict.reason
    assert "never binds" in by["flash-decode-goodput"].verdict.reason
    for key in ("sparse-decode-c1", "sparse-decode-c4"):
        pts = by[key].model.points
        assert pts[0][0] == "2K" and pts[-1][0] == "1M" and len(pts) > 2, key
    assert "pooled" in by["xfer-perplexity"].terms.what
    assert by["xfer-perplexity"].verdict.verdict != C.HOLDS
    assert "fastest of" in by["pulse-small-transfers"].verdict.reason
    for key in ("sparse-bytes-step", "sparse-link-at-80", "sparse-index-bytes"):
        assert by[key].verdict.verdict == C.CONSTRUCTION, key


def test_the_3090_rows_scale_the_published_shapes_run(rows):
    """Every 3× RTX 3090 prediction on the card scales the published shape's run (`reference.h100`) the way
    `labkit predict` does, naming its shape and GPU; a stand-in run appears only in a line that says so."""
    from labkit.docs import box
    by = {c.key: c for c in rows}
    ref = box.reference_run()
    at_1m = box.box_table(contexts=[C.PUBLISHED_CONTEXT], concurrency=[1]).set_index("strategy")
    c1 = by["sparse-decode-c1"].model
    assert c1.points[-1][0] == "1M" and c1.points[-1][1] == pytest.approx(at_1m.loc["zero_copy", "predicted_tok_s"])
    for key in ("sparse-decode-below-budget", "sparse-decode-c1", "sparse-decode-c4"):
        m = by[key].model
        assert ref in m.runs and "qwen3.8-flash-next, w4a16 weights, on one H100" in m.what, key
        assert "scaling qwen3.8-flash-next, w4a16 weights, on one H100" in m.text(), key     # the card's column
        assert "standin" not in m.what and "not re-run on the published shape at several rates yet" in m.how, key
        assert "link-1m-pcie4" in by[key].settle, key
    for key in ("sparse-decode-c1", "sparse-prefill-248k"):
        s = by[key].strongest
        assert "stand-in" not in s.what or "stand-in line: " in s.what, key
    pre = by["sparse-prefill-248k"]
    runs = C.RUNS["reference_prefill"]["h100"]
    runs = [runs] if isinstance(runs, str) else runs
    # the run with the prompt nearest the published 248K (a 1M prompt under a cap, listed after it, is not it)
    at_248k = next(r for r in runs if (load_run(REPO / r).metrics["context_len"] == 248 * 1024).any())
    assert pre.model.runs[0] == at_248k and not any(r in pre.model.runs for r in runs if r != at_248k)
    assert "the published shape" in pre.model.what and "248K prompt" in pre.model.what
    # the published length reached: judged (provisionally: the scaling to the box is unchecked), not out of regime
    assert pre.verdict.verdict != C.OUT_OF_REGIME and pre.verdict.provisional
    assert "3× RTX 3090" in pre.settle
    for key in ("sparse-bytes-step", "sparse-link-at-80", "sparse-index-bytes"):     # the reference grid's runs
        assert by[key].runs()[0] == ref and set(by[key].runs()) <= {ref, *box.reference_more()}, key


def test_the_pcie_row_reads_the_published_shapes_decode_grid(rows):
    """Offloaded (zero_copy, hot cache) over resident tok/s at each point of the H100 grid where both ran, judged
    with the H100's link as a proxy for PCIe 4.0 x16 (provisional); the box's predicted step ratio beside it."""
    from labkit.docs import box
    from labkit.report import summary as S
    from labkit.results import load_run
    row = {c.key: c for c in rows}["sparse-pcie4-hides"]
    d = S.decode_table(load_run(REPO / box.reference_run()).metrics).set_index(["strategy", "concurrency", "context_len"])
    want = d.loc[("zero_copy", 1, 1 << 20), "tok_s"] / d.loc[("resident", 1, 1 << 20), "tok_s"]
    pts = dict((p[0], p[1]) for p in row.terms.points)
    assert pts["zero_copy 1M c=1"] == pytest.approx(want) and "zero_copy 1M c=4" not in pts   # no resident there
    assert len(pts) == 10 and all(p.startswith(("zero_copy", "hot_cache")) for p in pts)
    assert row.verdict.provisional and "PCIe 5.0" in row.verdict.basis
    assert row.model is not None and len(row.model.points) == 12 and "link-1m-pcie4" in row.settle
    assert row.verdict.verdict == C.judge(row.published, row.terms)[0]


def test_claims_py_types_no_measured_number():
    """Numbers in the row builders (one module per system) and the figures they read from runs are published
    values (declared as such) or come from runs and data files."""
    import re
    here = Path(C.__file__).parent
    for name in ("common", "sparse", "flash", "pulse", "xfer"):
        body = (here / f"{name}.py").read_text()
        for bad in ("24 GiB", "one H200's PCIe", "of 30 layers", "== 8192", ">= 3701"):
            assert bad not in body, (name, bad)
        assert not re.search(r'gpu\("rtx3090"\), 3\b', body), name


# ---- the rule on constructed inputs ---------------------------------------------------------------------------
def _fig(v, lo=None, hi=None, median=None, noise=None):
    return C.Figure(v, v if lo is None else lo, v if hi is None else hi, "constructed", "constructed", median=median,
                    noise=noise)


RATIO = C.Published(2.0, "2×", "constructed")
ABS = C.Published(100, "100 tok/s", "constructed", "absolute", unit="tok/s")
T, A, E, M = C.TOLERANCE, C.APPROX_TOLERANCE, C.EFFECT_SHARE, C.MIN_EFFECT
eps = 1e-6
SMALL = C.Published(1.10, "~1.10×", "c", approx=True)            # "~": its band is capped by half its 10% effect
DROP = C.Published(60, "~60", "c", "absolute", approx=True, unit="tok/s", contrast=80)   # 80 -> 60: band 12.5%
UP = C.Published(2.6, "up to 2.6×", "c", up_to=True)
DOWN = C.Published(0.24, "up to 0.24×", "c", up_to=True)
LOWER = C.Published(0.5, "0.5×", "c")
DIRECTION = C.Published(1.0, "below 1×", "c", "direction", side=-1)
ZERO = C.Published(0, "zero failures", "c", "absolute", unit="failures")


@pytest.mark.parametrize("pub,fig,want", [
    # tolerance: ±10% either side
    (RATIO, _fig(2.0 * (1 + T) - eps), C.HOLDS), (RATIO, _fig(2.0 * (1 + T) + eps), C.PART),
    (RATIO, _fig(2.0 * (1 - T) + eps), C.HOLDS), (RATIO, _fig(2.0 * (1 - T) - eps), C.PART),
    # the published figure inside our spread, the spread clear of no effect / reaching it
    (RATIO, _fig(1.5, 1.4, 2.1), C.HOLDS), (RATIO, _fig(1.5, 1.0, 2.1), C.FAILS),
    # the direction: the spread clear of no effect ± MIN_EFFECT, or not
    (RATIO, _fig(1.3, 1 + M + eps, 1.5), C.PART), (RATIO, _fig(1.3, 1 + M - eps, 1.5), C.FAILS),
    (RATIO, _fig(0.8, 0.7, 0.9), C.FAILS),
    # a ratio below 1: the same on the other side
    (LOWER, _fig(0.5 * (1 + T) - eps), C.HOLDS), (LOWER, _fig(0.5 * (1 + T) + eps), C.PART),
    (LOWER, _fig(0.9, 0.8, 1 / (1 + M) - eps), C.PART), (LOWER, _fig(0.9, 0.8, 1 / (1 + M) + eps), C.FAILS),
    # "~": ±20%, but never more than half the reported effect (1.10: ±5%)
    (SMALL, _fig(1.10 * (1 + 0.10 * E) - eps), C.HOLDS), (SMALL, _fig(1.10 * (1 + 0.10 * E) + eps), C.PART),
    (SMALL, _fig(1.28, 1.20, 1.37), C.PART),
    (C.Published(100, "~100", "c", "absolute", approx=True), _fig(100 * (1 - A) + eps), C.HOLDS),
    (C.Published(100, "~100", "c", "absolute", approx=True), _fig(100 * (1 - A) - eps), C.PART),
    # a contrast for an absolute: 80 -> 60 caps the band at 12.5%, and the direction is "below 80"
    (DROP, _fig(60 * (1 + 0.25 * E) - eps), C.HOLDS), (DROP, _fig(60 * (1 + 0.25 * E) + eps), C.PART),
    (DROP, _fig(79, 78, 80 / (1 + M) - eps), C.PART), (DROP, _fig(79, 78, 80), C.FAILS),
    # "up to": the best unit against the published best, once the median's interval clears no effect too
    (UP, _fig(2.6 * (1 - T) + eps, 0.5, 2.6 * (1 - T) + eps, (1.5, 1.1, 2.0)), C.HOLDS),
    (UP, _fig(2.6 * (1 - T) - eps, 0.5, 2.6 * (1 - T) - eps, (1.5, 1.1, 2.0)), C.PART),
    (UP, _fig(3.5, 1.0, 3.5, (2.0, 1.5, 3.0)), C.HOLDS),                # past the published best
    (UP, _fig(1.5, 1.0, 1.5, (1.2, 1 + M + eps, 1.4)), C.PART), (UP, _fig(1.5, 1.0, 1.5, (1.2, 1 + M - eps, 1.4)), C.FAILS),
    (UP, _fig(1 + M - eps, 0.7, 1 + M - eps, (1 + M - eps,) * 3), C.FAILS),
    (DOWN, _fig(0.24 * (1 + T) - eps, 0.24, 3.0, (0.5, 0.4, 1 / (1 + M) - eps)), C.HOLDS),
    (DOWN, _fig(0.57, 0.57, 1.1, (0.8, 0.7, 0.9)), C.PART), (DOWN, _fig(1.0, 1.0, 2.0, (1.2, 1.0, 1.5)), C.FAILS),
    # ... one unit alone is not an effect: a best past the published figure with the median at no effect fails
    (UP, _fig(3.0, 0.8, 3.0, (1.0, 0.9, 1.1)), C.FAILS), (DOWN, _fig(0.2, 0.2, 1.3, (1.0, 0.9, 1.1)), C.FAILS),
    # ... no median: the whole spread must clear; or the best clears the repeats' measured noise
    (UP, _fig(3.0, 0.8, 3.0), C.FAILS), (UP, _fig(3.0, 1.1, 3.0), C.HOLDS),
    (UP, _fig(3.0, 0.8, 3.0, (1.0, 0.9, 1.1), noise=0.5), C.HOLDS),
    (UP, _fig(1.4, 0.8, 1.4, (1.0, 0.9, 1.1), noise=0.5), C.FAILS),
    # an absolute with nothing to contrast: PART_FACTOR
    (ABS, _fig(100 / C.PART_FACTOR + eps), C.PART), (ABS, _fig(100 / C.PART_FACTOR - eps), C.FAILS),
    (ABS, _fig(100 * C.PART_FACTOR - eps), C.PART), (ABS, _fig(100 * C.PART_FACTOR + eps), C.FAILS),
    # a claim of direction only, and a published zero
    (DIRECTION, _fig(0.5, 0.4, 1 / (1 + M) - eps), C.HOLDS), (DIRECTION, _fig(0.5, 0.4, 1 / (1 + M) + eps), C.FAILS),
    (ZERO, _fig(0), C.HOLDS), (ZERO, _fig(1), C.FAILS),
])
def test_judge_on_each_side_of_every_boundary(pub, fig, want):
    got, why = C.judge(pub, fig)
    assert got == want, why
    assert why


def test_a_figure_over_a_range_is_judged_at_every_point():
    pts = lambda *vs: tuple((f"{i}K", v, v, v) for i, v in enumerate(vs))  # noqa: E731
    fig = lambda *vs: C.Figure(vs[0], vs[0], vs[0], "c", "c", unit="tok/s", points=pts(*vs))  # noqa: E731
    assert C.judge(DROP, fig(60, 61, 59))[0] == C.HOLDS
    assert C.judge(DROP, fig(60, 75, 76))[0] == C.PART          # holds at one point, the direction at the rest
    assert C.judge(DROP, fig(79.5, 80, 85))[0] == C.FAILS        # nowhere below 80


def test_decide_takes_each_class_in_order():
    c = C.Claim("x", "s", ABS, construction=C.Figure(100, 100, 100, "arithmetic", "a × b"), terms=_fig(5))
    assert (c.verdict.verdict, c.verdict.provisional) == (C.CONSTRUCTION, False)
    c = C.Claim("x", "s", ABS, construction=C.Figure(20, 20, 20, "arithmetic", "a × b"))
    assert c.verdict.verdict == C.FAILS                      # the shape's arithmetic contradicts the figure
    c = C.Claim("x", "s", RATIO, terms=_fig(1.0, 0.99, 1.01), regime="the model predicts 1.0× here", settle="a run")
    assert (c.verdict.verdict, c.verdict.reason) == (C.OUT_OF_REGIME, "the model predicts 1.0× here")
    c = C.Claim("x", "s", RATIO, terms=_fig(2.0), stand_in=_fig(1.0, 0.9, 1.1), settle="a run")
    assert (c.verdict.verdict, c.verdict.provisional, c.verdict.basis) == (C.HOLDS, False, "published terms")
    c = C.Claim("x", "s", RATIO, stand_in=_fig(1.0, 0.9, 1.1), settle="a run")
    assert (c.verdict.verdict, c.verdict.provisional) == (C.FAILS, True)
    c = C.Claim("x", "s", ABS, model=_fig(100), model_checked=C.SCALED_TERMS)
    assert (c.verdict.verdict, c.verdict.provisional) == (C.HOLDS, False)
    c = C.Claim("x", "s", ABS, model=_fig(100))
    assert c.verdict.provisional and "unchecked" in c.verdict.basis
    c = C.Claim("x", "s", ABS, strongest=_fig(5), untestable="no such GPU here")
    assert (c.verdict.verdict, c.verdict.reason) == (C.UNTESTED, "no such GPU here")
    c = C.Claim("x", "s", ABS, terms=_fig(100), caveat="only the fastest way")
    assert c.verdict.verdict == C.HOLDS and c.verdict.reason.endswith("only the fastest way")


def test_the_rule_text_is_rendered_from_the_constants():
    t = C.rule_text()
    for v in C.VERDICTS:
        assert v in t or v.capitalize() in t, v
    assert f"±{C.TOLERANCE:.0%}" in t and f"±{C.APPROX_TOLERANCE:.0%}" in t and f"{C.EFFECT_SHARE:.0%}" in t


# ---- runs named later in docs/runs.toml are picked up -----------------------------------------------------------
def _run_folder(path, rows, **manifest):
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"run_id": path.name, "created": "2026-12-06T00:00:00Z",
                                                    "status": "ok", "parameters": {}, **manifest}))
    pd.DataFrame(rows).assign(status="ok").to_parquet(path / "metrics.parquet")
    return str(path)


def test_a_ladder_run_named_in_runs_toml_decides_pulseinfers_rows(tmp_path, monkeypatch):
    rows = []
    for w in range(8):      # a ladder without the prefetch baseline (the next test has it)
        for i, rung in enumerate(r for r in C.LADDER if r != "prefetch"):
            rows.append({"rung": rung, "window": w, "output_throughput": 100.0 * (1 + 0.4 * i) * (1 + 0.01 * w if i == 4 else 1),
                         "tpot_ms_p99": 50.0 / (1 + 0.5 * i)})
        rows.append({"rung": C.NO_OFFLOAD_ARM, "window": w, "output_throughput": 50.0, "tpot_ms_p99": 10.0})
    monkeypatch.setitem(C.RUNS, "pulse_ladder_decode", "")     # the decode-instance run, where named, comes first
    monkeypatch.setitem(C.RUNS, "pulse_ladder", _run_folder(tmp_path / "ladder0", rows))
    by = {c.key: c for c in C.pulse_claims()}      # prefill and decode on one GPU: not the published regime
    assert by["pulse-throughput"].verdict.verdict == C.OUT_OF_REGIME
    monkeypatch.setitem(C.RUNS, "pulse_ladder", _run_folder(tmp_path / "ladder", rows, parameters={"disaggregated": True}))
    by = {c.key: c for c in C.pulse_claims()}
    t = by["pulse-throughput"]
    assert t.verdict.basis == "published terms" and not t.verdict.provisional
    assert t.terms.value == pytest.approx(2.6 * 1.07, rel=1e-6)       # the best window: rung 5 / rung 1
    assert t.verdict.verdict == C.HOLDS
    assert by["pulse-tpot"].terms.value == pytest.approx(1 / 3)      # 50 / (50 / 3)
    assert by["pulse-vs-no-offload"].terms.value == pytest.approx(260 * 1.07 / 50)
    # a ladder without the no-offload arm: that row keeps its stand-in, the others still read the ladder
    monkeypatch.setitem(C.RUNS, "pulse_ladder", _run_folder(tmp_path / "ladder2", [r for r in rows if r["rung"] != C.NO_OFFLOAD_ARM],
                                                            parameters={"disaggregated": True}))
    by = {c.key: c for c in C.pulse_claims()}
    assert by["pulse-vs-no-offload"].terms is None and by["pulse-vs-no-offload"].verdict.basis == "stand-in"
    assert by["pulse-throughput"].terms is not None
    # numbered rungs read in their numeric order
    num = pd.DataFrame(rows).replace({r: i + 1 for i, r in enumerate(C.LADDER)})
    assert C.ladder_ratios(num, "output_throughput").max() == pytest.approx(2.6 * 1.07)
    # a run that chose its strongest arm on its calibration windows is read at that rung, named as chosen
    monkeypatch.setitem(C.RUNS, "pulse_ladder", _run_folder(tmp_path / "ladder3", rows, parameters={"disaggregated": True},
                                                            strongest_rung="switching"))
    by = {c.key: c for c in C.pulse_claims()}
    assert by["pulse-throughput"].terms.value == pytest.approx(2.2)          # rung 4 / rung 1
    # a decode-instance run named beside a colocated one decides the rows
    monkeypatch.setitem(C.RUNS, "pulse_ladder", str(tmp_path / "ladder0"))
    monkeypatch.setitem(C.RUNS, "pulse_ladder_decode", str(tmp_path / "ladder3"))
    by = {c.key: c for c in C.pulse_claims()}
    assert by["pulse-throughput"].terms.value == pytest.approx(2.2)      # ladder3's chosen rung, not ladder0's last
    assert by["pulse-throughput"].verdict.verdict == C.PART
    assert "chosen on the calibration windows (`switching`)" in by["pulse-throughput"].terms.what
    assert by["pulse-vs-no-offload"].terms.value == pytest.approx(220 / 50)


def test_link_rate_prefill_and_32k_runs_are_picked_up(tmp_path, monkeypatch):
    link = [{"link_gbps": g, "predicted_step_ms": 10.0 * (1 + e), "step_ms_median": 10.0}
            for g, e in ((8, 0.05), (16, -0.04), (24, 0.02))]
    # a link-rate run of the stand-in shape (the published name, no shape revision) checks nothing on the card
    monkeypatch.setitem(C.RUNS, "link_rate", _run_folder(tmp_path / "link0", link,
                                                         parameters={"shape": "qwen3.8-flash-next"}))
    chk = C.link_check()
    assert chk["checked"] and not chk["published"] and chk["shape"] == "qwen3.8-flash-next-standin"
    fig, checked = C.box_prediction(1)
    assert not checked and "not re-run on the published shape at several rates yet" in fig.how and chk["run"] not in fig.runs
    # one of the published shape does
    monkeypatch.setitem(C.RUNS, "link_rate", _run_folder(tmp_path / "link", link, shape_rev=2,
                                                         parameters={"shape": "qwen3.8-flash-next"}))
    chk = C.link_check()
    assert chk["checked"] and chk["published"] and chk["worst"] == pytest.approx(0.05) and chk["rates"] == [8, 16, 24]
    fig, checked = C.box_prediction(1)
    assert checked and fig.hi / fig.value == pytest.approx(1 / 0.95)
    pre = [{"config": "none", "prompts_per_s": 1.0}, {"config": "prefill", "prompts_per_s": 1.4},
           {"config": "both", "prompts_per_s": 1.5}]
    monkeypatch.setitem(C.RUNS, "prefill_throughput", _run_folder(tmp_path / "pre", pre))
    ttft = [{"kind": "ttft", "strategy": s, "context_len": 32768, "concurrency": c, "ttft_ms_median": ms,
             "ttft_ms_min": ms, "ttft_ms_max": ms} for s, c, ms in (("large_prefill", 1, 3600.0), ("mapped", 1, 1600.0),
                                                                   ("large_prefill", 8, 4000.0), ("mapped", 8, 2400.0))]
    monkeypatch.setitem(C.RUNS, "xfer_ttft_32k", _run_folder(tmp_path / "x32", ttft))
    by = {c.key: c for c in C.card(["sparse", "flash", "xfer"])}
    # the link-rate run checks the link term only: compute, bandwidth and shape stay unchecked, so still provisional
    c1 = by["sparse-decode-c1"]
    assert c1.model_checked == ("link",) and c1.verdict.provisional
    assert c1.verdict.basis.endswith("(unchecked on a second GPU: compute, bandwidth, shape)")
    assert by["flash-prefill-throughput"].terms.value == pytest.approx(1.4)
    assert by["flash-prefill-throughput"].verdict.verdict == C.HOLDS
    assert by["xfer-ttft-32k"].terms.value == pytest.approx(2.25) and by["xfer-ttft-32k"].verdict.verdict == C.HOLDS
    assert by["xfer-concurrency-8"].terms.value == pytest.approx(4000 / 2400)



def test_a_modern_prose_run_shows_beside_shakespeare(tmp_path, monkeypatch):
    before = {c.key: c for c in C.xfer_claims()}["xfer-perplexity"]
    run = _run_folder(tmp_path / "prose", [{"kind": "quality"}], parameters={"small": "first:9", "calib_tokens": 8192},
                      pair={"large": {"name": "smollm2-135m", "layers": 30}})
    pd.DataFrame([{"corpus": c, "mode": m, "ppl_ratio": r, "ppl_ratio_lo": r - 0.02, "ppl_ratio_hi": r + 0.03,
                   "ppl_ratio_n": 8} for c, r in (("prose", 1.2), ("pydoc", 1.31)) for m in ("mapped",)]
                 ).to_parquet(Path(run) / "quality_summary.parquet")
    monkeypatch.setitem(C.RUNS, "xfer_modern_prose", run)
    row = {c.key: c for c in C.xfer_claims()}["xfer-perplexity"]
    assert "Python's documentation topics): 1.310 [1.290, 1.340] over 8 sequences" in row.terms.what
    assert "first 9 of 30 layers" in row.terms.what and "Shakespeare in the same run 1.200" in row.terms.what
    assert run in row.runs() and row.terms.value == before.terms.value      # the verdict's figure is unchanged

# ---- the generated text and the notebook ------------------------------------------------------------------------
def test_generated_blocks_match_what_labkit_docs_write_writes(rows):
    assert BLOCK_FILES["claims"] == "docs/claims.md" and BLOCK_FILES["claims-summary"] == "README.md"
    for name, body in (("claims", C.claims_block(rows)), ("claims-summary", C.summary_block(rows))):
        text = (REPO / BLOCK_FILES[name]).read_text()
        assert rewrite(text, {name: body}, where=BLOCK_FILES[name]) == text, f"{name}: regenerate with labkit docs --write"
    assert "## Do the published figures hold?" in (REPO / "README.md").read_text()


def test_the_figure_colours_each_row_by_its_verdict(rows):
    fig = C.figure(rows)
    drawn = {t.name: len(t.x) for t in fig.data}
    want = pd.Series([c.verdict.verdict for c in rows]).value_counts().to_dict()
    assert drawn == want
    for t in fig.data:
        assert t.marker.color == C.COLOURS[t.name]


@pytest.mark.slow
def test_notebook_draws_the_card_under_papermill(tmp_path):
    """At toy cost (one system's rows), executed like the nightly runs it; its report shows the figure and table."""
    import papermill as pm

    from labkit.execute import KERNEL_ARGS
    from labkit.report.notebook import render_report
    assert set(pm.inspect_notebook(str(REPO / "notebooks" / "claims.ipynb"))) == {"systems", "link_base"}
    pm.execute_notebook(str(REPO / "notebooks" / "claims.ipynb"), str(tmp_path / "claims.ipynb"),
                        parameters={"systems": "xfer", "link_base": "../"}, progress_bar=False, cwd=str(REPO),
                        kernel_name="python3", **KERNEL_ARGS)
    html = render_report(tmp_path).read_text()
    assert "Traceback" not in html
    assert html.count('class="plotly-graph-div"') == 1
    assert "Do the published figures hold?" in html and C.COLOURS[C.UNTESTED] in html
    assert "HellaSwag" in html and "TTFT 3,657" in html and "3,701" not in html    # only the rows asked for
    assert "results/20261201-xfer-heldout-smollm2-cpu" in html     # each row links its runs


# ---- the rule's closed loopholes: each case is one the rule before these checks let through ---------------------
def test_the_up_to_best_window_alone_no_longer_lifts_a_row():
    """PulseInfer's 4.7x row as it was: best 1.03 of five windows, median 0.92 [0.80, 1.03]: does not hold."""
    fig = _fig(1.03, 0.80, 1.03, (0.92, 0.80, 1.03))
    assert C.judge(C.Published(4.7, "up to 4.7×", "c", up_to=True), fig)[0] == C.FAILS
    v, why = C.judge(C.Published(2.6, "up to 2.6×", "c", up_to=True), _fig(1.30, 1.01, 1.30, (1.04, 1.01, 1.30)))
    assert v == C.FAILS and "median 1.04" in why


def test_a_point_outside_the_regime_neither_refutes_nor_confirms_and_a_stand_in_stays_provisional():
    for fig in (_fig(2.0), _fig(0.5, 0.4, 0.6)):                     # would hold; would not hold
        c = C.Claim("x", "s", RATIO, terms=fig, regime="the limit never binds")
        assert (c.verdict.verdict, c.verdict.provisional) == (C.OUT_OF_REGIME, False)
    c = C.Claim("x", "s", RATIO, stand_in=_fig(2.0), regime="the limit never binds")
    assert (c.verdict.verdict, c.verdict.provisional) == (C.OUT_OF_REGIME, True)


def test_a_proxy_in_the_published_terms_makes_the_row_provisional():
    c = C.Claim("x", "s", RATIO, terms=_fig(2.0), proxy="a truncated model on a CPU")
    assert (c.verdict.verdict, c.verdict.provisional) == (C.HOLDS, True) and "proxy" in c.verdict.basis
    c = C.Claim("x", "s", RATIO, terms=_fig(0.5, 0.4, 0.6), proxy="a truncated model on a CPU")
    assert (c.verdict.verdict, c.verdict.provisional) == (C.FAILS, True)


def test_a_crossover_is_judged_on_both_halves():
    short = C.Published(1.0, "short loses", "c", "direction", side=-1)
    long_ = C.Published(1.0, "long wins", "c", "direction", side=1)
    half = lambda fig: ("it pays off on long context", long_, fig)  # noqa: E731
    assert C.Claim("x", "s", short, terms=_fig(0.5), other_half=half(_fig(0.8))).verdict.verdict == C.PART
    assert C.Claim("x", "s", short, terms=_fig(0.5), other_half=half(_fig(1.5))).verdict.verdict == C.HOLDS
    assert C.Claim("x", "s", short, terms=_fig(1.2), other_half=half(_fig(0.8))).verdict.verdict == C.FAILS
    assert C.Claim("x", "s", short, terms=_fig(0.5), other_half=half(None)).verdict.verdict == C.PART


def test_the_model_lifts_provisional_only_with_every_scaled_term_checked():
    for checked in (True, ("link",), ("link", "bandwidth", "compute")):
        c = C.Claim("x", "s", ABS, model=_fig(100), model_checked=checked)
        assert c.verdict.provisional, checked
    assert "shape" in C.Claim("x", "s", ABS, model=_fig(100), model_checked=("link",)).verdict.basis


def test_the_card_rows_carry_the_closed_rule(rows):
    by = {c.key: c for c in rows}
    tpot = by["pulse-tpot"].verdict.reason
    assert "p99 TPOT" in tpot and "mean TPOT" in tpot            # the statistic named, the other shown
    assert by["xfer-perplexity"].verdict.provisional and "proxy" in by["xfer-perplexity"].verdict.basis
    assert by["xfer-short-prompts"].other_half is not None and "the other half" in by["xfer-short-prompts"].verdict.reason
    for key in ("pulse-throughput", "pulse-vs-no-offload"):
        c = by[key]
        if c.terms is not None and c.terms.median is not None and c.terms.median[1] <= C.NO_EFFECT * (1 + C.MIN_EFFECT):
            assert c.verdict.verdict in (C.FAILS, C.OUT_OF_REGIME), key


def test_the_same_tokens_row_counts_each_offloaded_point_against_resident_at_its_own_point():
    """FlashOffloading's identical-results row: an offloaded point counts against the resident row of its own
    context, batch, budget and step count; a differing hash is named, a point with no resident row is left out."""
    import pandas as pd

    from labkit.docs.claims.flash import differing_points
    rows = [("resident", 65536, 1, "a"), ("zero_copy", 65536, 1, "a"), ("hot_cache", 65536, 1, "b"),
            ("resident", 65536, 4, "c"), ("zero_copy", 65536, 4, "c"), ("zero_copy", 1 << 20, 4, "d")]
    m = pd.DataFrame([{"strategy": s, "context_len": x, "concurrency": c, "budget": 2048, "logits_after_steps": 32,
                       "logits_sha": h} for s, x, c, h in rows])
    off, differ = differing_points(m)
    assert len(off) == 3 and differ == ["hot_cache 64K c=1"]
    m.loc[4, "logits_after_steps"] = 31        # another step count is another point: no resident row for it
    assert len(differing_points(m)[0]) == 2


def test_the_best_offload_system_is_the_better_baseline_in_each_window():
    """With the prefetch baseline in a ladder run, a PulseInfer ratio is to the better of the two baselines in
    each window: the higher throughput, the lower TPOT (a ratio to per_head alone would flatter PulseInfer
    wherever the prefetch is faster)."""
    import pandas as pd
    rows = []
    for w, (ph, pf) in enumerate([(100.0, 125.0), (100.0, 80.0)]):
        for rung, tput, tpot in (("per_head", ph, 1e3 / ph), ("prefetch", pf, 1e3 / pf), ("adaptive", 150.0, 1e3 / 150)):
            rows.append({"window": w, "rung": rung, "output_throughput": tput, "tpot_ms_p99": tpot})
    m = pd.DataFrame(rows)
    assert list(C.ladder_ratios(m, "output_throughput")) == pytest.approx([150 / 125, 150 / 100])
    assert list(C.ladder_ratios(m, "tpot_ms_p99")) == pytest.approx([125 / 150, 100 / 150])
    alone = m[m["rung"] != "prefetch"]
    assert list(C.ladder_ratios(alone, "output_throughput")) == pytest.approx([1.5, 1.5])


def test_two_processes_of_a_ladder_measure_the_noise_between_repeats():
    """The same windows replayed in two processes: the noise is the median over windows of the ratio's spread
    between processes over their mean; one process has none."""
    import pandas as pd

    from labkit.docs.claims.pulse import repeat_noise
    rows = []
    for p, (a, b) in enumerate([(120.0, 150.0), (130.0, 150.0)]):      # window 0's, window 1's adaptive throughput
        for w, top in enumerate((a, b)):
            rows += [{"process": p, "window": w, "rung": "per_head", "output_throughput": 100.0},
                     {"process": p, "window": w, "rung": "adaptive", "output_throughput": top}]
    m = pd.DataFrame(rows)
    assert repeat_noise(m, "output_throughput") == pytest.approx((0.1 / 1.25 + 0.0) / 2)
    assert repeat_noise(m[m["process"] == 0], "output_throughput") is None
