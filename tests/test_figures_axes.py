"""Axes a reader can use: the strategies are not squashed under an off-scale bound, facets are titled with
whole numbers, and a single run's trend is a dated point, not a time axis in fractions of a millisecond."""
from __future__ import annotations

import pandas as pd

from labkit.report.index import trend_figure
from labkit.experiments.decode.figures import tok_s_vs_context


def _metrics(link_gbps: float) -> pd.DataFrame:
    rows = [{"experiment": "probe", "status": "ok", "strategy": "contiguous", "direction": "h2d", "bytes": 2**28,
             "gbps": link_gbps}]
    for c in (1.0, 4.0):                                    # concurrency as floats, as parquet hands them back
        for s, ms in (("resident", 6.0), ("zero_copy", 7.0), ("host_gather", 10.0), ("per_row", 300.0)):
            for ctx in (8192, 65536, 1 << 20):
                rows.append({"experiment": "decode", "status": "ok", "axis": "context", "strategy": s, "concurrency": c,
                             "context_len": ctx, "budget": 2048, "step_ms_median": ms * c, "step_ms_min": ms * c * 0.98,
                             "step_ms_max": ms * c * 1.02, "tok_s": c / (ms * c / 1e3),
                             "h2d_bytes_per_step": 0 if s == "resident" else 48 * 2**20 * c})
    return pd.DataFrame(rows)


def test_far_bound_is_named_not_drawn_and_axis_fits_the_strategies():
    fig = tok_s_vs_context(_metrics(55.0))          # bound ~1,100 tok/s against 3..170 tok/s
    titles = [a.text for a in fig.layout.annotations if a.text.startswith("concurrency")]
    assert titles == ["concurrency 1", "concurrency 4"]
    assert not [t for t in fig.data if "link bound" in (t.name or "")]
    notes = [a.text for a in fig.layout.annotations if "link bound" in a.text]
    assert len(notes) == 2 and "above this axis" in notes[0] and "1,093 tok/s" in notes[0]
    lo, hi = fig.layout.yaxis.range
    assert fig.layout.yaxis.type == "log" and 10 ** hi < 1100 and 10 ** lo < 3.3


def test_near_bound_is_drawn():
    fig = tok_s_vs_context(_metrics(5.0))           # bound ~100 tok/s: inside the data's range
    assert [t for t in fig.data if "link bound" in (t.name or "")]
    assert not [a for a in fig.layout.annotations if "link bound" in a.text]


def test_single_run_trend_is_a_dated_point():
    h = pd.DataFrame([{"created": "2026-11-29T10:16:29+00:00", "run_id": "r1", "key": "zero_copy @ 1M", "value": 121.5,
                       "lo": 120.0, "hi": 122.0, "verdict": "first"}])
    fig = trend_figure(h, "H200", "decode tok/s")
    assert fig.layout.xaxis.type == "category" and list(fig.data[0].x) == ["2026-11-29 10:16 UTC"]
    assert "one run so far" in fig.layout.title.text
    two = pd.concat([h, h.assign(run_id="r2", created="2026-11-30T10:00:00+00:00", verdict="noise")])
    assert trend_figure(two, "H200", "decode tok/s").layout.xaxis.type != "category"


def _probe_rows():
    """The link probe's bars as a CPU run measures them (0.1 to 84 GB/s)."""
    return pd.DataFrame([{"experiment": "probe", "status": "ok", "strategy": s, "direction": "h2d", "bytes": 2**28,
                          "gbps": g, "size_mib": mib} for s, g, mib in
                         (("contiguous", 0.1, 1), ("contiguous", 83.9, 8), ("contiguous", 5.7, 256),
                          ("pageable", 10.6, 256), ("per_row", 0.6, None), ("zero_copy", 0.6, None))])


def test_link_limits_axis_fits_its_bars():
    from labkit.experiments.probe.figures import probe_bars
    fig = probe_bars(_probe_rows())
    lo, hi = fig.layout.yaxis.range
    assert fig.layout.yaxis.type == "log" and 10 ** hi < 1000 and 10 ** lo <= 0.1     # was autoranged to 1M GB/s


def test_token_counts_read_as_people_write_them():
    from labkit.experiments.decode.figures import tok_s_vs_concurrency
    from labkit.report.units import tokens_label
    assert [tokens_label(v) for v in (256, 256.0, 1024.0, 4096, 65536, 248 << 10, 1 << 20, 1536)] == \
        ["256", "256", "1K", "4K", "64K", "248K", "1M", "1.5K"]
    assert tokens_label(4096.0) == "4K" and tokens_label(256.0) == "256"
    m = _metrics(5.0)
    m.loc[m["context_len"] == 8192, "context_len"] = 256
    names = {t.name for t in tok_s_vs_concurrency(m).data}
    assert "zero_copy @ 256" in names and "zero_copy @ 1M" in names and not [n for n in names if "0K" in n]


def test_log_axes_label_each_tick_once_without_crowding():
    from labkit.experiments.decode.figures import step_ms_vs_context
    from labkit.report.figures import log_ticks
    for lo, hi in ((8, 600), (0.05, 90), (1e-5, 3e-3), (12, 19)):
        t = log_ticks(lo, hi)
        assert 2 <= len(t["tickvals"]) <= 12, (lo, hi, t)
        assert len(set(t["ticktext"])) == len(t["ticktext"]) and all(lo <= v <= hi for v in t["tickvals"])
    y = step_ms_vs_context(_metrics(5.0)).layout.yaxis
    assert y.type == "log" and y.tickvals and len(y.tickvals) <= 12        # no plotly minor labels (2..9 per decade)


def test_empty_figures_become_one_line_of_text():
    """A figure without data is shown as one sentence (`figures.show`), not empty axes under it; the
    rendered report is checked in test_report."""
    from labkit.experiments.decode.figures import bytes_engine_vs_nvml
    from labkit.report.figures import empty_reason, empty_text, telemetry_timeline
    m = _metrics(5.0)                                   # no NVML counts, as on a CPU
    fig = bytes_engine_vs_nvml(m)
    assert empty_reason(fig) and empty_reason(telemetry_timeline(pd.DataFrame(), m))
    assert empty_reason(tok_s_vs_context(m)) is None
    assert empty_text(fig).startswith("H2D bytes per step") and "NVML" in empty_text(fig)


def test_busy_points_are_flagged():
    from labkit.report.summary import busy_note, busy_points, table_view
    m = _metrics(5.0)
    hit = (m["strategy"] == "host_gather") & (m["concurrency"] == 1.0) & (m["context_len"] == 65536)
    m.loc[hit, ["step_ms_min", "step_ms_max"]] = [11.0, 1503.0]
    b = busy_points(m)
    assert len(b) == 1 and b["strategy"].iloc[0] == "host_gather"
    note = busy_note(m, {"cpu_count": 2, "machine_load_before": {"load_avg": [5.2, 4.0, 2.0]}})
    assert "1 of 24 points" in note and "11–1,503 ms" in note and "5.2 on 2 cores" in note
    t = table_view(m)
    assert (t["busy"] == "busy").sum() == 1 and str(t["context_len"].dtype) == "Int64"
    assert busy_note(_metrics(5.0), {}) == ""


def test_weight_product_bars_one_group_per_path_and_rows_under_the_read_bound():
    """Real probe rows, measured on this CPU through the Triton interpreter (the GEMV's GPU path cannot run
    here; its speed is meaningless, its rows and the figure drawn from them are what is checked)."""
    import os
    import subprocess
    import sys
    # one timed call per product, no warm-up (a timing through the interpreter means nothing; 7 calls of 8
    # copies each per matrix, M and path made this the slowest CPU test): every path still runs
    code = ("import functools, json, torch; import labkit.experiments.probe.measure as P; "
            "import labkit.experiments.device_rates as R; "
            "P.bench = R.bench = functools.partial(R.bench, rounds=1, warmup=0); "
            "rows = P.probe_weights(torch.device('cpu'), 1, 'tiny', ms=(1, 4)) + [R.hbm_read_gbps(torch.device('cpu'), 0.01, 2)]; "
            "print(json.dumps(rows))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0, p.stderr[-2000:]
    import json

    from labkit.experiments.probe.figures import weight_product_bars
    m = pd.DataFrame(json.loads(p.stdout.strip().splitlines()[-1]))
    fig = weight_product_bars(m)
    assert sorted(t.name for t in fig.data) == ["cublas, M = 1", "cublas, M = 4", "gemv, M = 1", "gemv, M = 4"]
    for t in fig.data:
        assert list(t.x) == ["qsa.w_in", "qsa.w_o", "dn.w_in", "dn.w_o", "ffn.w_gu", "ffn.w_d", "lm_head"]
        assert all(v > 0 for v in t.y)
    read = float(m.loc[m.strategy == "hbm_read", "gbps"].iloc[0])
    assert [s.y0 for s in fig.layout.shapes] == [read] and "HBM read" in fig.layout.annotations[0].text
    assert "no weight products" in weight_product_bars(m[m.strategy != "weight_product"]).layout.annotations[0].text


def test_a_cpu_run_draws_no_link_bound_and_judges_no_target():
    """A CPU has no host link: its probe's "contiguous" copy is a memcpy within RAM, so no bound is drawn or
    named from it, and the GPU thresholds are not judged against a CPU's ratios."""
    from labkit.report.summary import link_gbps, targets_view
    m = _metrics(3.9).assign(device="cpu")
    assert link_gbps(m) is None and link_gbps(_metrics(3.9).assign(device="cuda:0")) == 3.9
    fig = tok_s_vs_context(m)
    assert not [t for t in fig.data if "link bound" in (t.name or "")]
    assert not [a for a in fig.layout.annotations if "link bound" in a.text]
    t, _ = targets_view(m, {"gpu_name": None})
    assert len(t) and set(t["result"]) == {"not judged (CPU run)"}


def test_speed_caption_says_only_what_the_figure_draws():
    """The decode report's words under its speed plot: a dashed link bound only where one is drawn (a CPU run
    has no host link, so none), and no fixed caption in the notebook that promises one."""
    import json

    from browser_util import REPO
    from labkit.experiments.decode.figures import tok_s_vs_context_caption
    cpu = _metrics(5.0)
    cpu = cpu[cpu["experiment"] != "probe"].assign(device="cpu", gpu_name=None)
    words = tok_s_vs_context_caption(cpu, tok_s_vs_context(cpu))
    assert "Dashed" not in words and "No link bound: a CPU run has no host link" in words
    assert "Dashed: the link bound" in tok_s_vs_context_caption(_metrics(5.0), tok_s_vs_context(_metrics(5.0)))
    far = tok_s_vs_context_caption(_metrics(55.0), tok_s_vs_context(_metrics(55.0)))
    assert "Dashed" not in far and "not drawn" in far
    nb = json.loads((REPO / "notebooks" / "decode_sweep.ipynb").read_text())
    fixed = [''.join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]
    assert not [t for t in fixed if "dashed" in t.lower()], "a fixed caption describes a line the figure may not draw"


def test_anatomy_chart_says_why_a_measured_strategy_has_no_bars():
    """The committed CPU nightly run measured per_row but has no anatomy for it: the chart and its text say so
    and why, instead of leaving a reader to wonder where per_row went."""
    import pytest

    from browser_util import REPO
    from labkit.experiments.decode.anatomy import anatomy_bars, anatomy_frame, anatomy_text
    from labkit.results import load_run
    path = REPO / "results/nightly-2026-11-29/decode-small"
    if not path.is_dir():
        pytest.skip("the committed nightly decode run is not in this checkout")
    m = load_run(path).metrics
    assert "per_row" in set(m[m["experiment"] == "decode"]["strategy"]) and "per_row" not in set(anatomy_frame(m)["strategy"])
    title = anatomy_bars(m).layout.title.text
    assert "per_row has no anatomy" in title and "one repeat" in title, title
    assert "`per_row` has no anatomy" in anatomy_text(m)
