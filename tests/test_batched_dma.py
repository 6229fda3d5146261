"""Batched DMA's pointer arrays (labkit/engine/batched_dma.py), checked on any machine by reading memory
through them: each (dst, src, size) triple must name exactly the bytes of dst[order[j]] and src[ids[j]].
The driver call itself needs CUDA 13 (the H200 host): `tests/test_gpu_pulse.py::test_block_transfers_on_gpu`
checks every unit it delivers."""
import ctypes

import pytest
import torch

from labkit.engine.transfer.batched_dma import unit_pointers


def _bytes_at(ptr: int, n: int) -> bytes:
    return ctypes.string_at(ptr, n)


@pytest.mark.parametrize("with_order", [False, True])
def test_pointers_name_the_units(with_order):
    g = torch.Generator().manual_seed(0)
    src = torch.randint(-2**40, 2**40, (50, 12), generator=g)
    dst = torch.zeros(9, 12, dtype=torch.int64)
    ids = torch.randperm(50, generator=g)[:9]
    order = torch.randperm(9, generator=g) if with_order else None
    d, s, z = unit_pointers(src, ids, dst, order)
    assert (z == 12 * 8).all()
    for j in range(9):
        assert _bytes_at(int(s[j]), int(z[j])) == src[ids[j]].numpy().tobytes()
        ctypes.memmove(int(d[j]), int(s[j]), int(z[j]))           # what the DMA engine would do
    expect = torch.empty_like(dst)
    expect[order if with_order else torch.arange(9)] = src[ids]
    assert torch.equal(dst, expect)


def test_bad_input_is_refused():
    src, dst = torch.zeros(10, 4, dtype=torch.int64), torch.zeros(3, 4, dtype=torch.int64)
    with pytest.raises(IndexError, match="outside"):
        unit_pointers(src, torch.tensor([0, 1, 10]), dst)
    with pytest.raises(ValueError, match="do not agree"):
        unit_pointers(src, torch.tensor([0, 1]), dst)
    with pytest.raises(ValueError, match="permutation"):
        unit_pointers(src, torch.tensor([0, 1, 2]), dst, torch.tensor([0, 0, 1]))
    with pytest.raises(ValueError, match="contiguous"):
        unit_pointers(torch.zeros(10, 8, dtype=torch.int64)[:, ::2], torch.tensor([0, 1, 2]), dst)


def test_runs_cover_the_rows_in_order():
    from labkit.engine.transfer.batched_dma import runs
    g = torch.Generator().manual_seed(1)
    blocks = torch.randperm(40, generator=g)[:7] * 16
    rows = (blocks[:, None] + torch.arange(16)).flatten()
    rows[20] = 999                                      # a stray row breaks its block in two
    j, first, n = runs(rows)
    assert n.sum() == rows.numel() and j[0] == 0
    rebuilt = torch.cat([torch.arange(f, f + m) for f, m in zip(first.tolist(), n.tolist())])
    assert torch.equal(rebuilt, rows)
    assert len(j) == 7 + 2                              # 7 blocks, one cut by the stray row into 3 runs
    assert all(len(runs(torch.tensor(x))[0]) == 0 for x in ([],))


def test_run_pointers_name_the_runs():
    from labkit.engine.transfer.batched_dma import run_pointers
    g = torch.Generator().manual_seed(2)
    src = torch.randint(-2**40, 2**40, (64, 6), generator=g)
    rows = torch.tensor([8, 9, 10, 11, 40, 41, 3, 20, 21])
    dst = torch.zeros(rows.numel(), 6, dtype=torch.int64)
    d, s, z = run_pointers(src, rows, dst)
    assert z.tolist() == [4 * 48, 2 * 48, 48, 2 * 48]
    for a, b, n in zip(d.tolist(), s.tolist(), z.tolist()):
        ctypes.memmove(a, b, n)
    assert torch.equal(dst, src[rows])
    with pytest.raises(IndexError, match="outside"):
        run_pointers(src, torch.tensor([62, 63, 64]), torch.zeros(3, 6, dtype=torch.int64))


def test_call_slices_cover_the_units_once():
    from labkit.engine.transfer.batched_dma import call_slices
    assert call_slices(1536, 0) == [(0, 1536)]
    assert call_slices(1000, 256) == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert call_slices(0, 128) == []
    for n, k in ((7, 3), (512, 512), (513, 512)):
        got = [i for a, b in call_slices(n, k) for i in range(a, b)]
        assert got == list(range(n)) and all(b - a <= k for a, b in call_slices(n, k))


def test_runs_cut_into_units_as_per_head_selections_move_a_block():
    """max_rows cuts every run from its start: a 16-row block in 4-row units is 4 copies (per-head units of the
    reference shape: one KV head's K or V of a block, 8 KiB), a run of two adjacent blocks 8, a short run one;
    the units still cover the rows in order, and block_dma's CPU path delivers the same rows, counting a copy
    per unit."""
    from labkit.engine.transfer import get_strategy
    from labkit.engine.transfer.batched_dma import runs
    rows = torch.cat([torch.arange(32, 48), torch.arange(96, 128), torch.arange(200, 202), torch.tensor([5, 5])])
    j, first, n = runs(rows, 4)
    assert n.tolist() == [4] * 4 + [4] * 8 + [2, 1, 1]
    rebuilt = torch.cat([torch.arange(f, f + m) for f, m in zip(first.tolist(), n.tolist())])
    assert torch.equal(rebuilt, rows) and torch.equal(j, torch.cumsum(n, 0) - n)
    assert [t.tolist() for t in runs(rows, 0)] == [t.tolist() for t in runs(rows)]      # 0: whole runs
    assert runs(rows, 64)[2].tolist() == runs(rows)[2].tolist()
    with pytest.raises(ValueError, match="max_rows"):
        runs(rows, -1)

    class Pool:                                          # the two fields a load reads
        medium, row_bytes = "host", 6 * 8
        data = [torch.randint(-2**40, 2**40, (256, 6), generator=torch.Generator().manual_seed(3))]
    per_head, whole = get_strategy("block_dma", dma_unit_rows=4), get_strategy("block_dma")
    for s, copies in ((per_head, 15), (whole, 5)):
        out = torch.zeros(rows.numel(), 6, dtype=torch.int64)
        res = s.load(Pool, 0, rows, out)
        assert torch.equal(out, Pool.data[0][rows]) and s.copies == copies
        assert res.h2d_bytes == rows.numel() * Pool.row_bytes      # the same bytes, in more copies
    with pytest.raises(ValueError, match="dma_unit_rows"):
        get_strategy("block_dma", dma_unit_rows=-1)
