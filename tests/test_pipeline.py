"""Layers split across devices give the same outputs as one device (CPU "devices" here; N=1 on the GPU
host in test_gpu.py; N>1 GPUs need a multi-GPU machine)."""
import pytest
import torch

from labkit.engine import Engine, HybridModel, OffloadCache, get_strategy
from labkit.engine.drive.pipeline import PipelineEngine, measure_block_costs, model_block_costs, place_layers, split_model
from labkit.shapes import PRESETS
from labkit.engine.drive.runner import DecodeRunner

TINY = PRESETS["tiny"]


def test_place_layers_balances_cost_not_count():
    costs = [1, 1, 1, 1, 1, 1, 10, 1]
    r = place_layers(costs, 2)
    assert r == [(0, 6), (6, 8)]                      # 6 cheap blocks vs the expensive one + 1
    assert place_layers([1] * 9, 3) == [(0, 3), (3, 6), (6, 9)]
    for n in (1, 2, 3, 4):
        rr = place_layers(costs, n)
        assert rr[0][0] == 0 and rr[-1][1] == len(costs) and all(a < b for a, b in rr)
        assert all(rr[i][1] == rr[i + 1][0] for i in range(n - 1))
    with pytest.raises(ValueError):
        place_layers(costs, 9)


@pytest.mark.parametrize("n_dev", [2, 3])
@pytest.mark.parametrize("strategy", ["zero_copy", "resident"])
def test_split_model_matches_single_device(n_dev, strategy):
    toks = [torch.randint(0, TINY.vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in (90, 150)]
    ref_model = HybridModel(TINY, "cpu", seed=7)
    st = get_strategy(strategy)
    e = Engine(ref_model, OffloadCache.allocate(ref_model, st.medium, 2, 256, 16), st, 32)
    ref_pre = [e.prefill(s, t) for s, t in enumerate(toks)]
    r = DecodeRunner(e, 2)
    ref = []
    for _ in range(3):
        r.step()
        ref.append(r.state.logits.clone())

    model = HybridModel(TINY, "cpu", seed=7)
    ranges = place_layers(model_block_costs(model, 32), n_dev)
    stages = split_model(model, ranges, ["cpu"] * n_dev)
    assert sum(s.n_attn for s in stages) == TINY.attn_layers
    pipe = PipelineEngine(stages, strategy, 32, n_slots=2, capacity=256, page_size=16)
    pre = [pipe.prefill(s, t) for s, t in enumerate(toks)]
    for a, b in zip(pre, ref_pre):
        assert torch.equal(a, b)
    pr = pipe.decoder(2)
    for want in ref:
        pr.step()
        assert torch.equal(pr.state.logits, want)
    assert pr.h2d_bytes_per_step == r.h2d_bytes_per_step


def test_measured_block_costs_cover_every_block():
    model = HybridModel(TINY, "cpu", seed=0)
    cache = OffloadCache.allocate(model, "host", 1, 256, 16)
    cache.fill_random_([200], seed=0)
    costs = measure_block_costs(Engine(model, cache, get_strategy("host_gather"), 32), steps=3)
    assert len(costs) == TINY.layers and all(c > 0 for c in costs)
    assert place_layers(costs, 2)[-1][1] == TINY.layers


def test_micro_batch_ranges_cover_the_batch():
    from labkit.engine.drive.pipeline import micro_batch_ranges
    assert micro_batch_ranges(5, 2) == [(0, 3), (3, 2)]
    assert micro_batch_ranges(2, 4) == [(0, 1), (1, 1)]          # never more micro-batches than requests
    assert micro_batch_ranges(4, 1) == [(0, 4)]
    with pytest.raises(ValueError):
        micro_batch_ranges(0, 1)


@pytest.mark.parametrize("strategy", ["zero_copy", "resident"])
def test_micro_batches_give_each_request_its_own_decode(strategy):
    """Three requests of different lengths as two micro-batches over two stages: every request's logits,
    step after step, equal a one-device run of the whole batch (token for token), and the bytes moved
    per step are the same."""
    toks = [torch.randint(0, TINY.vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in (90, 150, 60)]
    st = get_strategy(strategy)
    ref_model = HybridModel(TINY, "cpu", seed=3)
    e = Engine(ref_model, OffloadCache.allocate(ref_model, st.medium, 3, 256, 16), st, 32)
    for s, t in enumerate(toks):
        e.prefill(s, t)
    r = DecodeRunner(e, 3)
    model = HybridModel(TINY, "cpu", seed=3)
    stages = split_model(model, place_layers(model_block_costs(model, 32), 2), ["cpu", "cpu"])
    pipe = PipelineEngine(stages, strategy, 32, n_slots=3, capacity=256, page_size=16)
    for s, t in enumerate(toks):
        pipe.prefill(s, t)
    pr = pipe.decoder(3, micro_batches=2)
    assert [len(row) for row in pr.grid] == [2, 2] and [row[0].state.batch for row in pr.grid] == [2, 1]
    for row in pr.grid:            # the same first tokens (a runner draws them per batch size)
        row[0].state.tokens.copy_(r.state.tokens[row[0].state.span])
    for _ in range(4):
        r.step()
        pr.step()
        got = pr.logits()
        assert torch.equal(got.argmax(-1), r.state.logits.argmax(-1))
        assert torch.equal(got, r.state.logits)
    assert pr.h2d_bytes_per_step == r.h2d_bytes_per_step
    assert sum(pr.stage_h2d_bytes_per_step()) == pr.h2d_bytes_per_step
    # the stages' caches advanced each micro-batch's slots once per step, like the one-device run
    for eng in pipe.engines:
        assert torch.equal(eng.cache.lens[:3].cpu(), e.cache.lens[:3].cpu())


def test_timeline_of_stages_taking_turns_never_overlaps():
    """On a CPU the stages run one after another: the timeline's spans (micro-batch x stage x step) must
    not overlap, and come in chain order."""
    model = HybridModel(TINY, "cpu", seed=1)
    stages = split_model(model, place_layers(model_block_costs(model, 32), 2), ["cpu", "cpu"])
    pipe = PipelineEngine(stages, "zero_copy", 32, n_slots=2, capacity=512, page_size=16)
    pipe.fill_random_([300, 200])
    pr = pipe.decoder(2, micro_batches=2)
    pr.prepare(1)
    spans = pr.timeline(steps=3)
    assert len(spans) == 3 * 2 * 2 and all(s["end_ms"] >= s["start_ms"] for s in spans)
    order = sorted(spans, key=lambda s: s["start_ms"])
    assert [(s["step"], s["micro_batch"], s["stage"]) for s in order] == \
        [(t, m, k) for t in range(3) for m in range(2) for k in range(2)]
    assert all(b["start_ms"] >= a["end_ms"] for a, b in zip(order, order[1:]))


def test_bubbles_of_a_known_timeline():
    """Two stages, two micro-batches of 1 ms each per stage, perfectly pipelined: in steady state each
    step ends 2 ms after the previous one and both stages are busy the whole cycle; stages taking turns
    (one micro-batch) leave each idle half the cycle."""
    from labkit.engine.drive.pipeline import bubbles
    piped = [dict(step=t, micro_batch=m, stage=k, start_ms=2 * t + m + k, end_ms=2 * t + m + k + 1)
             for t in range(4) for m in range(2) for k in range(2)]
    b = bubbles(piped)
    assert b["cycle_ms"] == 2 and b["busy_ms_stage0"] == 2 and b["busy_ms_stage1"] == 2 and b["bubble_share"] == 0
    turns = [dict(step=t, micro_batch=0, stage=k, start_ms=2 * t + k, end_ms=2 * t + k + 1) for t in range(4) for k in range(2)]
    b = bubbles(turns)
    assert b["cycle_ms"] == 2 and b["bubble_ms_stage0"] == 1 and b["bubble_share"] == 0.5
