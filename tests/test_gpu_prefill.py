"""Rotating-buffer prefill on the GPU (marked `gpu`): with real side streams the KV bytes, index keys,
DeltaNet states and logits equal the synchronous prefill's (a missing event would show up as stale or
half-written rows here), and the overlap makes it no slower than sync."""
import dataclasses
import time

import pytest
import torch

from labkit.engine import Engine, HybridModel, OffloadCache, get_strategy
from labkit.shapes import PRESETS

pytestmark = pytest.mark.gpu
REF = PRESETS["qwen3.8-flash-next-standin"]
# 6 QSA layers: 1 resident + 5 rotating through 3 buffers, so prefixes are loaded back each chunk
SIX = dataclasses.replace(REF, name="six", layers=24, vocab=4096)


def _prefill(model, strategy, mode, T, chunk):
    st = get_strategy(strategy)
    cache = OffloadCache.allocate(model, st.medium, 1, T)
    e = Engine(model, cache, st, 2048, prefill_chunk=chunk, prefill_mode=mode)
    tok = torch.randint(0, model.shape.vocab, (T,), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.inference_mode():
        e.prefill(0, tok[:2 * chunk])           # warm-up
        cache.pages.release(0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        lg = e.prefill(0, tok)
        torch.cuda.synchronize()
    return lg, cache, time.perf_counter() - t0


def _kv(cache, T):
    out = torch.empty((cache.pool.attn_layers, T, cache.row_words()), dtype=torch.int64, device="cuda")
    for layer in range(cache.pool.attn_layers):
        cache.read_prefix(layer, 0, T, out[layer])
    return out


@pytest.fixture(scope="module")
def six():
    return HybridModel(SIX, "cuda", seed=0)


def test_rotating_equals_sync_on_cuda(six):
    T, chunk = 20000, 2048
    lg0, c0, _ = _prefill(six, "zero_copy", "sync", T, chunk)
    lg1, c1, _ = _prefill(six, "zero_copy", "rotating", T, chunk)
    lg2, c2, _ = _prefill(six, "resident", "sync", T, chunk)
    torch.cuda.synchronize()
    assert torch.equal(_kv(c1, T), _kv(c0, T)), "pool bytes differ"
    assert torch.equal(_kv(c2, T), _kv(c0, T))
    assert torch.equal(c1.index.keys.view(torch.uint8), c0.index.keys.view(torch.uint8))
    assert torch.equal(c1.dn_state, c0.dn_state)
    assert torch.equal(lg1, lg0) and torch.equal(lg2, lg0)


def test_rotating_is_not_slower_than_sync(six):
    """The loads and write-backs overlap compute: never worse than taking turns (5% for noise)."""
    T, chunk = 65536, 8192
    _, _, t_sync = _prefill(six, "zero_copy", "sync", T, chunk)
    _, _, t_rot = _prefill(six, "zero_copy", "rotating", T, chunk)
    assert t_rot <= 1.05 * t_sync, (t_rot, t_sync)
