"""A prefill chunk's routed experts as grouped GEMMs (`moe_gemm.py`): the pairs' alignment against its definition
on the CPU; the kernels against the block-by-block reference and a whole MoE layer against its token-by-token
definition (`MoE.reference`) under TRITON_INTERPRET=1 (a subprocess: the variable must be set before triton is
imported), W4A16 and bf16, with blocks of several experts, padding rows and tiles narrower than the outputs. The
published widths and the speed are the GPU's (tests/test_gpu_portable.py, scripts/moe_gemm_bench.py)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from labkit.engine.model import moe_gemm

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


@pytest.mark.parametrize("T,k,E,bm", [(37, 3, 8, 4), (5, 2, 64, 8), (64, 4, 4, 16)])
def test_the_alignment_puts_each_experts_pairs_in_whole_blocks_of_it(T, k, E, bm):
    g = torch.Generator().manual_seed(T)
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    b = moe_gemm.align(experts, E, bm)
    R = T * k
    rows, n = b.rows.long(), int(b.n_blocks)
    assert b.rows.shape[0] % bm == 0 and b.expert.shape[0] == b.rows.shape[0] // bm
    real = rows[rows < R]
    assert sorted(real.tolist()) == list(range(R))                      # every pair once
    assert (rows[n * bm:] == R).all()                                   # nothing past the block count
    flat = experts.reshape(-1)
    for blk in range(n):
        place = rows[blk * bm:(blk + 1) * bm]
        pairs = place[place < R]
        assert len(pairs), "a block of only padding"
        assert (flat[pairs] == b.expert[blk]).all()                     # a block is one expert's
        assert torch.equal(pairs, pairs.sort().values)                  # token order within an expert
        assert (place[:len(pairs)] < R).all()                           # padding only at a block's end
    counts = torch.bincount(flat, minlength=E)
    assert n == int(((counts + bm - 1) // bm).sum())                    # the fewest blocks that hold them
    assert int(b.distinct) == int((counts > 0).sum())


KERNEL = textwrap.dedent('''
    import torch
    from labkit.engine.model import interpreter, moe_gemm
    from labkit.engine.model.experts import MoE
    from labkit.engine.model.quant import QuantWeight
    from labkit.shapes import ModelShape
    interpreter.fast_device_calls()
    worst = {}

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    g = torch.Generator().manual_seed(0)
    # K = 256: two W4A16 groups, four K steps of 64; N = 128 of gate and of up: four output tiles of 32
    T, k, E, K, N, H = 23, 3, 6, 256, 128, 96
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    experts[:9] = torch.tensor([0, 1, 2])       # expert 0..2 chosen by many: blocks of several rows, and padding
    for quant in (True, False):
        if quant:
            gu, d = QuantWeight.random(g, K, 2 * N, experts=E), QuantWeight.random(g, N, H, experts=E)
        else:
            gu = (torch.randn(E, 2 * N, K, generator=g) / K ** 0.5).bfloat16()
            d = (torch.randn(E, H, N, generator=g) / N ** 0.5).bfloat16()
        y = torch.randn(T, K, generator=g).bfloat16()
        tiles = moe_gemm.Tiles(bm=8, bn=32, bk=64)
        blocks = moe_gemm.align(experts, E, tiles.bm)
        want = moe_gemm.moe_gemm_reference(y, gu, blocks, glu=True)
        real = blocks.rows < blocks.pairs
        act = moe_gemm.moe_gemm(y, gu, blocks, glu=True, tiles=tiles)
        e1 = rel(act[real], want[real])
        down = moe_gemm.moe_gemm(act, d, blocks, scatter=True, tiles=moe_gemm.Tiles(bm=8, bn=64, bk=32 if not quant else 64))
        e2 = rel(down, moe_gemm.moe_gemm_reference(act, d, blocks, scatter=True))
        # the definition, pair by pair: token t's j-th choice through its expert's dense weights
        wgu = gu.dequantize() if quant else gu.transpose(1, 2)
        wd = d.dequantize() if quant else d.transpose(1, 2)
        t, j = 4, 1
        e = int(experts[t, j])
        gg, uu = (y[t].float() @ wgu[e].float()).chunk(2)
        a = (torch.nn.functional.silu(gg) * uu).bfloat16()
        e3 = rel(down[t * k + j], (a.float() @ wd[e].float()).bfloat16())
        # the interpreter rounds to bf16 by truncation (the GPU to nearest): one row of 96 drifts ~1%
        for name, err, tol in (("glu", e1, 1e-2), ("down", e2, 1e-2), ("pair", e3, 2e-2)):
            worst[f"{name}-{quant}"] = err
            assert err < tol, (quant, name, err)
        p = torch.softmax(torch.randn(T, k, generator=g), -1)
        sh, gl = torch.randn(T, H, generator=g).bfloat16(), torch.randn(T, 1, generator=g).bfloat16()
        got = moe_gemm.combine(down, p, sh, gl)
        ref = ((down.view(T, k, H).float() * p[..., None]).sum(1) + torch.sigmoid(gl.float()) * sh.float()).bfloat16()
        worst[f"combine-{quant}"] = rel(got, ref)
        assert rel(got, ref) < 1e-2

    # a whole layer of the small MoE shape through the GEMM path against its definition
    s = ModelShape.from_name("tiny-moe")
    moe = MoE(s, torch.Generator().manual_seed(1), torch.bfloat16, "cpu", weights_dtype="w4a16")
    y = torch.randn(moe_gemm.MIN_TOKENS, s.hidden, generator=g).bfloat16()
    assert moe_gemm.applies(y)
    out, n = moe(y)
    e4 = rel(out, moe.reference(y))
    worst["layer"] = e4
    assert e4 < 2e-2 and 0 < int(n) <= s.experts, (e4, int(n))
    print("ok", worst)
''')


@needs_triton
def test_the_grouped_gemms_match_their_definition_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-c", KERNEL], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]
