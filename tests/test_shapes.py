import json
import subprocess
import sys

import pytest

from labkit.shapes import ModelShape, PRESETS


def test_reference_shape_bytes():
    s = ModelShape.from_name("qwen3.8-flash-next")
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
    small = dataclasses.replace(s, layers=s.attn_every, vocab=8, ffn_intermediate=min(s.ffn_intermediate, 64))
    m = HybridModel(small, torch.device("cpu"))
    qsa = next(b for b in m.blocks if b.kind == "qsa")
    dn = next(b for b in m.blocks if b.kind == "dn")
    held = {"qsa.w_in": qsa.mixer.w_in, "qsa.w_o": qsa.mixer.w_o, "dn.w_in": dn.mixer.w_in, "dn.w_o": dn.mixer.w_o}
    for k, w in held.items():
        assert tuple(w.shape) == wm[k][:2], k
    sm = small.weight_matrices()
    assert tuple(dn.ffn.w_gu.shape) == sm["ffn.w_gu"][:2] and tuple(dn.ffn.w_d.shape) == sm["ffn.w_d"][:2]
    assert wm["lm_head"][:2] == (s.hidden, s.vocab)
    counts = {k: c for k, (_, _, c) in wm.items()}
    assert counts["qsa.w_in"] == s.attn_layers and counts["dn.w_o"] == s.deltanet_layers and counts["ffn.w_d"] == s.layers
    # weight_params is derived from weight_matrices: check it against what a whole model holds instead
    full = HybridModel(s, torch.device("cpu")) if name == "tiny" else None
    if full is not None:
        held = sum(p.numel() for n, p in full.named_parameters() if p.dim() == 2 and not n.endswith("conv_w"))
        assert held == s.weight_params()
