"""Axes a reader can use: the strategies are not squashed under an off-scale bound, facets are titled with
whole numbers, and a single run's trend is a dated point, not a time axis in fractions of a millisecond."""
from __future__ import annotations

import pandas as pd

from labkit.index import trend_figure
from labkit.report.figures import tok_s_vs_context


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
