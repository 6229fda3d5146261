import dataclasses
import json
import subprocess
import sys

import pytest

from labkit.shapes import ModelShape, PRESETS


def test_reference_shape_follows_the_public_config():
    s = ModelShape.from_name("qwen3.8-flash-next")
    assert (s.hidden, s.n_heads, s.n_kv_heads, s.head_dim, s.rotary_dim) == (2560, 24, 2, 256, 64)
    assert (s.dn_k_heads, s.dn_v_heads, s.dn_head_dim, s.dn_conv) == (16, 48, 128, 4)
    assert (s.experts, s.experts_per_tok, s.expert_intermediate, s.shared_intermediate) == (512, 10, 640, 640)
    assert (s.vocab, s.hc_count, s.hc_lowrank, s.ngram_heads, s.ple_layers) == (248320, 4, 320, 8, (2,))
    assert s.ffn_intermediate == 0 and s.index_key_bytes == 66 and s.index_compress == 4
    # a token's routed experts: 10 x (2560 x 1280 + 640 x 2560) bf16 a layer, 48 layers
    per_expert = 2560 * 1280 + 640 * 2560
    assert s.step_weight_bytes(1)["experts"] == pytest.approx(10 * per_expert * 2 * 48)
    # c requests read the distinct experts they chose: more than 10, fewer than 10 c
    assert 10 < s.expected_experts(4) < 40 and s.expected_experts(64) < 512
    # hyper-connections: down (4 x 2560 -> 320 + 4, padded to 384) and up (320 -> 4 x 2560), twice a layer
    assert s.step_weight_bytes(1)["hc"] == 2 * 48 * 2 * (10240 * 384 + 320 * 10240)
    # W4A16: 4 bits, a bf16 scale and a 4-bit zero per 128 for the quantised products; the rest bf16
    bf, q = s.step_weight_bytes(1), s.step_weight_bytes(1, "w4a16")
    assert q["experts"] == pytest.approx(bf["experts"] / 2 * (0.5 + 2.5 / 128))
    assert q["hc"] == bf["hc"] and q["head"] == bf["head"]
    # the n-gram embedding: 8 rows of 320 bf16 values a token from host RAM
    assert s.ngram_fetch_bytes == 8 * 320 * 2
    # the whole model: ~120 B parameters of experts, far past one GPU in bf16, ~68 GB in W4A16
    assert 240e9 < s.weight_bytes() < 260e9 and 60e9 < s.weight_bytes("w4a16") < 75e9


def test_runs_before_the_public_config_resolve_to_the_stand_in():
    from labkit.shapes import shape_for_run
    assert shape_for_run("qwen3.8-flash-next").name == "qwen3.8-flash-next-standin"
    assert shape_for_run("qwen3.8-flash-next", float("nan")).name == "qwen3.8-flash-next-standin"
    assert shape_for_run("qwen3.8-flash-next", 2).name == "qwen3.8-flash-next"
    assert shape_for_run("tiny").name == "tiny"


def test_stand_in_shape_bytes():
    s = ModelShape.from_name("qwen3.8-flash-next-standin")
    assert (s.layers, s.attn_layers, s.deltanet_layers) == (48, 12, 36)
    assert s.attn_layer_ids == list(range(3, 48, 4))
    assert s.row_bytes == 2 * 2 * 256 * 2 == 2048
    assert s.index_key_bytes == 66
    # the reference shape: 12 layers x 2048 rows x 2048 B = 48 MiB per step at budget 2048
    assert s.h2d_bytes_per_step(2048, [1 << 20]) == 12 * 2048 * 2048 == 48 << 20
    assert s.h2d_bytes_per_step(2048, [1000]) == 12 * 1000 * 2048      # context below the budget
    assert s.h2d_bytes_per_step(2048, [1 << 20] * 4) == 4 * (48 << 20)
    # weights close to the 7.0 GB the probe's weight-read model used (+ index projections, conv)
    assert 6.5e9 < s.weight_bytes() < 8e9


def test_unknown_shape_and_json(tmp_path):
    with pytest.raises(ValueError, match="unknown shape"):
        ModelShape.from_name("nope")
    d = PRESETS["tiny"].summary()
    base = {k: d[k] for k in ModelShape.__dataclass_fields__}
    base["name"], base["layers"] = "mine", 12
    p = tmp_path / "mine.json"
    p.write_text(json.dumps(base))
    s = ModelShape.from_name(str(p))
    assert s.name == "mine" and s.attn_layers == 3
    base["bogus"] = 1
    p.write_text(json.dumps(base))
    with pytest.raises(ValueError, match="unknown fields"):
        ModelShape.from_json(p)


def test_cli_shapes_json():
    out = subprocess.run([sys.executable, "-m", "labkit", "shapes", "--json"], capture_output=True, text=True, check=True)
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    for r in rows.values():
        assert {"name", "layers", "attn_layers", "row_bytes", "index_key_bytes"} <= set(r)
    assert rows["qwen3.8-flash-next"]["row_bytes"] == 2048


@pytest.mark.parametrize("name", list(PRESETS))
def test_weight_matrices_are_the_layers_own(name):
    """The matrices the probe and the GEMV bench stream are the ones the engine's layers hold ([K, N]),
    and with the embedding (a lookup) they are every weight the shape counts."""
    import dataclasses

    import torch

    from labkit.engine import HybridModel
    s = PRESETS[name]
    wm = s.weight_matrices()
    small = dataclasses.replace(s, layers=s.attn_every, vocab=8, ffn_intermediate=min(s.ffn_intermediate, 64),
                                experts=min(s.experts, 2), experts_per_tok=min(s.experts_per_tok, 2),
                                ngram_table_bytes=min(s.ngram_table_bytes, 1 << 16), ple_layers=())
    m = HybridModel(small, torch.device("cpu"))
    qsa = next(b for b in m.blocks if b.kind == "qsa")
    dn = next(b for b in m.blocks if b.kind == "dn")
    held = {"qsa.w_in": qsa.mixer.w_in, "qsa.w_o": qsa.mixer.w_o, "dn.w_in": dn.mixer.w_in, "dn.w_o": dn.mixer.w_o}
    for k, w in held.items():
        assert tuple(w.shape) == wm[k][:2], k
    sm = small.weight_matrices()
    if s.moe:       # the experts held [E, N, K] (K-major): each [K, N] as the shape counts it
        assert tuple(dn.ffn.w_gu.shape[1:][::-1]) == sm["moe.w_gu"][:2] and dn.ffn.w_gu.shape[0] == small.experts
        assert tuple(dn.ffn.w_d.shape[1:][::-1]) == sm["moe.w_d"][:2]
        assert tuple(dn.ffn.router.shape) == sm["moe.router"][:2]
        assert tuple(dn.ffn.shared_gu.shape) == sm["moe.shared_gu"][:2]
    else:
        assert tuple(dn.ffn.w_gu.shape) == sm["ffn.w_gu"][:2] and tuple(dn.ffn.w_d.shape) == sm["ffn.w_d"][:2]
    if s.hc_count > 1:
        assert tuple(dn.hc1.w_down.shape) == sm["hc.w_down"][:2] and tuple(dn.hc2.w_up.shape) == sm["hc.w_up"][:2]
    assert wm["lm_head"][:2] == (s.hidden, s.vocab)
    counts = {k: c for k, (_, _, c) in wm.items()}
    assert counts["qsa.w_in"] == s.attn_layers and counts["dn.w_o"] == s.deltanet_layers
    assert counts["moe.w_d" if s.moe else "ffn.w_d"] == s.layers * (s.experts if s.moe else 1)
    # weight_params is derived from weight_matrices: check it against what a whole model holds instead
    full = HybridModel(s, torch.device("cpu")) if name in ("tiny", "tiny-moe") else None
    if full is not None:
        held = sum(p.numel() for n, p in full.named_parameters() if p.dim() in (2, 3) and not n.endswith("conv_w"))
        assert held == s.weight_params()
        assert full.weight_bytes() >= s.weight_bytes() - 2 * s.hidden * s.layers * 8   # + norms, A_log, dt_bias


def test_prefill_flops_count_the_experts_a_token_chose_not_every_expert():
    """A token's prefill work does not grow with experts it never computes: twice the routed experts at the same
    experts per token add only the router's wider product; twice the experts per token add exactly the routed
    share again."""
    s = ModelShape.from_name("qwen3.8-flash-next")
    base = s.prefill_chunk_work(0, 1024)["experts_flops"]
    wider = dataclasses.replace(s, experts=2 * s.experts).prefill_chunk_work(0, 1024)["experts_flops"]
    K, _, layers = s.weight_matrices("per_token")["moe.router"]
    assert wider - base == pytest.approx(1024 * 2 * K * s.experts * layers, rel=1e-9)
    routed = sum(2 * K * N * c for n, (K, N, c) in s.weight_matrices("per_token").items() if n in ("moe.w_gu", "moe.w_d"))
    deeper = dataclasses.replace(s, experts_per_tok=2 * s.experts_per_tok).prefill_chunk_work(0, 1024)["experts_flops"]
    assert deeper - base == pytest.approx(1024 * routed, rel=1e-9)
