"""Several requests' chunks in one forward (`Engine.prefill_batch`) on a CPU: three prompts of different lengths
under a token budget (one spans two forwards, one ends mid-budget with the next request's tokens behind it) leave
the last-token logits and the cache (K/V rows in the pool, index keys, DeltaNet state and conv window) that
one-request prefill of each leaves, to within what one-request prefill itself moves when only its chunk size
changes (measured here, each run); rotating buffers and a resident pool leave the sync path's bytes; bad input is
one ValueError before anything is reserved."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from labkit.engine import Engine, HybridModel, OffloadCache, get_strategy
from labkit.engine.model.prefill_batch import BatchedPrefill, PrefillRequest, Segment
from labkit.shapes import PRESETS

LENS = [150, 40, 90]
BUDGET = 100
CAPACITY, PAGE = 160, 16
# the forwards first come, first served under the budget: request 0 spans two, request 1 ends mid-budget with
# request 2's first tokens behind it in the same forward
FORWARDS = [[Segment(0, 0, 100)], [Segment(0, 100, 150), Segment(1, 0, 40), Segment(2, 0, 10)], [Segment(2, 10, 90)]]
# chunk sizes of one-request prefill whose spread around 64 is the tolerance (the budget among them: one request
# alone under it is prefilled in chunks of that size)
CHUNKS = [32, 48, 64, 96, BUDGET]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Toy tensors: a second thread is overhead, and beside another busy worker it stalls at every barrier."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def model(request):
    return HybridModel(PRESETS[request.param], "cpu", seed=0)


@pytest.fixture(scope="module")
def tiny():
    return HybridModel(PRESETS["tiny"], "cpu", seed=0)


def _prompts(vocab):
    return [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(10 + i)) for i, n in enumerate(LENS)]


def _engine(model, strategy="zero_copy", mode="sync", chunk=64):
    st = get_strategy(strategy)
    cache = OffloadCache.allocate(model, st.medium, len(LENS), CAPACITY, page_size=PAGE)
    return Engine(model, cache, st, 16, prefill_chunk=chunk, prefill_mode=mode), cache


@torch.inference_mode()
def _one_by_one(model, chunk):
    e, cache = _engine(model, chunk=chunk)
    return [e.prefill(slot, t) for slot, t in enumerate(_prompts(model.shape.vocab))], cache


@torch.inference_mode()
def _batched(model, strategy="zero_copy", mode="sync"):
    e, cache = _engine(model, strategy, mode)
    gen = e.prefill_batch([PrefillRequest(s, t) for s, t in enumerate(_prompts(model.shape.vocab))], BUDGET)
    forwards = []
    while True:
        try:
            forwards.append(next(gen))
        except StopIteration as done:
            return done.value, cache, forwards


def _state(logits, cache) -> dict[str, list[torch.Tensor]]:
    """What a prefill leaves, per request, as fp32: logits, K/V rows of every QSA layer, index keys dequantised,
    DeltaNet state and conv window."""
    out = {k: [] for k in ("logits", "kv", "index_keys", "dn_state", "dn_conv")}
    for slot, n in enumerate(LENS):
        kv = torch.empty((cache.pool.attn_layers, n, cache.row_words()), dtype=torch.int64)
        for layer in range(cache.pool.attn_layers):
            cache.read_prefix(layer, slot, n, kv[layer])
        out["logits"].append(logits[slot].float())
        out["kv"].append(kv.view(torch.bfloat16).float())
        keys = cache.index.keys[:, slot, :n].float() * cache.index.scales[:, slot, :n, None].float()
        out["index_keys"].append(keys)
        out["dn_state"].append(cache.dn_state[:, slot].float())
        out["dn_conv"].append(cache.dn_conv[:, slot].float())
    return out


def _diff(a: dict, b: dict) -> dict[str, float]:
    return {k: max((x - y).abs().max().item() for x, y in zip(a[k], b[k])) for k in a}


@pytest.fixture(scope="module")
def one_request(model):
    """One-request prefill of each prompt at each chunk size of CHUNKS: what each leaves."""
    return {c: _state(*_one_by_one(model, c)) for c in CHUNKS}


def test_batched_prefill_leaves_what_one_request_prefill_leaves(model, one_request):
    """Same logits and cache contents as one-request prefill at 64-token chunks, within the largest difference
    one-request prefill shows between 64 and the other chunk sizes (bf16 products round differently with their
    row count, and random weights carry that through the layers: up to a tenth of a K/V value's range here). That
    tolerance is far below what a request's own prompt makes (another request's logits), so attention or state
    crossing requests would fail."""
    ref = one_request[64]
    tol = {k: max(_diff(one_request[c], ref)[k] for c in CHUNKS) for k in ref}
    logits, cache, forwards = _batched(model)
    assert forwards == FORWARDS[:-1]          # the generator yields after every forward but the last
    got = _state(logits, cache)
    diff = _diff(got, ref)
    for k in ref:
        assert diff[k] <= tol[k], (k, diff[k], tol[k])
    apart = min((ref["logits"][i] - ref["logits"][j]).abs().max().item() for i in range(3) for j in range(i))
    assert apart > 10 * max(tol["logits"], 1e-3), (apart, tol["logits"])
    assert cache.lens.tolist() == LENS


@torch.inference_mode()
def test_batched_prefill_equals_one_request_prefill_over_the_same_chunks(model):
    """Token for token: one-request prefill cut where the batch cut each request (request 0 at 100, request 1
    whole, request 2 at 10 then the rest, through a cached prefix) leaves bit for bit what the batch leaves. The
    batch changes only which rows share a product, and this CPU computes each row of these products alone; so
    any slip in what is per request (a conv window or state not carried between a request's forwards, a row
    attending past its own prefix) shows here even where it hides inside the tolerance above."""
    prompts = _prompts(model.shape.vocab)
    e100, cache = _engine(model, chunk=100)
    logits = [e100.prefill(0, prompts[0]), e100.prefill(1, prompts[1])]
    e100.prefill(2, prompts[2][:10])
    logits.append(e100.prefill(2, prompts[2], start=10))
    want = _state(logits, cache)
    got = _state(*_batched(model)[:2])
    for k in want:
        assert all(torch.equal(x, y) for x, y in zip(got[k], want[k])), k


def test_rotating_buffers_and_a_resident_pool_leave_the_sync_batch_bytes():
    """Six QSA layers through four buffers (layers reload their prefixes from the host), each request in a forward
    with buffers of its own, and the resident pool: the same bytes and logits as the sync path over a host pool."""
    shape = dataclasses.replace(PRESETS["tiny"], name="tiny-24", layers=24)
    m = HybridModel(shape, "cpu", seed=0)
    want_logits, want_cache, _ = _batched(m)
    want = _state(want_logits, want_cache)
    for strategy, mode in (("zero_copy", "rotating"), ("resident", "sync")):
        logits, cache, _ = _batched(m, strategy, mode)
        got = _state(logits, cache)
        for k in want:
            assert all(torch.equal(x, y) for x, y in zip(got[k], want[k])), (strategy, mode, k)


@pytest.mark.parametrize("change, says", [
    ({"budget": 0}, "must be > 0"),
    ({"lens": [150, CAPACITY + 1]}, "exceeds the cache capacity"),
    ({"slots": [1, 1]}, "slot 1 given to two requests"),
    ({"slots": [0, 3]}, "outside the cache's 3 slots"),
    ({"start": 150}, "outside the prompt"),
])
def test_bad_input_is_one_error_before_anything_is_reserved(tiny, change, says):
    e, cache = _engine(tiny)
    lens, slots = change.get("lens", [150, 40]), change.get("slots", [0, 1])
    reqs = [PrefillRequest(s, torch.zeros(n, dtype=torch.int64), start=change.get("start", 0) if i == 0 else 0)
            for i, (s, n) in enumerate(zip(slots, lens))]
    free = len(cache.pages.free)
    with pytest.raises(ValueError, match=says) as ex:
        next(e.prefill_batch(reqs, change.get("budget", BUDGET)))
    assert len(str(ex.value).splitlines()) == 1
    assert len(cache.pages.free) == free and cache.lens.tolist() == [0, 0, 0]


@torch.inference_mode()
def test_a_request_added_between_forwards_joins_the_next_one(tiny):
    """A scheduler admits a request when a slot frees up: it joins the next forward behind the part-done one, and
    its logits are those it gets when queued from the start (every forward the same rows, so exactly)."""
    m = tiny
    a, b = _prompts(m.shape.vocab)[:2]
    e, _ = _engine(m)
    batch = BatchedPrefill(e, BUDGET)
    batch.add(PrefillRequest(0, a))
    assert batch.step() == ([Segment(0, 0, 100)], {})
    batch.add(PrefillRequest(1, b))
    segs, done = batch.step()
    assert segs == [Segment(0, 100, 150), Segment(1, 0, 40)] and set(done) == {0, 1} and not batch.pending
    both, _ = _engine(m)
    want = both.prefill_batch([PrefillRequest(0, a), PrefillRequest(1, b)], BUDGET)
    try:
        while True:
            next(want)
    except StopIteration as fin:
        assert torch.equal(done[0], fin.value[0]) and torch.equal(done[1], fin.value[1])
