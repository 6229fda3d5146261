"""Top-k selection: the definition (`select_topk_reference`) against torch.topk on random and adversarial
scores, and the Triton radix-select kernels against the definition, bit for bit, under TRITON_INTERPRET=1
(in a subprocess: the variable must be set before triton is imported)."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from labkit.engine.model.select import order_keys, select_topk, select_topk_reference

NEG = float("-inf")


def _cases():
    g = torch.Generator().manual_seed(0)
    yield "random", torch.randn(3, 1000, generator=g), 100
    yield "all equal", torch.full((2, 300), 0.5), 64
    many = torch.randint(0, 4, (2, 800), generator=g).float()            # 4 distinct values, ~200 each
    yield "many ties", many, 250
    tail = torch.randn(3, 400, generator=g)
    tail[0, 50:] = NEG                                                    # fewer valid than k
    tail[1, 390:] = NEG
    tail[2, :] = NEG                                                      # nothing written yet
    yield "-inf tails", tail, 128
    yield "k == L", torch.randn(2, 77, generator=g), 77
    yield "negative and tiny", torch.randn(2, 500, generator=g) * 1e-30 - 1.0, 33
    yield "inf", torch.where(torch.rand(1, 300, generator=g) < 0.1, float("inf"), torch.randn(1, 300, generator=g)), 40


@pytest.mark.parametrize("name,scores,k", list(_cases()), ids=[c[0] for c in _cases()])
def test_reference_selects_what_topk_selects(name, scores, k):
    pos, valid = select_topk_reference(scores, k)
    for b in range(scores.shape[0]):
        s = scores[b]
        vals_topk = torch.topk(s, k).values
        taken = torch.unique(pos[b][valid[b]]) if valid[b].any() else pos[b][:0]
        assert taken.numel() == int(valid[b].sum()), "a position taken twice"
        # value multiset equals torch.topk's (ties may be broken differently, values may not)
        got = torch.sort(torch.cat([s[taken], torch.full((k - taken.numel(),), NEG)]), descending=True).values
        assert torch.equal(got, vals_topk)
        valid_pos = pos[b][valid[b]]
        assert torch.all(valid_pos[1:] > valid_pos[:-1]), "positions not ascending"
        assert (pos[b][~valid[b]] == 0).all()                         # masked slots point at a real row
        assert int(valid[b].sum()) == min(k, int((s > NEG).sum()))
        kth = vals_topk[-1]
        if (s == kth).sum() == 1 or kth == NEG:                    # threshold unique: sets equal exactly
            want = set(torch.topk(s, k).indices.tolist()) if kth > NEG else set(torch.nonzero(s > NEG)[:, 0].tolist())
            assert set(valid_pos.tolist()) == want
        else:                                                       # ties: the lowest positions win
            eq = torch.nonzero(s == kth)[:, 0]
            n_eq = k - int((s > kth).sum())
            assert set(eq[:n_eq].tolist()) <= set(valid_pos.tolist())


def test_order_keys_preserve_order():
    x = torch.tensor([NEG, -3.0, -1e-30, 0.0, 1e-30, 2.0, float("inf")])
    k = order_keys(x)
    assert torch.all(k[1:] > k[:-1]) and (k >= 0).all() and (k < 2**32).all()


def test_select_writes_in_place():
    s = torch.randn(2, 300)
    out = (torch.empty(2, 20, dtype=torch.int64), torch.empty(2, 20, dtype=torch.bool))
    pos, valid = select_topk(s, 20, out=out)
    assert pos.data_ptr() == out[0].data_ptr() and torch.equal(pos, select_topk_reference(s, 20)[0])


def test_bad_k_is_refused():
    with pytest.raises(ValueError, match="select k=0"):
        select_topk_reference(torch.randn(1, 10), 0)


SCRIPT = textwrap.dedent('''
    import torch
    from labkit.engine.model import select
    from labkit.engine.model.arch import kernels_run
    assert kernels_run(torch.zeros(1))
    g = torch.Generator().manual_seed(0)
    many = torch.randint(0, 4, (2, 900), generator=g).float()
    tail = torch.randn(2, 700, generator=g); tail[0, 30:] = float("-inf"); tail[1, :] = float("-inf")
    cases = [(torch.randn(3, 1000, generator=g), 100), (torch.full((2, 600), 0.25), 64), (many, 250),
             (tail, 128), (torch.randn(1, 513, generator=g), 513), (torch.randn(2, 300, generator=g) - 5, 7)]
    for scores, k in cases:
        for block in (128, 1024):
            pos, valid = select.select_topk_triton(scores, k, block=block)
            rpos, rvalid = select.select_topk_reference(scores, k)
            assert torch.equal(pos, rpos), (scores.shape, k, block, "positions")
            assert torch.equal(valid, rvalid), (scores.shape, k, block, "valid")
    print("select ok")
''')


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_radix_select_kernels_match_reference_under_interpreter():
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0 and "select ok" in p.stdout, p.stderr[-3000:]



BOUND_SCRIPT = textwrap.dedent('''
    import torch
    from labkit.engine.model import select
    g = torch.Generator().manual_seed(1)
    L, k = 4096, 16          # runs of 128 (64 cut by L: 2k runs a row at least), four blocks of 1024 a row
    tail = torch.randn(2, L, generator=g); tail[0, 100:] = float("-inf"); tail[1, :] = float("-inf")
    cases = {"random": torch.randn(3, L, generator=g),
             "rising": torch.randn(2, L, generator=g) + torch.linspace(0, 6, L),     # the best at the end
             "ascending": torch.arange(L, dtype=torch.float32).repeat(2, 1),          # candidates overflow
             "-inf tails": tail, "negative": -torch.rand(2, L, generator=g) - 1,
             "ties": torch.randint(0, 3, (2, L), generator=g).float(), "ragged": torch.randn(2, L - 77, generator=g)}
    fits = {}
    for name, scores in cases.items():
        B, n = scores.shape
        sub = select.bound_run(B, n, k, force=True)
        assert sub in (64, 128) and select.bound_run(B, n, k) == 0, sub    # small batches take the plain passes
        block, nblk, cap = 1024, -(-n // 1024), select.candidate_cap(n)
        hist_m = torch.zeros(4 * B * 256, dtype=torch.int32); cnt = torch.zeros(B, dtype=torch.int32)
        cand = select._bounded_candidates(scores, k, block, nblk, sub, cap, hist_m, cnt, 4)
        key = select.order_keys(scores)
        kth = torch.topk(key, k, dim=-1).values[:, -1]
        runs = torch.nn.functional.pad(key, (0, -n % sub)).view(B, -1, sub).amax(-1)
        lb = torch.topk(runs, k, dim=-1).values[:, -1]                  # the bound, from its definition
        assert bool((lb <= kth).all()), name
        for b in range(B):
            want = key[b][key[b] >= lb[b]]
            assert int(cnt[b]) == want.numel(), (name, b, int(cnt[b]), want.numel())
            if want.numel() <= cap:                                      # every candidate, in some order
                got = cand[b, :want.numel()].to(torch.int64) & 0xFFFFFFFF
                assert torch.equal(got.sort().values, want.sort().values), (name, b)
        fits[name] = bool((cnt <= cap).all())
        for bound in (True, False):
            pos, valid = select.select_topk_triton(scores, k, block=block, bound=bound)
            rpos, rvalid = select.select_topk_reference(scores, k)
            assert torch.equal(pos, rpos) and torch.equal(valid, rvalid), (name, bound)
    assert fits["random"] and fits["rising"] and not fits["ascending"], fits
    print("bound ok")
''')


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_bounded_select_matches_reference_under_interpreter():
    """The large-batch path: the k-th largest run maximum bounds the k-th largest score from below (checked
    against its definition), the compacted candidates are exactly the keys at or above it, a row whose
    candidates overflow is read whole, and the selection equals the definition either way."""
    p = subprocess.run([sys.executable, "-c", BOUND_SCRIPT], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0 and "bound ok" in p.stdout, p.stderr[-3000:]


def test_bound_runs_only_where_they_can_pay():
    from labkit.engine.model.select import BOUND_MIN_KEYS, bound_run
    assert bound_run(16, 1 << 20, 2048) == 256                         # 4,096 runs a row
    assert bound_run(16, 1 << 18, 2048) == 64                          # 4,096 runs of 64
    assert bound_run(1, 1 << 16, 2048) == 0 and bound_run(64, 1 << 16, 2048) == 0   # runs would be < 32
    assert bound_run(1, 1 << 20, 2048) == (256 if (1 << 20) >= BOUND_MIN_KEYS else 0)
    assert bound_run(1, 1 << 20, 2048, force=True) == 256

def test_default_block_covers_the_sms_twice_within_its_bounds():
    from labkit.engine.model.select import default_block
    for B in (1, 2, 4, 16):
        for L in (300, 8192, 65536, 1 << 18, 1 << 20):
            b = default_block(B, L, sms=132)
            assert b in (512, 1024, 2048), (B, L, b)
            programs = B * -(-L // b)
            # between one and two programs an SM, unless a bound holds it: a wave at least, and half
            # the block would be more than two programs an SM
            assert programs >= 132 or b == 512, (B, L, b)
            assert b == 512 or B * -(-L // (b // 2)) > 2 * 132, (B, L, b)
