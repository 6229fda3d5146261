"""labkit.xfer: the ridge mapper, the derived small model, RoPE handling, the mapped cache, bad input.

Real transformers code paths on tiny random-weight Llama checkpoints written to tmp (seconds on 2
cores); the SmolLM2 runs are in test_xfer_real.py. A random checkpoint is not a test double for the
model: the claims tested here (a layer whose KV is a linear function of the small model's features is
recovered exactly; copied layers are bit-exact; the pipeline then gives a perplexity ratio of 1) hold
for any weights.
"""

import pytest
import torch

pytest.importorskip("transformers")

from labkit.xfer.features import FeatureSpec, rope_cos_sin, rotate, unrotate  # noqa: E402
from labkit.xfer.mapper import Mapper, MapperMismatch, Sums, column_sse, solve  # noqa: E402
from labkit.xfer.pair import PairError, layer_table, plan_pair  # noqa: E402


def _tiny_checkpoint(path, layers=3, vocab=64, seed=0, words=None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=vocab, max_position_embeddings=256,
                      rope_theta=10000.0, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(path)
    words = words or [f"w{i}" for i in range(vocab)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk).save_pretrained(path)
    return path


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    return _tiny_checkpoint(tmp_path / "large")


def test_ridge_recovers_a_known_linear_map_from_streamed_sums():
    torch.manual_seed(0)
    d, out = 12, 5
    W = torch.randn(d, out, dtype=torch.float64)
    acc = Sums()
    for _ in range(7):  # streamed in chunks, never one design matrix
        X = torch.cat([torch.randn(200, d - 1, dtype=torch.float64), torch.ones(200, 1, dtype=torch.float64)], 1)
        acc.add("g", X, {0: X @ W})
    W_hat = solve(acc.xtx["g"], acc.xty[0], 1e-9)
    assert torch.allclose(W_hat, W, atol=1e-5)  # XᵀY is summed per chunk in float32
    rel = column_sse(W_hat, acc.xtx["g"], acc.xty[0], acc.yy[0]).abs() / acc.yy[0]
    assert float(rel.max()) < 1e-6
    # a wrong map has a large error: the sums-only SSE is not vacuous
    assert float((column_sse(W * 0.5, acc.xtx["g"], acc.xty[0], acc.yy[0]) / acc.yy[0]).min()) > 0.1


def test_rope_inverse_is_exact(tiny):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    cos, sin = rope_cos_sin(m, 50)
    k = torch.randn(1, 2, 50, 8)
    assert torch.allclose(unrotate(rotate(k, cos, sin), cos, sin), k, atol=1e-6)
    assert not torch.allclose(rotate(k, cos, sin), k, atol=1e-3)


def _fit_tiny(pair, features, rope="pre", n_seq=24, T=48):
    from labkit.xfer.transfer import fit_mapper, load_models

    models = load_models(pair)
    g = torch.Generator().manual_seed(1)
    calib = [("val" if i % 4 == 0 else "fit", f"s{i}", torch.randint(0, 64, (T,), generator=g)) for i in range(n_seq)]
    return models, fit_mapper(models, FeatureSpec.parse(features), calib, rope=rope, log=None)


def test_first_n_pair_copies_exactly_and_maps_a_linear_layer_exactly(tiny, tmp_path):
    """Large layer N reads norm(h_N) linearly: pre-RoPE keys and values are recovered with R² = 1, the
    mapped cache equals the true one and the perplexity ratio is 1; rotated keys (rope='post') are not."""
    from labkit.xfer.quality import evaluate, summarize
    from labkit.xfer.transfer import mapped_kv, true_cache
    from labkit.xfer.features import cache_kv

    pair = plan_pair(str(tiny), "first:2")
    assert pair.table.copy_layers == [0, 1] and pair.table.mapped_layers == [2]
    models, mp = _fit_tiny(pair, "h:-1")
    assert mp.r2_val[2][0] > 0.99999 and mp.r2_val[2][1] > 0.99999, mp.r2_val
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(7))
    true = true_cache(models.large, ids)
    kv = mapped_kv(models, mp, ids, "mapped")
    for i in (0, 1):  # copied layers: the same computation, bit for bit
        assert torch.equal(kv[i][0], cache_kv(true, i)[0]) and torch.equal(kv[i][1], cache_kv(true, i)[1])
    assert torch.allclose(kv[2][0], cache_kv(true, 2)[0], atol=1e-4)
    seqs = [("rand", "r0", torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(3)))]
    df, r2 = evaluate(models, mp, seqs, prompt_len=24, cont_len=16, agree_tokens=8, log=None)
    s = summarize(df).set_index("mode")
    assert abs(s.loc["mapped", "ppl_ratio"] - 1.0) < 1e-3 and s.loc["mapped", "top1_agree"] == 1.0
    assert (r2["r2"] > 0.9999).all()
    assert s.loc["zeros", "ppl_ratio"] > 1.0 + 1e-3  # the ablation must lose something
    _, mp_post = _fit_tiny(pair, "h:-1", rope="post")
    assert mp_post.r2_val[2][0] < 0.99, "a position-free linear map cannot produce rotated keys"


def test_mapper_roundtrip_and_refuses_other_models(tiny, tmp_path):
    pair = plan_pair(str(tiny), "first:2")
    _, mp = _fit_tiny(pair, "h:-1,h:aligned", n_seq=8)
    path = mp.save(tmp_path / "m.safetensors")
    back = Mapper.load(path, expect=pair)
    assert torch.equal(back.weights[2], mp.weights[2]) and back.lambdas == mp.lambdas
    assert back.corpus["fit_sha256"] == mp.corpus["fit_sha256"] and str(back.features) == "h:-1,h:aligned"
    other = plan_pair(str(_tiny_checkpoint(tmp_path / "other", layers=4, seed=1)), "first:2")
    with pytest.raises(MapperMismatch, match="fitted for large model") as e:
        Mapper.load(path, expect=other)
    assert "\n" not in str(e.value)
    with pytest.raises(MapperMismatch, match="no labkit mapper metadata"):
        from safetensors.torch import save_file
        save_file({"x": torch.zeros(1)}, str(tmp_path / "plain.safetensors"))
        Mapper.load(tmp_path / "plain.safetensors")


def test_bad_pairs_and_tables_are_one_line(tiny, tmp_path):
    other = _tiny_checkpoint(tmp_path / "othertok", words=[f"x{i}" for i in range(64)])
    with pytest.raises(PairError, match="different tokenizers"):
        plan_pair(str(tiny), str(other))
    with pytest.raises(PairError, match=r"N must be in \[1, 2\]"):
        plan_pair(str(tiny), "first:3")
    with pytest.raises(PairError, match="small layer 9 out of range"):
        layer_table(28, 4, 0, "5:9")
    with pytest.raises(PairError, match="large layer 40 out of range"):
        layer_table(28, 4, 0, "40:1")
    with pytest.raises(PairError, match="copied layer"):
        layer_table(30, 8, 8, "3:2")
    t = layer_table(28, 28 // 2, 0)  # proportional: ends map to ends
    assert t.aligned(0) == 0 and t.aligned(27) == 13 and t.copy_layers == []
    with pytest.raises(PairError, match="feature"):
        FeatureSpec.parse("q:3")
    with pytest.raises(PairError, match="hidden index out of range"):
        FeatureSpec.parse("h:12").keys(5, layer_table(30, 8, 8), 8)


def test_causal_mean_feature_and_per_head_lambda(tiny, tmp_path):
    """`@avg` is the causal mean over positions 0..t; λ chosen per KV head still recovers a linearly
    readable layer exactly (one λ per head of K and of V in the file), and the layer's K/V is the same
    whichever λ granularity chose it."""
    from labkit.xfer.ablation import merged
    from labkit.xfer.features import SmallPass
    from labkit.xfer.mapper import Fitter, restrict

    x = torch.arange(12, dtype=torch.float32).view(4, 3)
    sp = SmallPass({0: x}, None, None, None, None, {})
    keys = FeatureSpec.parse("h:0@avg").keys(0, layer_table(3, 1, 0), 1)
    got = sp.features(keys)[:, :3]
    from labkit.xfer.features import rms_normalize
    want = rms_normalize(x).cumsum(0) / torch.arange(1, 5).view(4, 1)
    assert torch.allclose(got, want)
    with pytest.raises(PairError, match="@avg"):
        FeatureSpec.parse("h:0@mean")

    pair = plan_pair(str(tiny), "first:2")
    models, mp = _fit_tiny(pair, "h:-1,h:-1@avg")
    assert mp.r2_val[2][0] > 0.999 and mp.r2_val[2][1] > 0.999
    # per-head λ from the same sums: 2 KV heads -> 4 λs per layer, the exact layer still exact
    from labkit.xfer.transfer import large_targets, true_cache
    from labkit.xfer.features import small_pass
    f = Fitter(pair, FeatureSpec.parse("h:-1,h:-1@avg"))
    g = torch.Generator().manual_seed(1)
    for i in range(12):
        ids = torch.randint(0, 64, (1, 48), generator=g)
        sp = small_pass(models.small, ids, f.hidden_needed)
        f.add("val" if i % 4 == 0 else "fit", sp, large_targets(models.large, true_cache(models.large, ids), [2]))
    mh = f.mapper(lambda_per="head")
    assert len(mh.lambdas[2]) == 4 and mh.r2_val[2][0] > 0.999 and mh.r2_val[2][1] > 0.999
    assert mh.corpus["lambda_per"] == "head" and len(mh.lambda_kv(2)) == 2
    # restrict + merge: the subset's mapper from the superset's sums equals a direct fit of the subset
    sub = restrict(merged(f, Fitter(pair, FeatureSpec.parse("h:-1,h:-1@avg"))), FeatureSpec.parse("h:-1"))
    assert sub.tokens == f.tokens
    assert sub.mapper().weights[2].shape[0] == pair.small.hidden + 1
