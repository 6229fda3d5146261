"""The fused QSA heads (q/k norms, partial RoPE, the K/V row in one Triton kernel) under the interpreter on
CPU (TRITON_INTERPRET=1 must be set before triton is imported, so in a subprocess) against the torch
definition `QSALayer.heads_reference`, and the decode step with it on against the step with it off.

Tolerance: the kernel rounds where the torch ops round (the norm's output, its weighted value, the
rotation once). On a GPU they differ only where fp32 sums in another order or another rsqrt / sin / cos
cross a bf16 rounding boundary. The interpreter rounds fp32 -> bf16 toward zero (checked below), so
here each of the norm's two roundings may lose an ulp of q and of its RoPE partner, and the rotation adds
both (c·n − s·p can be far smaller than n and p): within 4 bf16 ulps of the head's largest value. A
wrong norm, angle or partner is off by O(1)."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def _interpret(script: str) -> str:
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1", "LABKIT_QSA_FUSED": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


@needs_triton
def test_fused_heads_match_the_torch_definition_under_interpreter():
    """The tiny shape and the reference shape's heads (16 query heads of 256, 2 key heads, a quarter
    rotated), positions from 0 to past 1M (where an angle's ulp is large: the angles must be the same
    fp32 products), a padded projection (y wider than its splits), and the gate a view of y."""
    out = _interpret('''
        import dataclasses, torch
        from labkit.engine.model import qsa_step as Q
        from labkit.engine.model.layers import QSALayer
        from labkit.shapes import PRESETS
        def ulp(v):
            return torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(2.0 ** -126))) - 7)
        n = 0
        for s in (PRESETS["tiny"], dataclasses.replace(PRESETS["qwen3.8-flash-next-standin"], hidden=64)):
            layer = QSALayer(s, torch.Generator().manual_seed(1), torch.bfloat16, "cpu")
            with torch.no_grad():     # norms that are not all ones, so their weights are applied
                layer.q_norm.weight.copy_(1 + 0.1 * torch.randn(s.head_dim, generator=torch.Generator().manual_seed(2)))
                layer.k_norm.weight.copy_(1 + 0.1 * torch.randn(s.head_dim, generator=torch.Generator().manual_seed(3)))
            g = torch.Generator().manual_seed(4)
            x = torch.randn(5, s.hidden, generator=g).bfloat16()
            y = x @ layer.w_in
            assert y.shape[1] >= layer.in_cols
            pos = torch.tensor([0, 7, 4095, 262143, 1048575])
            assert Q.usable(layer, y)
            q, gate, kv_row = Q.qsa_heads(layer, y, pos)
            rq, rgate, rkv = layer.heads_reference(y, pos)[:3]
            assert q.shape == rq.shape and kv_row.shape == rkv.shape and q.dtype == torch.bfloat16
            assert torch.equal(gate, rgate), "the gate is a view of y"
            for got, ref, what in ((q, rq, "q"), (kv_row, rkv, "kv_row")):
                err = (got.float() - ref.float()).abs()
                heads = ref.float().view(ref.shape[0], -1, s.head_dim)
                tol = 4 * ulp(heads.abs().amax(-1, keepdim=True)).expand_as(heads).reshape(ref.shape)
                assert bool((err <= tol).all()), f"{s.name} {what}: {err.max().item()}"
                assert (err > 0).float().mean().item() < 0.9, "not a rounding difference"
                n += 1
            # v is copied, never rounded again
            v0 = layer.q_out + layer.kv_out
            assert torch.equal(kv_row[:, s.n_kv_heads * s.head_dim:], y[:, v0:v0 + layer.kv_out])
        # the interpreter's fp32 -> bf16 cast truncates (why the tolerance is wider here than on a GPU)
        import triton, triton.language as tl
        @triton.jit
        def cast(x_ptr, o_ptr):
            tl.store(o_ptr, tl.load(x_ptr).to(tl.bfloat16))
        o = torch.empty(1, dtype=torch.bfloat16)
        cast[(1,)](torch.tensor([1.0 + 3 * 2.0 ** -9]), o)
        print("heads checked", n, "truncates", float(o) == 1.0)
    ''')
    assert "heads checked 4" in out, out


@needs_triton
def test_decode_block_with_fused_heads_equals_the_torch_path_under_interpreter():
    """`Engine.block`'s QSA branch with the fused heads on (the compiled-pieces path, here eager pieces
    flagged as compiled) gives the block's residual pair the torch path gives, within bf16."""
    out = _interpret('''
        import dataclasses, torch
        from labkit.engine.model import hybrid as Hy, qsa_step as Q
        from labkit.engine import HybridModel
        from labkit.shapes import PRESETS
        s = PRESETS["tiny"]
        model = HybridModel(s, "cpu", seed=0)
        blk = next(b for b in model.blocks if b.kind == "qsa")
        g = torch.Generator().manual_seed(0)
        x, d = torch.randn(3, s.hidden, generator=g).bfloat16(), torch.randn(3, s.hidden, generator=g).bfloat16()
        pos = torch.tensor([5, 900, 70000])
        h0, q0, gate0, kv0, k80, sc0, iq0, iw0 = Hy.qsa_pre(blk, x, d, pos)
        h1, y, k81, sc1, iq1, iw1 = Hy.qsa_project(blk, x, d)
        q1, gate1, kv1 = Q.qsa_heads(blk.mixer, y, pos)
        # the residual add and the norm run inside the projection's kernel (`gemv.norm_matmul`), which
        # rounds like the torch ops; the interpreter's casts truncate, so within bf16, not bit-equal
        assert bool(((h0.float() - h1.float()).abs() <= 2.0 ** -7 * h0.float().abs()).all())
        for a, b in ((q0, q1), (kv0, kv1), (k80.float(), k81.float()), (sc0, sc1), (iq0, iq1), (iw0, iw1),
                     (gate0, gate1)):
            assert ((a.float() - b.float()).norm() / a.float().norm()).item() < 2e-2
        att = torch.randn(q0.shape, generator=g).bfloat16()
        o0, o1 = Hy.qsa_out(blk, att, gate0), Hy.qsa_out(blk, att, gate1)
        assert ((o0.float() - o1.float()).norm() / o0.float().norm()).item() < 2e-2
        print("block ok")
    ''')
    assert "block ok" in out, out
