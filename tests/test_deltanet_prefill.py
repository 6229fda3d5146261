"""DeltaNet's prefill path on the GPU (`deltanet_prefill.py`): the short causal conv + silu kernel against the torch
form's conv under Triton's interpreter (in a subprocess: the variable must be set before triton is imported), and
the whole scan (the kernel and flash-linear-attention's grouped, in-kernel-normalised delta rule) against the torch
form of `DeltaNetLayer.forward_seq` at the reference shape on a GPU (marked `gpu`)."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

SCRIPT = textwrap.dedent('''
    import torch
    from labkit.engine.model import deltanet_prefill as D
    g = torch.Generator().manual_seed(0)
    C, K = 200, 4                                   # channels not a multiple of the kernel's 128
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for T in (1, 2, 3, 70):                     # chunks shorter than the window, and longer
            rows = torch.randn(T, C + 37, generator=g).to(dtype)
            qkv = rows[:, 5:5 + C]                  # strided rows, as the projection's split gives them
            w = torch.randn(C, K, generator=g).to(dtype)
            window = torch.randn(C, K - 1, generator=g).to(dtype)
            st_got, st_want = window.clone(), window.clone()
            got = D.causal_conv_silu(qkv, st_got, w)
            want = D.causal_conv_silu_reference(qkv, st_want, w)
            assert got.dtype == want.dtype == dtype and got.shape == (T, C)
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
            assert torch.equal(st_got, st_want), (T, dtype)          # the next chunk's window
            # the window matters: another window, another first output row
            other = D.causal_conv_silu(qkv, window.clone() + 1, w)
            assert not torch.allclose(other[0].float(), got[0].float())
    print("conv ok")
''')


@needs_triton
def test_the_conv_kernel_matches_the_torch_form_under_interpreter():
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0 and "conv ok" in p.stdout, p.stderr[-3000:]


def test_bad_shapes_fail_with_one_line():
    from labkit.engine.model import deltanet_prefill as D
    with pytest.raises(ValueError, match="do not fit"):
        D.causal_conv_silu(torch.zeros(4, 8), torch.zeros(8, 2), torch.zeros(8, 4))


@pytest.mark.gpu
def test_the_scan_on_fla_matches_the_torch_form_at_the_reference_shape():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("fla.ops.gated_delta_rule")
    from labkit.engine.model import layers as L
    from labkit.shapes import ModelShape
    s = ModelShape.from_name("qwen3.8-flash-next")
    layer = L.DeltaNetLayer(s, torch.Generator(device="cuda").manual_seed(0), torch.bfloat16, torch.device("cuda"))
    (H, dk, dv), (C, W) = L.dn_state_shapes(s)
    g = torch.Generator(device="cuda").manual_seed(1)
    S0 = torch.randn(H, dk, dv, generator=g, device="cuda") * 0.05
    conv0 = torch.randn(C, W, generator=g, device="cuda").bfloat16()
    runs = {}
    for kernel in ("torch", "fla"):
        before, L.DN_PREFILL = L.DN_PREFILL, kernel
        try:
            S, conv, outs = S0.clone(), conv0.clone(), []
            for T in (300, 2):                      # two chunks: the state and the window carried between them
                x = torch.randn(T, s.hidden, generator=torch.Generator(device="cuda").manual_seed(T),
                                device="cuda").bfloat16()
                with torch.inference_mode():
                    outs.append(layer.forward_seq(x, S, conv).float())
        finally:
            L.DN_PREFILL = before
        runs[kernel] = (outs, S, conv)
    (o_t, S_t, c_t), (o_f, S_f, c_f) = runs["torch"], runs["fla"]
    for a, b in zip(o_f, o_t):
        assert ((a - b).norm() / b.norm()).item() < 2e-2             # bf16 q/k/v against fp32
    assert ((S_f - S_t).norm() / S_t.norm()).item() < 2e-2
    assert torch.equal(c_f, c_t)
