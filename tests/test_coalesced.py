"""The coalesced block transfer (labkit/engine/coalesced.py) on CPU: the real chunking, threads and
staging, with the device copies as plain copies (on the GPU host `tests/test_gpu_pulse.py` runs it over
the link). Every unit lands where `order` says, for both gather backends, chunk sizes that do and do not
divide the selection, repeated calls through the same staging, and bad input refused before dst is
written."""
import pytest
import torch

from labkit.engine.transfer.coalesced import CoalescedLoader


def _case(seed, n=300, m=77, w=16):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(-2**40, 2**40, (n, w), generator=g)
    ids = torch.randperm(n, generator=g)[:m]
    return src, ids, torch.randperm(m, generator=g)


@pytest.mark.parametrize("backend", ["threads", "torch"])
@pytest.mark.parametrize("threads,chunk_units,piece", [(1, 1000, 8192), (3, 5, 32), (4, 1, 8192), (8, 13, 64)])
def test_units_land_in_order(backend, threads, chunk_units, piece):
    """`piece` below the unit's 128 bytes: each unit gathered as 128 / piece pieces (through views)."""
    loader = CoalescedLoader(threads=threads, chunk_bytes=chunk_units * 16 * 8, backend=backend, piece_bytes=piece)
    try:
        for seed in range(3):                      # the same staging, reused with other ids
            src, ids, order = _case(seed)
            dst = torch.full((ids.numel(), 16), -1, dtype=torch.int64)
            moved = loader.load(src, ids, dst, order=order)
            expect = torch.empty_like(dst)
            expect[order] = src[ids]
            assert torch.equal(dst, expect)
            assert moved == ids.numel() * 16 * 8
            plain = torch.full_like(dst, -1)
            loader.load(src, ids, plain)
            assert torch.equal(plain, src[ids])
        assert len(loader.chunks(77, 16 * 8)) == -(-77 // chunk_units)
        src, ids, _ = _case(5)
        assert loader.pieces(src, ids, torch.empty(77, 16, dtype=torch.int64))[2] == 77 * max(1, 128 // piece)
    finally:
        loader.close()


def test_bad_input_is_refused_before_anything_is_written():
    src, ids, _ = _case(0)
    dst = torch.full((ids.numel(), 16), -1, dtype=torch.int64)
    loader = CoalescedLoader(threads=2)
    bad = ids.clone()
    bad[3] = src.shape[0]
    with pytest.raises(IndexError, match="outside"):
        loader.load(src, bad, dst)
    assert (dst == -1).all()
    with pytest.raises(ValueError, match="do not agree"):
        loader.load(src, ids[:5], dst)
    loader.close()
    for kw, msg in (({"threads": -1}, "threads"), ({"chunk_bytes": 0}, "chunk_bytes"), ({"backend": "dma"}, "backend")):
        with pytest.raises(ValueError, match=msg):
            CoalescedLoader(**kw)
