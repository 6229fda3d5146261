"""Every committed run opens in the explorer, by name and by changing the run control, with a filled first
view: the multi-GPU runs' rows name no shape (their manifest does), which used to raise TraitError."""
from __future__ import annotations

from browser_util import REPO
from labkit.explore import Explorer

MULTIGPU = ("20261130-065613-multigpu-h200x2", "20261130-070629-multigpu-h200x2")


def _filled(ex: Explorer) -> bool:
    return ex.w_shape.value not in (None, "", "nan") and any(len(t.x or ()) for t in ex.fig_ctx.data)


def test_the_multigpu_runs_open_by_name():
    for run in MULTIGPU:
        ex = Explorer(REPO / "results", run=run)
        assert ex.w_run.value.startswith(run) and ex.w_shape.value == "qwen3.8-flash-next" and _filled(ex)


def test_every_committed_run_opens_from_the_run_control():
    ex = Explorer(REPO / "results")
    assert len(ex.runs) >= 20
    empty = []
    for label in list(ex.runs):
        ex.w_run.value = label                        # raised TraitError on the multi-GPU runs
        if not _filled(ex):
            empty.append(label)
    assert not empty, empty
