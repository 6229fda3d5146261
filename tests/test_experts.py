"""Routed experts and W4A16 weights (`experts.py`, `grouped_gemv.py`, `quant.py`): the grouped kernel against
its definition under TRITON_INTERPRET=1 (a subprocess: the variable must be set before triton is imported),
the MoE layer against a token-by-token reference, the routing plan's groups and bytes against the formula."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from labkit.engine.model.experts import MoE
from labkit.engine.model.routing import plan, route
from labkit.engine.model.quant import QuantWeight, dequantize, unpack
from labkit.shapes import ModelShape, WEIGHT_BYTES

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def test_w4a16_packs_two_values_a_byte_and_dequantises_exactly():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(2, 256, 24, generator=gen)                          # [E, K, N]
    qw = QuantWeight.quantize(w)
    assert qw.q.shape == (2, 24, 128) and qw.scales.shape == (2, 24, 2)
    codes = unpack(qw.q)
    assert codes.min() >= 0 and codes.max() <= 15
    # the packing round-trips: low nibble first
    again = unpack((codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8))
    assert torch.equal(again, codes)
    back = qw.dequantize().float()
    step = qw.scales.float().transpose(1, 2).repeat_interleave(128, 1)   # [E, K, N] the group's scale
    assert ((back - w).abs() <= 0.5 * step + 1e-2 * w.abs()).all()      # round to nearest (bf16 rounding on top)
    # bytes: 4 bits a value + a bf16 scale and a 4-bit zero per 128
    assert qw.nbytes == 2 * 24 * (128 + 2 * 2 + 2)
    assert WEIGHT_BYTES["w4a16"] == pytest.approx(0.5 + 2.5 / 128)


def test_the_plan_groups_pairs_by_expert_and_counts_distinct_experts():
    experts = torch.tensor([[3, 7, 1], [7, 2, 3], [9, 3, 0]])
    g, back = plan(experts)
    n = int(g.n_groups)
    assert n == len(set(experts.flatten().tolist())) == 6
    seg, wid = g.seg.tolist(), g.wid.tolist()
    assert wid[:n] == sorted(set(experts.flatten().tolist()))
    for i in range(n):
        toks = g.tok[seg[i]:seg[i + 1]].tolist()
        assert all(wid[i] in experts[t].tolist() for t in toks)
        assert len(toks) == sum(wid[i] in row for row in experts.tolist())
    assert seg[n] == experts.numel()
    # back undoes the order: pair j of token t is at back[t*k + j]
    flat_sorted = torch.tensor(wid[:n]).repeat_interleave(torch.diff(torch.tensor(seg[:n + 1])))
    assert torch.equal(flat_sorted[back].view(3, 3), experts)


def test_distinct_experts_follow_the_formula_under_uniform_routing():
    s = ModelShape.from_name("qwen3.8-flash-next")
    gen = torch.Generator().manual_seed(1)
    for c in (1, 4, 16):
        counts = []
        for _ in range(400):
            logits = torch.randn(c, s.experts, generator=gen)
            idx, p = route(logits, s.experts_per_tok)
            assert torch.allclose(p.sum(-1), torch.ones(c))
            counts.append(int(plan(idx)[0].n_groups))
        mean = sum(counts) / len(counts)
        assert mean == pytest.approx(s.expected_experts(c), rel=0.02), (c, mean)
    # the bytes a step reads grow with the distinct experts, not with c x k
    b1 = s.step_weight_bytes(1)["experts"]
    b4 = s.step_weight_bytes(4)["experts"]
    assert b4 / b1 == pytest.approx(s.expected_experts(4) / 10) and b4 / b1 < 4


def test_moe_on_cpu_equals_the_token_by_token_reference():
    s = ModelShape.from_name("tiny-moe")
    for wd in ("bf16", "w4a16"):
        moe = MoE(s, torch.Generator().manual_seed(0), torch.bfloat16, "cpu", weights_dtype=wd)
        y = torch.randn(5, s.hidden, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
        out, n = moe(y)
        want = moe.reference(y)
        assert torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2), (wd, (out - want).abs().max())
        assert 1 <= int(n) <= 5 * s.experts_per_tok


def test_the_split_by_waves_is_never_longer_than_the_filling_one_and_spares_the_second_wave():
    """`grouped_gemv.w4_split` with W4_SPLIT_WAVES (the engine's default until timed is the split rounded up to fill
    the multiprocessors): by `w4_split_cost` never a longer launch than the filling split, at every program count and
    K the decode products take; and the QSA input projection at one row (214 output blocks, 20 K tiles) two splits
    in one wave of an H100's 528 places, where filling them takes three splits and 1.22 waves."""
    from labkit.engine.model import grouped_gemv as G
    dev = torch.device("cpu")                     # sized as the H200's 132 multiprocessors, as on an H100
    places = G.W4_PROGRAMS_PER_SM * 132
    saved = G.W4_SPLIT_WAVES
    try:
        for programs in range(1, 700, 7):
            for k_tiles in (1, 2, 5, 10, 20, 48):
                G.W4_SPLIT_WAVES = False
                fill, fill_tiles = G.w4_split(programs, k_tiles, dev)
                G.W4_SPLIT_WAVES = True
                waves, waves_tiles = G.w4_split(programs, k_tiles, dev)
                assert (waves - 1) * waves_tiles < k_tiles <= waves * waves_tiles      # no split empty, K covered
                assert (G.w4_split_cost(programs, k_tiles, waves, places)
                        <= G.w4_split_cost(programs, k_tiles, fill, places)), (programs, k_tiles)
                assert waves <= fill, (programs, k_tiles)        # never more splits than filling takes
        G.W4_SPLIT_WAVES = False
        assert G.w4_split(214, 20, dev) == (3, 7) and 214 * 3 > places
        G.W4_SPLIT_WAVES = True
        assert G.w4_split(214, 20, dev) == (2, 10) and 214 * 2 <= places
        # 640 programs (32 groups' gate|up): filling takes one split, and so does waves, where its cost model alone
        # would take two in three waves: more splits than filling is a choice no bench has timed
        assert G.w4_split(640, 20, dev) == (1, 20) and G.w4_split_cost(640, 20, 2, places) < G.w4_split_cost(640, 20, 1, places)
    finally:
        G.W4_SPLIT_WAVES = saved


KERNEL = textwrap.dedent('''
    import torch
    from labkit.engine.model.experts import MoE
    from labkit.engine.model.routing import plan
    from labkit.engine.model.grouped_gemv import Groups, grouped_gemv, grouped_gemv_reference
    from labkit.engine.model.quant import QuantWeight
    from labkit.shapes import ModelShape
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for quant in (False, True):
        for glu in (False, True):
            E, K, N = 6, 256, 48
            w = (torch.randn(E, K, 2 * N if glu else N, generator=g) / 16)
            w = QuantWeight.quantize(w) if quant else w.transpose(1, 2).contiguous().to(torch.bfloat16)
            # decode one request, four (12 pairs on 6 experts: groups of several rows), a prefill chunk (80 pairs:
            # groups of some 13 rows, some past 16, two blocks of M_PAD = 16). A plan's groups take one row at a time
            # by default, the path the four requests run already: the chunk takes the 16-row blocks only (one row at
            # a time it cost the interpreter several times the rest of this test)
            for T, k, pads in ((1, 3, (None, 16)), (4, 3, (None, 16)), (40, 2, (16,))):
                x = torch.randn(T, K, generator=g).to(torch.bfloat16)
                idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
                groups, _ = plan(idx)
                for m_pad in pads:
                    got = grouped_gemv(x, w, groups, glu=glu, m_pad=m_pad)
                    want = grouped_gemv_reference(x, w, groups, glu=glu)
                    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                    worst = max(worst, err)
                    assert err < 1e-2, (quant, glu, T, m_pad, err)
            # a dense product: one group of every row
            x = torch.randn(3, K, generator=g).to(torch.bfloat16)
            got = grouped_gemv(x, w, Groups.one(3, "cpu"), glu=glu)
            want = grouped_gemv_reference(x, w, Groups.one(3, "cpu"), glu=glu)
            assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    # W4A16's row kernel with K cut into splits (the last split to arrive adds them, silu(gate) * up after the sum)
    # and at other tiles, one request and four. K = 640, five groups of 128: five splits of one tile by default,
    # three of two, two and one tiles (a split's loop takes two at a time), and two tiles of four groups, the second
    # holding one
    w = QuantWeight.quantize(torch.randn(1, 640, 80, generator=g) / 16)
    for R in (1, 3, 4):           # three rows: a four-row tile with one row past the group
        x = torch.randn(R, 640, generator=g).to(torch.bfloat16)
        want = grouped_gemv_reference(x, w, Groups.one(R, "cpu"), glu=True)
        for split, gt in ((None, None), (3, 1), (1, 4)):
            for gather in ((True, False) if R == 3 else (True,)):      # rows taken as they are: none past x
                got = grouped_gemv(x, w, Groups.one(R, "cpu"), glu=True, split=split, group_tile=gt, gather=gather)
                err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                assert err < 1e-2, (R, split, gt, gather, err)
        # the plan taken as known (W4_ONE: no plan read) gives the same bits, either kernel; so does the row
        # kernel's K loop a tile a turn under Triton's pipeliner (W4_PIPE)
        from labkit.engine.model import grouped_gemv as G, w4_decode
        read = grouped_gemv(x, w, Groups.one(R, "cpu"), glu=True, split=3)
        w4_decode.W4_ONE, G.W4_PIPE = True, 3
        try:
            assert torch.equal(grouped_gemv(x, w, Groups.one(R, "cpu"), glu=True, split=3), read), R
            # the plan not read at all: its count zeroed, the fixed plan's product is still whole
            one = Groups.one(R, "cpu")
            unread = Groups(one.tok, one.wid, one.seg, torch.zeros_like(one.n_groups), fixed=True)
            assert torch.equal(grouped_gemv(x, w, unread, glu=True, split=3), read), R
        finally:
            w4_decode.W4_ONE, G.W4_PIPE = False, 0
    # a dense W4A16 product of a prefill chunk's rows: the weight dequantised by one kernel, then a GEMM
    from labkit.engine.model.grouped_gemv import W4_DEQUANT_ROWS, dequantize_w4
    w = QuantWeight.quantize(torch.randn(1, 256, 96, generator=g) / 16)
    # the definition's values, to one bf16 step (the interpreter rounds fp32 -> bf16 its own way)
    assert torch.allclose(dequantize_w4(w).float(), w.dequantize()[0].t().float(), rtol=2 ** -7, atol=0)
    x = torch.randn(W4_DEQUANT_ROWS + 44, 256, generator=g).to(torch.bfloat16)
    for glu in (False, True):
        got = grouped_gemv(x, w, Groups.one(x.shape[0], "cpu"), glu=glu)
        want = grouped_gemv_reference(x, w, Groups.one(x.shape[0], "cpu"), glu=glu)
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2, glu
    # a decode step's plan in one launch equals torch's stable sort, pair for pair (many repeats at 6 x 3 of 4)
    from labkit.engine.model.routing import plan_reference
    for T, k, E in ((1, 10, 512), (4, 10, 512), (6, 3, 4)):
        ex = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        (a, ba), (b, bb) = plan(ex), plan_reference(ex)
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("tok", "wid", "seg", "n_groups")), (T, k)
        assert torch.equal(ba, bb), (T, k)
    # the router's top-k, their weights and the plan in one launch equal torch's top-k, softmax and stable sort
    # (choosing by biased logits, weighting by the unbiased ones)
    from labkit.engine.model.routing import route, route_plan
    for T, k, E in ((1, 10, 512), (4, 10, 512), (3, 4, 16)):
        lg = torch.randn(T, E, generator=g).to(torch.bfloat16)
        bias = torch.randn(E, generator=g) * 0.1
        ex, p, gr, back = route_plan(lg, bias, k)
        want, _ = route(lg.float() + bias, k)
        assert torch.equal(ex, want), (T, k)
        assert torch.allclose(p, torch.softmax(torch.gather(lg.float(), 1, want), dim=-1), rtol=1e-6, atol=1e-7)
        b, bb = plan_reference(want)
        assert all(torch.equal(getattr(gr, f), getattr(b, f)) for f in ("tok", "wid", "seg", "n_groups")), (T, k)
        assert torch.equal(back, bb)
    # the tensor-core decode kernel for every product (the engine takes it for dense products of 2-16 rows, which
    # the dense product above ran): routed groups of one and several rows, K split three ways and not at all
    from labkit.engine.model import grouped_gemv as GG
    GG.W4_KERNEL = "dot"
    w = QuantWeight.quantize(torch.randn(6, 384, 160, generator=g) / 16)
    for T, k in ((1, 3), (4, 3)):
        x = torch.randn(T, 384, generator=g).to(torch.bfloat16)
        groups, _ = plan(torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(T)]))
        want = grouped_gemv_reference(x, w, groups, glu=True)
        for split in (None, 1):
            got = grouped_gemv(x, w, groups, glu=True, split=split)
            assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2, (T, split)
    GG.W4_KERNEL = "auto"
    s = ModelShape.from_name("tiny-moe")
    moe = MoE(s, torch.Generator().manual_seed(0), torch.bfloat16, "cpu", weights_dtype="w4a16")
    # two tokens, eight (token, expert) pairs: the routed experts one row at a time, gathered and not; the shared
    # expert a four-row tile with two rows past the tokens
    y = torch.randn(2, s.hidden, generator=g).to(torch.bfloat16)
    out, n = moe(y)
    ref = moe.reference(y)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2
    # the decode step's three launches (moe_step: the shared expert in the routed products' launches, the weighted
    # sum in the down product's last arrival) against the same layer with the shared expert and the sum apart, one
    # token and three (groups of several rows): the same distinct experts, outputs a bf16 rounding apart (the
    # interpreter's casts truncate where the tail rounds), both near the definition; a weight on the wrong row or
    # the shared row ungated would be O(1)
    from labkit.engine.model import moe_step as MS
    for T in (1, 3):
        y = torch.randn(T, s.hidden, generator=g).to(torch.bfloat16)
        assert MS.applies(moe, y, None)
        out, n = moe(y)
        MS.MOE_STEP = False
        apart, n_apart = moe(y)
        MS.MOE_STEP = True
        ref = moe.reference(y)
        assert torch.equal(n, n_apart), (T, n, n_apart)
        assert ((out.float() - apart.float()).norm() / apart.float().norm()).item() < 1e-2, T
        assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2, T
    print("ok", worst)
''')


@needs_triton
def test_grouped_kernel_matches_its_definition_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-c", KERNEL], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]
