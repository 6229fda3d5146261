"""The small-batch GEMV: the Triton kernel under the interpreter on CPU (TRITON_INTERPRET=1 must be set
before triton is imported, so in a subprocess) against the fp32 reference, and `matmul`'s dispatch
(kernel for 1..16 rows where Triton runs, `x @ w` otherwise, also inside torch.compile).

Tolerance: the kernel sums exact bf16 products in fp32 (in another order than the reference) and rounds
once, so each output is within 2 bf16 ulps of the kernel's reference before its rounding (`gemv.gemv_reference`,
`gemv.silu_glu_reference` on fp32 copies of the bf16 inputs: exact, so the fp32 sums) (one for the
rounding, one for a different fp32 sum crossing a rounding boundary), plus 2^-16 of the largest output
for outputs that cancel to near zero (where an ulp of the output is far below the fp32 sum's error)."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from labkit.engine.model import gemv as G

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

TOLERANCE = textwrap.dedent('''
    import torch
    from labkit.engine.model.gemv import gemv_reference, silu_glu_reference
    def unrounded(reference, x, w):
        """A kernel's reference before its one rounding: on fp32 copies of the bf16 inputs (exact)."""
        return reference(x.float(), w.float())
    def bf16_ulp(v):
        """Spacing of bf16 numbers at |v| (7 stored mantissa bits)."""
        e = torch.floor(torch.log2(v.abs().clamp_min(2.0 ** -126)))
        return torch.exp2(e - 7)
    def check(out, x, w, what):
        ref = unrounded(gemv_reference, x, w)
        tol = 2 * bf16_ulp(ref) + 2.0 ** -16 * ref.abs().max()
        err = (out.float() - ref).abs()
        assert out.dtype == x.dtype and out.shape == ref.shape, what
        worst = err.argmax()
        assert bool((err <= tol).all()), f"{what}: max err {err.max().item()} (tol there {tol.flatten()[worst].item()})"
        return err.max().item()
''')


def _interpret(script: str) -> str:
    p = subprocess.run([sys.executable, "-c", TOLERANCE + textwrap.dedent(script)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "TRITON_INTERPRET": "1", "LABKIT_GEMV": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


@needs_triton
def test_kernel_matches_fp32_reference_under_interpreter():
    """M = 1, 3, 16; K and N not multiples of the blocks; one program per tile and K split over several
    (the last-arriving program sums the partials); the FMA path (M = 1) and the tensor-core path."""
    out = _interpret('''
        from labkit.engine.model import gemv as G
        g = torch.Generator().manual_seed(0)
        n_checked = 0
        for M in (1, 3, 16):
            small = [None, G.Config(32, 16, 1, M > 1, 4, 2), G.Config(32, 16, 3, M > 1, 4, 2),
                     G.Config(64, 32, 5, M > 1, 4, 2),
                     # the first K block peeled (the PDL path's order: its weights before x)
                     G.Config(32, 16, 1, M > 1, 4, 2, pdl=True), G.Config(32, 16, 3, M > 1, 4, 2, pdl=True),
                     # the tensor-core path swapped (out^T = w^T @ x^T), K split, peeled
                     G.Config(32, 16, 3, True, 4, 2, pdl=True, swap=True)]
            if M == 1:
                small.append(G.Config(32, 16, 3, True, 4, 2))    # one row through the dot path
            if M == 16:     # the kernel M = 3 runs (M is no constexpr), every padded row real: plain, split, swapped
                small = [None, G.Config(32, 16, 3, True, 4, 2), G.Config(32, 16, 3, True, 4, 2, pdl=True, swap=True)]
            # [100, 70]: every config (the small tiles: several column tiles and K blocks, the last of both partial,
            # K split unevenly, 3, 3 and 1 blocks of 16); [257, 150]: the defaults' [128] tiles, two, the last
            # partial, K split (three splits at one row, the last of one K row; two at more) and five splits, the
            # last of one K row; [64, 128]: exact multiples of the tiles, split and not. (The interpreter's time
            # grows with the programs and their K blocks: every path on the small matrix, not on the larger too.)
            for K, N, configs in ((100, 70, small), (257, 150, [None, G.Config(64, 32, 5, M > 1, 4, 2)]),
                                  (64, 128, [None, G.Config(32, 16, 3, M > 1, 4, 2),
                                             G.Config(32, 16, 3, True, 4, 2, pdl=True, swap=True)])):
                x = torch.randn(M, K, generator=g).bfloat16()
                w = (torch.randn(K, N, generator=g) / K ** 0.5).bfloat16()
                for c in configs:
                    o = G.gemv(x, w, config=c)
                    check(o, x, w, f"M={M} K={K} N={N} {c}")
                    n_checked += 1
                    # each split path again (one row: the FMA, dot and swapped sums), with the counters it reset
                    if c is not None and c.split > 1 and K == 100 and M == 1:
                        again = torch.full_like(o, float("nan"))
                        G.gemv(x, w, out=again, config=c)
                        assert torch.equal(o, again), "split partials summed in another order"
        assert int(G._counters(torch.device("cpu")).abs().sum()) == 0, "arrival counters not reset"
        # fp16 and a strided x (a column slice of a wider activation)
        xw = torch.randn(5, 2 * 90, generator=g).half()
        w = (torch.randn(90, 33, generator=g) / 90 ** 0.5).half()
        check(G.gemv(xw[:, ::2], w, config=G.Config(16, 16, 2, True, 4, 2)), xw[:, ::2], w, "fp16 strided")
        # the engine's decode shapes are exact multiples: a DeltaNet output projection at M = 4
        x = torch.randn(4, 512, generator=g).bfloat16()
        w = (torch.randn(512, 256, generator=g) / 512 ** 0.5).bfloat16()
        check(G.gemv(x, w), x, w, "default config, split")
        print("checked", n_checked + 2)
    ''')
    assert "checked 35" in out, out


@needs_triton
def test_k_major_weights_match_fp32_reference_under_interpreter():
    """w given K-major (a [N, K] weight seen as its transpose, rows of the storage padded too): every path
    of the row-major test (FMA with the products summed once after the loop or per tile, tensor-core dot,
    K split, first block peeled) and the fused gate/up, against the fp32 reference; the dispatch takes it."""
    out = _interpret('''
        from labkit.engine.model import gemv as G
        g = torch.Generator().manual_seed(5)
        n = 0
        for M in (1, 3, 16):
            small = [None, G.Config(32, 16, 1, M > 1, 4, 2), G.Config(32, 16, 3, M > 1, 4, 2),
                     G.Config(64, 32, 5, M > 1, 4, 2, pdl=True), G.Config(32, 16, 1, True, 4, 2, swap=True)]
            if M == 1:
                small += [G.Config(32, 16, 3, False, 4, 2, acc2d=True), G.Config(16, 64, 1, False, 4, 2, acc2d=True),
                          G.Config(32, 16, 2, False, 4, 2, pdl=True, acc2d=True)]
            if M == 16:     # the kernel M = 3 runs (M is no constexpr), every padded row real: plain, split, swapped
                small = [None, G.Config(32, 16, 3, True, 4, 2), G.Config(32, 16, 1, True, 4, 2, swap=True)]
            for K, N in ((100, 70), (257, 150)):
                x = torch.randn(M, K, generator=g).bfloat16()
                store = torch.zeros(N, K + 24).bfloat16()                 # rows padded past K
                store[:, :K] = (torch.randn(N, K, generator=g) / K ** 0.5).bfloat16()
                w = store[:, :K].t()                                      # [K, N], stride (1, K + 24)
                assert w.stride() == (1, K + 24) and G.layout_ok(w)
                # every path on [100, 70]; on [257, 150] the defaults, the engine's (one row: [16, 512] tiles, ten,
                # the last partial; more rows: [64, 128] swapped), where the small tiles would add only the
                # interpreter's time (it grows with the programs and their K blocks)
                for c in small if K == 100 else [None]:
                    o = G.gemv(x, w, config=c)
                    check(o, x, w, f"K-major M={M} K={K} N={N} {c}")
                    n += 1
                    if c is None:
                        default = o
                assert G.default_config(M, N, K, k_major=True).acc2d == (M == 1)
                assert torch.equal(G.matmul(x, w), default)               # the entry takes the kernel
                if N % 2 == 0:                                            # [gate | up] K-major
                    ref = unrounded(silu_glu_reference, x, w)
                    glu = [None] + ([G.Config(32, 16, 3, M > 1, 4, 2, acc2d=M == 1)] if K == 100 and M < 16 else [])
                    for c in glu:
                        o = G.gemv(x, w, glu=True, config=c)
                        tol = 2 * bf16_ulp(ref) + 2.0 ** -16 * ref.abs().max()
                        assert bool(((o.float() - ref).abs() <= tol).all()), f"K-major glu M={M} {c}"
                        n += 1
        assert int(G._counters(torch.device("cpu")).abs().sum()) == 0
        # the default mode takes the kernel for one row against K-major weights only
        G.set_mode("auto")
        wk, wr = w, w.contiguous()
        x1, x4 = torch.randn(1, K).bfloat16(), torch.randn(4, K).bfloat16()
        assert G.kernel_applies(x1, wk) and not G.kernel_applies(x1, wr) and not G.kernel_applies(x4, wk)
        G.set_mode("0")
        assert not G.kernel_applies(x1, wk)
        G.set_mode("1")
        assert G.kernel_applies(x4, wk) and G.kernel_applies(x4, wr)
        print("k-major checked", n)
    ''')
    assert "k-major checked 27" in out, out


@needs_triton
def test_norm_fused_product_matches_its_definition_under_interpreter():
    """The residual add and RMSNorm inside the kernel (`gemv(norm=...)`, the engine's `norm_matmul` and
    `norm_silu_glu`): h = x + d comes back exactly, and the product is within the plain product's
    tolerance of the fp32 product of the normed input, for every path (one row with the products summed
    once or per tile, the tensor-core path, K split, the first block peeled, gate/up fused), K-major and
    row-major, a norm weight that is not ones. The interpreter rounds fp32 -> bf16 toward zero (checked
    here): the reference rounds h, h * r and the weight's product the same way, so only the fp32 sums'
    order separates them."""
    out = _interpret('''
        from labkit.engine.model import gemv as G
        import triton, triton.language as tl
        @triton.jit
        def cast(x_ptr, o_ptr):
            tl.store(o_ptr, tl.load(x_ptr).to(tl.bfloat16))
        one = torch.empty(1, dtype=torch.bfloat16)
        cast[(1,)](torch.tensor([1.0 + 3 * 2.0 ** -9]), one)          # 1.0 if it truncates, else 1 + 2^-7
        truncates = float(one) == 1.0
        def bf16(t):                              # the cast the kernel's roundings do where it runs
            if truncates:
                return (t.float().view(torch.int32) & -65536).view(torch.float32).bfloat16()
            return t.bfloat16()
        def normed(x, d, nw, eps):
            h = bf16(x.float() + d.float())
            hf = h.float()
            xn = bf16(hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps))
            return h, bf16(xn.float() * nw.float())
        g = torch.Generator().manual_seed(11)
        n = 0
        for M in (1, 3, 16):
            for K, N in ((100, 70), (257, 150)):
                x, d = torch.randn(M, K, generator=g).bfloat16(), torch.randn(M, K, generator=g).bfloat16()
                nw = (1 + 0.25 * torch.randn(K, generator=g)).bfloat16()
                store = (torch.randn(N, K, generator=g) / K ** 0.5).bfloat16()
                h_ref, xn = normed(x, d, nw, 1e-6)
                for w in (store.t(), store.t().contiguous()):            # K-major, row-major
                    # every path on [100, 70] (at M = 16, the kernel M = 3 runs, M being no constexpr, with every
                    # padded row real: plain, split, swapped); on [257, 150] the defaults: [128]-wide row-major
                    # tiles, the last partial, K split (3 splits at one row, 2 at more); at more rows 16 padded
                    # rows, whose row sums take two chunks of 256 (of K rounded up to 512). The small tiles there
                    # would add only the interpreter's time (it grows with the programs and their K blocks).
                    configs = [None]
                    if K == 100:
                        configs += [G.Config(32, 16, 3, M > 1, 4, 2),
                                    G.Config(32, 16, 3, True, 4, 2, pdl=True, swap=True)]
                    if K == 100 and M < 16:
                        configs.append(G.Config(64, 32, 5, M > 1, 4, 2, pdl=True))
                    if K == 100 and M == 1:
                        configs += [G.Config(16, 64, 1, False, 4, 2, acc2d=True),
                                    G.Config(32, 16, 2, False, 4, 2, pdl=True, acc2d=True)]
                    for c in configs:
                        h, o = G.gemv(x, w, norm=(d, nw, 1e-6), config=c)
                        assert torch.equal(h, h_ref), f"h M={M} K={K} {c}"
                        check(o, xn, w, f"normed M={M} K={K} N={N} {c}")
                        n += 1
                    if N % 2 == 0:
                        ref = unrounded(silu_glu_reference, xn, w)
                        glu = [None] + ([G.Config(32, 16, 3, M > 1, 4, 2, acc2d=M == 1)] if K == 100 and M < 16 else [])
                        for c in glu:
                            h, o = G.gemv(x, w, glu=True, norm=(d, nw, 1e-6), config=c)
                            tol = 2 * bf16_ulp(ref) + 2.0 ** -16 * ref.abs().max()
                            assert torch.equal(h, h_ref) and bool(((o.float() - ref).abs() <= tol).all()), f"glu M={M} {c}"
                            n += 1
        assert int(G._counters(torch.device("cpu")).abs().sum()) == 0
        from labkit.engine.model.layers import RMSNorm
        def Norm(weight, eps):                    # the layers' own norm, with this weight
            n = RMSNorm(weight.shape[0], weight.dtype, "cpu", eps)
            n.weight.data.copy_(weight)
            return n
        # the engine's entries: "auto" fuses the norm at one row against K-major weights (at more rows
        # only as far as LABKIT_GEMV_NORM_ROWS asks, here 16), else the torch ops exactly
        assert G._NORM_ROWS == 1
        G.set_mode("auto")
        assert not G.norm_applies(x[:16].contiguous(), d[:16].contiguous(), Norm(nw, 1e-6), store.t())
        G._NORM_ROWS = 16
        norm = Norm(nw, 1e-6)
        wk, wr = store.t(), store.t().contiguous()
        for M, w, fused in ((1, wk, True), (16, wk, True), (3, wr, False)):
            xm, dm = x[:M].contiguous(), d[:M].contiguous()
            assert G.norm_applies(xm, dm, norm, w) == fused
            h, o = G.norm_matmul(xm, dm, norm, w)
            if fused:
                assert torch.equal(o, G.gemv(xm, w, norm=(dm, nw, 1e-6))[1])
            else:
                assert torch.equal(h, xm + dm) and torch.equal(o, norm(xm + dm) @ w)
        G._NORM = False
        assert not G.norm_applies(x[:1], d[:1], norm, wk)
        h, o = G.norm_matmul(x[:1], d[:1], norm, wk)
        assert torch.equal(o, G.matmul(norm(x[:1] + d[:1]), wk))
        print("truncates", truncates, "norm checked", n)
    ''')
    assert "norm checked 48" in out, out


def test_weights_hold_the_same_values_in_either_layout():
    """make_weight: K-major (stored [N, K], held as its transpose, unit row stride) and row-major hold the
    same seeded matrix, padded columns zero in both; the model's default is K-major."""
    from labkit.engine.model.layers import K_MAJOR, make_weight
    for pad in (False, True):
        a = make_weight(torch.Generator().manual_seed(2), 48, 37, torch.bfloat16, "cpu", pad=pad, k_major=True)
        b = make_weight(torch.Generator().manual_seed(2), 48, 37, torch.bfloat16, "cpu", pad=pad, k_major=False)
        assert a.shape == b.shape == (48, 64 if pad else 37) and torch.equal(a, b)
        assert a.stride(0) == 1 and b.stride(1) == 1
        assert not a[:, 37:].any()
    assert K_MAJOR == (os.environ.get("LABKIT_WEIGHTS", "nk") == "nk")


@needs_triton
def test_fused_gate_up_silu_matches_fp32_reference_under_interpreter():
    """silu(x @ gate) * (x @ up) from one pass over [gate | up], rounded once, against the same in fp32;
    K split too (the last program applies the activation to the summed partials)."""
    out = _interpret('''
        from labkit.engine.model import gemv as G
        g = torch.Generator().manual_seed(3)
        n = 0
        for M in (1, 3, 16):
            for K, F in ((100, 35), (257, 150)):
                x = torch.randn(M, K, generator=g).bfloat16()
                w = (torch.randn(K, 2 * F, generator=g) / K ** 0.5).bfloat16()
                ref = unrounded(silu_glu_reference, x, w)
                # every config on [100, 35] (the small tiles' K split, 3, 3 and 1 blocks of 16; at M = 16, the
                # kernel M = 3 runs, M being no constexpr, with every padded row real: plain and split); on
                # [257, 150] the default, whose [128] tiles are split there (3 splits at one row, 2 at more): the
                # small tiles there would add only the interpreter's time
                configs = [None, G.Config(32, 16, 3, M > 1, 4, 2)]
                if M < 16:
                    configs += [G.Config(32, 16, 1, M > 1, 4, 2), G.Config(32, 16, 3, M > 1, 4, 2, pdl=True)]
                for c in configs if K == 100 else configs[:1]:
                    o = G.gemv(x, w, glu=True, config=c)
                    assert o.shape == (M, F) and o.dtype == torch.bfloat16
                    err = (o.float() - ref).abs()
                    tol = 2 * bf16_ulp(ref) + 2.0 ** -16 * ref.abs().max()
                    assert bool((err <= tol).all()), f"M={M} K={K} F={F} {c}: {err.max().item()}"
                    n += 1
                    if c is None:
                        default = o
                if M == 3:     # the entry the FFN calls takes the kernel here
                    assert torch.equal(G.silu_glu(x, w), default)
        assert int(G._counters(torch.device("cpu")).abs().sum()) == 0
        print("glu checked", n)
    ''')
    assert "glu checked 13" in out, out


@needs_triton
def test_matmul_takes_the_kernel_for_up_to_16_rows_also_when_compiled():
    """Under the interpreter the kernel runs on CPU tensors: `matmul` sends 1..16 rows to it (counted),
    17 rows and the switched-off kernel to `x @ w` (bit-equal), and a torch.compile'd function keeps the
    custom op in its graph (the kernel runs, the result matches)."""
    out = _interpret('''
        from labkit.engine.model import gemv as G
        calls = []
        real = G.gemv
        def counting(x, w, out=None, config=None, glu=False):
            calls.append(tuple(x.shape))
            return real(x, w, out=out, config=config, glu=glu)
        G.gemv = counting
        g = torch.Generator().manual_seed(1)
        w = (torch.randn(96, 80, generator=g) / 96 ** 0.5).bfloat16()
        for M in (1, 16):
            x = torch.randn(M, 96, generator=g).bfloat16()
            check(G.matmul(x, w), x, w, f"matmul M={M}")
        assert calls == [(1, 96), (16, 96)], calls
        x17 = torch.randn(17, 96, generator=g).bfloat16()
        assert torch.equal(G.matmul(x17, w), x17 @ w) and len(calls) == 2, "17 rows went to the kernel"
        G.set_enabled(False)
        assert torch.equal(G.matmul(x17[:4], w), x17[:4] @ w) and len(calls) == 2, "kernel off but called"
        G.set_enabled(True)
        assert torch.equal(G.matmul(x17[:4].float(), w.float()), x17[:4].float() @ w.float()) and len(calls) == 2

        def block(x, w):
            return torch.nn.functional.silu(G.matmul(x * 2.0, w)) + 1.0
        x = torch.randn(4, 96, generator=g).bfloat16()
        fn = torch.compile(block, dynamic=False, backend="aot_eager", fullgraph=True)
        got = fn(x, w)
        assert len(calls) == 3, f"compiled graph did not run the kernel: {calls}"
        assert torch.equal(got, block(x, w)) and len(calls) == 4, "compiled differs from eager"
        check(G.matmul(x * 2.0, w), x * 2.0, w, "the compiled block's product")

        # inductor, as the engine compiles its blocks: the ops stay in the graph, the elementwise work
        # around them is fused (in fp32, so that part is equal within bf16 rounding, not bit-equal)
        w_gu = (torch.randn(96, 64, generator=g) / 96 ** 0.5).bfloat16()
        def ffn_like(x, w, w_gu):
            return torch.nn.functional.silu(G.matmul(x * 2.0, w)) + 1.0, G.silu_glu(x, w_gu)
        n0 = len(calls)
        a = torch.compile(ffn_like, dynamic=False, fullgraph=True)(x, w, w_gu)
        assert len(calls) == n0 + 2, "inductor's graph did not run both kernels"
        b = ffn_like(x, w, w_gu)
        assert torch.equal(a[1], b[1])
        assert torch.allclose(a[0].float(), b[0].float(), rtol=2 ** -7, atol=2 ** -7)
        print("dispatch ok")
    ''')
    assert "dispatch ok" in out



@needs_triton
def test_every_weight_product_of_a_decode_block_takes_the_kernel():
    """The layers' decode paths call the kernel for each weight (QSA and DeltaNet input and output
    projections, the FFN's fused gate/up and its down projection), at batch 3 here (under the
    interpreter, where the kernel runs on CPU), and give what they give with the kernel off within
    bf16 rounding; a 40-token prefill chunk stays on `x @ w`."""
    out = _interpret('''
        from labkit.engine import HybridModel
        from labkit.engine.model import gemv as G, hybrid as Hy
        from labkit.shapes import PRESETS
        calls = []
        real = G.gemv
        def counting(x, w, out=None, config=None, glu=False, norm=None):
            calls.append((tuple(w.shape), glu, norm is not None))
            return real(x, w, out=out, config=config, glu=glu, norm=norm)
        G.gemv = counting
        s = PRESETS["tiny"]
        model = HybridModel(s, "cpu", seed=0)
        qsa = next(b for b in model.blocks if b.kind == "qsa")
        dn = next(b for b in model.blocks if b.kind == "dn")
        g = torch.Generator().manual_seed(0)
        x = torch.randn(3, s.hidden, generator=g).bfloat16()
        pos = torch.tensor([5, 9, 30])
        from labkit.engine.model.layers import dn_state_shapes
        (H, dk, dv), (C, kw) = dn_state_shapes(s)
        def run():
            conv = torch.zeros(3, C, kw).bfloat16()
            zero = torch.zeros_like(x)
            h0, q, k, v, la, beta, z = Hy.dn_pre(dn, x, zero, conv)
            o = torch.randn(3, H, dv, generator=torch.Generator().manual_seed(1))
            y1 = Hy.dn_post(dn, o, z)
            h1, y2 = Hy.ffn_residual(dn, h0, y1)
            h2, qq, gate, kv_row, k8, sc, iq, iw = Hy.qsa_pre(qsa, h1, y2, pos)
            y3 = Hy.qsa_out(qsa, qq.flatten(1), gate)
            return [t.float() for t in (q, k, v, z, y1, h1 + y2, kv_row, h2 + y3)]
        on = run()
        # the FFN's gate/up with its norm and the residual add inside (the unfused mixers' pieces here
        # take the norm as torch ops; the fused ones' `dn_project` and `qsa_project` as the FFN does)
        want = [(tuple(dn.mixer.w_in.shape), False, False), (tuple(dn.mixer.w_o.shape), False, False),
                (tuple(dn.ffn.w_gu.shape), True, True), (tuple(dn.ffn.w_d.shape), False, False),
                (tuple(qsa.mixer.w_in.shape), False, False), (tuple(qsa.mixer.w_o.shape), False, False)]
        assert calls == want, calls
        G.set_enabled(False)
        off = run()
        G.set_enabled(True)
        assert len(calls) == len(want)
        for i, (a, b) in enumerate(zip(on, off)):
            rel = ((a - b).norm() / b.norm()).item()
            assert rel < 2e-2, (i, rel)
        conv = torch.zeros(C, kw).bfloat16()
        S = torch.zeros(H, dk, dv)
        dn.mixer.forward_seq(torch.randn(40, s.hidden, generator=g).bfloat16(), S, conv)
        assert len(calls) == len(want), "a 40-row prefill chunk went to the kernel"
        print("blocks ok")
    ''')
    assert "blocks ok" in out

@needs_triton
def test_padded_weight_rows_take_the_kernel_and_match():
    """A weight held as the [K, N] view of a [K, ld] buffer (rows padded to an aligned length, as the
    layers hold the QSA input projection) goes through the kernel with its row stride, plain and
    gate/up fused, and K split: the padding columns (filled with NaN here) never reach an output."""
    out = _interpret('''
        from labkit.engine.model import gemv as G
        g = torch.Generator().manual_seed(5)
        for M, K, N, ld in ((1, 100, 70, 128), (4, 257, 70, 96), (16, 64, 130, 192)):
            buf = torch.full((K, ld), float("nan")).bfloat16()
            buf[:, :N] = (torch.randn(K, N, generator=g) / K ** 0.5).bfloat16()
            w = buf[:, :N]
            x = torch.randn(M, K, generator=g).bfloat16()
            assert G.kernel_applies(x, w)
            for c in (None, G.Config(32, 16, 3, M > 1, 4, 2)):
                check(G.gemv(x, w, config=c), x, w, f"padded M={M} K={K} N={N} ld={ld} {c}")
            if N % 2 == 0:
                ref = unrounded(silu_glu_reference, x, w)
                o = G.gemv(x, w, glu=True, config=G.Config(32, 16, 3, M > 1, 4, 2)).float()
                assert bool(((o - ref).abs() <= 2 * bf16_ulp(ref) + 2.0 ** -16 * ref.abs().max()).all())
        print("padded ok")
    ''')
    assert "padded ok" in out


def test_qsa_projection_is_padded_to_an_aligned_width_with_the_same_values():
    """The QSA input projection of the reference shape (9,540 columns) is held 9,600 wide: its first
    9,540 columns are the unpadded draw's values, the rest zeros, and `project` gives what the
    unpadded weight gives, bit for bit (the zero columns are cut off the product before the split)."""
    import dataclasses
    from labkit.engine.model import layers as Ly
    from labkit.shapes import PRESETS
    s = dataclasses.replace(PRESETS["qwen3.8-flash-next-standin"], hidden=64)
    qsa = Ly.QSALayer(s, torch.Generator().manual_seed(7), torch.bfloat16, "cpu")
    N = qsa.in_cols
    assert N % 8 != 0 and qsa.w_in.shape == (64, -(-N // 64) * 64)
    assert qsa.w_in.stride() == ((1, 64) if Ly.K_MAJOR else (qsa.w_in.shape[1], 1))
    plain = (torch.randn(64, N, generator=torch.Generator().manual_seed(7)) / 8).bfloat16()
    assert torch.equal(qsa.w_in[:, :N], plain) and not qsa.w_in[:, N:].any()
    x, pos = torch.randn(3, 64).bfloat16(), torch.tensor([0, 5, 9])
    got = qsa.project(x, pos)
    with torch.no_grad():
        # the same layout as the layers' (a product's bits depend on it on CPU)
        qsa.w_in = torch.nn.Parameter(plain.t().contiguous().t() if Ly.K_MAJOR else plain, requires_grad=False)
    for a, b in zip(got, qsa.project(x, pos)):
        assert torch.equal(a, b)


def test_cpu_matmul_is_plain_matmul_eager_and_compiled():
    """Without the interpreter a CPU tensor never meets the kernel: bit-equal to `x @ w` for any rows,
    eager and inside torch.compile (the engine's CPU results stay what they were)."""
    assert not G.kernel_applies(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(8, 4, dtype=torch.bfloat16))
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(64, 48, generator=g) / 8).bfloat16()
    for M in (1, 3, 16, 17, 40):
        x = torch.randn(M, 64, generator=g).bfloat16()
        assert torch.equal(G.matmul(x, w), x @ w)

    w_gu = (torch.randn(64, 96, generator=g) / 8).bfloat16()
    for M in (1, 16, 17):
        x = torch.randn(M, 64, generator=g).bfloat16()
        gate, up = (x @ w_gu).chunk(2, dim=-1)
        assert torch.equal(G.silu_glu(x, w_gu), torch.nn.functional.silu(gate) * up)

    def f(x, w):
        return G.matmul(x, w).float().relu()
    x = torch.randn(4, 64, generator=g).bfloat16()
    assert torch.equal(torch.compile(f, dynamic=False, fullgraph=True)(x, w), f(x, w))     # inductor


def test_custom_op_traces_with_its_fake():
    """The op's fake gives the shape and dtype compile needs without running anything."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(3, 64, dtype=torch.bfloat16)
        w = torch.empty(64, 40, dtype=torch.bfloat16)
        y = torch.ops.labkit.gemv(x, w)
    assert y.shape == (3, 40) and y.dtype == torch.bfloat16


@needs_triton
@pytest.mark.parametrize("x_shape,w_shape,dtypes,msg", [
    ((17, 8), (8, 4), (torch.bfloat16, torch.bfloat16), "17 rows"),
    ((2, 8), (9, 4), (torch.bfloat16, torch.bfloat16), "not [M, K] and [K, N]"),
    ((2, 8), (8, 4), (torch.bfloat16, torch.float16), "dtypes"),
    ((2, 8), (8, 4), (torch.float32, torch.float32), "dtypes"),
])
def test_bad_input_is_one_clear_line(x_shape, w_shape, dtypes, msg):
    x, w = torch.zeros(x_shape, dtype=dtypes[0]), torch.zeros(w_shape, dtype=dtypes[1])
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        G.gemv(x, w)


@needs_triton
@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_bench_script_runs_end_to_end_on_cpu(tmp_path, layout):
    """scripts/gemv_bench.py's dry run: every code path of the GPU measurement (sweep, whole-step chains,
    JSON and table) on CPU under the interpreter with the tiny shape, the GEMV on row-major and on K-major
    weights, at one row (the FMA path) and four (the tensor-core path, the script's code the default's 16
    rows run too); its numbers mean nothing."""
    import json
    script = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "gemv_bench.py")
    p = subprocess.run([sys.executable, script, str(tmp_path), "--dry-run", "--shape", "tiny", "--layout", layout,
                        "--rows", "1,4"],
                       capture_output=True, text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((tmp_path / "gemv_bench.json").read_text())
    assert r["gemv_layout"] == layout
    if layout == "nk":    # the sweep tried K-major configurations (the one-row FMA path sums once)
        assert all(x["gemv_config"]["acc2d"] == (x["M"] == 1) for x in r["per_matrix"])
    assert r["dry_run"] and len(r["per_matrix"]) == 7 * 2 and [w["M"] for w in r["whole_step"]] == [1, 4]
    assert all("gemv_best" in x and x["gemv_max_abs_err"] <= 0.25 for x in r["per_matrix"])
    assert r["whole_step"][0]["matrices"] == 8 * 4 + 1          # tiny: 8 layers, 4 weights each, the head
    assert "gemv_glu" in next(x for x in r["per_matrix"] if x["matrix"] == "ffn.w_gu")
    md = (tmp_path / "gemv_bench.md").read_text()
    assert md.count("\n| ") >= 14 + 2 + 2


@needs_triton
def test_rows_bench_script_runs_end_to_end_on_cpu(tmp_path):
    """scripts/gemv_rows_bench.py's dry run: every path of the GPU measurement (cuBLAS, the kernel as x @ w and
    swapped, a tile sweep at M = 4, the whole-step chains, the JSON) on CPU under the interpreter with the tiny
    shape; its timings mean nothing, but the swapped product is checked against the fp32 product."""
    import json
    script = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "gemv_rows_bench.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, script, str(tmp_path), "--dry-run", "--shape", "tiny"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((tmp_path / "bench_swap.json").read_text())
    assert r["dry_run"] and r["shape"] == "tiny"
    matrices = ("qsa.w_in", "qsa.w_o", "dn.w_in", "dn.w_o", "ffn.w_gu", "ffn.w_d")      # the head left out
    assert sorted((x["matrix"], x["M"]) for x in r["rows"]) == sorted((n, m) for n in matrices for m in (4, 16))
    for x in r["rows"]:
        assert all(x[k] > 0 for k in ("cublas_nk", "dot", "swap")), x
        assert x["swap_err"] <= 0.07, x                 # 2 bf16 ulps of outputs below 8 (N(0, 1) here)
        assert ("best_cfg" in x) == (x["M"] == 4) and (x["M"] != 4 or x["best_cfg"]["swap"])
    assert sorted(r["chain"]) == sorted(f"{k}_M{m}" for k in ("cublas_nk", "dot", "swap", "swap_best") for m in (4, 16))
    bad = subprocess.run([sys.executable, script, str(tmp_path / "x"), "--dry-run", "--rows", "1,4"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode != 0 and bad.stderr.strip().count("\n") == 0 and "--rows" in bad.stderr
    assert not (tmp_path / "x").exists()
