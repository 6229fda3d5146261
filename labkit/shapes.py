"""Model shapes: layer pattern, heads, dims, bytes per KV row and per index key; named presets.

`ModelShape.from_name("qwen3.8-flash-next")` gives the reference shape (Qwen3.8-Flash-Next, the hybrid model of sparse offload at 1M context). Users add their
own with `ModelShape.from_json(path)` (the same field names) or by constructing the dataclass.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

BF16_BYTES = 2


# rows the reference model's indexer keeps per QSA layer and request (its top-k): every experiment's budget
# on a GPU unless told otherwise
REFERENCE_BUDGET = 2048


ROW_ALIGN = 64      # elements: a padded projection's width is a multiple of it (128-byte rows in bf16)


def aligned_width(n: int) -> int:
    """The width a split projection is held at: n rounded up to `ROW_ALIGN` (layers.py says why)."""
    return -(-n // ROW_ALIGN) * ROW_ALIGN


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    attn_every: int          # every `attn_every`-th layer (1-based: layer index % attn_every == attn_every-1) is QSA
    hidden: int
    n_heads: int             # query heads of a QSA layer
    n_kv_heads: int
    head_dim: int
    rotary_dim: int          # partial RoPE (Qwen3-Next rotates a quarter of head_dim)
    index_dim: int           # fp8 values per index key (+ one fp16 scale)
    index_heads: int         # indexer query heads, weighted and summed into one score per token
    dn_k_heads: int          # gated DeltaNet key/query heads
    dn_v_heads: int          # gated DeltaNet value heads
    dn_head_dim: int
    dn_conv: int             # short causal conv kernel of the DeltaNet q/k/v
    ffn_intermediate: int    # dense stand-in for the active experts
    vocab: int
    note: str = ""

    # -- derived ---------------------------------------------------------------
    @property
    def attn_layer_ids(self) -> list[int]:
        return [i for i in range(self.layers) if i % self.attn_every == self.attn_every - 1]

    @property
    def attn_layers(self) -> int:
        return len(self.attn_layer_ids)

    @property
    def deltanet_layers(self) -> int:
        return self.layers - self.attn_layers

    @property
    def row_bytes(self) -> int:
        """K+V bytes of one token in one QSA layer (bf16)."""
        return 2 * self.n_kv_heads * self.head_dim * BF16_BYTES

    @property
    def index_key_bytes(self) -> int:
        """Index key of one token in one QSA layer: index_dim fp8 values + one fp16 scale."""
        return self.index_dim + 2

    def kv_bytes_per_token(self) -> int:
        return self.row_bytes * self.attn_layers

    def h2d_bytes_per_step(self, budget: int, context_lens: list[int]) -> int:
        """Bytes the selected rows of one decode step weigh, summed over requests and QSA layers."""
        return sum(min(budget, c) for c in context_lens) * self.row_bytes * self.attn_layers

    def prefill_chunk_work(self, start: int, end: int, dn_chunk: int = 64, budget: int = 0) -> dict[str, float]:
        """The work of prefilling positions [start, end) of one prompt: FLOPs per phase and bytes moved, the
        numerators of a prefill anatomy's bounds (`labkit.engine.model.prefill_marks` names the phases).

        - `weights_flops`: 2 x tokens x every weight product's K x N (the head's product is the last token's);
        - `attention_flops`: dense causal attention, per QSA layer 4 x Hq x D x (query i sees its position + 1
          keys): tokens x start + tokens (tokens + 1) / 2 pairs;
        - `deltanet_flops`: the chunked delta rule's products per value head and token, counted from its
          WY form (`layers.delta_rule_chunked`): 2 x (3 dk dv + C (3 dk + 2 dv)) with C = `dn_chunk`;
        - `kv_write_bytes`: the chunk's K/V rows and index keys written; `kv_read_bytes`: the prefix [0, end)
          read back per QSA layer (the sync path's read; rotating buffers read [held, start) instead);
        - with `budget` > 0 (sparse prefill): a query attends to min(its keys, budget) rows, and
          `index_score_flops` counts the indexer's scores over every key it sees (2 x index_heads x index_dim a
          pair), the fused score-and-select's products."""
        n = end - start
        per_token = sum(2 * K * N * c for name, (K, N, c) in self.weight_matrices().items() if name != "lm_head")
        K, N, _ = self.weight_matrices()["lm_head"]
        pairs = n * start + n * (n + 1) / 2
        attended = pairs if not budget else sum(min(p + 1, budget) for p in range(start, end))
        dk = dv = self.dn_head_dim
        dn = 2 * (3 * dk * dv + dn_chunk * (3 * dk + 2 * dv)) * self.dn_v_heads
        return {"weights_flops": float(n * per_token + 2 * K * N),
                "attention_flops": float(4 * self.n_heads * self.head_dim * attended * self.attn_layers),
                "index_score_flops": float(2 * self.index_heads * self.index_dim * pairs * self.attn_layers) if budget else 0.0,
                "deltanet_flops": float(n * dn * self.deltanet_layers),
                "kv_write_bytes": float(n * (self.row_bytes + self.index_key_bytes) * self.attn_layers),
                "kv_read_bytes": float(end * self.row_bytes * self.attn_layers)}

    def weight_params(self) -> int:
        """Parameters the engine instantiates: the weight matrices a step multiplies by, and the embedding."""
        return sum(K * N * c for K, N, c in self.weight_matrices().values()) + self.vocab * self.hidden

    def weight_matrices(self) -> dict[str, tuple[int, int, int]]:
        """Each distinct weight a decode step multiplies by: name -> (K, N, how many a step reads), [K, N]
        as the layers hold them (gate and up one matrix; the QSA input projection padded with zero
        columns to `aligned_width`; the embedding is a lookup, not a product)."""
        h = self.hidden
        dk, dv = self.dn_k_heads * self.dn_head_dim, self.dn_v_heads * self.dn_head_dim
        qsa_in = 2 * self.n_heads * self.head_dim + 2 * self.n_kv_heads * self.head_dim \
            + self.index_heads * self.index_dim + self.index_heads + self.index_dim
        return {"qsa.w_in": (h, aligned_width(qsa_in), self.attn_layers), "qsa.w_o": (self.n_heads * self.head_dim, h, self.attn_layers),
                "dn.w_in": (h, 2 * dk + 2 * dv + 2 * self.dn_v_heads, self.deltanet_layers),
                "dn.w_o": (dv, h, self.deltanet_layers),
                "ffn.w_gu": (h, 2 * self.ffn_intermediate, self.layers), "ffn.w_d": (self.ffn_intermediate, h, self.layers),
                "lm_head": (h, self.vocab, 1)}

    def weight_bytes(self) -> int:
        return self.weight_params() * BF16_BYTES

    def summary(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(attn_layers=self.attn_layers, deltanet_layers=self.deltanet_layers, row_bytes=self.row_bytes,
                 index_key_bytes=self.index_key_bytes, weight_bytes=self.weight_bytes())
        return d

    # -- construction ----------------------------------------------------------
    @classmethod
    def from_name(cls, name: str) -> "ModelShape":
        if name in PRESETS:
            return PRESETS[name]
        if name.endswith(".json") and Path(name).is_file():
            return cls.from_json(name)
        raise ValueError(f"unknown shape {name!r}: choose one of {', '.join(PRESETS)} or give a .json file")

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelShape":
        d = json.loads(Path(path).read_text())
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"shape file {path}: unknown fields {sorted(unknown)}")
        return cls(**d)


PRESETS: dict[str, ModelShape] = {
    # The published sparse-offload model (Qwen3.8-Flash-Next), with the public Qwen3-Next-80B-A3B layout where the publication is silent.
    "qwen3.8-flash-next": ModelShape(
        name="qwen3.8-flash-next", layers=48, attn_every=4, hidden=2048, n_heads=16, n_kv_heads=2,
        head_dim=256, rotary_dim=64, index_dim=64, index_heads=4, dn_k_heads=16, dn_v_heads=32,
        dn_head_dim=128, dn_conv=4, ffn_intermediate=11 * 512, vocab=151936,
        note="MoE FFN (10 routed + 1 shared experts of 512) replaced by a dense 11x512 stand-in with "
             "the same active parameters; weights random and seeded"),
    # Same pattern, tiny dims: CPU tests in seconds.
    "tiny": ModelShape(
        name="tiny", layers=8, attn_every=4, hidden=64, n_heads=4, n_kv_heads=2, head_dim=32,
        rotary_dim=8, index_dim=16, index_heads=2, dn_k_heads=2, dn_v_heads=4, dn_head_dim=16,
        dn_conv=4, ffn_intermediate=128, vocab=512, note="test shape with the reference layer pattern"),
}


def planned_shape(name: str) -> ModelShape:
    """The shape a plan names (a preset or a .json file), or one BadInput line saying which exist."""
    from .params import BadInput
    try:
        return ModelShape.from_name(name)
    except ValueError as ex:
        raise BadInput(str(ex)) from None
