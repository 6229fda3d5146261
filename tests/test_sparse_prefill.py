"""Sparse prefill (`sparse_prefill.py`): the torch definitions against torch.topk / dense attention on CPU,
the Triton kernels against the definitions under TRITON_INTERPRET=1 (in a subprocess: the variable must be
set before triton is imported), and both
at the reference shape on a GPU (marked `gpu`).

Exactness: the selection kernel sums fp32 products in another order than the torch definition, so equal
sets can only be asked where every score is exact in fp32 whatever the order: integer-valued queries and
fp8 keys, half-integer head weights, power-of-two scales. Those inputs also make ties common (forced ties
on top), so the tie rule is checked bit for bit. Real-valued inputs are checked by what a top-k is: every
selected score at or above the k-th largest, every other visible score at or below it (within fp32
rounding)."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from labkit.engine.model import sparse_prefill as P
from labkit.engine.model.attention import dense_prefill_attention, split_rows

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

# shared by the CPU tests, the interpreter script and the GPU tests (the script imports this module's text)
HELPERS = '''
import torch
from labkit.engine.model.kv import quantize_index_keys


def exact_inputs(T, S, Hi=4, Di=64, seed=0, ties=False, device="cpu"):
    """Inputs whose scores are exact in fp32 in any summation order; `ties`: few distinct key rows."""
    g = torch.Generator().manual_seed(seed)
    iq = torch.randint(-3, 4, (T, Hi, Di), generator=g).to(torch.bfloat16)
    iw = (torch.randint(-2, 3, (T, Hi), generator=g) * 0.5).to(torch.bfloat16)
    keys = torch.randint(-4, 5, (S, Di), generator=g).float()
    scales = 2.0 ** torch.randint(-1, 2, (S,), generator=g)
    if ties:   # three distinct key rows, one scale: every score repeated ~S/3 times
        keys = keys[:3][torch.randint(0, 3, (S,), generator=g)]
        scales = torch.ones(S)
    q_pos = torch.arange(S - T, S)
    return (iq.to(device), iw.to(device), keys.to(torch.float8_e4m3fn).to(device), scales.half().to(device),
            q_pos.to(device))


def real_inputs(T, S, Hi=4, Di=64, seed=0, device="cpu"):
    """Projection-like inputs: iq and iw strided views of one [T, Hi*Di + Hi] row, keys through the cache's
    quantiser."""
    g = torch.Generator(device=device).manual_seed(seed)
    y = torch.randn(T, Hi * Di + Hi, generator=g, device=device).to(torch.bfloat16)
    iq, iw = y[:, :Hi * Di].view(T, Hi, Di), y[:, Hi * Di:]
    keys, scales = quantize_index_keys(torch.randn(S, Di, generator=g, device=device))
    return iq, iw, keys, scales, torch.arange(S - T, S, device=device)


def check_is_topk(idx, valid, scores, k, what=""):
    """idx/valid a top-k of each row of scores [T, S] (-inf: not visible) within fp32 rounding."""
    T, S = scores.shape
    for t in range(T):
        s = scores[t]
        n_vis = int((s > float("-inf")).sum())
        v = valid[t]
        assert int(v.sum()) == min(k, n_vis), (what, t, int(v.sum()), n_vis)
        assert bool(v[:int(v.sum())].all()), (what, t, "valid slots not first")
        taken = idx[t][v]
        assert bool((taken[1:] > taken[:-1]).all()), (what, t, "not ascending")
        assert bool((idx[t][~v] == 0).all()), (what, t, "invalid slots not at position 0")
        assert bool((taken < S).all()) and bool((s[taken] > float("-inf")).all()), (what, t, "not visible")
        kth = torch.topk(s, min(k, n_vis)).values[-1]
        tol = 1e-5 * float(s[s > float("-inf")].abs().max()) + 1e-30
        rest = torch.ones(S, dtype=torch.bool, device=s.device)
        rest[taken] = False
        rest &= s > float("-inf")
        assert float(s[taken].min()) >= float(kth) - tol, (what, t, "a selected score below the k-th")
        if rest.any():
            assert float(s[rest].max()) <= float(kth) + tol, (what, t, "a left score above the k-th")
'''
exec(HELPERS)


# ------------------------------------------------------------------ the definitions, on CPU

@pytest.mark.parametrize("k", [1, 16, 64, 250])
@pytest.mark.parametrize("ties", [False, True])
def test_reference_selects_each_querys_causal_topk_with_the_tie_rule(k, ties):
    iq, iw, keys, scales, q_pos = exact_inputs(48, 200, ties=ties)
    idx, valid = P.prefill_select_reference(iq, iw, keys, scales, q_pos, k)
    scores = P.prefill_scores_reference(iq, iw, keys, scales, q_pos)
    assert idx.shape == (48, k) and valid.dtype == torch.bool
    check_is_topk(idx, valid, scores, k)
    for t in range(48):                                     # the tie rule: the lowest equal positions win
        s, n = scores[t], int(valid[t].sum())
        kth = torch.topk(s, n).values[-1]
        eq = torch.nonzero(s == kth)[:, 0]
        n_eq = n - int((s > kth).sum())
        assert set(eq[:n_eq].tolist()) <= set(idx[t][valid[t]].tolist()), t
        if (s == kth).sum() == 1:
            assert set(idx[t][valid[t]].tolist()) == set(torch.topk(s, n).indices.tolist())


def test_reference_scores_are_the_decode_indexers_for_one_query():
    """The prefill score of the last query equals the decode indexer's score of the same query (fp32)."""
    from labkit.engine.model.indexer import index_scores_reference
    iq, iw, keys, scales, q_pos = exact_inputs(8, 100)
    s = P.prefill_scores_reference(iq, iw, keys, scales, q_pos)[-1]
    d = index_scores_reference(iq[-1:].float(), iw[-1:].float(), keys[None], scales[None], torch.tensor([100]))[0]
    assert torch.equal(s, d)


def test_first_chunk_queries_see_fewer_than_k():
    iq, iw, keys, scales, _ = exact_inputs(30, 30)
    idx, valid = P.prefill_select_reference(iq, iw, keys, scales, torch.arange(30), 16)
    assert valid.sum(-1).tolist() == [min(16, t + 1) for t in range(30)]
    assert torch.equal(idx[3], torch.tensor([0, 1, 2, 3] + [0] * 12))


def test_attention_reference_with_every_visible_row_is_dense_causal_attention():
    g = torch.Generator().manual_seed(0)
    T, S, Hq, n_kv, D = 12, 40, 8, 2, 32
    k, v = split_rows(torch.randn(S, 2 * n_kv * D, generator=g).bfloat16(), n_kv, D)
    q = torch.randn(T, Hq, D, generator=g).bfloat16()
    iq, iw, keys, scales, q_pos = exact_inputs(T, S)
    idx, valid = P.prefill_select_reference(iq, iw, keys, scales, q_pos, S + 5)
    out = P.sparse_prefill_attention(q, k, v, idx, valid)       # CPU: the reference
    assert torch.allclose(out.float(), dense_prefill_attention(q, k, v).float(), atol=2e-2, rtol=2e-2)


def test_bad_input_fails_with_one_line_before_work():
    iq, iw, keys, scales, q_pos = exact_inputs(4, 10)
    with pytest.raises(ValueError, match="k=0"):
        P.prefill_select(iq, iw, keys, scales, q_pos, 0)
    with pytest.raises(ValueError, match="do not fit"):
        P.prefill_select(iq, iw[:, :2], keys, scales, q_pos, 4)
    if importlib.util.find_spec("triton") is not None:     # the kernel path's own checks
        with pytest.raises(ValueError, match="power of two"):
            P.prefill_select_triton(iq, iw, keys, scales, q_pos, 4, splits=3)
        with pytest.raises(ValueError, match="bs_sampled=256"):
            P.prefill_select_triton(iq, iw, keys, scales, q_pos, 4, bs_sampled=256)
    q = torch.zeros(4, 6, 32, dtype=torch.bfloat16)
    kv = torch.zeros(10, 4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="n_kv dividing Hq"):
        P.sparse_prefill_attention(q, kv, kv, torch.zeros(4, 3, dtype=torch.int64), torch.ones(4, 3, dtype=torch.bool))


# ------------------------------------------------------------------ the kernels, under the interpreter

SCRIPT = HELPERS + textwrap.dedent('''
    from labkit.engine.model import sparse_prefill as P
    from labkit.engine.model.attention import dense_prefill_attention, split_rows
    from labkit.engine.model.arch import kernels_run
    assert kernels_run(torch.zeros(1))
    # selection: exact inputs, bit for bit against the definition. The exact passes for every query (k = 1,
    # 64, > S; the chunk at an offset, the first chunk, forced ties, k = S; two tiles of 16 queries, the second
    # cut by T, and key tiles of 128, the last cut by S; the interpreter's cost grows with T x S) ...
    cases = [(exact_inputs(24, 200, seed=1), k, "offset") for k in (1, 64, 230)]
    cases += [(exact_inputs(21, 21, seed=2), 16, "first chunk"), (exact_inputs(24, 300, seed=3, ties=True), 64, "ties"),
              (exact_inputs(20, 300, seed=4, ties=True), 300, "ties, k = S")]
    for (iq, iw, keys, scales, q_pos), k, what in cases:
        got = P.prefill_select(iq, iw, keys, scales, q_pos, k) if what == "first chunk" else \
            P.prefill_select_triton(iq, iw, keys, scales, q_pos, k, method="exact")
        want = P.prefill_select_reference(iq, iw, keys, scales, q_pos, k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (what, k)
    # ... and the sampled path (16 queries a call, in one collect block cut by T): queries bounded by the sample
    # (S = 600 > the cap, so no query takes all its keys);
    # ties far over the list of equal keys (its first k are the lowest positions), also a query whose head weights
    # are all negative (its top k: keys scoring exactly 0, ~1 in 16); queries sent to the exact passes (a sample
    # holding the best keys puts the bound above the k-th largest; a cap below the keys above the bound), both
    # kinds beside bounded queries in one call
    T = 16
    adv = list(exact_inputs(T, 600, seed=7))
    adv[3] = torch.where(torch.arange(600) % 8 == 0, 4.0, 0.25).half()   # every sampled key scaled up 16x
    neg = list(exact_inputs(T, 2000, seed=10))
    neg[1] = -neg[1].abs() - 0.5                                         # every head weight negative
    # five keys score above 0 and every other exactly 0: the top k takes the five and the lowest-placed zeros,
    # from both lists at once (merged by position)
    S_m, T_m = 600, T
    few = torch.zeros(S_m, 64)
    few[torch.tensor([3, 170, 333, 480, 599]), 0] = 2.0
    iq_m = torch.zeros(T_m, 4, 64)
    iq_m[:, 0, 0] = 1.0
    mixed = (iq_m.bfloat16(), torch.tensor([[0.5, -1.0, -1.0, -1.0]] * T_m).bfloat16(), few.to(torch.float8_e4m3fn),
             torch.ones(S_m).half(), torch.arange(S_m - T_m, S_m))
    cases = [(exact_inputs(T, 600, seed=5), 16, None, "sampled"), (exact_inputs(T, 600, seed=6), 64, 256, "sampled"),
             (exact_inputs(T, 600, seed=8), 1, None, "sampled"), (tuple(adv), 64, None, "bound too high"),
             (exact_inputs(T, 600, seed=5), 16, 64, "cap below the keys above"),
             (exact_inputs(T, 600, seed=9, ties=True), 16, None, "ties over the list"),
             (tuple(neg), 16, None, "all weights negative"), (mixed, 16, None, "ties and five above")]
    for i, ((iq, iw, keys, scales, q_pos), k, cap, what) in enumerate(cases):
        stats = {}
        # the collect's query heads held or reloaded each tile, and its key ranges in 1, 2 or 4 segments, each checked
        got = P.prefill_select_triton(iq, iw, keys, scales, q_pos, k, cap=cap, stats=stats, bs_sampled=64,
                                      hoist=what != "ties over the list", splits=(1, 2, 4)[i % 3])
        want = P.prefill_select_reference(iq, iw, keys, scales, q_pos, k)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (what, k)
        fell = int(stats["fallback"].sum())
        if what in ("bound too high", "cap below the keys above"):
            assert 8 <= fell < T, (what, k, fell)                      # the exact passes did the work, beside
                                                                       # bounded queries
        else:
            assert fell <= 2, (what, k, fell)                          # the bound and the two lists held
        if what == "sampled":                                          # bounded: not every key a candidate
            assert int(stats["above"].max()) < 600 - T, (what, k)
    zeros = (P.prefill_scores_reference(*neg) == 0).sum(1)
    assert int(zeros.min()) > 2 * 16, int(zeros.min())                # the ties overflowed the list of equals
    # real-valued, strided iq / iw as the projection gives them: a top-k within fp32 rounding
    iq, iw, keys, scales, q_pos = real_inputs(40, 300, seed=5)
    assert not iq.is_contiguous() and not iw.is_contiguous()
    stats = {}
    idx, valid = P.prefill_select_triton(iq, iw, keys, scales, q_pos, 16, stats=stats)
    check_is_topk(idx, valid, P.prefill_scores_reference(iq, iw, keys, scales, q_pos), 16, "real")
    assert int(stats["fallback"].sum()) <= 4
    # attention: strided K/V views of pool rows, GQA groups of 2 and 8, invalid slots, k not a block multiple
    for T, S, Hq, n_kv, D, k in ((12, 90, 4, 2, 32, 20), (8, 120, 16, 2, 64, 70)):
        g = torch.Generator().manual_seed(T)
        kk, vv = split_rows(torch.randn(S, 2 * n_kv * D, generator=g).bfloat16(), n_kv, D)
        q = torch.randn(T, Hq, D, generator=g).bfloat16()
        iq, iw, keys, scales, q_pos = exact_inputs(T, S, seed=T)
        idx, valid = P.prefill_select_reference(iq, iw, keys, scales, q_pos, k)
        valid[::3, k // 2:] = False                           # some queries with fewer rows
        idx = torch.where(valid, idx, 0)
        got = P.sparse_prefill_attention(q, kk, vv, idx, valid)
        want = P.sparse_prefill_attention_reference(q, kk, vv, idx, valid)
        err = float((got.float() - want.float()).abs().max())
        assert err <= 2e-2, ("attention", T, S, err)
    # every visible row selected (k >= S): the sparse path is dense causal attention, also for a first chunk
    for T, S in ((12, 60), (12, 12)):
        g = torch.Generator().manual_seed(S)
        kk, vv = split_rows(torch.randn(S, 2 * 2 * 32, generator=g).bfloat16(), 2, 32)
        q = torch.randn(T, 8, 32, generator=g).bfloat16()
        iq, iw, keys, scales, q_pos = exact_inputs(T, S, seed=S)
        idx, valid = P.prefill_select(iq, iw, keys, scales, q_pos, S + 3)
        got = P.sparse_prefill_attention(q, kk, vv, idx, valid)
        err = float((got.float() - dense_prefill_attention(q, kk, vv).float()).abs().max())
        assert err <= 2e-2, ("dense", T, S, err)
    print("sparse prefill ok")
''')


@needs_triton
@pytest.mark.slow
def test_kernels_match_the_definitions_under_interpreter():
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0 and "sparse prefill ok" in p.stdout, p.stderr[-3000:]


# ------------------------------------------------------------------ the reference shape, on a GPU

GPU_T, GPU_S, GPU_K = 8192, 65536, 2048


def _query_slice(T):
    """Queries checked against the definition: both ends of the chunk and some between."""
    return torch.cat([torch.arange(8), torch.arange(T - 8, T), torch.randperm(T, generator=torch.Generator()
                                                                              .manual_seed(0))[:48]])


@pytest.mark.gpu
@pytest.mark.parametrize("offset", [True, False], ids=["chunk at 56K", "first chunk"])
def test_gpu_selection_at_reference_shape(offset):
    S = GPU_S if offset else GPU_T
    iq, iw, keys, scales, q_pos = real_inputs(GPU_T, S, device="cuda")
    sl = _query_slice(GPU_T).cuda()
    scores = P.prefill_scores_reference(iq[sl], iw[sl], keys, scales, q_pos[sl])
    stats = {}
    idx, valid = P.prefill_select_triton(iq, iw, keys, scales, q_pos, GPU_K, stats=stats)
    check_is_topk(idx[sl], valid[sl], scores, GPU_K, "gpu real, sampled")
    assert int(stats["fallback"].sum()) <= GPU_T // 100                 # the sample's bound holds almost always
    idx2, valid2 = P.prefill_select_triton(iq, iw, keys, scales, q_pos, GPU_K, method="exact")
    check_is_topk(idx2[sl], valid2[sl], scores, GPU_K, "gpu real, exact")
    # exact inputs: bit for bit, ties included
    iq, iw, keys, scales, q_pos = exact_inputs(GPU_T, S, ties=not offset, device="cuda")
    idx, valid = P.prefill_select(iq, iw, keys, scales, q_pos, GPU_K)
    want = P.prefill_select_reference(iq[sl], iw[sl], keys, scales, q_pos[sl], GPU_K)
    assert torch.equal(idx[sl], want[0]) and torch.equal(valid[sl], want[1])


@pytest.mark.gpu
def test_gpu_attention_at_reference_shape():
    T, S, Hq, n_kv, D = GPU_T, GPU_S, 16, 2, 256
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.randn(S, 2 * n_kv * D, generator=g, device="cuda").bfloat16()
    k, v = split_rows(rows, n_kv, D)
    q = torch.randn(T, Hq, D, generator=g, device="cuda").bfloat16()
    iq, iw, keys, scales, q_pos = real_inputs(T, S, device="cuda")
    idx, valid = P.prefill_select(iq, iw, keys, scales, q_pos, GPU_K)
    out = P.sparse_prefill_attention(q, k, v, idx, valid)
    sl = _query_slice(T).cuda()
    want = P.sparse_prefill_attention_reference(q[sl], k, v, idx[sl], valid[sl])
    err = float((out[sl].float() - want.float()).abs().max())
    assert err <= 1e-2, err
    # all visible rows on a short chunk: dense causal attention
    Ts, Ss = 256, 1024
    idx, valid = P.prefill_select(iq[:Ts], iw[:Ts], keys[:Ss], scales[:Ss], torch.arange(Ss - Ts, Ss, device="cuda"),
                                  Ss)
    out = P.sparse_prefill_attention(q[:Ts], k[:Ss], v[:Ss], idx, valid)
    err = float((out.float() - dense_prefill_attention(q[:Ts], k[:Ss], v[:Ss]).float()).abs().max())
    assert err <= 1e-2, err


