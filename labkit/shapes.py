"""Model shapes: layer pattern, heads, dims, experts, bytes per KV row and per index key; named presets.

`ModelShape.from_name("qwen3.8-flash-next")` gives the reference shape: Qwen3.8-Flash-Next as its public text
configuration describes it (the hybrid model of sparse offload at 1M context). Users add their own with
`ModelShape.from_json(path)` (the same field names) or by constructing the dataclass.

What a decode step reads (`step_weight_bytes`): every dense matrix once; of the routed experts, the distinct
ones the batch's tokens chose (`expected_experts`: c requests choose up to `experts_per_tok` x c of them); the
hyper-connections' mixing matrices before each sub-block; one embedding row a request and, where the model has
an n-gram embedding, `ngram_heads` rows of it a request from wherever the table lives (host RAM by default:
`ngram_fetch_bytes`). `weights_dtype` says how a weight is stored (`WEIGHT_BYTES`: bf16, or W4A16's 4-bit
values with a bf16 scale and a 4-bit zero per group of 128).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from . import atomic
from .params import BadInput, Param

BF16_BYTES = 2
W4_GROUP = 128             # W4A16: one scale and one zero per 128 weights along K
# bytes a weight takes, per storage: W4A16 is 4 bits + (bf16 scale + 4-bit zero) / 128 (AWQ's layout)
WEIGHT_BYTES = {"bf16": 2.0, "w4a16": 0.5 + (2 + 0.5) / W4_GROUP}
# The one spelling of the ways a model's weights are held: the `weights_dtype` parameter's choices, the holding
# rule's (`engine.model.hybrid.resolve_holding`) and the cost model's all read these.
WEIGHT_DTYPES = tuple(WEIGHT_BYTES)
WEIGHTS_DTYPE_CHOICES = ("auto", *WEIGHT_DTYPES)    # "auto": the holding rule decides per device


# a prefill chunk's phases counted in FLOPs (`ModelShape.prefill_chunk_work`'s `<phase>_flops`; each a phase of
# the prefill anatomy, `engine.model.prefill_marks`)
FLOP_PHASES = ("weights", "experts", "hc", "attention", "deltanet", "index_score")


def _flop_part(matrix: str) -> str:
    """The FLOP phase a weight matrix's products are timed in (`weight_matrices`' names)."""
    return {"moe": "experts", "hc": "hc"}.get(matrix.split(".")[0], "weights")


def check_weights_dtype(weights_dtype: str, auto: bool = False) -> None:
    """A ValueError naming the choices unless `weights_dtype` is one of `WEIGHT_DTYPES` (or "auto" with `auto`)."""
    choices = WEIGHTS_DTYPE_CHOICES if auto else WEIGHT_DTYPES
    if weights_dtype not in choices:
        raise ValueError(f"unknown weights_dtype {weights_dtype!r}: choose from {', '.join(choices)}")


def held_quantised(weights_dtype: str, K: int) -> bool:
    """Whether a quantisable matrix of fan-in `K` is held 4-bit: under "w4a16" where K is a multiple of its
    group (else bf16: tiny shapes only; the reference shape's are all multiples of 128)."""
    return weights_dtype == "w4a16" and K % W4_GROUP == 0


# How a shape's model is held and routed (`engine.HybridModel`): every experiment that builds one takes them.
MODEL_PARAMS = [
    Param("weights_dtype", "str", "auto", "weights: bf16, or w4a16 (4-bit, group 128, bf16 activations, as the "
          "public RTX 3090 checkpoint); auto: bf16 where the whole model fits the device, else w4a16 (with fewer "
          "expert banks where even that does not fit)", choices=WEIGHTS_DTYPE_CHOICES),
    Param("expert_banks", "int", 0, "layers whose routed experts the device holds, the others sharing them (same "
          "bytes a step, less memory); 0: every layer where they fit, else as many as fit", ge=0),
    Param("routing", "str", "router", "expert routing: router (the seeded router, near uniform), zipf:S "
          "(expert popularity ~ 1/rank^S, seeded per layer), file:PATH (recorded expert frequencies, JSON)"),
    Param("ngram_table_gib", "float", 4.0, "the n-gram embedding's table in host RAM (GiB; the published one "
          "is ~49): its rows cross the host link each step whatever its size", gt=0),
]


def model_kwargs(p: Mapping[str, Any]) -> dict:
    """HybridModel's keyword arguments from a plan's model parameters (defaults where a plan has none)."""
    d = {q.name: q.default for q in MODEL_PARAMS} | {k: p[k] for k in (q.name for q in MODEL_PARAMS) if k in p}
    return {"weights_dtype": d["weights_dtype"], "expert_banks": d["expert_banks"] or None,
            "routing": d["routing"], "ngram_table_bytes": int(d["ngram_table_gib"] * 2**30)}


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
    ffn_intermediate: int    # a dense FFN's width (0 where the model routes to experts)
    vocab: int
    note: str = ""
    # mixture of experts: `experts` routed experts of width `expert_intermediate`, `experts_per_tok` chosen per
    # token by a router (softmax over the top k, renormalised), plus one shared expert of `shared_intermediate`
    experts: int = 0
    experts_per_tok: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    # hyper-connections: the residual stream is `hc_count` copies of the hidden state; before each sub-block a
    # low-rank (`hc_lowrank`) gated mix of them is its input, after it the output is injected into every copy
    hc_count: int = 1
    hc_lowrank: int = 0
    # the n-gram embedding: `ngram_heads` rows of hidden / ngram_heads values per token (hashed n-grams of
    # order `ngram_order`), added to the input of the layers in `ple_layers`; the table is `ngram_table_bytes`
    ngram_heads: int = 0
    ngram_order: int = 3
    ngram_table_bytes: int = 0
    ple_layers: tuple = ()
    index_compress: int = 1  # the public config's indexer_compress_ratio (the note says how the lab keeps it)

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

        - `weights_flops`: 2 x tokens x every dense weight product's K x N (the head's product is the last
          token's); `experts_flops` the same of the router, the `experts_per_tok` routed experts a token chose and
          the shared expert; `hc_flops` of the hyper-connections' down and up products (`FLOP_PHASES`: each its
          own phase of the anatomy);
        - `attention_flops`: dense causal attention, per QSA layer 4 x Hq x D x (query i sees its position + 1
          keys): tokens x start + tokens (tokens + 1) / 2 pairs;
        - `deltanet_flops`: the chunked delta rule's products per value head and token, counted from its
          WY form (`layers.delta_rule_chunked`): 2 x (3 dk dv + C (3 dk + 2 dv)) with C = `dn_chunk`;
        - `kv_write_bytes`: the chunk's K/V rows and index keys written; `kv_read_bytes`: the prefix [0, end)
          read back per QSA layer (the sync path's read; rotating buffers read [held, start) instead);
        - with `budget` > 0 (sparse prefill): a query attends to min(its keys, budget) rows, and
          `index_score_flops` counts the indexer's scores over every key it sees (2 x index_heads x index_dim a
          pair), the fused score-and-select's products;
        - `ngram_bytes`: the n-gram embedding's rows the chunk's tokens read from host RAM (each layer that adds
          them)."""
        n = end - start
        mats = self.weight_matrices(routed="per_token")

        def per_token(part: str) -> int:
            return sum(2 * K * N * c for name, (K, N, c) in mats.items() if _flop_part(name) == part
                       and name != "lm_head")
        K, N, _ = mats["lm_head"]
        pairs = n * start + n * (n + 1) / 2
        attended = pairs if not budget else sum(min(p + 1, budget) for p in range(start, end))
        dk = dv = self.dn_head_dim
        dn = 2 * (3 * dk * dv + dn_chunk * (3 * dk + 2 * dv)) * self.dn_v_heads
        return {"weights_flops": float(n * per_token("weights") + 2 * K * N),
                "experts_flops": float(n * per_token("experts")),
                "hc_flops": float(n * per_token("hc")),
                "attention_flops": float(4 * self.n_heads * self.head_dim * attended * self.attn_layers),
                "index_score_flops": float(2 * self.index_heads * self.index_dim * pairs * self.attn_layers) if budget else 0.0,
                "deltanet_flops": float(n * dn * self.deltanet_layers),
                "kv_write_bytes": float(n * (self.row_bytes + self.index_key_bytes) * self.attn_layers),
                "kv_read_bytes": float(end * self.row_bytes * self.attn_layers),
                "ngram_bytes": float(n * self.ngram_fetch_bytes * len(self.ple_layers))}

    def weight_params(self) -> int:
        """Parameters the engine instantiates: every weight matrix (all experts of every layer) and the
        embedding (the n-gram table is not counted: it lives in host RAM, `ngram_table_bytes`)."""
        return sum(K * N * c for K, N, c in self.weight_matrices().values()) + self.vocab * self.hidden

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def weight_matrices(self, routed: str = "all") -> dict[str, tuple[int, int, int]]:
        """Each distinct weight: name -> (K, N, how many there are), [K, N] as the layers hold them (gate and
        up one matrix; the QSA input projection padded with zero columns to `aligned_width`; the embedding is a
        lookup, not a product). The routed experts count `routed="all"` (every expert of every layer: what is
        held) or `"per_token"` (the `experts_per_tok` one token reads a layer; `step_weight_bytes` counts a
        batch's)."""
        h = self.hidden
        dk, dv = self.dn_k_heads * self.dn_head_dim, self.dn_v_heads * self.dn_head_dim
        qsa_in = 2 * self.n_heads * self.head_dim + 2 * self.n_kv_heads * self.head_dim \
            + self.index_heads * self.index_dim + self.index_heads + self.index_dim
        out = {"qsa.w_in": (h, aligned_width(qsa_in), self.attn_layers),
               "qsa.w_o": (self.n_heads * self.head_dim, h, self.attn_layers),
               "dn.w_in": (h, 2 * dk + 2 * dv + 2 * self.dn_v_heads, self.deltanet_layers),
               "dn.w_o": (dv, h, self.deltanet_layers)}
        if self.ffn_intermediate:
            out.update({"ffn.w_gu": (h, 2 * self.ffn_intermediate, self.layers),
                        "ffn.w_d": (self.ffn_intermediate, h, self.layers)})
        if self.moe:
            n = self.experts if routed == "all" else self.experts_per_tok
            out.update({"moe.router": (h, self.experts, self.layers),
                        "moe.w_gu": (h, 2 * self.expert_intermediate, n * self.layers),
                        "moe.w_d": (self.expert_intermediate, h, n * self.layers)})
            if self.shared_intermediate:
                out.update({"moe.shared_gu": (h, 2 * self.shared_intermediate, self.layers),
                            "moe.shared_d": (self.shared_intermediate, h, self.layers),
                            "moe.shared_gate": (h, 1, self.layers)})
        if self.hc_count > 1:
            hh = self.hc_count * h
            # before each of a block's two sub-blocks: down (low rank) and the injection logits, then up
            out.update({"hc.w_down": (hh, aligned_width(self.hc_lowrank + self.hc_count), 2 * self.layers),
                        "hc.w_up": (self.hc_lowrank, hh, 2 * self.layers)})
        out["lm_head"] = (h, self.vocab, 1)
        return out

    # the matrices W4A16 quantises: every product's weight but the router, the shared expert's gate and the
    # hyper-connections' mixing (kept in bf16 by the public checkpoint, as the head is)
    QUANTISED = ("qsa.w_in", "qsa.w_o", "dn.w_in", "dn.w_o", "ffn.w_gu", "ffn.w_d", "moe.w_gu", "moe.w_d",
                 "moe.shared_gu", "moe.shared_d")

    def weight_bytes(self, weights_dtype: str = "bf16") -> int:
        """Bytes every weight takes (all experts; the embedding in bf16)."""
        return int(sum(K * N * c * self.bytes_per_weight(name, weights_dtype, K)
                       for name, (K, N, c) in self.weight_matrices().items()) + self.vocab * self.hidden * BF16_BYTES)

    def bytes_per_weight(self, name: str, weights_dtype: str, K: int) -> float:
        """Bytes a weight of matrix `name` (fan-in `K`, `weight_matrices`' names) takes held as `weights_dtype`:
        a quantised matrix's under "w4a16" (`held_quantised`), else bf16's."""
        check_weights_dtype(weights_dtype)
        return WEIGHT_BYTES[weights_dtype] if name in self.QUANTISED and K % W4_GROUP == 0 else BF16_BYTES


    def expected_experts(self, concurrency: int) -> float:
        """Distinct routed experts a layer reads at a decode step of `concurrency` requests whose tokens choose
        uniformly (each token k of E without repeats): E (1 - (1 - k/E)^c)."""
        if not self.moe:
            return 0.0
        E, k = self.experts, self.experts_per_tok
        return E * (1 - (1 - k / E) ** concurrency)

    def step_weight_bytes(self, concurrency: int = 1, weights_dtype: str = "bf16",
                          experts_read: float | None = None) -> dict[str, float]:
        """Weight bytes one decode step reads, by part: `dense` (every matrix but the routed experts and the
        head), `experts` (the distinct routed experts: `experts_read` a layer, by default the expectation for
        uniform routing), `hc` (the hyper-connections' mixing), `head`, `embed` (one row a request)."""
        mats = self.weight_matrices(routed="per_token")
        parts = {"dense": 0.0, "experts": 0.0, "hc": 0.0, "head": 0.0}
        for name, (K, N, c) in mats.items():
            b = K * N * self.bytes_per_weight(name, weights_dtype, K)
            if name in ("moe.w_gu", "moe.w_d"):
                per_layer = self.expected_experts(concurrency) if experts_read is None else experts_read
                parts["experts"] += b * per_layer * self.layers
            elif name.startswith("hc."):
                parts["hc"] += b * c
            elif name == "lm_head":
                parts["head"] += b * c
            else:
                parts["dense"] += b * c
        parts["embed"] = float(concurrency * self.hidden * BF16_BYTES)
        return parts

    @property
    def ngram_fetch_bytes(self) -> int:
        """Bytes of the n-gram embedding one request reads a step (its `ngram_heads` rows, bf16)."""
        return self.hidden * BF16_BYTES if self.ngram_heads else 0

    def summary(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(attn_layers=self.attn_layers, deltanet_layers=self.deltanet_layers, row_bytes=self.row_bytes,
                 index_key_bytes=self.index_key_bytes, weight_bytes=self.weight_bytes(),
                 weight_bytes_w4a16=self.weight_bytes("w4a16"),
                 step_weight_bytes_c1=sum(self.step_weight_bytes(1).values()),
                 step_weight_bytes_c1_w4a16=sum(self.step_weight_bytes(1, "w4a16").values()))
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
        if "ple_layers" in d:
            d["ple_layers"] = tuple(d["ple_layers"])
        return cls(**d)


QWEN38_NOTE = (
    "Qwen3.8-Flash-Next as its public text configuration gives it: 48 layers, QSA every 4th (12) and gated "
    "DeltaNet (36); hidden 2,560; QSA 24 query / 2 KV heads of 256, partial RoPE 0.25; DeltaNet 16 key / 48 value "
    "heads of 128, conv 4; 512 routed experts of 640, 10 a token, and a shared expert of 640; vocabulary 248,320; "
    "hyper-connections (4 streams, rank 320); an n-gram embedding (8 heads a 3-gram, added at layer 2), whose "
    "table (~49 GiB, as a public 4x RTX 3090 stack measured it) lives in host RAM and gives 8 rows of 320 values "
    "(5,120 B) a token. The index keys take the published 66 B a token and layer (64 fp8 values and an fp16 "
    "scale): the public config's indexer (4 heads x 128, one key head, indexer_compress_ratio 4) compresses 4 "
    "tokens into one 128-wide entry, which in fp8 with a 4-byte scale is 33 B a token, half the published figure; "
    "the lab keeps the published bytes and one key a token, which reads 2x the index bytes of the compressed form "
    "(0.8 GB a step at 1M context and 12 layers, against 48 MiB of rows). Left out: the vision tower (prefill-only, "
    "and only for images), the MTP head (speculative decoding; the lab decodes one token a step) and the n-gram "
    "embedding's short conv (4 taps over 2,560 values: no weight stream). Weights random and seeded.")

PRESETS: dict[str, ModelShape] = {
    # The published sparse-offload model as its public text configuration describes it
    "qwen3.8-flash-next": ModelShape(
        name="qwen3.8-flash-next", layers=48, attn_every=4, hidden=2560, n_heads=24, n_kv_heads=2,
        head_dim=256, rotary_dim=64, index_dim=64, index_heads=4, dn_k_heads=16, dn_v_heads=48,
        dn_head_dim=128, dn_conv=4, ffn_intermediate=0, vocab=248320, note=QWEN38_NOTE,
        experts=512, experts_per_tok=10, expert_intermediate=640, shared_intermediate=640,
        hc_count=4, hc_lowrank=320, ngram_heads=8, ngram_order=3, ngram_table_bytes=49 * 2**30, ple_layers=(2,),
        index_compress=4),
    # The lab's reference shape until 2026-12-05, before the public config was known: every run made with it
    # before then says "qwen3.8-flash-next" and resolves here (`shape_for_run`).
    "qwen3.8-flash-next-standin": ModelShape(
        name="qwen3.8-flash-next-standin", layers=48, attn_every=4, hidden=2048, n_heads=16, n_kv_heads=2,
        head_dim=256, rotary_dim=64, index_dim=64, index_heads=4, dn_k_heads=16, dn_v_heads=32,
        dn_head_dim=128, dn_conv=4, ffn_intermediate=11 * 512, vocab=151936,
        note="a stand-in for Qwen3.8-Flash-Next made before its public config was known: hidden 2,048, 16 query "
             "heads, 32 DeltaNet value heads, the MoE FFN (10 routed + 1 shared experts of 512) replaced by a "
             "dense 11x512 FFN with the same active parameters, vocabulary 151,936, no hyper-connections or "
             "n-gram embedding; weights random and seeded"),
    # Same pattern, tiny dims: CPU tests in seconds.
    "tiny": ModelShape(
        name="tiny", layers=8, attn_every=4, hidden=64, n_heads=4, n_kv_heads=2, head_dim=32,
        rotary_dim=8, index_dim=16, index_heads=2, dn_k_heads=2, dn_v_heads=4, dn_head_dim=16,
        dn_conv=4, ffn_intermediate=128, vocab=512, note="test shape with the reference layer pattern"),
    # The published model's parts at tiny dims: experts, hyper-connections, the n-gram embedding.
    "tiny-moe": ModelShape(
        name="tiny-moe", layers=8, attn_every=4, hidden=128, n_heads=4, n_kv_heads=2, head_dim=32,
        rotary_dim=8, index_dim=16, index_heads=2, dn_k_heads=2, dn_v_heads=4, dn_head_dim=32,
        dn_conv=4, ffn_intermediate=0, vocab=512, experts=16, experts_per_tok=4, expert_intermediate=128,
        shared_intermediate=128, hc_count=4, hc_lowrank=16, ngram_heads=4, ngram_order=3,
        ngram_table_bytes=1 << 20, ple_layers=(2,), index_compress=4,
        note="test shape with the reference model's parts: routed and shared experts, hyper-connections, the "
             "n-gram embedding"),
}

def shape_for_run(name: str, shape_rev=None) -> ModelShape:
    """The shape a run was made with: its recorded name, except that a run from before the reference shape
    followed the public config (no `shape_rev` in its rows or manifest, `results.SHAPE_REV`) that names
    "qwen3.8-flash-next" was made with the stand-in."""
    if name == "qwen3.8-flash-next" and not _rev(shape_rev):
        return PRESETS["qwen3.8-flash-next-standin"]
    return ModelShape.from_name(name)


def _rev(v) -> int:
    try:
        return int(v) if v is not None and v == v else 0          # NaN from a table is no revision
    except (TypeError, ValueError):
        return 0


def metrics_shape(m) -> ModelShape:
    """The shape of a run's metrics table (its first named shape): `shape_for_run`."""
    rows = m[m["shape"].notna()]
    rev = rows["shape_rev"].iloc[0] if "shape_rev" in rows else None
    return shape_for_run(str(rows["shape"].iloc[0]), rev)


ROUTING_FILE_CAP = 64 << 20      # a recorded routing's frequencies: 48 layers x 512 experts is ~200 KB of JSON


def routing_spec(routing: str, s: ModelShape | None = None) -> tuple[str, Any]:
    """The `routing` parameter read and checked before anything is built: ("router", None), ("zipf", S) with S a
    finite number >= 0, or ("file", rows), the recorded frequencies (a JSON object {"experts": [...]} for every
    layer or {"layers": [[...], ...]} one list a layer, finite numbers >= 0), read only as a regular file of at most
    ROUTING_FILE_CAP bytes; with the shape `s`, rows of its layers x experts. One BadInput line otherwise."""
    if routing == "router":
        return "router", None
    if routing.startswith("zipf:"):
        try:
            a = float(routing[5:])
        except ValueError:
            a = float("nan")
        if not (a == a and 0 <= a < float("inf")):
            raise BadInput(f"routing {routing!r}: zipf:S takes a finite exponent S >= 0")
        return "zipf", a
    if routing.startswith("file:"):
        path = Path(routing[5:])
        try:
            d = json.loads(atomic.read_regular_at(None, path.resolve(), ROUTING_FILE_CAP).decode())
        except (OSError, UnicodeDecodeError, ValueError) as ex:
            raise BadInput(f"routing file {path}: {getattr(ex, 'strerror', None) or ex}") from None
        rows = d.get("layers", [d.get("experts")] * (s.layers if s else 1)) if isinstance(d, dict) else None
        if not (isinstance(rows, list) and rows and all(isinstance(r, list) and r and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < float("inf") for x in r)
                for r in rows)):
            raise BadInput(f"routing file {path}: not a JSON object of expert frequencies ({{\"experts\": [...]}} or "
                           f"{{\"layers\": [[...], ...]}}, finite numbers >= 0)")
        if s is not None and (len(rows), len(rows[0])) != (s.layers, s.experts) or len({len(r) for r in rows}) != 1:
            raise BadInput(f"routing file {path}: {len(rows)} x {len(rows[0])} frequencies, the shape has "
                           f"{s.layers if s else '?'} layers of {s.experts if s else '?'} experts")
        return "file", rows
    raise BadInput(f"unknown routing {routing!r}: router, zipf:S or file:PATH")


def planned_shape(name: str) -> ModelShape:
    """The shape a plan names (a preset or a .json file), or one BadInput line saying which exist."""
    try:
        return ModelShape.from_name(name)
    except ValueError as ex:
        raise BadInput(str(ex)) from None
