"""The explorer's logic (`labkit/explore.py`) without a browser: it finds the runs, its widgets redraw
the figures in place, the measure button's path measures one point with the sweep on the CPU, and the
notebook stays a few hidden cells that only call the library."""
from __future__ import annotations

import nbformat
import pytest

from browser_util import REPO, nightly_root
from labkit.params import BadInput

EXPLORE = REPO / "notebooks" / "explore.ipynb"


@pytest.fixture(scope="module")
def explorer():
    from labkit.explore import Explorer
    return Explorer(nightly_root(), run="decode-small")


def test_widgets_update_figures_in_place(explorer):
    ex = explorer
    # decode-small; the failed entry has no decode points (other tests may add runs to the same root later)
    assert [k for k in ex.runs if "deliberately-fails" in k] == []
    assert ex.w_run.value.startswith("nightly-2026-01-02/decode-small")
    assert type(ex.fig_point).__name__ == "FigureWidget"
    assert [t.name for t in ex.fig_ctx.data] == ["resident", "host_gather", "zero_copy"]
    ids = (id(ex.fig_point), id(ex.fig_ctx))
    before = tuple(ex.fig_point.data[0].y)
    other = next(v for _, v in ex.w_ctx.options if v != ex.w_ctx.value)
    ex.w_ctx.value = other
    assert tuple(ex.fig_point.data[0].y) != before, "moving the context slider did not change the bars"
    assert ex.fig_ctx.layout.shapes[0].x0 == other
    assert (id(ex.fig_point), id(ex.fig_ctx)) == ids      # same objects: updated in place
    ex.w_strat.value = ("zero_copy",)
    assert [t.name for t in ex.fig_ctx.data] == ["zero_copy"] and list(ex.fig_point.data[0].x) == ["zero_copy"]
    assert "zero_copy" in ex.readout.value and "tok/s" in ex.readout.value


def test_measure_button_is_disabled_without_cuda_and_says_why(explorer):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the button is enabled (tests/test_gpu_explore.py presses it)")
    assert explorer.measure.disabled and "no CUDA GPU" in explorer.why.value


def test_measure_path_on_cpu_is_the_sweep(explorer):
    """What the button runs, on the CPU: one point by the sweep into a scratch folder, shown as a live bar."""
    ex = explorer
    ex.w_strat.value = ("zero_copy",)
    ex.w_repeats.value, ex.w_steps.value = 1, 2
    n_traces = len(ex.fig_point.data)
    rec = ex.measure_selected("cpu")
    assert rec["status"] == "ok" and rec["tok_s"] > 0 and rec["strategy"] == "zero_copy", rec
    assert rec["context_len"] == ex.w_ctx.value and rec["budget"] == ex.w_budget.value and rec["shape"] == "tiny"
    assert rec["h2d_bytes_per_step"] > 0 and rec["repeats"] == 1 and rec["steps"] == 2
    assert ex.bar.value == ex.bar.max and ex.bar.description == "done"
    assert len(ex.fig_point.data) == n_traces + 1 and ex.fig_point.data[-1].name == "live"
    assert len(ex.live_rows) == 1 and "<table" in ex.live.value
    assert not str(rec["run_dir"]).startswith(str(REPO / "results"))       # nothing written to results/


def test_a_selection_the_sweep_refuses_is_one_line_not_a_crash(explorer, monkeypatch):
    from labkit import explore
    monkeypatch.setattr(explore, "measure_point", lambda **k: (_ for _ in ()).throw(BadInput("unknown shape 'x'")))
    rec = explorer.measure_selected("cpu")
    assert rec["status"] == "failed" and explorer.bar.description == "failed"
    assert "unknown shape" in explorer.status.value


def test_measure_point_rejects_bad_input_before_allocating(tmp_path):
    from labkit.explore import measure_point
    with pytest.raises(BadInput):
        measure_point("tiny", "no_such_strategy", 256, 64, 1, device="cpu", scratch=tmp_path / "x")


def test_no_runs_is_said_not_an_error(tmp_path):
    from labkit.explore import Explorer
    ex = Explorer(tmp_path)
    assert ex.runs == {} and ex.w_run.value is None and len(ex.fig_ctx.data) == 0


def test_notebook_is_a_few_hidden_cells_calling_the_library():
    nb = nbformat.read(EXPLORE, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert any("parameters" in c.metadata.get("tags", []) for c in code)
    assert len(code) <= 4
    for c in code:
        assert c.metadata.get("jupyter", {}).get("source_hidden") is True, c.source[:60]
        assert len(c.source.strip().splitlines()) <= 5, c.source
        assert "_shape" not in c.source and "devices" not in c.source      # no reaching into the sweep
    assert "labkit.explore" in "\n".join(c.source for c in code)
