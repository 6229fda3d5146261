"""Weights read into L2 ahead of their product (`engine/model/l2_prefetch.py`): the touch kernel under the
Triton interpreter on CPU (TRITON_INTERPRET=1 set before triton is imported, so in a subprocess) must read
every word it is given and no other (each program's XOR against the same XOR in torch), and the engine's
prefetcher is off where it cannot help (CPU), so CPU decode is unchanged. The GPU side (the branch in a
captured graph, logits unchanged) is tests/test_gpu_l2_prefetch.py."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from labkit.engine.model import l2_prefetch as P

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


@needs_triton
def test_touch_reads_every_word_once_under_interpreter():
    script = textwrap.dedent('''
        import torch
        from labkit.engine.model import l2_prefetch as P
        def xor_per_program(words, per, progs):
            out = []
            for p in range(progs):
                seg = words[p * per:(p + 1) * per]
                acc = 0
                for v in seg.tolist():
                    acc ^= v
                out.append(acc)
            return out
        g = torch.Generator().manual_seed(0)
        # a bf16 weight (two values a word), a prefix of it, and a size that is not a whole block
        w = torch.randn(96, 1000, generator=g).to(torch.bfloat16)
        for max_bytes in (None, 40000, 6 * 1000 * 2 + 8):
            sink = torch.full((P.SINK_SLOTS,), -1, dtype=torch.int32)
            words = w.view(-1).view(torch.int32)
            n = words.numel() if max_bytes is None else max_bytes // 4
            progs = P.touch(w, sink, max_bytes, sms=2)
            exp_progs, per = P.programs_for(n, 2)
            assert progs == exp_progs, (progs, exp_progs)
            assert sink[:progs].tolist() == xor_per_program(words[:n], per, progs), max_bytes
            assert bool((sink[progs:] == -1).all()), "wrote past its programs"
        print("ok")
    ''')
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().endswith("ok")


def test_programs_cover_the_words_in_whole_blocks():
    for n in (1, P.BLOCK - 1, P.BLOCK, 5 * P.BLOCK + 3, 4_194_304, 11_534_336):
        progs, per = P.programs_for(n, 132)
        assert per % P.BLOCK == 0 and per > 0
        assert progs * per >= n > (progs - 1) * per          # every word, no empty program
        assert progs <= P.PROGRAMS_PER_SM * 132


def test_touch_refuses_what_is_not_whole_words():
    with pytest.raises(ValueError, match="4-byte words"):
        P.touch(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="4-byte words"):
        P.touch(torch.zeros(4, 4).t(), torch.zeros(8, dtype=torch.int32))


def test_prefetcher_is_off_on_cpu_even_when_enabled():
    P.set_enabled(True)
    try:
        pf = P.Prefetcher(torch.device("cpu"))
        assert not pf.on
        pf.fork([torch.zeros(4)])       # no stream, nothing to join
        pf.join()
    finally:
        P.set_enabled(False)
