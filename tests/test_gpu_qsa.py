"""The fused QSA heads on the GPU (marked `gpu`): the kernel against `QSALayer.heads_reference` on the
reference shape in bf16 (round to nearest on the GPU, so within one ulp and almost all bit-equal), and a
model's logits over 64 graph-replayed decode steps with the fused heads against the torch path."""

import pytest
import torch

from labkit.engine import HybridModel
from labkit.engine.model import qsa_step as Q
from labkit.engine.model.layers import QSALayer

from decode_util import MID, REF, teacher_forced_logits

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("B", [1, 4, 16])
def test_heads_kernel_matches_torch_definition_on_reference_shape(B):
    g = torch.Generator(device="cuda").manual_seed(B)
    layer = QSALayer(REF, g, torch.bfloat16, "cuda")
    layer.q_norm.weight.copy_(1 + 0.1 * torch.randn(REF.head_dim, generator=g, device="cuda"))
    layer.k_norm.weight.copy_(1 + 0.1 * torch.randn(REF.head_dim, generator=g, device="cuda"))
    y = torch.randn(B, REF.hidden, generator=g, device="cuda").bfloat16() @ layer.w_in
    pos = torch.randint(0, 1 << 20, (B,), generator=g, device="cuda")
    assert Q.usable(layer, y)
    q, gate, kv_row = Q.qsa_heads(layer, y, pos)
    rq, rgate, rkv = layer.heads_reference(y, pos)[:3]
    assert torch.equal(gate, rgate)
    for got, ref, what in ((q, rq, "q"), (kv_row, rkv, "kv_row")):
        err = (got.float() - ref.float()).abs()
        ulp = torch.exp2(torch.floor(torch.log2(ref.float().abs().clamp_min(2.0 ** -126))) - 7)
        assert bool((err <= ulp + 2.0 ** -20).all()), f"{what}: {err.max().item()}"
        same = (got == ref).float().mean().item()
        assert same > 0.97, f"{what}: {same:.3f} bit-equal"


def test_logits_with_fused_heads_equal_torch_path_over_64_steps(monkeypatch):
    """Teacher-forced tokens (a near-tie flipping an argmax cannot send the runs apart); the KV rows the
    fused heads write are what later steps attend to, so a wrong row would drift."""
    model = HybridModel(MID, "cuda", seed=5)
    logits = {}
    for fused in (False, True):
        monkeypatch.setattr(Q, "FUSED_QSA", fused)
        logits[fused] = teacher_forced_logits(model)
    a, b = logits[False], logits[True]
    rel = (a - b).norm(dim=-1) / a.norm(dim=-1)
    assert float(rel.max()) < 4e-2, float(rel.max())
    assert float(rel[-8:].mean()) < 3e-2
    assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() > 0.9
