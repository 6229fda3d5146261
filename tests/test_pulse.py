"""PulseInfer on CPU: the request-level scheduler (continuous batching, chunked prefill, slots freed and
reused), two-batch switching at layer boundaries, and their correctness contract: every request's
greedy tokens equal those it gets alone with the same strategy; no request waits past the stated bound.
(GPU: tests/test_gpu_pulse.py, real side streams and event queries.)"""
import math

import pytest
import torch

from labkit.params import BadInput
from labkit.engine import Engine
from labkit.engine.model.forward import BlockDone, LoadRequest
from labkit.engine.model.kv import PageTable
from labkit.engine.drive.runner import DecodeState
from labkit.engine.drive.scheduler import AllTo, Request, Scheduler, Threshold, make_lanes, parse_policy
from labkit.engine.drive.switching import Loader, Pending, Timeline, switched_round
from labkit.serving.latency import summarize
from labkit.shapes import PRESETS

TINY = PRESETS["tiny"]
CFG = dict(capacity=256, budget=16, page_size=16, prefill_chunk=32)


@pytest.fixture(autouse=True)
def one_thread():
    # tiny matmuls on a shared 2-core machine: one thread is ~10x faster than two fighting for cores
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def lanes_factory():
    from labkit.engine.model.hybrid import HybridModel
    model = HybridModel(TINY, "cpu", seed=0)

    def make(resident=2, offload=2, strategy="zero_copy", **kw):
        return make_lanes(TINY, "cpu", resident, offload, strategy=strategy, model=model, **{**CFG, **kw})
    return make


def _requests(spec, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Request(torch.randint(0, TINY.vocab, (n,), generator=g).tolist(), m, id=f"r{i}")
            for i, (n, m) in enumerate(spec)]


SPEC = [(40, 6), (90, 4), (30, 8), (120, 5), (50, 3), (70, 1), (100, 7)]


def test_page_table_release_and_move():
    pt = PageTable(n_pages=8, page_size=4, n_slots=3, max_pages_per_slot=4, device=torch.device("cpu"))
    pt.reserve(0, 8)
    pt.reserve(1, 12)
    assert pt.n_free == 3
    assert pt.release(0) == 2 and pt.n_free == 5
    assert pt.table[0].tolist() == [0, 0, 0, 0] and pt.pages[0] == []
    pt.reserve(2, 16)                       # reuses the released pages, lowest first
    assert pt.pages[2] == [0, 1, 5, 6]
    pt.move(1, 0)
    assert pt.pages[1] == [] and pt.pages[0] == [2, 3, 4]
    assert pt.rows(torch.tensor([0]), torch.tensor([[0, 5, 9]])).tolist() == [[8, 13, 17]]
    with pytest.raises(ValueError, match="still holds"):
        pt.move(2, 0)
    with pytest.raises(MemoryError):
        pt.reserve(1, 16)


@pytest.mark.parametrize("switching", [True, False])
def test_batched_tokens_equal_each_alone(lanes_factory, switching):
    """Mixed prefill/decode, slots freed and reused, two lanes (with and without switching): each
    request's tokens equal those it gets run alone in the same lane."""
    sched = Scheduler(lanes_factory(), Threshold(80), switching=switching)
    done = sched.run(_requests(SPEC))
    assert [r.status for r in done] == ["done"] * len(SPEC)
    assert {r.lane for r in done} == {"resident", "offload"}
    assert max(r.start_iter for r in done) > min(r.end_iter for r in done)     # slots were reused
    modes = {x["mode"] for x in sched.rounds}
    assert ("switched" in modes) == switching
    for r, alone_req in zip(done, _requests(SPEC)):
        alone = Scheduler(lanes_factory(), Threshold(80)).run([alone_req])[0]
        assert len(r.tokens) == r.max_tokens
        assert r.tokens == alone.tokens, r.id


def test_block_dma_lanes_switched_tokens_equal_each_alone(lanes_factory):
    """block_dma with block selection (the offload lane's loads are one run per block) under switching:
    tokens as each request alone, and the selection is coarser than per token (other tokens than
    select_block=1 for at least one request, or the option would be a no-op)."""
    sched = Scheduler(lanes_factory(strategy="block_dma", select_block=4), Threshold(80), switching=True)
    done = sched.run(_requests(SPEC))
    assert [r.status for r in done] == ["done"] * len(SPEC)
    assert any(x["mode"] == "switched" for x in sched.rounds)
    for r, alone_req in zip(done, _requests(SPEC)):
        alone = Scheduler(lanes_factory(strategy="block_dma", select_block=4), Threshold(80)).run([alone_req])[0]
        assert r.tokens == alone.tokens, r.id
    per_token = Scheduler(lanes_factory(), Threshold(80)).run(_requests(SPEC))
    assert [r.tokens for r in done] != [r.tokens for r in per_token]


def test_switching_on_cpu_is_not_a_no_op(lanes_factory):
    """A different model seed must change tokens (the equality above can fail)."""
    from labkit.engine.model.hybrid import HybridModel
    other = make_lanes(TINY, "cpu", 2, 2, model=HybridModel(TINY, "cpu", seed=1), **CFG)
    a = Scheduler(lanes_factory(), Threshold(80)).run(_requests(SPEC[:2]))
    b = Scheduler(other, Threshold(80)).run(_requests(SPEC[:2]))
    assert [r.tokens for r in a] != [r.tokens for r in b]


def test_starvation_bound(lanes_factory):
    """FCFS with one slot per lane: the stated bounds on wait and on completion hold for every request."""
    spec = [(40, 9), (120, 3), (30, 8), (60, 2), (100, 6), (35, 5)]
    sched = Scheduler(lanes_factory(resident=1, offload=1), Threshold(80))
    done = sched.run(_requests(spec))
    chunk = CFG["prefill_chunk"]
    work = [math.ceil(len(r.prompt) / chunk) + r.max_tokens for r in done]
    for i, r in enumerate(done):
        assert r.start_iter - r.queued_iter <= sum(work[:i]), r.id
        assert r.end_iter - r.start_iter <= work[i] - 1, r.id
    assert [r.start_iter for r in done] == sorted(r.start_iter for r in done)      # nobody overtaken


class Countdown(Loader):
    """Synchronous loads whose completion check says 'done' only at the `after`-th query: the
    scheduling order of a slow transfer, without a GPU."""

    def __init__(self, engine, after):
        super().__init__(engine)
        self.after = after

    def issue(self, req, timeline=None):
        p = super().issue(req, timeline)
        after = self.after

        class Slow(Pending):
            def done(self):
                self.checks += 1
                return self.checks >= after
        return Slow(p.req, p.result, None, p.start, p.end)


def _two_batches(lanes_factory, lens=(60, 90)):
    lanes = lanes_factory(resident=1, offload=1)
    toks = _requests([(n, 4) for n in lens])
    states = []
    for e, r in zip((lanes["resident"], lanes["offload"]), toks):
        e.prefill(0, torch.tensor(r.prompt))
        st = DecodeState(e, 1, None, 16)
        e.strategy.bind(e.cache, 1, st.k)
        states.append((e, st))
    return states


@pytest.mark.parametrize("after", [1, 2, 3, 100])
def test_switch_order_follows_completion(lanes_factory, after):
    """The offloaded batch resumes at the first block boundary where its transfer reports done; with
    nothing left of the normal batch, remaining transfers are joined (stalls)."""
    (ne, ns), (oe, os_) = _two_batches(lanes_factory)
    with torch.inference_mode():
        st = switched_round(ne, ns, oe, os_, Countdown(oe, after))
    qsa = TINY.attn_layer_ids
    n_blocks = TINY.layers
    # the expected order, simulated: o runs to its first load; every `after` normal blocks it resumes
    exp, loads, left, blocks = [("o", 0)], 1, after, 0
    while blocks < n_blocks:
        exp.append(("n", blocks)); blocks += 1
        if loads <= len(qsa):
            left -= 1
            if left == 0:
                exp.append(("o", loads if loads < len(qsa) else -1)); loads += 1; left = after
    while loads <= len(qsa):
        exp.append(("o", loads if loads < len(qsa) else -1)); loads += 1
    assert st.order == exp
    assert st.switches + st.stalls == len(qsa)
    assert len(st.loads_offloaded) == len(qsa) and len(st.loads_normal) == len(qsa)


def test_switched_round_equals_plain_steps(lanes_factory):
    (ne, ns), (oe, os_) = _two_batches(lanes_factory)
    with torch.inference_mode():
        tl = Timeline(cuda=False)
        switched_round(ne, ns, oe, os_, Countdown(oe, 2), tl)
        got = (ns.logits.clone(), os_.logits.clone())
    (ne, ns), (oe, os_) = _two_batches(lanes_factory)
    with torch.inference_mode():
        for e, s in ((ne, ns), (oe, os_)):
            for req in e.decode_segments(s):
                e.strategy.load(e.cache.pool, req.layer, req.rows, req.out)
    assert torch.equal(got[0], ns.logits) and torch.equal(got[1], os_.logits)
    spans = tl.spans()
    kinds = {(s["batch"], s["kind"]) for s in spans}
    assert {("normal", "compute"), ("offloaded", "compute"), ("offloaded", "transfer")} <= kinds
    assert all(s["end_ms"] >= s["start_ms"] >= 0 for s in spans)
    assert sum(s["kind"] == "compute" and s["batch"] == "normal" for s in spans) == TINY.layers


def test_block_boundaries_are_optional(lanes_factory):
    (ne, ns), _ = _two_batches(lanes_factory)
    with torch.inference_mode():
        plain = list(ne.decode_segments(ns))
        marked = list(ne.decode_segments(ns, boundaries=True))
    assert all(isinstance(x, LoadRequest) for x in plain)
    assert [x.block for x in marked if isinstance(x, BlockDone)] == list(range(TINY.layers))
    assert sum(isinstance(x, LoadRequest) for x in marked) == len(plain)


def test_prefill_chunks_equal_prefill(lanes_factory):
    lanes = lanes_factory(resident=2, offload=0)
    e = lanes["resident"]
    toks = torch.tensor(_requests([(100, 1)])[0].prompt)
    whole = e.prefill(0, toks)
    gen = e.prefill_chunks(1, toks)
    spans = []
    with torch.inference_mode():
        while True:
            try:
                spans.append(next(gen))
            except StopIteration as s:
                parts = s.value
                break
    assert spans == [(0, 32), (32, 64), (64, 96)]
    assert torch.equal(whole, parts)
    assert int(e.cache.lens[1]) == 100


def test_records_give_vllm_metrics(lanes_factory):
    sched = Scheduler(lanes_factory(), Threshold(80), timeline_every=2)
    done = sched.run(_requests(SPEC))
    recs = [r.record() for r in done]
    s = summarize(recs, slo_tpot_ms=1e6)
    assert s["completed"] == len(SPEC) and s["failed"] == 0
    assert s["total_output_tokens"] == sum(m for _, m in SPEC)
    assert s["ttft_ms_p50"] > 0 and s["tpot_ms_p99"] >= s["tpot_ms_p50"] > 0 and s["itl_ms_p90"] > 0
    assert s["good_requests"] == len(SPEC)
    for r in recs:
        assert len(r["token_times"]) == r["output_len"] and r["token_times"] == sorted(r["token_times"])
    assert sched.timelines and all(t["spans"] for t in sched.timelines)


def test_bad_requests_are_one_line_and_a_failure_mid_run_is_recorded(lanes_factory):
    sched = Scheduler(lanes_factory(), Threshold(80))
    with pytest.raises(BadInput, match="exceed"):
        sched.submit(Request(list(range(250)), 10, id="long"))
    with pytest.raises(BadInput, match="max_tokens"):
        sched.submit(Request([1, 2], 0))
    with pytest.raises(BadInput, match="empty prompt"):
        sched.submit(Request([], 3))
    with pytest.raises(BadInput, match="token ids"):
        sched.submit(Request([TINY.vocab], 3))
    with pytest.raises(BadInput, match="policy"):
        parse_policy("threshold:x")
    assert isinstance(parse_policy("offload"), AllTo) and parse_policy("threshold:9").tokens == 9

    lanes = lanes_factory()
    real = lanes["offload"].strategy.load
    calls = {"n": 0}

    def flaky(pool, layer, rows, out):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("transfer failed")
        return real(pool, layer, rows, out)
    lanes["offload"].strategy.load = flaky
    done = Scheduler(lanes, Threshold(80)).run(_requests(SPEC))
    failed = [r for r in done if r.status == "failed"]
    assert failed and all("transfer failed" in r.error for r in failed)
    assert any(r.lane == "offload" for r in failed)
    ok = [r for r in done if r.status == "done"]
    assert len(ok) + len(failed) == len(SPEC)
    # it went on: requests started after the failed round completed, in the offload lane too
    at = max(r.end_iter for r in failed)
    assert any(r.lane == "offload" and r.start_iter > at for r in ok)


def test_switching_bench_point_on_cpu():
    from labkit.experiments.pulse_switch.measure import overlap_ms, switching_point
    r = switching_point(TINY, "cpu", context=200, offload_batch=2, normal_batch=2, normal_context=100, budget=16,
                        steps=2, warmup=1)
    for k in ("normal_only_ms", "offload_only_ms", "offload_compute_ms", "sequential_ms", "switched_ms", "bound_ms"):
        assert r[k] > 0, k
    assert r["switches"] + r["stalls"] == TINY.attn_layers
    assert r["h2d_bytes_per_round"] == 2 * 16 * TINY.attn_layers * TINY.row_bytes
    assert {s["kind"] for s in r["timeline"]} >= {"compute", "transfer"}
    assert overlap_ms([{"kind": "transfer", "batch": "offloaded", "start_ms": 0, "end_ms": 2},
                       {"kind": "compute", "batch": "normal", "start_ms": 1, "end_ms": 5}]) == 1


def test_adaptive_placement_and_calibration(lanes_factory):
    from labkit.engine.drive.scheduler import Adaptive, Costs, calibrate
    lanes = lanes_factory(resident=2, offload=2, capacity=256)
    costs = calibrate(lanes)
    assert costs.step_ms >= 0 and costs.per_req_ms >= 0 and costs.xfer_ms >= 0 and costs.xfer_fixed_ms >= 0
    assert costs.transfer(0) == 0 and costs.transfer(3) == costs.xfer_fixed_ms + 3 * costs.xfer_ms
    for e in lanes.values():                              # calibration left the lanes empty
        assert e.cache.pages.n_free == e.cache.pages.n_pages and int(e.cache.lens.sum()) == 0
    sched = Scheduler(lanes_factory(resident=4, resident_pool_tokens=512),
                      Adaptive(Costs(step_ms=1.0, per_req_ms=0.1, xfer_ms=0.5)))
    short, long_ = Request([1] * 20, 4), Request([1] * 200, 8)
    assert sched.policy.place(short, sched) == "resident"     # no normal batch to hide a transfer behind
    assert sched.policy.place(long_, sched) == "offload"      # 13 pages > its share (32 free / 4 slots)
    sched.lanes["resident"].running = [Request([1], 1)]       # a normal batch of one: 1.1 ms of compute
    assert sched.policy.place(short, sched) == "offload"      # 0.5 ms of transfer hides behind it
    sched.policy = Adaptive(Costs(step_ms=1.0, per_req_ms=0.1, xfer_ms=5.0))
    assert sched.policy.place(short, sched) == "resident"     # 5 ms would not hide
    sched.policy = Adaptive(Costs(step_ms=1.0, per_req_ms=0.1, xfer_ms=0.5, xfer_fixed_ms=0.7))
    assert sched.policy.place(short, sched) == "resident"     # 0.7 + 0.5 > 1.1: the fixed cost counts
    # a full resident lane: overflow to the offload lane only where the transfer hides, else wait
    full = Scheduler(lanes_factory(resident=2, offload=2), Adaptive(Costs(step_ms=1.0, per_req_ms=0.1, xfer_ms=5.0)))
    full.lanes["resident"].running = [Request([1], 1), Request([1], 1)]
    tiny = Request([1] * 4, 2)                                # below the budget: never offloaded for itself
    assert not full.lanes["resident"].fits(tiny) and full.lanes["offload"].fits(tiny)
    assert full.policy.place(tiny, full) == "resident"        # 5 ms cannot hide behind 1.2: it waits
    full.policy = Adaptive(Costs(step_ms=1.0, per_req_ms=0.1, xfer_ms=0.5))
    assert full.policy.place(tiny, full) == "offload"         # 0.5 ms hides: it overflows
    # and it runs: the adaptive policy through a whole run, tokens as alone
    sched = Scheduler(lanes_factory(), Adaptive(costs))
    done = sched.run(_requests(SPEC))
    assert all(r.status == "done" for r in done)


def test_block_probe_on_cpu():
    from labkit.experiments.pulse_blocks.measure import block_probe
    rows = block_probe(TINY, "cpu", context=1024, budget=128, block=16, repeats=2, chunk_bytes=4096, threads=3)
    by = {(r["selection"], r["strategy"]): r for r in rows}
    assert len(by) == 16 and all(r["status"] == "ok" for r in rows)
    for sel in ("per_head", "retrieval_head"):        # the pipelined paths put every unit where it belongs
        assert by[(sel, "coalesced_pipelined")]["correct"] and by[(sel, "coalesced_pipelined_threads")]["correct"]
        assert by[(sel, "gather_only")]["correct"]
    multi = block_probe(TINY, "cpu", context=1024, budget=128, block=16, repeats=1, requests=3)
    assert {r["bytes"] for r in multi} == {3 * 128 * TINY.row_bytes} and all(r["correct"] is not False for r in multi)
    assert "per_unit_copy" not in {r["strategy"] for r in multi}
    ph, rh = by[("per_head", "zero_copy")], by[("retrieval_head", "zero_copy")]
    assert ph["unit_bytes"] == 16 * TINY.head_dim * 2 and rh["unit_bytes"] == 16 * TINY.row_bytes
    assert ph["bytes"] == rh["bytes"] == 128 * TINY.row_bytes                   # same bytes, other granularity
    assert ph["units"] == 128 // 16 * TINY.n_kv_heads * 2 and rh["units"] == 128 // 16
    assert all(r["correct"] for r in rows if r["correct"] is not None)
    with pytest.raises(ValueError, match="multiples"):
        block_probe(TINY, "cpu", context=1000, budget=128, block=16)
