"""PulseInfer on a GPU: real side streams, event queries and overlap (run on the device host:
`python -m pytest -q -m gpu tests/test_gpu_pulse.py`). Skipped without CUDA."""
import pytest
import torch

from labkit.engine.model.hybrid import HybridModel
from labkit.engine.drive.scheduler import Request, Scheduler, Threshold, make_lanes
from labkit.shapes import PRESETS

pytestmark = pytest.mark.gpu
TINY = PRESETS["tiny"]
CFG = dict(capacity=512, budget=32, page_size=16, prefill_chunk=64)
SPEC = [(60, 6), (200, 5), (40, 8), (300, 4), (90, 3), (250, 7), (120, 2)]


def _requests(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Request(torch.randint(0, TINY.vocab, (n,), generator=g).tolist(), m, id=f"r{i}")
            for i, (n, m) in enumerate(spec)]


@pytest.fixture(scope="module")
def model():
    return HybridModel(TINY, "cuda", seed=0)


def test_switching_changes_no_token_on_gpu(model):
    """Same arrivals, same batches: with switching (loads on a side stream, event queries) every token
    equals the run without switching (loads inline): the stream/event ordering is right."""
    runs = {}
    for sw in (True, False):
        sched = Scheduler(make_lanes(TINY, "cuda", 2, 2, model=model, **CFG), Threshold(150), switching=sw)
        runs[sw] = sched.run(_requests(SPEC))
        assert all(r.status == "done" for r in runs[sw]), [r.error for r in runs[sw]]
        if sw:
            assert any(x["mode"] == "switched" for x in sched.rounds)
    assert [r.tokens for r in runs[True]] == [r.tokens for r in runs[False]]


@pytest.mark.parametrize("strategy,select_block,switching", [("zero_copy", 1, True), ("block_dma", 16, True),
                                                              ("block_dma", 16, False)])
def test_scheduler_graphs_change_no_token(model, strategy, select_block, switching):
    """CUDA graphs in the scheduler (whole steps; steps cut at block boundaries and loads when switched,
    host paced; a host strategy's steps cut at its loads, run inline, when not switched) give the eager
    tokens."""
    runs = {}
    for graphs in (True, False):
        sched = Scheduler(make_lanes(TINY, "cuda", 2, 2, model=model, strategy=strategy, select_block=select_block,
                                     **CFG), Threshold(150), switching=switching, graphs=graphs, timeline_every=3)
        runs[graphs] = sched.run(_requests(SPEC))
        assert all(r.status == "done" for r in runs[graphs]), [r.error for r in runs[graphs]]
        assert any(x["mode"] == "switched" for x in sched.rounds) == switching
        assert sum(x["h2d_bytes"] for x in sched.rounds) > 0       # the offload lane's loads were counted
        assert all(t["spans"] for t in sched.timelines)
        assert sched.graph_error is None and sched.graphs == graphs       # no silent fallback to eager
    assert [r.tokens for r in runs[True]] == [r.tokens for r in runs[False]]


def test_switched_tokens_equal_each_alone_on_gpu(model):
    """The issue's contract on the device: each request alone gets the same greedy tokens. (A failure
    here with the test above passing would mean batch-size-dependent GEMM rounding, not switching.)"""
    sched = Scheduler(make_lanes(TINY, "cuda", 2, 2, model=model, **CFG), Threshold(150), switching=True)
    done = sched.run(_requests(SPEC))
    for r, a in zip(done, _requests(SPEC)):
        alone = Scheduler(make_lanes(TINY, "cuda", 2, 2, model=model, **CFG), Threshold(150)).run([a])[0]
        assert r.tokens == alone.tokens, r.id


@pytest.mark.xfail(strict=False, reason="measured on the H200 (results/20261130-100611-pulse-switch-h200): zero-copy "
                   "gathers are SM work, so beside the normal batch they slow it as much as they hide: switched "
                   "15.60 ms vs 15.59 in turn")
def test_side_stream_transfer_overlaps_normal_compute():
    """A transfer-heavy offloaded batch (64K context, budget 2048, 4 requests: 12 MiB of rows per QSA
    layer for the reference shape's rows) beside a normal batch: the timeline shows transfers in flight
    while normal blocks run, completions are found by event queries at block boundaries, and the
    switched round is faster than running the two steps one after the other."""
    from labkit.experiments.pulse_switch.measure import switching_point
    s = PRESETS["qwen3.8-flash-next-standin"]
    r = switching_point(s, "cuda", context=65536, offload_batch=4, normal_batch=4, normal_context=8192,
                        budget=2048, steps=5, warmup=2)
    print({k: v for k, v in r.items() if k != "timeline"})
    assert r["h2d_bytes_per_round"] == 4 * 2048 * s.attn_layers * s.row_bytes
    assert r["overlap_ms"] > 0
    assert r["switches"] > 0
    assert r["switched_ms"] < r["sequential_ms"]
    assert r["switched_ms"] >= 0.9 * r["bound_ms"]       # the bound is a bound (10% timing slack)


@pytest.mark.xfail(strict=False, reason="measured on the H200 (results/20261130-100611-pulse-switch-h200): the DMA "
                   "overlaps (5.8 ms a round) but the host gather of 16 MiB of 2 KiB rows takes 1.35 ms a layer, "
                   "3x the normal blocks between QSA layers: switched 24.8 ms vs 21.2 in turn")
def test_coalesced_transfer_overlaps_normal_compute():
    """The offloaded batch's rows moved by DMA (`coalesced`: threaded gather, chunked copies, issued from
    a background thread) instead of the zero-copy kernel: the copies use the copy engine, not SMs, so the
    normal batch's blocks run while they travel, and the switched round beats the two steps in turn."""
    from labkit.experiments.pulse_switch.measure import switching_point
    s = PRESETS["qwen3.8-flash-next-standin"]
    r = switching_point(s, "cuda", context=65536, offload_batch=4, normal_batch=4, normal_context=8192,
                        budget=2048, strategy="coalesced", steps=5, warmup=2)
    print({k: v for k, v in r.items() if k != "timeline"})
    assert r["h2d_bytes_per_round"] == 4 * 2048 * s.attn_layers * s.row_bytes
    assert r["overlap_ms"] > 0 and r["switches"] > 0
    assert r["switched_ms"] < r["sequential_ms"]


def test_block_transfers_on_gpu():
    """Coalesced block transfers (the copy) reach >= 0.9 x contiguous; per-head 8 KB units are measured;
    every variant delivers the selected bytes."""
    from labkit.experiments.pulse_blocks.measure import block_probe
    s = PRESETS["qwen3.8-flash-next-standin"]
    rows = block_probe(s, "cuda", context=65536, budget=2048, block=16, repeats=10)
    rows4 = block_probe(s, "cuda", context=65536, budget=2048, block=16, repeats=10, requests=4)
    for r in rows + rows4:
        print(r["requests"], r["selection"], r["strategy"], r["unit_bytes"], round(r["gbps"], 2), round(r["ratio_to_contiguous"], 3))
    by = {(r["selection"], r["strategy"]): r for r in rows}
    assert by[("per_head", "per_unit_copy")]["unit_bytes"] == 8192
    assert all(r["correct"] for r in rows + rows4 if r["correct"] is not None)
    # the one copy of coalesced data runs at the link's speed (16 MiB: a 4 MiB copy's ratio varies 0.88-1.05)
    by4 = {(r["selection"], r["strategy"]): r for r in rows4}
    assert ("retrieval_head", "batched_dma") in by4, "cuMemcpyBatchAsync unavailable (needs a CUDA 13 driver)"
    assert by4[("retrieval_head", "coalesced_copy")]["ratio_to_contiguous"] >= 0.9


def test_pingpong_round_changes_no_token_on_gpu(model):
    """Two offloaded batches alternated at their loads (side streams, device-side waits) give the tokens
    of running them one after the other: the streams are ordered right."""
    from labkit.engine import Engine, get_strategy
    from labkit.engine.model.cache import OffloadCache
    from labkit.engine.drive.runner import DecodeState
    from labkit.engine.drive.switching import Loader, pingpong_round, sequential_round
    toks = {}
    for mode in ("pingpong", "sequential"):
        es = []
        for i in range(2):
            c = OffloadCache.allocate(model, "host", 2, 192, page_size=16)
            c.fill_random_([150, 150], seed=5 + i)
            e = Engine(model, c, get_strategy("zero_copy"), 16)
            s = DecodeState(e, 2, None, 16)
            e.strategy.bind(c, 2, s.k)
            es.append((e, s))
        loaders = (Loader(es[0][0]), Loader(es[1][0]))
        seen = []
        for _ in range(3):
            if mode == "pingpong":
                pingpong_round(*es[0], *es[1], loaders)
            else:
                sequential_round(es)
            seen.append([s.tokens.tolist() for _, s in es])
        toks[mode] = seen
    assert toks["pingpong"] == toks["sequential"]


@pytest.mark.parametrize("strategy,select_block", [("zero_copy", 1), ("block_dma", 16)])
def test_scaling_point_on_gpu(tmp_path, strategy, select_block):
    """The scaling bench at a small size on the device: every mode measured, the link probe and bound
    filled in, bytes counted from the loads; a host strategy's steps as graph pieces with its loads between."""
    from labkit.experiments.pulse_scaling.measure import scaling
    rows, spans = scaling(PRESETS["qwen3.8-flash-next-standin"], "cuda", context=65536, requests=(1, 4), steps=3,
                          strategy=strategy, select_block=select_block)
    assert all(r["status"] == "ok" for r in rows), [r.get("error") for r in rows]
    assert all(r["graphs"] for r in rows)
    sw = next(r for r in rows if r["mode"] == "switched")
    assert sw["h2d_bytes_per_step_counted"] == 4 * sw["row_bytes_per_request"]
    assert sw["link_gbps"] > 5 and sw["switched_floor_ms"] > 0 and spans


def test_batched_dma_delivers_runs_on_any_stream():
    """cuMemcpyBatchAsync refuses the legacy default stream (CUresult 1 on the H200 before the fix): a
    copy from it goes through a private stream joined both ways; from a side stream it is queued there.
    Every unit lands where it should, and a capture is refused before the driver sees it."""
    from labkit.engine.transfer.batched_dma import BatchedDMA
    dma = BatchedDMA()
    g = torch.Generator().manual_seed(0)
    src = torch.randint(-2**40, 2**40, (4096, 256), generator=g).pin_memory()      # 2 KiB rows
    blocks = torch.randperm(4096 // 16, generator=g)[:40] * 16
    rows = (blocks[:, None] + torch.arange(16)).flatten()
    for stream in (None, torch.cuda.Stream()):
        dst = torch.zeros(rows.numel(), 256, dtype=torch.int64, device="cuda")
        assert dma.copy_runs(src, rows, dst, stream) == rows.numel() * 2048
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), src[rows])
        order = torch.randperm(rows.numel(), generator=g)
        dst.zero_()
        dma.copy(src, rows, dst, order=order, stream=stream)
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu()[order], src[rows])
    graph, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(s):
        with pytest.raises(RuntimeError, match="captured"), torch.cuda.graph(graph, stream=s):
            dma.copy_runs(src, rows, dst)


def test_block_dma_switched_tokens_equal_each_alone_on_gpu(model):
    """block_dma (loads from a background thread, one batched DMA call) with block selection under
    switching: each request gets the tokens it gets alone."""
    cfg = dict(CFG, select_block=16)
    sched = Scheduler(make_lanes(TINY, "cuda", 2, 2, model=model, strategy="block_dma", **cfg), Threshold(150),
                      switching=True)
    done = sched.run(_requests(SPEC))
    assert all(r.status == "done" for r in done), [r.error for r in done]
    assert any(x["mode"] == "switched" for x in sched.rounds)
    for r, a in zip(done, _requests(SPEC)):
        alone = Scheduler(make_lanes(TINY, "cuda", 2, 2, model=model, strategy="block_dma", **cfg),
                          Threshold(150)).run([a])[0]
        assert r.tokens == alone.tokens, r.id


@pytest.mark.xfail(strict=False, reason="measured on the H200 (results/20261130-123044-pulse-switch-h200): with the "
                   "prefer-overlap hint the batched DMA moved 32 KiB blocks at ~21 GB/s inside the switched round (0.78 ms "
                   "a layer, not 0.37), 8 of 12 loads stalled: switched 22.07 ms vs 21.39 in turn (this test passed "
                   "once, with 5 steps)")
def test_block_dma_transfer_overlaps_normal_compute():
    """The prediction for block-granular DMA (shared probe: 44.9 GB/s for 32 KiB blocks): 16 MiB per QSA
    layer for 4 requests at 64K in ~0.37 ms, below the ~0.45 ms of normal blocks between two QSA layers,
    so the switched round beats the two steps in turn."""
    from labkit.experiments.pulse_switch.measure import switching_point
    s = PRESETS["qwen3.8-flash-next-standin"]
    r = switching_point(s, "cuda", context=65536, offload_batch=4, normal_batch=4, normal_context=8192,
                        budget=2048, strategy="block_dma", steps=5, warmup=2, select_block=16)
    print({k: v for k, v in r.items() if k != "timeline"})
    assert r["h2d_bytes_per_round"] == 4 * 2048 * s.attn_layers * s.row_bytes
    assert r["overlap_ms"] > 0 and r["switches"] > 0
    assert r["switched_ms"] < r["sequential_ms"]


@pytest.mark.parametrize("strategy,select_block", [("zero_copy", 1), ("block_dma", 16)])
def test_calibrate_times_the_steps_the_scheduler_runs(model, strategy, select_block):
    """`calibrate(graphs=True)` times replays of the captured step (a host strategy's loads inline), as a
    scheduler with graphs runs it: cheaper than the eager, launch-bound step it timed before (which made
    every transfer look hidden and the adaptive policy offload like a low threshold), and the lanes are
    empty again afterwards (a scheduler starts from them)."""
    from labkit.engine.drive.scheduler import calibrate
    lanes = make_lanes(TINY, "cuda", 2, 2, model=model, strategy=strategy, select_block=select_block, **CFG)
    eager, graphed = calibrate(lanes), calibrate(lanes, graphs=True)
    print(f"{strategy}: eager {eager}, graphed {graphed}")
    assert 0 < graphed.compute(1) < 0.8 * eager.compute(1)
    assert all(e.cache.pages.n_free == e.cache.pages.n_pages for e in lanes.values())
    sched = Scheduler(lanes, Threshold(150), graphs=True)
    done = sched.run(_requests(SPEC[:3]))
    assert all(r.status == "done" for r in done), [r.error for r in done]


def test_per_head_units_by_dma_change_no_token_and_count_their_copies_on_gpu(model):
    """block_dma with per-head units (dma_unit_rows=4 of a 16-row block: pulse_ladder's per_head rung), every
    request offloaded, gives the tokens of whole-block DMA and of resident KV; its rounds count 4x the copies
    of whole blocks (a partly filled last block moves as two runs in both) for the same bytes."""
    cfg = dict(CFG, select_block=16)
    out, copies, moved = {}, {}, {}
    for name, lanes in (("units", dict(offload_slots=4, strategy="block_dma", settings={"dma_unit_rows": 4})),
                        ("blocks", dict(offload_slots=4, strategy="block_dma")),
                        ("resident", dict(offload_slots=0))):
        res = 0 if name != "resident" else 4
        sched = Scheduler(make_lanes(TINY, "cuda", res, model=model, **lanes, **cfg),
                          Threshold(0 if name != "resident" else 10**9), switching=False)
        out[name] = [r.tokens for r in sched.run(_requests(SPEC[:4]))]
        copies[name] = sum(r["copies"] for r in sched.rounds)
        moved[name] = sum(r["h2d_bytes"] for r in sched.rounds)
    assert out["units"] == out["blocks"] == out["resident"]
    assert moved["units"] == moved["blocks"] > 0 and copies["units"] > 2 * copies["blocks"] > 0


@pytest.mark.parametrize("graphs", [False, True])
def test_handed_over_requests_decode_alone_and_alike_in_either_pool_on_gpu(model, graphs):
    """A decode instance on the GPU: requests handed over with their KV (placed in the device pool or in the
    pinned host pool, with the clock stopped) run no prefill forward and decode the same tokens whether
    resident, offloaded by block DMA, or switched between the two; the handover's seconds are counted apart."""
    cfg = dict(CFG, select_block=16)
    out = {}
    for name, res, off, pol in (("resident", 4, 0, Threshold(10**9)), ("offload", 0, 4, Threshold(0)),
                                ("switched", 2, 2, Threshold(150))):
        sched = Scheduler(make_lanes(TINY, "cuda", res, off, model=model, strategy="block_dma", **cfg), pol,
                          graphs=graphs)
        reqs = _requests(SPEC[:5])
        for r in reqs:
            r.prefilled = True
        done = sched.run(reqs)
        assert all(r.status == "done" for r in done), [r.error for r in done]
        assert sched.prefill_forwards == 0 and sched.handovers == 5 and sched.handover_s > 0
        assert all(r.record()["ttft_s"] is None for r in done)
        out[name] = [r.tokens for r in done]
    assert out["resident"] == out["offload"] == out["switched"]
