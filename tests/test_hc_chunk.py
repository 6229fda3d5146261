"""The hyper-connections' mix over a prefill chunk (`hc_chunk.py`) against eager's (`hybrid.hc_in`: the stream h + d
and `HyperConnection.mix`) under TRITON_INTERPRET=1 (a subprocess: the variable must be set before triton is
imported): the stream bit for bit (each add rounded where eager rounds), y and the injection logits within 1%, with
the addend dense and pending (with and without the n-gram rows), at widths with several column blocks and a
partial last row block. The GPU check at the published widths is in test_gpu_portable.py."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

KERNEL = textwrap.dedent('''
    import types
    import torch
    from labkit.engine.model import hc_chunk, hybrid, interpreter
    from labkit.engine.model.hc_mix import Pending
    from labkit.engine.model.layers import HyperConnection
    interpreter.fast_device_calls()
    worst = {}
    for H, rank, N in ((128, 16, 21), (640, 80, 70)):
        s = types.SimpleNamespace(hc_count=4, hc_lowrank=rank, hidden=H)
        g = torch.Generator().manual_seed(H)
        hc = HyperConnection(s, g, torch.bfloat16, "cpu")
        hc.norm_w.data = (1 + 0.2 * torch.randn(hc.norm_w.shape, generator=g)).bfloat16()
        for kind in ("tensor", "pending", "pending+ngram"):
            h = (torch.randn(N, 4, H, generator=g) * torch.tensor([0.5, 1.0, 3.0, 8.0])[:, None]).view(N, -1).bfloat16()
            inj, o = torch.randn(N, 4, generator=g).bfloat16(), torch.randn(N, H, generator=g).bfloat16()
            e = torch.randn(N, H, generator=g).bfloat16() if "ngram" in kind else None
            d = torch.randn(N, 4 * H, generator=g).bfloat16() if kind == "tensor" else Pending(inj, o, e)
            assert hc_chunk.applies(hc, h)
            stream, y, zero, got_inj = hc_chunk.mix(hc, h, d)
            want_stream, want_y, _, want_inj = hybrid.hc_in(hc, h, d if kind == "tensor" else d.dense())
            assert torch.equal(stream, want_stream), (H, kind, "stream")
            assert torch.equal(zero, torch.zeros_like(zero))
            for name, a, b in (("y", y, want_y), ("inj", got_inj, want_inj)):
                err = ((a.float() - b.float()).norm() / b.float().norm()).item()
                worst[name] = max(worst.get(name, 0.0), err)
                assert err < 1e-2, (H, kind, name, err)
    print("ok", worst)
''')


@needs_triton
def test_the_chunk_mix_matches_eagers_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-c", KERNEL], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]
