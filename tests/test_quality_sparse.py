"""Sparse-attention instrumentation on a tiny random Llama (no real weights, fast)."""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the quality lab needs transformers: pip install -e '.[quality]'")

from labkit.quality import sparse  # noqa: E402
from labkit.quality.indexer import Indexer, projections_from_moments, quantize_fp8, dequantize_fp8  # noqa: E402
from labkit.quality.sparse import LayerPolicy, SparseController, instrument, select, selection_recall  # noqa: E402


def tiny_llama(seed=0, layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=101, max_position_embeddings=512)
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg).eval()


def _nll(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


def test_budget_at_least_seq_len_is_exactly_dense():
    model = tiny_llama()
    ids = torch.randint(0, 101, (1, 96))
    ref = _nll(model, ids)
    ctl = instrument(model)
    for policy in sparse.POLICIES:
        if policy == "indexer":
            continue
        ctl.retrieval_heads = {0: 1, 1: 3}
        ctl.set_all(policy, 96, 2)
        assert _nll(model, ids) == pytest.approx(ref, rel=1e-5), policy
    ctl.set_all("oracle", 8, 2)
    assert abs(_nll(model, ids) - ref) > 1e-4, "a small budget must change the output"
    ctl.set_all(None, None, 2)
    assert _nll(model, ids) == pytest.approx(ref, rel=1e-5)


def _probs(b=1, hkv=2, g=3, t=12, seed=1):
    torch.manual_seed(seed)
    s = torch.randn(b, hkv, g, t, t)
    qpos = torch.arange(t)
    kpos = torch.arange(t)
    causal = kpos[None, :] <= qpos[:, None]
    p = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
    return p, qpos, kpos, causal


def test_oracle_picks_exactly_true_topk():
    p, qpos, kpos, causal = _probs()
    k = 4
    ctl = SparseController()
    for policy, agg in (("oracle_qhead", p), ("oracle", p.sum(2, keepdim=True)),
                        ("oracle_shared", p.sum((1, 2), keepdim=True))):
        mask = select(ctl, 0, policy, k, p, None, None, qpos, kpos, causal)
        for idx in torch.cartesian_prod(*[torch.arange(n) for n in agg.shape[:3]]):
            for t in range(p.shape[3]):
                row = agg[tuple(idx)][t][: t + 1]
                want = set(torch.topk(row, min(k, t + 1)).indices.tolist())
                got = set(torch.nonzero(mask[tuple(idx)][t]).flatten().tolist())
                assert got == want, (policy, tuple(idx.tolist()), t)


def test_retrieval_head_keeps_sink_and_recent_then_its_head():
    p, qpos, kpos, causal = _probs(t=40)
    ctl = SparseController(sink_window=2, recent_window=3, retrieval_heads={0: 4})
    mask = select(ctl, 0, "retrieval_head", 8, p, None, None, qpos, kpos, causal)[0, 0, 0]
    t = 39
    sel = set(torch.nonzero(mask[t]).flatten().tolist())
    assert {0, 1, 37, 38, 39} <= sel and len(sel) == 8
    head = p[0, 4 // 3, 4 % 3, t, 2:37]
    assert sel - {0, 1, 37, 38, 39} == set((torch.topk(head, 3).indices + 2).tolist())


def test_block_selection_takes_whole_blocks_of_most_mass():
    """Block granularity (PulseInfer's 16-token blocks; here 4 of a 40-token past): every selected
    position comes with its whole (causal part of the) block, `budget // block` blocks per row, and the
    blocks are those of the most summed probability -- per KV head for `oracle`, the retrieval head's for
    `retrieval_head` (its sink and recent blocks first)."""
    p, qpos, kpos, causal = _probs(t=40)
    ctl = SparseController(block=4, sink_window=2, recent_window=3, retrieval_heads={0: 4})
    t = 39
    m = select(ctl, 0, "oracle", 12, p, None, None, qpos, kpos, causal)
    for h in range(2):
        sel = torch.nonzero(m[0, h, 0, t]).flatten()
        blocks = set((sel // 4).tolist())
        assert len(blocks) == 3 and len(sel) == 12                      # whole blocks, budget // block of them
        mass = p[0, h, :, t].sum(0).view(10, 4).sum(-1)
        assert blocks == set(torch.topk(mass, 3).indices.tolist())
    m = select(ctl, 0, "retrieval_head", 12, p, None, None, qpos, kpos, causal)[0, 0, 0, t]
    blocks = set((torch.nonzero(m).flatten() // 4).tolist())
    assert {0, 9} <= blocks and len(blocks) == 3                        # sink block, recent block, then mass
    mass = p[0, 4 // 3, 4 % 3, t].view(10, 4).sum(-1)
    assert (blocks - {0, 9}).pop() == int(torch.topk(mass[1:9], 1).indices) + 1
    # a row whose causal past holds fewer blocks than the budget keeps its whole past
    early = select(ctl, 0, "oracle", 12, p, None, None, qpos, kpos, causal)[0, 0, 0, 9]
    assert torch.equal(early, causal[9])


def test_selection_recall_hand_made():
    sel = torch.tensor([[1, 1, 0, 1, 0, 0], [0, 0, 1, 1, 1, 0]], dtype=torch.bool)
    ref = torch.tensor([[1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 0, 1]], dtype=torch.bool)
    assert selection_recall(sel, ref, 3).tolist() == pytest.approx([2 / 3, 0.0])


def test_mass_recall_and_indexer_overlap_recorded():
    model = tiny_llama()
    ids = torch.randint(0, 101, (1, 64))
    d = 2 * 16
    eye = torch.eye(d)
    idx = Indexer(q_proj={0: eye, 1: eye}, k_proj={0: eye, 1: eye}, rank=d, quantize=False)
    ctl = instrument(model, SparseController(indexer=idx))
    ctl.set_all("oracle_shared", 16, 2)
    ctl.reset_stats()
    _nll(model, ids)
    assert 0 < ctl.mass_recall() < 1 and ctl.oracle_overlap() == pytest.approx(1.0)
    ctl.set_all("indexer", 16, 2)
    ctl.reset_stats()
    _nll(model, ids)
    assert 0 < ctl.oracle_overlap() < 1
    assert ctl.stats[0].recall_n == 4 * (64 - 16)  # 4 query heads x sparsified rows


def test_indexer_projection_full_rank_is_identity_and_key_is_66_bytes():
    torch.manual_seed(0)
    x = torch.randn(500, 12) @ torch.randn(12, 12)
    y = torch.randn(500, 12) @ torch.randn(12, 12)
    a, b = projections_from_moments(x.T.double() @ x.double(), y.T.double() @ y.double(), rank=12)
    assert torch.allclose(a @ b.T, torch.eye(12), atol=1e-3)
    a4, b4 = projections_from_moments(x.T.double() @ x.double(), y.T.double() @ y.double(), rank=4)
    assert a4.shape == (12, 4) and b4.shape == (12, 4)
    v, s = quantize_fp8(torch.randn(3, 64) * 10)
    assert v.dtype == torch.float8_e4m3fn and s.dtype == torch.float16
    assert v[0].numel() * v.element_size() + s[0].numel() * s.element_size() == 66
    assert Indexer({}, {}, rank=64).bytes_per_token == 66
    xx = torch.randn(3, 64)
    assert torch.allclose(dequantize_fp8(*quantize_fp8(xx)), xx, rtol=0.07, atol=1e-2)


def test_bad_policy_is_one_clear_error():
    with pytest.raises(ValueError, match="unknown policy"):
        LayerPolicy("topk", 8)
    with pytest.raises(ValueError, match="budget"):
        LayerPolicy("oracle", 0)


def test_decode_with_cache_matches_full_pass_under_sparsity():
    """Teacher-forced block on a dense-prefilled cache == step-by-step decode (same selections)."""
    import copy

    from labkit.quality.evaluate import forward

    model = tiny_llama()
    ids = torch.randint(0, 101, (1, 48))
    ctl = instrument(model)
    with torch.no_grad():
        ctl.set_all(None, None, 2)
        cache = forward(model, ids[:, :32])[1]
        ctl.set_all("oracle", 8, 2)
        block = forward(model, ids[:, 32:], copy.deepcopy(cache))[0]
        c = copy.deepcopy(cache)
        steps = []
        for t in range(32, 48):
            logits, c = forward(model, ids[:, t : t + 1], c)
            steps.append(logits)
    assert torch.allclose(block, torch.cat(steps, 1), atol=1e-4)
    assert not math.isnan(float(block.sum()))
