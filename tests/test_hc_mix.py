"""The hyper-connections' two-launch mix (`hc_mix.py`) against its definition (`layers.HyperConnection.mix` of the
stream h + d): under TRITON_INTERPRET=1 (a subprocess: the variable must be set before triton is imported) at
widths that give several K splits a copy, several column blocks and several rows; and the pending injection's
bookkeeping on the CPU. The GPU check (the published widths, PDL, a CUDA graph) is in test_gpu_portable.py."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from labkit.engine.model import hc_mix
from labkit.engine.model.layers import HyperConnection, inject

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def _hc(H=64, rank=8, seed=0):
    s = types.SimpleNamespace(hc_count=4, hc_lowrank=rank, hidden=H)
    return HyperConnection(s, torch.Generator().manual_seed(seed), torch.bfloat16, "cpu")


def test_a_pending_injection_is_the_eager_addend_and_settles_once():
    g = torch.Generator().manual_seed(1)
    inj, o, e = torch.randn(3, 4, generator=g).bfloat16(), torch.randn(3, 64, generator=g).bfloat16(), \
        torch.randn(3, 64, generator=g).bfloat16()
    p = hc_mix.Pending(inj, o)
    assert torch.equal(p.dense(), inject(inj, o))
    withe = hc_mix.add_rows(p, e)                  # the n-gram rows ride along, added after the injection
    assert isinstance(withe, hc_mix.Pending) and withe.e is e
    assert torch.equal(withe.dense(), inject(inj, o) + e.repeat(1, 4))
    d = torch.randn(3, 256, generator=g).bfloat16()
    assert torch.equal(hc_mix.add_rows(d, e), d + e.repeat(1, 4))
    h = torch.randn(3, 256, generator=g).bfloat16()
    settled = hc_mix.settle((h, withe))
    assert settled[0] is h and torch.equal(settled[1], withe.dense())
    assert hc_mix.settle((h, d)) == (h, d)


def test_the_kernels_are_not_taken_where_they_cannot_run():
    hc = _hc()
    h = torch.zeros(2, 256, dtype=torch.bfloat16)
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not hc_mix.applies(hc, h)           # CPU tensors without the interpreter: the torch pieces
    assert not hc_mix.applies(hc, h.float())
    assert not hc_mix.applies(hc, torch.zeros(hc_mix.HC_MAX_ROWS + 1, 256, dtype=torch.bfloat16))


KERNEL = textwrap.dedent('''
    import types
    import torch
    from labkit.engine.model import hc_mix, interpreter
    from labkit.engine.model.layers import HyperConnection
    interpreter.fast_device_calls()
    worst = {}
    # (hidden, rank): one split a copy and one column block; two splits a copy (BK 256) and two column blocks
    for H, rank in ((128, 16), (512, 80)):
        s = types.SimpleNamespace(hc_count=4, hc_lowrank=rank, hidden=H)
        g = torch.Generator().manual_seed(H)
        hc = HyperConnection(s, g, torch.bfloat16, "cpu")
        hc.norm_w.data = (1 + 0.2 * torch.randn(hc.norm_w.shape, generator=g)).bfloat16()
        for M, kind in ((1, "pending"), (3, "pending+ngram"), (2, "tensor"), (5, "pending+ngram")):
            # each copy at its own scale: a copy given another's 1/rms would be off by a factor
            h = (torch.randn(M, 4, H, generator=g) * torch.tensor([0.5, 1.0, 3.0, 8.0])[:, None]).view(M, -1).bfloat16()
            inj = torch.randn(M, 4, generator=g).bfloat16()
            o = torch.randn(M, H, generator=g).bfloat16()
            e = torch.randn(M, H, generator=g).bfloat16() if "ngram" in kind else None
            d = torch.randn(M, 4 * H, generator=g).bfloat16() if kind == "tensor" else hc_mix.Pending(inj, o, e)
            assert hc_mix.applies(hc, h)
            stream, y, zero, got_inj = hc_mix.hc_mix(hc, h, d)
            want_stream = h + (d if kind == "tensor" else d.dense())
            want_y, want_inj = hc.mix(want_stream)
            # each add rounded to bf16 as eager rounds it (`bf16_round`: the interpreter rounds as the GPU does)
            assert torch.equal(stream, want_stream), (H, M, kind, "stream")
            assert torch.equal(zero, torch.zeros_like(zero)), "zero"
            for name, a, b in (("y", y, want_y), ("inj", got_inj, want_inj)):
                assert torch.isfinite(a).all(), (H, M, kind, name)
                err = ((a.float() - b.float()).norm() / b.float().norm()).item()
                worst[name] = max(worst.get(name, 0.0), err)
                assert err < 1e-2, (H, M, kind, name, err)
    print("ok", worst)
''')


@needs_triton
def test_the_two_launch_mix_matches_its_definition_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-c", KERNEL], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]
