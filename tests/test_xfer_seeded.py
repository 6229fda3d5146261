"""Cross-model TTFT at the published pair's shapes with seeded weights (`labkit run crossmodel -p weights=seeded`), at
toy size of the same family on the CPU: the rows the claims card reads, the mapped path's first token from the
large model's decode over a mapped cache of its own shape, bad input in one line."""
from __future__ import annotations

import pytest
import torch

from labkit.params import BadInput

TINY = {"weights": "seeded", "large": "qwen3-tiny-large", "small": "qwen3-tiny-small", "device": "cpu",
        "dtype": "float32", "ttft_lens": [40], "concurrency": [1, 3], "repeats": 2, "seed": 3}


def test_published_shapes_are_the_published_configs():
    from labkit.experiments.crossmodel.seeded import SHAPES, pair_spec

    s, l_ = SHAPES["qwen3-0.6b"], SHAPES["qwen3-1.7b"]
    assert (s["num_hidden_layers"], s["hidden_size"], s["intermediate_size"]) == (28, 1024, 3072)
    assert (l_["num_hidden_layers"], l_["hidden_size"], l_["intermediate_size"]) == (28, 2048, 6144)
    for c in (s, l_):
        assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["vocab_size"]) == (16, 8, 128, 151936)
        assert c["rope_theta"] == 1e6
    pair = pair_spec("qwen3-1.7b", "qwen3-0.6b", 0)
    assert pair.table.mapped_layers == list(range(28)) and [pair.table.aligned(i) for i in range(28)] == list(range(28))


def test_seeded_run_writes_the_rows_the_card_reads(tmp_path):
    from labkit.experiments import measure
    from labkit.docs.claims.xfer import _ttft_speedup
    from labkit.results import load_run

    run = measure("crossmodel", dict(TINY, out_dir=str(tmp_path / "run")), progress_bar=False)
    lr = load_run(run.path)
    m = lr.metrics
    assert (m["status"] == "ok").all() and (m["kind"] == "ttft").all() and (m["weights"] == "seeded").all()
    assert sorted(zip(m["concurrency"], m["strategy"])) == [(1, "large_prefill"), (1, "mapped"),
                                                           (3, "large_prefill"), (3, "mapped")]
    assert (m["context_len"] == 40).all() and (m["cache_tokens"] == 39).all()
    for col in ("ttft_ms_median", "ttft_ms_min", "ttft_ms_max"):
        assert (m[col] > 0).all(), col
    assert ((m["ttft_ms_min"] <= m["ttft_ms_median"]) & (m["ttft_ms_median"] <= m["ttft_ms_max"])).all()
    for c in (1, 3):
        g = m[m["concurrency"] == c].set_index("strategy")
        ratio = g.loc["large_prefill", "ttft_ms_median"] / g.loc["mapped", "ttft_ms_median"]
        assert g.loc["mapped", "speedup"] == pytest.approx(ratio)
        fig = _ttft_speedup(str(run.path), concurrency=c, near=40)      # the card's own reader
        assert fig is not None and fig.value == pytest.approx(ratio)
    one = m[(m["concurrency"] == 1) & (m["strategy"] == "mapped")].iloc[0]
    parts = one["small_prefill_ms"] + one["mapping_ms"] + one["prefix_ms"] + one["decode_first_ms"]
    assert 0 < parts <= one["ttft_ms_max"] * 1.05       # the stages are inside the timed path
    mf = lr.manifest
    assert mf["status"] == "ok" and mf["parameters"]["weights"] == "seeded"
    assert mf["mapper"]["macs_per_token"] == (4 * 32 + 1) * 2 * 2 * 16 * 3   # 4 hidden features + bias -> 3 layers' K, V


def test_mapped_first_token_is_the_large_models_decode_over_a_mapped_cache():
    from labkit.experiments.crossmodel import seeded as S
    from labkit.crossmodel.features import build_cache, cache_kv, call
    from labkit.crossmodel.mapped_cache import Models, mapped_kv

    pair = S.pair_spec("qwen3-tiny-large", "qwen3-tiny-small", 5)
    m = Models(pair, S.build("qwen3-tiny-large", 5, torch.float32, "cpu"), S.build("qwen3-tiny-small", 6, torch.float32, "cpu"), None)
    mp = S.fit_mapper(m, 5, tokens=96)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    tok, cache, logits = S.mapped_first(m, mp, ids, exact_prefix=1)
    assert logits.shape == (256,) and tok == int(logits.argmax())
    assert len(cache.layers) == 3                               # the large model's layers, not the small one's 2
    for i in range(3):
        k, v = cache_kv(cache, i)
        assert k.shape == v.shape == (1, 2, 30, 16)             # T - 1 mapped positions + the decoded one
    # the same step recomputed from the mapped K/V: the token is the large model's, over that cache
    kv = mapped_kv(m, mp, ids[:, :-1], "mapped", exact_prefix=1)
    again = call(m.large, ids[:, -1:], build_cache(m.large, kv))[0].logits[0, -1]
    assert torch.allclose(again, logits, atol=1e-5)
    # the decode reads the cache: other mapped values give other logits
    other = call(m.large, ids[:, -1:], build_cache(m.large, [(k, v * 0 + 1) for k, v in kv]))[0].logits[0, -1]
    assert not torch.allclose(other, logits, atol=1e-3)
    # the small model alone could not have produced it: its logits differ
    small_logits = call(m.small, ids)[0].logits[0, -1]
    assert not torch.allclose(small_logits, logits, atol=1e-3)


@pytest.mark.parametrize("change, words", [
    ({"large": "qwen3-32b"}, "not a known shape"),
    ({"small": "qwen3-tiny-large"}, "not a pair of one family"),
    ({"ttft_lens": [4096]}, "must be in [3, 512]"),
    ({"ttft_lens": []}, "give ttft_lens"),
    ({"backend": "vllm"}, "transformers path only"),
    ({"concurrency": [0]}, ">= 1"),
    ({"weights": "random"}, "checkpoint or seeded"),
])
def test_bad_input_is_one_line(change, words):
    from labkit.experiments import plan

    with pytest.raises(BadInput) as ex:
        plan("crossmodel", dict(TINY, **change))
    assert words in str(ex.value) and "\n" not in str(ex.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_cuda_without_a_gpu_is_one_line():
    from labkit.experiments import plan

    with pytest.raises(BadInput, match="no CUDA GPU"):
        plan("crossmodel", dict(TINY, device="cuda"))
