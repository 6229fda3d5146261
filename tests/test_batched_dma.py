"""Batched DMA's pointer arrays (labkit/engine/batched_dma.py), checked on any machine by reading memory
through them: each (dst, src, size) triple must name exactly the bytes of dst[order[j]] and src[ids[j]].
The driver call itself needs CUDA 13 (the H200 host): `tests/test_gpu_pulse.py::test_block_transfers_on_gpu`
checks every unit it delivers."""
import ctypes

import pytest
import torch

from labkit.engine.batched_dma import unit_pointers


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
