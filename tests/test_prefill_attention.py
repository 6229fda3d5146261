"""Prefill's dense attention in two pieces (the prefix with the GQA group folded into the queries, the chunk's
causal square, merged by log-sum-exp) against SDPA under a lower-right causal mask. On CPU the cuDNN call is
replaced by its definition in torch ops (`attention_with_lse`): what is tested here is the fold, the split and
the merge; the cuDNN kernel itself is compared on the GPU (`gpu` tests below)."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from labkit.engine.model import attention as A


def _inputs(T, S, Hq, n_kv, D, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(T, Hq, D, generator=g).to(device, dtype)
    rows = torch.randn(S, 2 * n_kv * D, generator=g).to(device, dtype)     # the pool's row layout, strided K/V
    k, v = A.split_rows(rows, n_kv, D)
    return q, k, v


@pytest.mark.parametrize("T,S,Hq,n_kv,D", [(8, 8, 4, 2, 16), (8, 40, 4, 2, 16), (16, 100, 8, 1, 8),
                                           (5, 37, 6, 3, 4), (1, 9, 2, 2, 4)])
def test_split_prefill_attention_equals_the_lower_right_causal_definition(T, S, Hq, n_kv, D):
    q, k, v = _inputs(T, S, Hq, n_kv, D)
    want = A.grouped_sdpa_attention(q, k, v)
    got = A.split_prefill_attention(q, k, v, attend=A.attention_with_lse)
    assert got.shape == want.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_merge_is_not_an_average_of_the_two_pieces():
    """The log-sum-exp weights matter: a prefix that dominates the softmax must dominate the output."""
    T, S, Hq, n_kv, D = 4, 12, 2, 1, 4
    q, k, v = _inputs(T, S, Hq, n_kv, D, seed=3)
    k = k.clone()
    k[: S - T] = q[0, 0] * 20          # every query scores the prefix far above its own chunk
    want = A.grouped_sdpa_attention(q, k, v)
    got = A.split_prefill_attention(q, k, v, attend=A.attention_with_lse)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_cpu_takes_sdpa_and_the_switch_is_recorded():
    from labkit import envs
    assert A.prefill_kernel(torch.device("cpu")) == "sdpa"
    assert envs.in_force()["prefill_attn"] in ("auto", "split", "sdpa")


@pytest.mark.gpu
@pytest.mark.parametrize("T,S", [(256, 256), (256, 1280), (1024, 8192)])
def test_split_prefill_attention_on_cudnn_matches_sdpa_at_the_reference_heads(T, S):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, v = _inputs(T, S, 16, 2, 256, dtype=torch.bfloat16, device="cuda")
    want = A.grouped_sdpa_attention(q, k, v).float()
    got = A.split_prefill_attention(q, k, v).float()
    err = (got - want).abs().max().item()
    assert err < 2e-2, err


@pytest.mark.gpu
def test_the_delta_rule_on_flash_linear_attention_matches_the_torch_form():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("fla.ops.gated_delta_rule")
    from labkit.engine.model import layers as L
    g = torch.Generator(device="cuda").manual_seed(2)
    T, H, dk, dv = 300, 4, 64, 32                      # not a multiple of the 64-token chunk
    q = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=g, device="cuda"), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=g, device="cuda"), dim=-1)
    v = torch.randn(T, H, dv, generator=g, device="cuda")
    log_a = -torch.rand(T, H, generator=g, device="cuda") * 0.2
    beta = torch.rand(T, H, generator=g, device="cuda")
    S0 = torch.randn(H, dk, dv, generator=g, device="cuda") * 0.1
    o_t, S_t = L.delta_rule_chunked(q, k, v, log_a, beta, S0)
    before, L.DN_PREFILL = L.DN_PREFILL, "fla"
    try:
        o_f, S_f = L.delta_rule_prefill(q, k, v, log_a, beta, S0)
    finally:
        L.DN_PREFILL = before
    assert ((o_f - o_t).norm() / o_t.norm()).item() < 2e-2      # bf16 inputs against fp32
    assert ((S_f - S_t).norm() / S_t.norm()).item() < 2e-2


def _prefill(attention: str, budget: int, strategy: str = "resident", mode: str = "sync", T: int = 200):
    from labkit.engine import Engine, HybridModel, OffloadCache, get_strategy
    from labkit.shapes import ModelShape
    shape = ModelShape.from_name("tiny")
    model = HybridModel(shape, torch.device("cpu"), seed=0)
    st = get_strategy(strategy)
    cache = OffloadCache.allocate(model, st.medium, 1, 256)
    e = Engine(model, cache, st, budget, prefill_chunk=64, prefill_mode=mode, prefill_attention=attention)
    tokens = torch.randint(0, shape.vocab, (T,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        return e.prefill(0, tokens).float(), cache


def test_sparse_prefill_with_a_budget_over_the_prompt_is_dense_prefill():
    dense, _ = _prefill("dense", 16)
    sparse, _ = _prefill("sparse", 4096)
    assert torch.equal(dense, sparse)


def test_sparse_prefill_attends_to_fewer_rows_and_every_io_path_agrees():
    """A budget below the prefix changes the logits (the selection is applied), and the sync read-back, the
    host pool and the rotating buffers hand the same prefix and index keys to it (same logits)."""
    dense, _ = _prefill("dense", 16)
    base, _ = _prefill("sparse", 16)
    assert not torch.allclose(dense, base, atol=1e-3)
    for strategy, mode in (("zero_copy", "sync"), ("zero_copy", "rotating")):
        got, _ = _prefill("sparse", 16, strategy, mode)
        torch.testing.assert_close(got, base, atol=1e-5, rtol=1e-5)


def test_an_unknown_prefill_attention_is_one_line():
    with pytest.raises(ValueError, match="prefill_attention"):
        _prefill("sparsest", 16)


MERGE = '''
import torch
from labkit.engine.model import attention as A
g = torch.Generator().manual_seed(0)
H, T, D = 3, 21, 32
o1, o2 = torch.randn(1, H, T, D, generator=g).bfloat16(), torch.randn(1, H, T, D, generator=g).bfloat16()
l1, l2 = torch.randn(1, H, T, generator=g) * 4, torch.randn(1, H, T, generator=g) * 4
got = A.merge_by_lse(o1, l1, o2, l2)
m = torch.maximum(l1, l2)
w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
want = ((o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None])[0].transpose(0, 1)
assert got.shape == (T, H, D)
assert ((got.float() - want).abs() <= want.abs() * 2 ** -7 + 1e-6).all()
print("merge ok")
'''


def test_the_lse_merge_kernel_matches_the_torch_ops_under_the_interpreter():
    """The split attention's merge (`merge_by_lse`, one Triton kernel on CUDA) against its torch ops, under
    TRITON_INTERPRET=1 in a subprocess (the variable must be set before triton is imported)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    p = subprocess.run([sys.executable, "-c", MERGE], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert p.returncode == 0 and "merge ok" in p.stdout, p.stderr[-3000:]
