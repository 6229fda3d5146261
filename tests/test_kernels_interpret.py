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
    from labkit.engine import gather
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
    print("kernels ok")
''')


def test_gather_and_scatter_kernels_under_interpreter(tmp_path):
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0 and "kernels ok" in p.stdout, p.stderr[-3000:]
