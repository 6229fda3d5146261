"""What each card of a layer split holds, planned from the shape before anything is allocated.

    plans = plan_split(shape, cards=3, context_len=1 << 20, concurrency=4, weights_dtype="w4a16")
    for p in plans: print(p.line())          # card 0: layers 0-15, weights 21.3 GiB, index keys 0.97 GiB, ...

The reference box is 3x RTX 3090 (24 GiB each): the published sparse-offload system keeps the weights and the
index keys on the cards ("fitted into VRAM tightly") and the KV rows in host RAM. A card's device memory, by
part (all on the device unless said):
- `weights`: its blocks' weights (every routed expert of its layers, in `weights_dtype`; the mixers, the
  shared experts, the hyper-connections, norms), plus the embedding on the first card and the head on the last;
- `index_keys`: `index_dim + 2` bytes a token, request and QSA layer, for a capacity of whole pages;
- `deltanet_state`: each DeltaNet layer's recurrent state (fp32) and conv window per request;
- `decode_buffers`: a decode batch's static buffers (the staging of a step's selected rows, the selections,
  the rows, the logits on the last card, the stream's hand-off);
- `hot_cache`: the hot cache's device slots (`hot_cache` only: capacity x row bytes x QSA layers x requests);
- `workspace`: what a captured step holds besides (the index scores and the selection's buffers of one
  layer at a time: the step's graph keeps them); a CUDA context and cuBLAS/Triton workspaces are outside the
  allocator and outside this plan (`CONTEXT_GIB` is kept off the card's size instead).
Host RAM per card: its QSA layers' KV rows (`host_kv`).

`fits(cap_gib)` is the point's verdict; the decode experiment says so in one line before it allocates.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..shapes import BF16_BYTES, ModelShape
from .model.cache import PAGE_SIZE

GIB = 1 << 30
CONTEXT_GIB = 0.5            # CUDA context and library workspaces: outside the allocator, kept off the card


def split_layers(layers: int, cards: int) -> list[tuple[int, int]]:
    """Contiguous, as even as whole blocks allow (the first cards take the remainder)."""
    base, extra = divmod(layers, cards)
    out, a = [], 0
    for i in range(cards):
        b = a + base + (1 if i < extra else 0)
        out.append((a, b))
        a = b
    return out


@dataclass
class CardPlan:
    card: int
    layers: tuple[int, int]
    parts: dict[str, int] = field(default_factory=dict)
    host_kv: int = 0

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def fits(self, cap_gib: float) -> bool:
        return self.total <= (cap_gib - CONTEXT_GIB) * GIB

    def line(self) -> str:
        parts = ", ".join(f"{k.replace('_', ' ')} {v / GIB:.2f}" for k, v in self.parts.items() if v)
        return (f"card {self.card}: layers {self.layers[0]}-{self.layers[1] - 1}, {self.total / GIB:.2f} GiB "
                f"({parts}); host KV {self.host_kv / GIB:.1f} GiB")


def block_weight_bytes(s: ModelShape, index: int, weights_dtype: str) -> int:
    """One block's weights as the engine holds them (all routed experts)."""
    qsa = index in s.attn_layer_ids
    mats = s.weight_matrices()
    mine = ("qsa.w_in", "qsa.w_o") if qsa else ("dn.w_in", "dn.w_o")
    per_layer = [n for n in mats if n.startswith(("ffn.", "moe.", "hc."))]
    n = 0.0
    for name in mine:
        K, N, _ = mats[name]
        n += K * N * s.bytes_per_weight(name, weights_dtype, K)
    for name in per_layer:
        K, N, c = mats[name]
        n += K * N * (c / s.layers) * s.bytes_per_weight(name, weights_dtype, K)
    # norms (two per block, the QSA q/k norms, the DeltaNet gate params and conv) and the HC norms: small
    small = 2 * s.hidden + (2 * s.head_dim if qsa else s.dn_head_dim + 2 * s.dn_v_heads
                            + (2 * s.dn_k_heads * s.dn_head_dim + s.dn_v_heads * s.dn_head_dim) * s.dn_conv)
    small += 2 * s.hc_count * s.hidden if s.hc_count > 1 else 0
    return int(n + small * BF16_BYTES)


def plan_split(s: ModelShape, cards: int, context_len: int, concurrency: int, weights_dtype: str = "w4a16",
               budget: int = 2048, strategy: str = "zero_copy", hot_capacity: int = 4096,
               max_steps: int = 64) -> list[CardPlan]:
    """Per card of a `cards`-way split: its device memory by part and its host KV (module docstring)."""
    cap = -(-(context_len + max_steps) // PAGE_SIZE) * PAGE_SIZE
    k = min(budget, cap)
    c = concurrency
    hc = s.hc_count
    out = []
    for i, (a, b) in enumerate(split_layers(s.layers, cards)):
        ids = range(a, b)
        n_attn = sum(1 for j in ids if j in s.attn_layer_ids)
        n_dn = (b - a) - n_attn
        p = CardPlan(i, (a, b))
        w = sum(block_weight_bytes(s, j, weights_dtype) for j in ids)
        if a == 0:
            w += s.vocab * s.hidden * BF16_BYTES
        if b == s.layers:
            w += s.vocab * s.hidden * BF16_BYTES + s.hidden * BF16_BYTES
        p.parts["weights"] = w
        p.parts["index_keys"] = n_attn * c * cap * s.index_key_bytes
        conv_ch = 2 * s.dn_k_heads * s.dn_head_dim + s.dn_v_heads * s.dn_head_dim
        p.parts["deltanet_state"] = n_dn * c * (s.dn_v_heads * s.dn_head_dim ** 2 * 4 + conv_ch * (s.dn_conv - 1)
                                                * BF16_BYTES)
        staging = c * k * s.row_bytes
        sel = n_attn * c * k * (8 + 8 + 1)                       # rows, selections, valid
        hand = 2 * c * s.hidden * hc * BF16_BYTES
        logits = c * s.vocab * BF16_BYTES if b == s.layers else 0
        p.parts["decode_buffers"] = staging + sel + hand + logits
        p.parts["hot_cache"] = n_attn * c * hot_capacity * s.row_bytes if strategy == "hot_cache" else 0
        # one layer's scores (fp32) and the selection's candidates and histograms: about three score-sized buffers
        p.parts["workspace"] = 3 * c * (cap * 4) + (16 << 20) if n_attn else 16 << 20
        p.host_kv = n_attn * c * cap * s.row_bytes
        out.append(p)
    return out
