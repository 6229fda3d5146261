"""The small-batch GEMV on the GPU (marked `gpu`): every weight shape of the reference model at M = 1, 4,
16 against the fp32 reference (the tolerance of test_gemv.py: 2 bf16 ulps of each output, plus 2^-16 of
the largest for outputs near zero), bit-identical repeats and CUDA-graph replays (the split products'
arrival counters reset themselves), each on row-major and K-major weights, and a captured decode step with
the kernel equal to the step with cuBLAS within bf16 rounding (batch 4 with the kernel forced on; batch 1
with the engine's default, the kernel on the layers' K-major weights, the norms inside the products that
follow them), and the residual add and RMSNorm inside the kernel against torch's on those products."""
import dataclasses

import pytest
import torch

from labkit.engine import Engine, HybridModel, OffloadCache, get_strategy
from labkit.engine.drive.runner import DecodeRunner
from labkit.engine.model import gemv as G
from labkit.engine.model.layers import RMSNorm
from labkit.shapes import PRESETS

pytestmark = pytest.mark.gpu
REF = PRESETS["qwen3.8-flash-next-standin"]
MID = dataclasses.replace(REF, name="mid", layers=8, vocab=4096)


@pytest.fixture(autouse=True)
def kernel_on():
    """The kernel for every layout and 1-16 rows (by default the engine takes it at one row on K-major
    weights only); the mode before is restored."""
    was = G.mode()
    G.set_mode("1")
    yield
    G.set_mode(was)


def laid_out(w: torch.Tensor, layout: str) -> torch.Tensor:
    """w [K, N] row-major, or the same values K-major (stored [N, K], seen transposed)."""
    return w if layout == "kn" else w.t().contiguous().t()


def reference_weight_shapes(s=REF) -> dict[str, tuple[int, int]]:
    """[K, N] of each distinct weight a decode step multiplies by (the layers' and the head's)."""
    m = HybridModel(dataclasses.replace(s, layers=s.attn_every, vocab=8), "cuda")      # one block of each kind
    qsa = next(b for b in m.blocks if b.kind == "qsa")
    dn = next(b for b in m.blocks if b.kind == "dn")
    return {"qsa.w_in": tuple(qsa.mixer.w_in.shape), "qsa.w_o": tuple(qsa.mixer.w_o.shape),
            "dn.w_in": tuple(dn.mixer.w_in.shape), "dn.w_o": tuple(dn.mixer.w_o.shape),
            "ffn.w_gu": tuple(dn.ffn.w_gu.shape), "ffn.w_d": tuple(dn.ffn.w_d.shape),
            "lm_head": (s.hidden, s.vocab)}


def _check(out, x, w, what):
    ref = G.gemv_reference(x.float(), w.float())        # the reference before its rounding (exact on fp32 copies)
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2.0 ** -126))) - 7)
    err = (out.float() - ref).abs()
    tol = 2 * ulp + 2.0 ** -16 * ref.abs().max()
    assert bool((err <= tol).all()), f"{what}: max err {err.max().item()}"


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("M", [1, 4, 16])
def test_gemv_matches_reference_on_every_weight_shape(M, layout):
    g = torch.Generator(device="cuda").manual_seed(M)
    for name, (K, N) in reference_weight_shapes().items():
        w = laid_out((torch.randn(K, N, generator=g, device="cuda") / K ** 0.5).bfloat16(), layout)
        x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
        y = G.gemv(x, w)
        _check(y, x, w, f"{name} M={M}")
        assert torch.equal(G.gemv(x, w), y), f"{name} M={M}: repeat differs"
        assert torch.allclose(y.float(), (x @ w).float(), rtol=2 ** -6, atol=2 ** -12 * y.float().abs().max().item())
        if name == "ffn.w_gu":
            ref = G.silu_glu_reference(x.float(), w.float())
            h = G.gemv(x, w, glu=True)
            ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2.0 ** -126))) - 7)
            err = (h.float() - ref).abs()
            assert bool((err <= 2 * ulp + 2.0 ** -16 * ref.abs().max()).all()), f"gate/up M={M}: {err.max().item()}"
            assert torch.equal(G.silu_glu(x, w), h)
    torch.cuda.synchronize()
    assert int(G._counters(torch.device("cuda")).abs().sum()) == 0


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("M", [1, 4, 16])
def test_norm_fused_product_matches_on_every_normed_shape(M, layout):
    """The residual add and RMSNorm inside the kernel (`gemv(norm=...)`) on the products that take them
    (the input projections, the FFN's gate/up, the head): h is torch's x + d bit for bit; the product is
    within the plain product's tolerance of the fp32 product of torch's normed input, except where the
    kernel's normed input rounded to the neighbouring bf16 (its sum of squares in another order): those
    outputs, at most 2% of them, within one bf16 ulp of every normed input more; repeats bit-identical."""
    g = torch.Generator(device="cuda").manual_seed(20 + M)
    shapes = reference_weight_shapes()
    for name in ("qsa.w_in", "dn.w_in", "ffn.w_gu", "lm_head"):
        K, N = shapes[name]
        w = laid_out((torch.randn(K, N, generator=g, device="cuda") / K ** 0.5).bfloat16(), layout)
        x, d = (torch.randn(M, K, generator=g, device="cuda").bfloat16() for _ in range(2))
        nw = (1 + 0.25 * torch.randn(K, generator=g, device="cuda")).bfloat16()
        norm = RMSNorm(K, torch.bfloat16, "cuda", eps=1e-6)      # the layers' own norm, with this weight
        norm.weight.data.copy_(nw)
        h_ref = x + d
        xn = norm(h_ref)
        glu = name == "ffn.w_gu"
        h, y = G.gemv(x, w, glu=glu, norm=(d, nw, 1e-6))
        assert torch.equal(h, h_ref), f"{name} M={M}: h"
        ref = xn.float() @ w.float()
        slack = torch.exp2(torch.floor(torch.log2(xn.float().abs().clamp_min(2.0 ** -126))) - 7) @ w.float().abs()
        if glu:   # silu(gate) * up: the slack through the product rule, |d(silu)| <= 1.1
            (ga, up), (sg, su) = ref.chunk(2, dim=-1), slack.chunk(2, dim=-1)
            ref = torch.nn.functional.silu(ga) * up
            slack = 1.1 * sg * up.abs() + torch.nn.functional.silu(ga).abs() * su + 1.1 * sg * su
        ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(2.0 ** -126))) - 7)
        tol = 2 * ulp + 2.0 ** -16 * ref.abs().max()
        err = (y.float() - ref).abs()
        strict = (err <= tol).float().mean().item()
        assert strict >= 0.98, f"{name} M={M}: {strict:.4f} within the plain tolerance"
        assert bool((err <= tol + slack).all()), f"{name} M={M}: max err {err.max().item()}"
        assert torch.equal(G.gemv(x, w, glu=glu, norm=(d, nw, 1e-6))[1], y), f"{name} M={M}: repeat differs"
    torch.cuda.synchronize()
    assert int(G._counters(torch.device("cuda")).abs().sum()) == 0


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_split_products_repeat_bit_identically(layout):
    """The K-split products hand their partials over through arrival counters: 300 back-to-back products
    (several programs racing to be last in each tile) give the same bits every time."""
    g = torch.Generator(device="cuda").manual_seed(3)
    for K, N, M in [(4096, 2048, 1), (5632, 2048, 16), (2048, 11264, 4)]:
        w = laid_out((torch.randn(K, N, generator=g, device="cuda") / K ** 0.5).bfloat16(), layout)
        x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        assert G.default_config(M, N, K, sms, k_major=layout == "nk").split > 1
        first = G.gemv(x, w)
        outs = torch.empty(300, M, N, device="cuda", dtype=torch.bfloat16)
        for i in range(300):
            G.gemv(x, w, out=outs[i])
        torch.cuda.synchronize()
        assert bool((outs == first).all()), f"K={K} N={N} M={M}: a repeat differs"
        _check(first, x, w, f"K={K} N={N} M={M}")
        glu = G.gemv(x, w, glu=True) if N % 2 == 0 else None
        assert glu is None or all(torch.equal(G.gemv(x, w, glu=True), glu) for _ in range(50))


def test_gemv_chain_replays_from_a_cuda_graph():
    """Split and unsplit products back to back in one graph, replayed with new inputs."""
    g = torch.Generator(device="cuda").manual_seed(7)
    ws = [(torch.randn(K, N, generator=g, device="cuda") / K ** 0.5).bfloat16()
          for K, N in [(2048, 12352), (4096, 2048), (2048, 11264), (5632, 2048)]]
    xs = [torch.zeros(4, w.shape[0], device="cuda", dtype=torch.bfloat16) for w in ws]
    outs = [torch.empty(4, w.shape[1], device="cuda", dtype=torch.bfloat16) for w in ws]
    for x, w, o in zip(xs, ws, outs):
        G.gemv(x, w, out=o)                                   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, w, o in zip(xs, ws, outs):
            G.gemv(x, w, out=o)
    for rep in range(3):
        for x in xs:
            x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        for i, (x, w, o) in enumerate(zip(xs, ws, outs)):
            _check(o, x, w, f"replay {rep} product {i}")
            assert torch.equal(o, G.gemv(x, w)), f"replay {rep} product {i}: differs from eager"


@pytest.mark.parametrize("batch,mode", [(4, "1"), (1, "auto")])
@pytest.mark.parametrize("compile", [False, True])
def test_captured_decode_step_with_gemv_equals_cublas_step(compile, batch, mode):
    """The whole decode step captured in one graph, the kernel on (`mode`) and off: logits equal within
    bf16 (the products round differently, so not bit-equal). Each step's input tokens are set, not taken
    from the previous argmax, so a near-tie flipping cannot send the two runs down different paths."""
    from labkit.engine.model.layers import K_MAJOR
    model = HybridModel(MID, "cuda", seed=11)
    assert model.blocks[0].ffn.w_gu.stride(0) == (1 if K_MAJOR else model.blocks[0].ffn.w_gu.shape[1])
    logits, calls = {}, {}
    real = G.gemv

    def counting(*a, **k):
        calls[m] = calls.get(m, 0) + 1
        return real(*a, **k)
    try:
        G.gemv = counting
        for m in ("0", mode):
            G.set_mode(m)
            cache = OffloadCache.allocate(model, "device", batch, 4096)
            cache.fill_random_([3000, 1000, 2500, 700][:batch], seed=2)
            r = DecodeRunner(Engine(model, cache, get_strategy("resident"), 512, compile=compile), batch)
            r.prepare(warmup=1)
            assert r.graph_mode == "full"
            steps = []
            for i in range(3):
                r.state.tokens.copy_(torch.tensor([11, 222, 3333, 44][:batch], device="cuda") + i)
                r.step()
                steps.append(r.state.logits.float().clone())
            torch.cuda.synchronize()
            logits[m] = torch.stack(steps)
    finally:
        G.gemv = real
        G.set_mode("1")
    a, b = logits["0"], logits[mode]
    rel = ((a - b).norm() / a.norm()).item()
    assert rel < 3e-2, rel
    assert "0" not in calls, "the kernel ran with the mode off"
    # the kernel ran while the step was built (eager warm-up or the compiled graph's trace); under the
    # default mode only where the weights are K-major
    assert calls.get(mode, 0) > 0 or (mode == "auto" and not K_MAJOR), calls
    assert not torch.equal(a, b)
