"""Rotating-buffer prefill on CPU (the streams run in order): the same KV bytes in the pool, the same
index keys, DeltaNet states and logits as the synchronous prefill, and as a resident prefill; loads
actually happen (a shape with more QSA layers than buffers); bad modes refused."""
import dataclasses

import pytest
import torch

from labkit.engine import Engine, HybridModel, OffloadCache, get_strategy
from labkit.engine.model.prefill_buffers import RotatingPrefillIO, buffer_of
from labkit.shapes import PRESETS

# 6 QSA layers: layer 0 resident, layers 1..5 rotate through 3 buffers (1 and 4 share one, so a
# chunk's prefix of layer 1 is loaded back from the host after layer 4 took its buffer).
SHAPE = dataclasses.replace(PRESETS["tiny"], name="tiny-24", layers=24)
LENS = [300, 129]


@pytest.fixture(scope="module")
def model():
    return HybridModel(SHAPE, "cpu", seed=0)


def _prefill(model, strategy, mode, chunk=64, page_size=16, start_from=None):
    st = get_strategy(strategy)
    cache = OffloadCache.allocate(model, st.medium, len(LENS), 320, page_size=page_size)
    e = Engine(model, cache, st, 16, prefill_chunk=chunk, prefill_mode=mode)
    logits = []
    for slot, n in enumerate(LENS):
        tok = torch.randint(0, model.shape.vocab, (n,), generator=torch.Generator().manual_seed(slot))
        logits.append(e.prefill(slot, tok))
    return e, cache, logits


def _kv(cache, slot, n):
    out = torch.empty((cache.pool.attn_layers, n, cache.row_words()), dtype=torch.int64)
    for layer in range(cache.pool.attn_layers):
        cache.read_prefix(layer, slot, n, out[layer])
    return out


@pytest.mark.parametrize("chunk", [64, 100, 512])
def test_rotating_prefill_equals_sync(model, chunk):
    """Same chunking, same bytes: pool rows, index keys, DeltaNet states, logits (a chunk is one matmul,
    so each chunk size is compared with itself)."""
    _, c0, lg0 = _prefill(model, "zero_copy", "sync", chunk=chunk)
    _, c1, lg1 = _prefill(model, "zero_copy", "rotating", chunk=chunk)
    for slot, n in enumerate(LENS):
        assert torch.equal(_kv(c1, slot, n), _kv(c0, slot, n)), "pool bytes differ from the sync prefill"
        assert torch.equal(lg1[slot], lg0[slot]), "logits differ from the sync prefill"
    assert torch.equal(c1.index.keys.view(torch.uint8), c0.index.keys.view(torch.uint8))
    assert torch.equal(c1.index.scales, c0.index.scales)
    assert torch.equal(c1.dn_state, c0.dn_state) and torch.equal(c1.dn_conv, c0.dn_conv)
    assert torch.equal(c1.lens, c0.lens)


def test_rotating_prefill_equals_sync_with_experts_hyper_connections_and_ngrams():
    """The published model's parts (routed experts in W4A16, hyper-connections, the n-gram embedding) through the
    rotating buffers: the same bytes and logits as the sync prefill (the rotating `io` answers what these layers
    ask of it)."""
    moe = HybridModel(PRESETS["tiny-moe"], "cpu", seed=0, weights_dtype="w4a16", ngram_table_bytes=1 << 20)
    assert moe.shape.moe and moe.shape.hc_count > 1 and moe.ngram is not None
    _, c0, lg0 = _prefill(moe, "zero_copy", "sync")
    _, c1, lg1 = _prefill(moe, "zero_copy", "rotating")
    for slot, n in enumerate(LENS):
        assert torch.equal(_kv(c1, slot, n), _kv(c0, slot, n))
        assert torch.equal(lg1[slot], lg0[slot])
    assert torch.equal(c1.dn_state, c0.dn_state)


def test_resident_prefill_equals_offloaded(model):
    _, c0, lg0 = _prefill(model, "zero_copy", "sync")
    _, c1, lg1 = _prefill(model, "resident", "sync")
    for slot, n in enumerate(LENS):
        assert torch.equal(_kv(c1, slot, n), _kv(c0, slot, n))
        assert torch.equal(lg1[slot], lg0[slot])


def test_rotating_loads_back_what_the_buffers_cannot_hold(model, monkeypatch):
    """With 6 QSA layers and 4 buffers some prefixes must come back from the host: count them, and
    check the rows a load brings are the ones the pool holds (a load that read stale or no rows
    would change the logits compared above; here: it happened at all, for the right layers)."""
    loads = []
    orig = OffloadCache.read_prefix

    def spy(self, layer, slot, n, out, start=0):
        loads.append((layer, start, n))
        return orig(self, layer, slot, n, out, start)

    monkeypatch.setattr(OffloadCache, "read_prefix", spy)
    _prefill(model, "zero_copy", "rotating", chunk=64)
    assert loads, "no prefix was loaded back"
    assert all(buffer_of(layer) != 0 for layer, *_ in loads), "the resident layer was loaded"
    assert {layer for layer, *_ in loads} == {1, 2, 4, 5}, loads     # layer 3 has buffer 3 to itself
    assert all(start == 0 for _, start, _ in loads)


def test_start_resumes_a_cached_prefix(model):
    """prefill(start=s) over a cache that holds [0, s) gives what one prefill of the whole prompt gives."""
    tok = torch.randint(0, SHAPE.vocab, (200,), generator=torch.Generator().manual_seed(7))
    outs = []
    for mode in ("sync", "rotating"):
        st = get_strategy("zero_copy")
        c = OffloadCache.allocate(model, "host", 1, 256, page_size=16)
        e = Engine(model, c, st, 16, prefill_chunk=64, prefill_mode=mode)
        e.prefill(0, tok[:128])                 # the cached prefix (two whole chunks)
        outs.append((e.prefill(0, tok, start=128), _kv(c, 0, 200)))
    st = get_strategy("zero_copy")
    c = OffloadCache.allocate(model, "host", 1, 256, page_size=16)
    full = Engine(model, c, st, 16, prefill_chunk=64).prefill(0, tok)
    for lg, kv in outs:
        assert torch.equal(lg, full) and torch.equal(kv, _kv(c, 0, 200))


@pytest.mark.parametrize("mode,strategy,msg", [("overlap", "zero_copy", "unknown prefill_mode"),
                                               ("rotating", "resident", "host pool")])
def test_bad_prefill_mode_is_refused(model, mode, strategy, msg):
    st = get_strategy(strategy)
    c = OffloadCache.allocate(model, st.medium, 1, 64, page_size=16)
    with pytest.raises(ValueError, match=msg):
        Engine(model, c, st, 16, prefill_mode=mode)


def test_one_buffer_is_refused(model):
    st = get_strategy("zero_copy")
    c = OffloadCache.allocate(model, "host", 1, 64, page_size=16)
    e = Engine(model, c, st, 16, prefill_mode="rotating")
    with pytest.raises(ValueError, match="2 buffers"):
        RotatingPrefillIO(e, 0, 64, n_buffers=1)
