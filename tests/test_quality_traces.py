"""Selection-trace file schema, locality statistics and the engine's trace replay."""

from pathlib import Path

import numpy as np
import pytest
import torch

from labkit.engine.model.trace_replay import load_selection_trace, scale_row
from labkit.quality.traces import Trace, load_trace, locality, reuse_distance, save_trace

REPO = Path(__file__).resolve().parents[1]


def hand_trace():
    # 3 steps, 2 layers, budget 4, contexts 100..102; sink 2, recent 3
    pos = np.array([
        [[0, 10, 20, 99], [0, 1, 50, 99]],
        [[0, 10, 30, 100], [0, 1, 50, 100]],
        [[0, 10, 30, 101], [0, 1, 50, -1]],
    ])
    return Trace(positions=pos, context_len=np.array([100, 101, 102]), tokens=np.array([5, 6, 7]),
                 layers=np.array([3, 7]), meta={"policy": "indexer", "budget": 4, "sink_window": 2, "recent_window": 3})


def test_trace_round_trip_schema(tmp_path):
    tr = hand_trace()
    p = save_trace(tr, tmp_path / "t.npz")
    with np.load(p) as z:
        assert set(z.files) == {"positions", "context_len", "tokens", "layers", "meta"}
        assert z["positions"].dtype == np.int16 and z["context_len"].dtype == np.int32
    back = load_trace(p)
    assert np.array_equal(back.positions, tr.positions) and np.array_equal(back.layers, tr.layers)
    assert back.meta["schema"] == 1 and back.meta["policy"] == "indexer"
    with pytest.raises(ValueError, match="does not exist"):
        load_trace(tmp_path / "missing.npz")


def test_locality_hand_made():
    loc = locality(hand_trace()).set_index(["layer", "step"])
    assert np.isnan(loc.loc[(3, 0), "overlap_prev"])
    assert loc.loc[(3, 1), "overlap_prev"] == pytest.approx(2 / 4)  # {0,10} kept of {0,10,30,100}
    assert loc.loc[(3, 2), "overlap_prev"] == pytest.approx(3 / 4)
    assert loc.loc[(7, 2), "overlap_prev"] == pytest.approx(1.0)  # {0,1,50} all in previous
    assert loc.loc[(3, 0), "sink_share"] == pytest.approx(1 / 4)  # 0 < 2
    assert loc.loc[(7, 0), "sink_share"] == pytest.approx(2 / 4)
    assert loc.loc[(3, 0), "recent_share"] == pytest.approx(1 / 4)  # 99 >= 100-3
    assert loc.loc[(3, 1), "new_share"] == pytest.approx(2 / 4)  # 30, 100 never seen
    rd = reuse_distance(hand_trace()).set_index("reuse_distance")["count"]
    # layer 3: step1 -> 0,10 d1; 30,100 new. step2 -> 0,10,30 d1; 101 new. layer 7: step1 0,1,50 d1; 100 new; step2 0,1,50 d1
    assert rd["1"] == 2 + 3 + 3 + 3 and rd["new"] == 2 + 1 + 1 and rd.sum() == 15


@pytest.mark.parametrize("context_len,budget", [(1_000_000, 2048), (4096, 64), (300, 256), (90, 4), (8, 8)])
def test_replay_positions_in_range_unique_sorted(tmp_path, context_len, budget):
    p = save_trace(hand_trace(), tmp_path / "t.npz")
    x = load_selection_trace(p, n_layers=5, context_len=context_len, budget=budget, steps=7)
    assert x.dtype == torch.long and x.shape == (7, 5, budget)
    assert int(x.min()) >= 0 and int(x.max()) < context_len
    assert bool((x[..., 1:] > x[..., :-1]).all()), "rows must be strictly increasing (sorted, unique)"
    y = load_selection_trace(p, n_layers=5, context_len=context_len, budget=budget, steps=7)
    assert torch.equal(x, y), "replay must be deterministic"


def test_replay_anchors_sink_and_recent_and_cycles_steps(tmp_path):
    p = save_trace(hand_trace(), tmp_path / "t.npz")
    x = load_selection_trace(p, n_layers=2, context_len=10_000, budget=4, steps=4)
    # trace layer 0 step 0: [0, 10, 20, 99] of 100 -> sink 0 stays, 99 (last key) -> 9999, middle scaled
    assert x[0, 0, 0] == 0 and x[0, 0, -1] == 9_999
    mid = 10_000 - 3 - 2
    assert x[0, 0, 1] == 2 + (10 - 2) * mid // (100 - 3 - 2)
    assert torch.equal(x[3], x[0]), "step 3 replays trace step 0 (3 steps, cycling)"
    # engine layer i -> trace layer floor(i * 2 / n)
    z = load_selection_trace(p, n_layers=4, context_len=10_000, budget=4, steps=1)
    assert torch.equal(z[0, 0], z[0, 1]) and torch.equal(z[0, 2], z[0, 3]) and not torch.equal(z[0, 0], z[0, 2])


def test_scale_row_trims_evenly_and_pads_recent():
    row = np.array([0, 1] + list(range(10, 90, 2)) + [97, 98, 99])
    out = scale_row(row, 100, 100, 10, sink=2, recent=3)
    assert out.size == 10 and {0, 1, 97, 98, 99} <= set(out.tolist())
    small = scale_row(np.array([0, 50, -1, -1]), 100, 1000, 4, sink=2, recent=3)
    assert small.tolist()[-2:] == [998, 999] and small.size == 4


def test_replay_bad_input_one_line(tmp_path):
    p = save_trace(hand_trace(), tmp_path / "t.npz")
    with pytest.raises(ValueError, match="exceeds context_len"):
        load_selection_trace(p, 2, 10, 20, 1)
    with pytest.raises(ValueError, match="does not exist"):
        load_selection_trace(tmp_path / "nope.npz", 2, 100, 4, 1)
    with pytest.raises(ValueError, match="n_layers"):
        load_selection_trace(p, 0, 100, 4, 1)


def test_committed_real_trace_replays():
    traces = sorted((REPO / "labkit" / "data").glob("*.npz"))
    if not traces:
        pytest.skip("no committed selection trace under labkit/data/")
    tr = load_trace(traces[0])
    assert tr.positions.shape[1] == 30 and tr.meta["model"] == "smollm2-135m"
    assert (tr.positions.max(axis=2) < tr.context_len[:, None]).all()
    x = load_selection_trace(traces[0], n_layers=12, context_len=262_144, budget=2048, steps=16)
    assert x.shape == (16, 12, 2048) and bool((x[..., 1:] > x[..., :-1]).all())
