"""The Triton kernels themselves, run on CPU under TRITON_INTERPRET=1 (set before triton is imported, so
in a subprocess), against their torch references on fresh random inputs."""
import importlib.util
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

SCRIPT = textwrap.dedent('''
    import torch
    from labkit.engine.model import gather
    assert gather.interpret_mode() and gather.HAVE_TRITON
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        src = torch.randint(-2**62, 2**62, (300, 40), generator=g)
        rows = torch.randint(0, 300, (37,), generator=g)
        for rpp in (1, 4):
            out = torch.full((37, 40), -1, dtype=torch.int64)
            gather.gather_rows(src, rows, out, rows_per_prog=rpp)
            assert torch.equal(out, src[rows]), "gather"
        dst = src.clone()
        wr = torch.randperm(300, generator=g)[:9]
        vals = torch.randint(-2**62, 2**62, (9, 40), generator=g)
        gather.scatter_rows(vals, wr, dst)
        ref = src.clone(); ref[wr] = vals
        assert torch.equal(dst, ref), "scatter"
    from labkit.engine.model import deltanet_step as D
    for B, H, HK in ((1, 4, 2), (3, 4, 4)):
        g = torch.Generator().manual_seed(B)
        S = torch.randn(B, H, 16, 64, generator=g)
        q, k = torch.randn(B, HK, 16, generator=g), torch.randn(B, HK, 16, generator=g)
        v, la, beta = torch.randn(B, H, 64, generator=g), -torch.rand(B, H, generator=g), torch.rand(B, H, generator=g)
        S2 = S.clone()
        o = D.delta_step(S, q, k, v, la, beta, tile=32)
        o2 = D.delta_step_reference(S2, q, k, v, la, beta)
        assert torch.allclose(o, o2, atol=1e-4, rtol=1e-4), "delta step output"
        assert torch.allclose(S, S2, atol=1e-5, rtol=1e-5), "delta step state"
    print("kernels ok")
''')


def test_gather_scatter_and_delta_step_kernels_under_interpreter(tmp_path):
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0 and "kernels ok" in p.stdout, p.stderr[-3000:]
