"""Replaying real selections for the hot cache: the stable mapping keeps a trace's reuse when it scales
the trace up (the per-step mapping does not), and the CPU replay through HotIndex gives the hit rates
the issue quotes for the committed trace (a plain LRU of 1.5 x budget hits ~98%)."""
from pathlib import Path

import numpy as np
import pytest

from labkit.experiments.hot_replay.measure import overlap_prev, replay_sweep
from labkit.engine.model.trace_replay import load_selection_trace
from labkit.quality.traces import Trace, save_trace

REPO = Path(__file__).resolve().parent.parent
REAL = REPO / "labkit" / "data" / "smollm2-135m-prose-indexer-b2048.npz"


def growing_trace(steps=6, layers=2, budget=8, ctx0=200, seed=0, middle_only=False):
    """A trace whose context grows one token per step, selections overlapping ~60% step to step."""
    g = np.random.default_rng(seed)
    pos = np.empty((steps, layers, budget), dtype=np.int64)
    for li in range(layers):
        cur = np.sort(g.choice(np.arange(16, ctx0 - 64), budget, replace=False))
        for s in range(steps):
            if s:
                keep = cur[g.random(budget) < 0.6]
                hi = ctx0 - 64 if middle_only else ctx0 + s - 1
                fresh = g.choice(np.setdiff1d(np.arange(16, hi), keep), budget - keep.size, replace=False)
                cur = np.sort(np.concatenate([keep, fresh]))
            pos[s, li] = cur
    return Trace(pos, np.arange(ctx0, ctx0 + steps), np.zeros(steps, dtype=np.int64), np.arange(layers),
                 {"sink_window": 16, "recent_window": 64})


def _overlaps(x):
    return [len(set(x[s, li].tolist()) & set(x[s - 1, li].tolist())) for s in range(1, x.shape[0]) for li in range(x.shape[1])]


@pytest.mark.parametrize("context_len", [10_000, 1 << 20])
def test_stable_replay_keeps_every_overlap(tmp_path, context_len):
    tr = growing_trace()
    p = save_trace(tr, tmp_path / "t.npz")
    x = load_selection_trace(p, 2, context_len, 8, tr.steps, stable=True).numpy()
    assert _overlaps(x) == _overlaps(tr.positions)
    assert x.max() < context_len and (np.diff(x, axis=2) > 0).all()
    drift = load_selection_trace(p, 2, context_len, 8, tr.steps).numpy()     # the per-step mapping
    assert sum(_overlaps(drift)) < sum(_overlaps(tr.positions)), "per-step mapping was expected to lose reuse"


def test_stable_replay_widens_a_sparser_trace_into_runs(tmp_path):
    tr = growing_trace(budget=8, middle_only=True)      # recent positions are anchored, not widened
    p = save_trace(tr, tmp_path / "t.npz")
    x = load_selection_trace(p, 2, 1 << 20, 32, tr.steps, stable=True).numpy()     # 4 positions per selected one
    assert [4 * o for o in _overlaps(tr.positions)] == _overlaps(x)


@pytest.mark.skipif(not REAL.is_file(), reason="no committed trace")
def test_replay_of_the_committed_trace_gives_the_quoted_hit_rate():
    df = replay_sweep([REAL], [1 << 16], budget=2048, capacity_x=[1.5], policies=["lru"], log=None)
    r = df.iloc[0]
    assert r["ratio"] == "1/4" and r["capacity"] == 3072
    assert 0.95 < r["hit_rate"] < 1.0
    assert abs(r["overlap_replayed"] - r["overlap_trace"]) < 0.01
    assert r["bytes_vs_zero_copy"] == pytest.approx(1 - r["hit_rate"])


def test_overlap_prev_counts_shared_positions():
    sel = np.array([[[1, 2, 3, 4]], [[2, 3, 4, 9]], [[9, 10, 11, 12]]])
    assert overlap_prev(sel) == pytest.approx((3 / 4 + 1 / 4) / 2)


def test_trace_share_counts_what_the_fill_adds(tmp_path):
    from labkit.experiments.hot_replay.measure import trace_share
    mid = save_trace(growing_trace(budget=8, middle_only=True), tmp_path / "mid.npz")
    assert trace_share(mid, 2, 1 << 20, 32) == pytest.approx(1.0)     # 8 middle positions x runs of 4
    tr = growing_trace(budget=8, middle_only=True)
    tr.positions[:, :, 0] = 0                                           # one sink pick per row: not widened
    p = save_trace(tr, tmp_path / "sink.npz")
    share = trace_share(p, 2, 1 << 20, 32)
    x = load_selection_trace(p, 2, 1 << 20, 32, tr.steps, stable=True).numpy()
    assert share == pytest.approx(29 / 32) and x.shape[2] == 32       # 1 + 7 x 4 rows; 3 filled
