"""A DeltaNet layer's decode step between its projections as one Triton kernel (`deltanet_mix`) against
its torch definition (`DeltaNetLayer.mix_reference`), under the Triton interpreter on CPU: output, the
recurrent state and the conv window, over several steps (the window shifts, the state accumulates),
with the conv window a strided slice of a larger buffer as the engine hands it over. In fp16 and fp32:
the interpreter converts fp32 to bf16 by truncation where the GPU rounds to nearest even, so a bf16 run
here would test the interpreter; the roundings the kernel makes are the same ops in every dtype. The
GPU check in bf16 on the reference shape, and of a whole model's logits over 64 steps, is in
test_gpu.py."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

SCRIPT = textwrap.dedent('''
    import dataclasses, torch
    from labkit.engine.model import deltanet_step as D
    from labkit.engine.model.layers import DeltaNetLayer
    from labkit.shapes import PRESETS
    assert D.FUSED_MIX
    n = 0
    # (the interpreter's cost grows with B x h x d / tile: two requests once, one where heads are wider)
    for (hk, h, d, K), B, dt in (((2, 4, 16, 4), 1, torch.float16), ((2, 4, 16, 4), 2, torch.float32),
                                 ((4, 4, 32, 3), 1, torch.float16)):
        s = dataclasses.replace(PRESETS["tiny"], dn_k_heads=hk, dn_v_heads=h, dn_head_dim=d, dn_conv=K)
        g = torch.Generator().manual_seed(n)
        layer = DeltaNetLayer(s, g, dt, "cpu")
        layer.o_norm.weight.copy_(1 + 0.3 * torch.randn(d, generator=g))
        C = layer.conv_ch
        S = torch.randn(B, h, d, d, generator=g) * 0.1
        conv_buf = torch.randn(2, B + 1, C, K - 1, generator=g).to(dt)         # [layers, slots, C, K-1]
        S2, conv2_buf = S.clone(), conv_buf.clone()
        conv, conv2 = conv_buf[1, 1:], conv2_buf[1, 1:]                         # a slice, as the engine's
        for step in range(4):
            y = (torch.randn(B, C + h * d + 2 * h, generator=g) * 2).to(dt)
            out = D.deltanet_mix(layer, y, S, conv, tile=8)         # several DV tiles per head
            ref = layer.mix_reference(y, S2, conv2)
            assert out.shape == ref.shape == (B, h * d) and out.dtype == dt
            err = (out.float() - ref.float()).abs()
            ulp = torch.finfo(dt).eps * ref.float().abs().clamp_min(2.0 ** -10)
            assert bool((err <= 4 * ulp + 1e-4).all()), f"{hk}/{h}/{d}/{K} {dt} B={B} step {step}: {err.max()}"
            assert torch.allclose(S, S2, atol=1e-5, rtol=1e-4), "state"
            assert torch.equal(conv_buf, conv2_buf), "conv window (and nothing beside it) shifted alike"
            n += 1
    print("mix checked", n)
''')


def test_deltanet_mix_kernel_matches_torch_definition_under_interpreter():
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0 and "mix checked 12" in p.stdout, p.stderr[-3000:]


def test_engine_cpu_path_is_the_torch_definition():
    """Off the GPU (no interpreter) `deltanet_mix` is `mix_reference` itself, bit for bit."""
    import torch
    from labkit.engine.model import deltanet_step as D
    from labkit.engine.model.layers import DeltaNetLayer
    from labkit.shapes import PRESETS
    s = PRESETS["tiny"]
    g = torch.Generator().manual_seed(0)
    layer = DeltaNetLayer(s, g, torch.bfloat16, "cpu")
    B, C = 2, layer.conv_ch
    y = torch.randn(B, C + s.dn_v_heads * s.dn_head_dim + 2 * s.dn_v_heads, generator=g).bfloat16()
    S = torch.randn(B, s.dn_v_heads, s.dn_head_dim, s.dn_head_dim, generator=g)
    conv = torch.randn(B, C, s.dn_conv - 1, generator=g).bfloat16()
    S2, conv2 = S.clone(), conv.clone()
    assert torch.equal(D.deltanet_mix(layer, y, S, conv), layer.mix_reference(y, S2, conv2))
    assert torch.equal(S, S2) and torch.equal(conv, conv2)
