"""labkit.crossmodel: the ridge mapper, the derived small model, RoPE handling, the mapped cache, bad input.

Real transformers code paths on tiny random-weight Llama checkpoints written to tmp (seconds on 2
cores); the SmolLM2 runs are in test_xfer_real.py. A random checkpoint is not a test double for the
model: the claims tested here (a layer whose KV is a linear function of the small model's features is
recovered exactly; copied layers are bit-exact; the pipeline then gives a perplexity ratio of 1) hold
for any weights.
"""

import pytest
import torch

pytest.importorskip("transformers")

from labkit.crossmodel.features import FeatureSpec, rope_cos_sin, rotate, unrotate  # noqa: E402
from labkit.crossmodel.mapper import Mapper, MapperMismatch, Sums, column_sse, solve  # noqa: E402
from labkit.crossmodel.pair import PairError, layer_table, plan_pair  # noqa: E402


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
    from labkit.crossmodel.mapped_cache import fit_mapper, load_models

    models = load_models(pair)
    g = torch.Generator().manual_seed(1)
    calib = [("val" if i % 4 == 0 else "fit", f"s{i}", torch.randint(0, 64, (T,), generator=g)) for i in range(n_seq)]
    return models, fit_mapper(models, FeatureSpec.parse(features), calib, rope=rope, log=None)


def test_first_n_pair_copies_exactly_and_maps_a_linear_layer_exactly(tiny, tmp_path):
    """Large layer N reads norm(h_N) linearly: pre-RoPE keys and values are recovered with R² = 1, the
    mapped cache equals the true one and the perplexity ratio is 1; rotated keys (rope='post') are not."""
    from labkit.crossmodel.quality import evaluate, summarize
    from labkit.crossmodel.mapped_cache import mapped_kv, true_cache
    from labkit.crossmodel.features import cache_kv

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
    from labkit.experiments.crossmodel.ablation import merged
    from labkit.crossmodel.features import SmallPass
    from labkit.crossmodel.mapper import Fitter, restrict

    x = torch.arange(12, dtype=torch.float32).view(4, 3)
    sp = SmallPass({0: x}, None, None, None, None, {})
    keys = FeatureSpec.parse("h:0@avg").keys(0, layer_table(3, 1, 0), 1)
    got = sp.features(keys)[:, :3]
    from labkit.crossmodel.features import rms_normalize
    want = rms_normalize(x).cumsum(0) / torch.arange(1, 5).view(4, 1)
    assert torch.allclose(got, want)
    with pytest.raises(PairError, match="@avg"):
        FeatureSpec.parse("h:0@mean")

    pair = plan_pair(str(tiny), "first:2")
    models, mp = _fit_tiny(pair, "h:-1,h:-1@avg")
    assert mp.r2_val[2][0] > 0.999 and mp.r2_val[2][1] > 0.999
    # per-head λ from the same sums: 2 KV heads -> 4 λs per layer, the exact layer still exact
    from labkit.crossmodel.mapped_cache import large_targets, true_cache
    from labkit.crossmodel.features import small_pass
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


def _low_rank_fitter(pair, r0, seed=0, n_seq=10, T=64):
    """A Fitter whose targets are exactly rank r0 in the features: Y_l = X P C_l for every mapped layer."""
    from labkit.crossmodel.features import SmallPass, rms_normalize
    from labkit.crossmodel.mapper import Fitter

    g = torch.Generator().manual_seed(seed)
    f = Fitter(pair, FeatureSpec.parse("h:-1"))
    d, w = pair.small.hidden + 1, f.kv_width
    P = torch.randn(d, r0, generator=g)
    C = {l_: torch.randn(r0, 2 * w, generator=g) * (0.1 if l_ % 2 else 3.0) for l_ in pair.table.mapped_layers}
    for i in range(n_seq):
        h = torch.randn(T, pair.small.hidden, generator=g)
        X = torch.cat([rms_normalize(h), torch.ones(T, 1)], 1)
        Y = {l_: X @ P @ C[l_] for l_ in C}
        f.add("val" if i % 4 == 0 else "fit", SmallPass({pair.small.layers: h}, None, None, None, None, {}),
              {l_: (Y[l_][:, :w], Y[l_][:, w:]) for l_ in C})
    return f, P, C


def _gap(f, mp, W_r):
    """Σ_blocks ‖X (W_b − W_r,b)‖² / SST_b from the fitter's sums (the objective `reduced` claims to minimize)."""
    from labkit.crossmodel.mapper import column_sst

    both = f.sums["fit"].merged(f.sums["val"])
    (keys, layers), = f.groups.items()
    w, G, total = f.kv_width, both.xtx[keys], 0.0
    for l_ in layers:
        D = mp.weights[l_].double() - W_r[l_].double()
        col = (D * (G @ D)).sum(0)
        sst = column_sst(both.yy[l_], both.ys[l_], both.n[keys])
        total += float(col[:w].sum() / sst[:w].sum() + col[w:].sum() / sst[w:].sum())
    return total


def test_reduced_rank_mapper_is_exact_at_full_rank_and_optimal_below(tiny):
    """A shared projection A [d, r] then B_l per layer: at r = d it is the ridge mapper itself; targets that
    are exactly rank r0 in the features are recovered at r0 and not at r0 - 1; below that it beats the
    naive truncated SVD of W (which ignores XᵀX and the per-block scales) and a perturbed subspace, and
    its objective equals Eckart–Young's sum of the discarded squared singular values."""
    from labkit.crossmodel.mapper import column_sse

    pair = plan_pair(str(tiny), "first:1")
    assert pair.table.mapped_layers == [1, 2]
    f, P, C = _low_rank_fitter(pair, r0=3)
    mp = f.mapper(grid=(1e-5,))
    d = pair.small.hidden + 1
    full = f.reduced(mp, d)
    assert full.rank == d and set(full.proj) == {1} and full.groups == {1: 1, 2: 1}
    for l_ in (1, 2):
        assert torch.allclose(full.proj[1] @ full.weights[l_], mp.weights[l_], atol=1e-4, rtol=1e-4)
    assert mp.r2_val[1][0] > 0.9999 and mp.r2_val[2][1] > 0.9999

    # exact rank-3 targets: rank 3 keeps R² = 1 on the sums, rank 2 cannot
    both = f.sums["fit"].merged(f.sums["val"])
    (keys, _), = f.groups.items()

    def r2(m, l_):
        W = (m.proj[m.groups[l_]] @ m.weights[l_]).double() if m.rank else m.weights[l_].double()
        sse = column_sse(W, both.xtx[keys], both.xty[l_], both.yy[l_])
        from labkit.crossmodel.mapper import column_sst
        return float(1 - sse.sum() / column_sst(both.yy[l_], both.ys[l_], both.n[keys]).sum())

    r3, r2_ = f.reduced(mp, 3), f.reduced(mp, 2)
    assert min(r2(r3, 1), r2(r3, 2)) > 0.9999
    assert min(r2(r2_, 1), r2(r2_, 2)) < 0.99
    assert r3.macs_per_token() == d * 3 + 2 * 3 * 2 * f.kv_width < mp.macs_per_token()
    assert max(max(g) for g in r3.rank_gap.values()) < 1e-6 and max(max(g) for g in r2_.rank_gap.values()) > 1e-3

    # noisy targets (full rank): rank 2 is optimal for the weighted objective
    g = torch.Generator().manual_seed(5)
    noisy = {l_: mp.weights[l_] + 0.3 * torch.randn(mp.weights[l_].shape, generator=g) for l_ in (1, 2)}
    mp.weights.update(noisy)
    r = 2
    ours = f.reduced(mp, r)
    W_ours = {l_: ours.proj[1] @ ours.weights[l_] for l_ in (1, 2)}
    U, S, Vh = torch.linalg.svd(torch.cat([mp.weights[1], mp.weights[2]], 1).double(), full_matrices=False)
    naive = U[:, :r] @ torch.diag(S[:r]) @ Vh[:r]
    w2 = 2 * f.kv_width
    W_naive = {1: naive[:, :w2], 2: naive[:, w2:]}
    # another rank-2 matrix: a perturbed projection with its least-squares B (any rank-2 W must do worse)
    A2 = ours.proj[1] + 0.05 * torch.randn(ours.proj[1].shape, generator=g)
    Bp = torch.linalg.lstsq(A2.double(), torch.cat([W_ours[1], W_ours[2]], 1).double()).solution
    W_pert = {1: (A2.double() @ Bp)[:, :w2], 2: (A2.double() @ Bp)[:, w2:]}
    j_ours = _gap(f, mp, W_ours)
    assert j_ours < _gap(f, mp, W_naive) and j_ours < _gap(f, mp, W_pert)
    assert abs(j_ours - sum(sum(x) for x in ours.rank_gap.values())) < 1e-6 * max(1.0, j_ours)
    # Eckart–Young: the optimum is the sum of the discarded squared singular values of Z = Lᵀ W Γ
    from labkit.crossmodel.mapper import column_sst
    Lc = torch.linalg.cholesky(both.xtx[keys])
    w = f.kv_width
    scale = torch.cat([torch.cat([column_sst(both.yy[l_], both.ys[l_], both.n[keys])[:w].sum().repeat(w),
                                  column_sst(both.yy[l_], both.ys[l_], both.n[keys])[w:].sum().repeat(w)]) for l_ in (1, 2)])
    Z = Lc.T @ torch.cat([mp.weights[1], mp.weights[2]], 1).double() / scale.sqrt()
    s = torch.linalg.svdvals(Z)
    assert abs(j_ours - float((s[r:] ** 2).sum())) < 1e-6 * max(1.0, j_ours)


def test_reduced_rank_mapper_roundtrip_and_pipeline(tiny, tmp_path):
    """Rank, projections, groups and gaps survive save/load; the mapped cache of a full-rank factorization
    equals the ridge mapper's, and a rank-r file runs through the same pipeline."""
    from labkit.crossmodel.mapper import Fitter, read_metadata
    from labkit.crossmodel.mapped_cache import large_targets, mapped_kv, true_cache
    from labkit.crossmodel.features import small_pass

    pair = plan_pair(str(tiny), "first:1")
    models, _ = _fit_tiny(pair, "h:-1,h:0", n_seq=4)
    f = Fitter(pair, FeatureSpec.parse("h:-1,h:0"))
    g = torch.Generator().manual_seed(1)
    for i in range(12):
        ids = torch.randint(0, 64, (1, 48), generator=g)
        f.add("val" if i % 4 == 0 else "fit", small_pass(models.small, ids, f.hidden_needed),
              large_targets(models.large, true_cache(models.large, ids), pair.table.mapped_layers))
    mp = f.mapper()
    d = 2 * pair.small.hidden + 1
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(7))
    kv_full, kv_fact = mapped_kv(models, mp, ids), mapped_kv(models, f.reduced(mp, d), ids)
    for a, b in zip(kv_full, kv_fact):
        assert torch.allclose(a[0], b[0], atol=1e-4) and torch.allclose(a[1], b[1], atol=1e-4)
    r8 = f.mapper(rank=8)
    path = r8.save(tmp_path / "r8.safetensors")
    assert read_metadata(path)["rank"] == 8
    back = Mapper.load(path, expect=pair)
    assert back.rank == 8 and back.groups == r8.groups and back.rank_gap == r8.rank_gap
    assert torch.equal(back.proj[1], r8.proj[1]) and back.proj[1].shape == (d, 8)
    assert back.input_dim(2) == d and back.macs_per_token() == d * 8 + 2 * 8 * 2 * f.kv_width
    kv8 = mapped_kv(models, back, ids)
    assert not torch.allclose(kv8[2][1], kv_full[2][1], atol=1e-4)  # rank 8 < d really drops something
    assert torch.equal(kv8[0][0], kv_full[0][0])                     # the copied layer is untouched
    with pytest.raises(PairError, match="rank must be"):
        f.reduced(mp, 0)


def test_exact_prefix_holds_the_large_models_own_first_positions(tiny):
    """`exact_prefix=k`: the first k positions of every mapped layer are the large model's own K/V (its
    k-token forward equals its full prefill there: attention is causal); later positions are the mapper's."""
    from labkit.crossmodel.features import cache_kv
    from labkit.crossmodel.mapped_cache import mapped_kv, true_cache

    pair = plan_pair(str(tiny), "first:1")
    models, mp = _fit_tiny(pair, "h:-1", n_seq=6)
    ids = torch.randint(0, 64, (1, 30), generator=torch.Generator().manual_seed(4))
    tc = true_cache(models.large, ids)
    plain = mapped_kv(models, mp, ids, exact_prefix=0)
    tm = {}
    for k in (1, 3):
        kv = mapped_kv(models, mp, ids, exact_prefix=k, timings=tm)
        for l_ in pair.table.mapped_layers:
            for j in (0, 1):
                assert torch.allclose(kv[l_][j][:, :, :k], cache_kv(tc, l_)[j][:, :, :k], atol=1e-5)
                assert torch.equal(kv[l_][j][:, :, k:], plain[l_][j][:, :, k:])
        assert not torch.allclose(plain[2][1][:, :, :k], cache_kv(tc, 2)[1][:, :, :k], atol=1e-3)  # it was predicted
        assert torch.equal(kv[0][0], plain[0][0])   # copied layer untouched
    assert tm["prefix_s"] >= 0
    zeros = mapped_kv(models, mp, ids, "zeros", exact_prefix=1)   # the ablations stay what they say
    assert float(zeros[2][0].abs().max()) == 0.0
