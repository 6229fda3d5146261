"""The claims card (labkit/report/claims.py): every published headline has a row with a verdict from the declared
set; the verdict rule gives each of the four outcomes where it should; runs named later in docs/runs.toml are
picked up with no code change; docs/claims.md and the README block say what `labkit docs --write` writes; the
notebook draws the card under papermill."""
import json
import math
from pathlib import Path

import pandas as pd
import pytest

from labkit.report import claims as C
from labkit.report.readme_tables import BLOCK_FILES, rewrite
from labkit.results import REPO

# Every figure in the results lines of the four publications: (system key, published value, how the row's
# published text writes it). Kept here, by hand, so that a row dropped from the card fails this test.
HEADLINES = [
    ("sparse", 60, "~60 tok/s"), ("sparse", 150, "~150 tok/s"), ("sparse", 3701, "3,701 tok/s"), ("sparse", 48, "48 MiB"),
    ("flash", 1.38, "1.38×"), ("flash", 1.91, "1.91×"),
    ("pulse", 2.6, "2.6×"), ("pulse", 0.24, "76% lower TPOT"), ("pulse", 4.7, "4.7×"), ("pulse", 6, "~6 GB/s"),
    ("xfer", 2.22, "2.22×"), ("xfer", 1.10, "~10% worse"), ("xfer", 3928 / 2393, "2,393 vs 3,928 ms"),
    ("xfer", 0.94, "94%"),
]


@pytest.fixture(scope="module")
def rows():
    return C.card()


def test_every_published_headline_has_a_row(rows):
    for system, value, text in HEADLINES:
        hit = [c for c in rows if c.system == C.SYSTEMS[system] and math.isclose(c.published.value, value, rel_tol=1e-3)]
        assert len(hit) == 1, f"{system}: {text} has {len(hit)} rows"
        assert text in hit[0].published.text, (text, hit[0].published.text)
    assert len(rows) == len(HEADLINES), [c.published.text for c in rows]
    assert len({c.key for c in rows}) == len(rows)


def test_every_row_has_a_verdict_from_the_declared_set_and_says_why(rows):
    for c in rows:
        assert c.verdict.verdict in C.VERDICTS, c.key
        assert c.verdict.reason, c.key
        if c.verdict.verdict == C.UNTESTABLE:
            assert c.terms is None and c.model is None and c.stand_in is None, c.key
        else:   # the deciding figure carries its spread
            f = c.terms or c.model or c.stand_in
            assert f.lo <= f.value <= f.hi and f.how, c.key
        if c.verdict.provisional or c.verdict.verdict == C.UNTESTABLE:
            assert c.settle, f"{c.key}: no run named that would settle it"
        assert c.runs() or c.verdict.verdict == C.UNTESTABLE, c.key


def test_rows_read_the_figures_the_readme_states(rows):
    """Spot checks against the committed runs: the bytes per step are the layout's 48 MiB; the FlashOffloading
    goodput row is the capacity runs' own both / none ratio at their 30 ms TPOT limit."""
    by = {c.key: c for c in rows}
    assert by["sparse-bytes-step"].terms.value == pytest.approx(48.0)
    assert by["sparse-bytes-step"].verdict.verdict == C.HOLDS
    g = by["flash-decode-goodput"].terms
    assert 1.5 < g.value < 2.0 and g.lo <= g.value <= g.hi and "30 ms" in g.what
    assert by["xfer-hellaswag"].verdict.verdict == C.UNTESTABLE


# ---- the rule on constructed inputs ---------------------------------------------------------------------------
def _fig(v, lo=None, hi=None):
    return C.Figure(v, v if lo is None else lo, v if hi is None else hi, "constructed", "constructed")


RATIO = C.Published(2.0, "2×", "constructed")
ABS = C.Published(100, "100 tok/s", "constructed", "absolute", unit="tok/s")


@pytest.mark.parametrize("pub,fig,want", [
    (RATIO, _fig(1.5, 1.4, 2.1), C.HOLDS),                          # the published figure inside our interval
    (RATIO, _fig(2.0 * (1 + C.TOLERANCE) - 1e-9), C.HOLDS),        # at the tolerance's edge
    (RATIO, _fig(2.0 * (1 + C.TOLERANCE) + 1e-3), C.PART),         # just past it: the direction still holds
    (RATIO, _fig(1.3, 1.1, 1.5), C.PART),                           # a smaller effect, interval clear of 1
    (RATIO, _fig(1.03, 0.88, 1.20), C.FAILS),                       # spread straddles no effect
    (RATIO, _fig(0.8, 0.7, 0.9), C.FAILS),                          # the opposite direction
    (C.Published(0.24, "0.24×", "c"), _fig(0.5, 0.4, 0.6), C.PART),  # "lower is better" ratios: direction below 1
    (C.Published(0.24, "0.24×", "c"), _fig(1.2, 1.1, 1.3), C.FAILS),
    (C.Published(2.6, "up to 2.6×", "c", up_to=True), _fig(1.2, 0.88, 1.2), C.PART),   # up to: the best case decides
    (C.Published(2.6, "up to 2.6×", "c", up_to=True), _fig(0.95, 0.7, 0.95), C.FAILS),  # even the best case loses
    (ABS, _fig(85), C.PART),                                        # absolute: within PART_FACTOR
    (ABS, _fig(100 / C.PART_FACTOR - 1), C.FAILS),                  # beyond it
    (C.Published(100, "~100", "c", "absolute", approx=True), _fig(85), C.HOLDS),   # "~x": the wider tolerance
])
def test_judge_gives_each_outcome(pub, fig, want):
    got, why = C.judge(pub, fig)
    assert got == want, why
    assert why


def test_decide_takes_the_published_terms_first_and_marks_stand_ins_provisional():
    c = C.Claim("x", "s", RATIO, terms=_fig(2.0), stand_in=_fig(1.0, 0.9, 1.1), settle="a run")
    assert (c.verdict.verdict, c.verdict.provisional, c.verdict.basis) == (C.HOLDS, False, "published terms")
    c = C.Claim("x", "s", RATIO, stand_in=_fig(1.0, 0.9, 1.1), settle="a run")
    assert (c.verdict.verdict, c.verdict.provisional) == (C.FAILS, True)
    c = C.Claim("x", "s", ABS, model=_fig(100), model_checked=True)
    assert (c.verdict.verdict, c.verdict.provisional) == (C.HOLDS, False)
    c = C.Claim("x", "s", ABS, model=_fig(100))
    assert c.verdict.provisional and "unchecked" in c.verdict.basis
    c = C.Claim("x", "s", ABS, strongest=_fig(5), untestable="no such GPU here")
    assert (c.verdict.verdict, c.verdict.reason) == (C.UNTESTABLE, "no such GPU here")


# ---- runs named later in docs/runs.toml are picked up -----------------------------------------------------------
def _run_folder(path, rows, **manifest):
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"run_id": path.name, "created": "2026-12-01T00:00:00+00:00", "status": "ok",
                                                       "parameters": {}, **manifest}))
    pd.DataFrame(rows).assign(status="ok").to_parquet(path / "metrics.parquet")
    return str(path)


def test_a_ladder_run_named_in_runs_toml_decides_pulseinfers_rows(tmp_path, monkeypatch):
    rows = []
    for w in range(8):
        for i, rung in enumerate(C.LADDER):
            rows.append({"rung": rung, "window": w, "output_throughput": 100.0 * (1 + 0.4 * i) * (1 + 0.01 * w if i == 4 else 1),
                         "tpot_ms_p99": 50.0 / (1 + 0.5 * i)})
        rows.append({"rung": C.NO_OFFLOAD_ARM, "window": w, "output_throughput": 50.0, "tpot_ms_p99": 10.0})
    monkeypatch.setitem(C.RUNS, "pulse_ladder", _run_folder(tmp_path / "ladder", rows))
    by = {c.key: c for c in C.pulse_claims()}
    t = by["pulse-throughput"]
    assert t.verdict.basis == "published terms" and not t.verdict.provisional
    assert t.terms.value == pytest.approx(2.6 * 1.07, rel=1e-6)       # the best window: rung 5 / rung 1
    assert t.verdict.verdict == C.HOLDS
    assert by["pulse-tpot"].terms.value == pytest.approx(1 / 3)      # 50 / (50 / 3)
    assert by["pulse-vs-no-offload"].terms.value == pytest.approx(260 * 1.07 / 50)
    # a ladder without the no-offload arm: that row keeps its stand-in, the others still read the ladder
    monkeypatch.setitem(C.RUNS, "pulse_ladder", _run_folder(tmp_path / "ladder2", [r for r in rows if r["rung"] != C.NO_OFFLOAD_ARM]))
    by = {c.key: c for c in C.pulse_claims()}
    assert by["pulse-vs-no-offload"].terms is None and by["pulse-vs-no-offload"].verdict.basis == "stand-in"
    assert by["pulse-throughput"].terms is not None
    # numbered rungs read in their numeric order
    num = pd.DataFrame(rows).replace({r: i + 1 for i, r in enumerate(C.LADDER)})
    assert C.ladder_ratios(num, "output_throughput").max() == pytest.approx(2.6 * 1.07)


def test_link_rate_prefill_and_32k_runs_are_picked_up(tmp_path, monkeypatch):
    link = [{"link_gbps": g, "predicted_step_ms": 10.0 * (1 + e), "step_ms_median": 10.0}
            for g, e in ((8, 0.05), (16, -0.04), (24, 0.02))]
    monkeypatch.setitem(C.RUNS, "link_rate", _run_folder(tmp_path / "link", link))
    chk = C.link_check()
    assert chk["checked"] and chk["worst"] == pytest.approx(0.05) and chk["rates"] == [8, 16, 24]
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
    assert by["sparse-decode-c1"].model_checked and not by["sparse-decode-c1"].verdict.provisional
    assert by["flash-prefill-throughput"].terms.value == pytest.approx(1.4)
    assert by["flash-prefill-throughput"].verdict.verdict == C.HOLDS
    assert by["xfer-ttft-32k"].terms.value == pytest.approx(2.25) and by["xfer-ttft-32k"].verdict.verdict == C.HOLDS
    assert by["xfer-concurrency-8"].terms.value == pytest.approx(4000 / 2400)



def test_a_modern_prose_run_shows_beside_shakespeare(tmp_path, monkeypatch):
    before = {c.key: c for c in C.xfer_claims()}["xfer-perplexity"]
    run = _run_folder(tmp_path / "prose", [{"kind": "quality"}], parameters={"small": "first:9", "calib_tokens": 8192})
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
    assert "Do the published figures hold?" in html and C.COLOURS[C.UNTESTABLE] in html
    assert "HellaSwag" in html and "TTFT 3,657" in html and "3,701" not in html    # only the rows asked for
    assert "results/20261201-xfer-heldout-smollm2-cpu" in html     # each row links its runs
