"""The explorer's logic (`labkit/explore.py`) without a browser: it finds the runs, its widgets redraw
the figures in place, the measure button's path measures one point with the sweep on the CPU, and the
notebook stays a few hidden cells that only call the library."""
from __future__ import annotations

import nbformat
import pytest

from browser_util import H200_RUN, REPO, explore_root, nightly_root
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


def _filled(ex) -> dict[str, int]:
    """Per explorer figure, how many of its traces hold at least one point."""
    return {n: sum(1 for t in getattr(ex, n).data if t.y is not None and len(t.y))
            for n in ("fig_ctx", "fig_point", "fig_budget")}


def _select_run(ex, folder: str) -> None:
    ex.w_run.value = next(k for k in ex.runs if k.split(" · ")[0] == folder)


def test_first_view_is_filled_on_a_cpu_sweep_with_a_budget_axis():
    """The newest run (a CPU sweep whose smaller budget is measured only at the largest context) opens on
    a measured point: its main-table budget, at the context where the budget axis was measured."""
    from labkit.explore import Explorer
    ex = Explorer(explore_root())
    assert ex.w_run.value.startswith("cpu-sweep")
    assert (ex.w_ctx.value, ex.w_budget.value, ex.w_conc.value) == (1024, 64, 1)
    assert all(_filled(ex).values()), _filled(ex)
    assert [len(t.y) for t in ex.fig_ctx.data] == [2, 2] and [len(t.y) for t in ex.fig_budget.data] == [2, 2]
    assert "no point measured" not in ex.readout.value


def test_first_view_is_filled_on_the_committed_h200_run():
    from labkit.explore import Explorer
    ex = Explorer(explore_root(), run=H200_RUN.name)
    assert (ex.w_ctx.value, ex.w_budget.value, ex.w_conc.value) == (1 << 20, 2048, 1)
    assert all(_filled(ex).values()), _filled(ex)
    assert [len(t.y) for t in ex.fig_budget.data] == [3, 3, 3]      # 512, 2048, 8192 at 1M


def test_changing_run_offers_the_new_runs_shapes_and_a_filled_view():
    from labkit.explore import Explorer
    ex = Explorer(explore_root())
    assert ex.w_shape.options == ("tiny",)
    _select_run(ex, H200_RUN.name)
    assert ex.w_shape.options == ("qwen3.8-flash-next",) and ex.w_shape.value == "qwen3.8-flash-next"
    assert all(_filled(ex).values()), _filled(ex)
    _select_run(ex, "cpu-sweep")
    assert ex.w_shape.options == ("tiny",) and all(_filled(ex).values())


def test_titles_fit_their_figure():
    """No title line wider than its figure (plotly clips a long title at the right instead of wrapping):
    the longest note, a single-budget point off the budget axis, included."""
    import re
    from labkit.explore import Explorer
    ex = Explorer(explore_root(), run=H200_RUN.name)
    ex.w_ctx.value = 8192                     # one budget here: the budget figure's title carries a note
    assert "one budget measured here" in ex.fig_budget.layout.title.text
    ex.w_budget.value = 512                   # not measured at 8K: the point's title says so
    assert "not measured" in ex.fig_point.layout.title.text
    for name in ("fig_ctx", "fig_point", "fig_budget"):
        f = getattr(ex, name)
        for line in f.layout.title.text.split("<br>"):
            text = re.sub("<[^>]+>", "", line)
            assert len(text) * 9 <= f.layout.width - 40, f"{name}: title line {text!r} is wider than {f.layout.width} px"


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
