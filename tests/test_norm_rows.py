"""A prefill chunk's row kernels (`norm_rows`) against eager's ops under TRITON_INTERPRET=1 (a subprocess: the
variable must be set before triton is imported): the residual add and RMSNorm (h bit for bit, the normed rows within
a bf16 step) and DeltaNet's output gate (within two bf16 steps: the rounded norm, then the gate); few rows take
eager's ops themselves."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from labkit.engine.model.layers import RMSNorm
from labkit.engine.model.norm_rows import MIN_ROWS, add_norm

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def test_few_rows_are_eagers_ops():
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, torch.bfloat16, "cpu")
    x, d = torch.randn(MIN_ROWS - 1, 96, generator=g).bfloat16(), torch.randn(MIN_ROWS - 1, 96, generator=g).bfloat16()
    h, y = add_norm(x, d, norm)
    assert torch.equal(h, x + d) and torch.equal(y, norm(x + d))


KERNEL = textwrap.dedent('''
    import torch
    from labkit.engine.model import interpreter
    from labkit.engine.model.layers import RMSNorm
    from labkit.engine.model.norm_rows import add_norm
    interpreter.fast_device_calls()
    g = torch.Generator().manual_seed(1)
    for N, H in ((17, 96), (40, 640)):
        norm = RMSNorm(H, torch.bfloat16, "cpu")
        norm.weight.data = (1 + 0.3 * torch.randn(H, generator=g)).bfloat16()
        x = (torch.randn(N, H, generator=g) * 4).bfloat16()
        d = torch.randn(N, H, generator=g).bfloat16()
        h, y = add_norm(x, d, norm)
        assert torch.equal(h, x + d), (N, H)
        want = norm(x + d)
        assert ((y.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-6).all(), (N, H)
    # DeltaNet's output gate: per-head norm of o (fp32, rounded to bf16 first as eager), times silu(z)
    from labkit.engine.model.norm_rows import gated_norm
    for N, H, D in ((17, 3, 32), (33, 6, 16)):
        norm = RMSNorm(D, torch.bfloat16, "cpu")
        norm.weight.data = (1 + 0.3 * torch.randn(D, generator=g)).bfloat16()
        o, z = torch.randn(N, H, D, generator=g) * 2, torch.randn(N, H * D, generator=g).bfloat16()
        got = gated_norm(o, z, norm)
        want = (norm(o.to(z.dtype)) * torch.nn.functional.silu(z.view(N, H, D))).flatten(1)
        assert got is not None and got.shape == want.shape
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -6 + 1e-6).all(), (N, H, D)
    print("ok")
''')


@needs_triton
def test_the_one_pass_add_and_norm_matches_eagers_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-c", KERNEL], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]
