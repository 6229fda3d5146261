"""What a device-memory cap holds while prompts prefill: the byte formulas of every allocation the engine makes,
and per configuration the largest chunk and in-flight count that fit (pure arithmetic on the shape).

Device bytes at the peak of a prefill, term by term (each one the size of a tensor the engine allocates):

- `weights`: the weights held (`held_weight_bytes`: every matrix as `weights_dtype` holds it, W4A16's 4-bit values
  with their group scales and zeros, and of the routed experts only the `expert_banks` layers' worth the device
  holds, the other layers sharing them; a run passes the built model's own `HybridModel.weight_bytes`);
- `slot` per prompt in flight (`OffloadCache.allocate` with one slot per prompt held): the index keys and their
  scales (`attn_layers x T x index_key_bytes`), the DeltaNet state and conv window, the page-table row; with the KV
  on the device (`none`) also its pool rows, `attn_layers x T x row_bytes`;
- `prefix`: the prompt's prefix buffers: `none` the one layer-sized prefix a chunk reads back (`T x row_bytes`),
  `prefill`/`both` the four rotating layer buffers (`rotating_buffer_bytes`);
- `activations`: a chunk of `c` tokens, the live set at the peak of a forward (`activation_bytes`), which depends on
  the kernels the engine takes on the device (`layers.dn_prefill_kernel`, `attention.prefill_kernel`; `Fit` records
  them): with DeltaNet's torch form (`layers.delta_rule_chunked`, every CPU) `c x activation_bytes_per_token +
  activation_fixed_bytes`, inside the recurrence; with flash-linear-attention's kernel (`deltanet_prefill.scan_fla`,
  CUDA) `c x fla_activation_bytes_per_token + fla_activation_fixed_bytes`, less than half of it; with the split
  attention (cuDNN, Hopper) the larger of that and a QSA layer's live set at its last chunk with a prefix
  (`split_attention_bytes`: per token, plus the prefix's keys and values copied once), the peak of the fla path at
  the reference shape;
- with hyper-connections every frame of a forward also holds the residual stream (`hc_frame_bytes_per_token`: the
  pair of `hc_count` copies the caller holds, their sum, the mix's low-rank product), and with routed experts the
  FFN's live set may be the peak instead (`moe_activation_bytes_per_token`: the router's logits, the shared
  expert's output, the chosen pairs and their weights, the gate|up activations of every pair and their down
  products, as `moe_gemm.routed_experts` allocates them on the device), whichever is more;
- `prompts`: the N prompts' token ids and the logits kept per prompt;
- a forward of several requests (`Engine.prefill_batch`, `batched=True`): the chunk is the forward's token budget,
  which may exceed a prompt; the activations are those of a chunk of the forward's total tokens (the dense products
  and the experts see all of them at once, and a forward of one request alone takes the whole budget whenever a
  prompt is longer than it; where every forward mixes requests, DeltaNet's scan and the attention hold one
  request's rows at a time, and the term is an upper bound); every request a forward touches holds its slot, and
  with rotating buffers its own four (`forward_shape`: the most requests a forward touches, and the longest
  prefix its first request brings, from the scheduler's first-come-first-served rule);
- `reserve`: what the formulas do not count (cuBLAS workspace, the allocator's rounding and fragmentation).

Checked two ways: against the live tensors of a CPU prefill (`tests/test_prefill_throughput.py`, the per-token
slope within a few percent) and against the allocator's peaks of the committed H200 prefill runs at 248K and 1M
(within 0.3%; the activations of an 8K chunk are 2.61 GB there; torch form and SDPA attention). The fla and split
terms are the tensors their source allocates, counted (`tests/test_prefill_throughput.py` runs the engine's own
forward on a CPU with stand-ins that allocate what the kernels allocate). On CUDA every run records the prediction
next to `torch.cuda.max_memory_allocated`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ...engine.model.cache import PAGE_SIZE
from ...engine.model.layers import dn_state_shapes
from ...engine.model.moe_gemm import TILES
from ...engine.model.prefill_buffers import rotating_buffer_bytes
from ...shapes import BF16_BYTES, ModelShape, aligned_width

FP32 = 4
DN_CHUNK = 64          # `DeltaNetLayer.forward_seq`'s recurrence chunk: a prefill chunk is a multiple of it
KV_ON_DEVICE = {"none": True, "prefill": False, "both": False}


def held_weight_bytes(s: ModelShape, weights_dtype: str = "bf16", expert_banks: int | None = None) -> int:
    """Device bytes of the weights as held: every matrix and the embedding as `weights_dtype` holds it
    (`ModelShape.weight_bytes`), less the routed experts of the layers beyond `expert_banks` (they share the banks
    held: `engine.model.hybrid.resolve_holding`'s bank is one layer's routed experts). The norms' and gates'
    vectors are not counted (under 1% at toy widths, nothing at the reference's)."""
    held = s.weight_bytes(weights_dtype)
    if s.moe and expert_banks and expert_banks < s.layers:
        bank = s.step_weight_bytes(1, weights_dtype, experts_read=s.experts)["experts"] / s.layers
        held -= int((s.layers - expert_banks) * bank)
    return held


def hc_frame_bytes_per_token(s: ModelShape) -> int:
    """What hyper-connections add to every frame of a prefill forward, per token (0 without them): the stream pair
    the caller holds through the block (2 x hc_count x hidden; the first block's is the embeddings repeated and
    zeros), the stream's sum (hc_count x hidden) less the plain pair it replaces (2 x hidden), and the mix's
    low-rank down product with its injection logits (`hc.w_down`'s padded width); bf16."""
    if s.hc_count <= 1:
        return 0
    return ((3 * s.hc_count - 2) * s.hidden + aligned_width(s.hc_lowrank + s.hc_count)) * BF16_BYTES


def moe_activation_bytes_per_token(s: ModelShape) -> int:
    """Bytes per chunk token live at the peak of a routed-experts FFN on the device's grouped GEMMs
    (`moe_gemm.routed_experts`, at its combine): the residual and its norm (2 x hidden), the router's and the
    shared gate's logits (experts + 1), the shared expert's output (hidden), the gate|up activations of the
    `experts_per_tok` pairs (k x expert width) and their down products (k x hidden), the combined output (hidden),
    all bf16; the chosen experts (int64), their weights (fp32) and the sorted pair rows (int32), k each; plus the
    hyper-connections' frames. 0 without experts."""
    if not s.moe:
        return 0
    k = s.experts_per_tok
    bf16 = 2 * s.hidden + s.experts + 1 + s.hidden + k * s.expert_intermediate + k * s.hidden + s.hidden
    return bf16 * BF16_BYTES + k * (8 + FP32 + 4) + hc_frame_bytes_per_token(s) + POSITION_BYTES


def moe_activation_fixed_bytes(s: ModelShape) -> int:
    """Per forward, whatever the chunk: each expert's pairs padded to a block of the grouped GEMM's rows, at most
    a block's rows short per expert, in the activations and the pair rows."""
    if not s.moe:
        return 0
    bm = TILES["glu"].bm
    return s.experts * bm * (s.expert_intermediate * BF16_BYTES + 4)


def activation_bytes_per_token(s: ModelShape) -> int:
    """Bytes per chunk token live at the peak of a prefill forward (inside a DeltaNet layer's recurrence):
    the residual pair, its sum and norm (4 x hidden, bf16); the input projection (bf16); the conv's input and
    output (2 x conv channels, bf16); twelve fp32 tensors of value width (q and k repeated to the value heads,
    v, their padded copies, k*beta, u, w, the decayed k and q, the output); six fp32 [C x C] blocks per
    recurrence chunk and head (decay, its masks, A, (I+A)^-1, q.k); five fp32 gates per head; the
    hyper-connections' frames (`hc_frame_bytes_per_token`)."""
    dk, dv, hv = s.dn_k_heads * s.dn_head_dim, s.dn_v_heads * s.dn_head_dim, s.dn_v_heads
    conv_ch = 2 * dk + dv
    in_proj = 2 * dk + 2 * dv + 2 * hv
    return (4 * s.hidden * BF16_BYTES + in_proj * BF16_BYTES + 2 * conv_ch * BF16_BYTES + 12 * dv * FP32
            + 6 * hv * DN_CHUNK * FP32 + 5 * hv * FP32 + hc_frame_bytes_per_token(s))


def activation_fixed_bytes(s: ModelShape) -> int:
    """Per forward, whatever the chunk: the recurrent state's working copies (four of [H, dk, dv] fp32) and
    one chunk's new values (u - w S)."""
    return 4 * s.dn_v_heads * s.dn_head_dim ** 2 * FP32 + s.dn_v_heads * DN_CHUNK * s.dn_head_dim * FP32


# Per chunk token in every layer's live set: the chunk's positions and its pool rows and index-key slots (int64)
POSITION_BYTES = 3 * 8
DN_KERNELS = ("torch", "fla")           # `layers.dn_prefill_kernel`
ATTENTION_KERNELS = ("sdpa", "split")   # `attention.prefill_kernel`


def fla_activation_bytes_per_token(s: ModelShape) -> int:
    """Bytes per chunk token live at the peak of a DeltaNet layer on flash-linear-attention's kernel (fla-core
    0.6.0's `chunk_gated_delta_rule` from `deltanet_prefill.scan_fla`), its last allocation (the output o):
    the engine's frames: the residual pair, its sum and norm (4 x hidden, bf16), the input projection (bf16), the
    conv's output (conv channels, bf16: the lab's kernel writes nothing else that lives), the gates (log decay and
    beta in fp32, beta again in bf16), the positions; the kernel's: contiguous copies of q, k, v (its input guard:
    they are strided views of the conv output), the l2-normed q and k (bf16) and their inverse norms (fp32), the
    decay's cumulative sum (fp32, one a value head), A ((I+A)^-1 per 64-token chunk, bf16 [value heads x 64]),
    w and u (bf16, value width), the state at each 64-token chunk's start (bf16 [value heads, dk, dv] / 64),
    the new values and the output (bf16, value width)."""
    dh, hk, hv = s.dn_head_dim, s.dn_k_heads, s.dn_v_heads
    dk, dv = hk * dh, hv * dh
    conv_ch = 2 * dk + dv
    frames = (4 * s.hidden + s.weight_matrices()["dn.w_in"][1] + conv_ch) * BF16_BYTES \
        + 2 * hv * FP32 + hv * BF16_BYTES + POSITION_BYTES
    kernel = (conv_ch + 2 * dk + hv * DN_CHUNK + 2 * dv + hv * dh * dh // DN_CHUNK + 2 * dv) * BF16_BYTES \
        + (2 * hk + hv) * FP32
    return frames + kernel + hc_frame_bytes_per_token(s)


def fla_activation_fixed_bytes(s: ModelShape) -> int:
    """Per forward on flash-linear-attention's kernel: its final state ([value heads, dk, dv] fp32; the initial
    state is the cache's own, taken as it is)."""
    return s.dn_v_heads * s.dn_head_dim ** 2 * FP32


def split_attention_bytes_per_token(s: ModelShape) -> int:
    """Bytes per chunk token live in a QSA layer at the peak of the split attention
    (`attention.split_prefill_attention`, cuDNN), where the two calls' outputs are merged: the block's residual
    pair and its sum (3 x hidden), the input projection (its padded width), the roped q, the K/V row, the index key and
    scale, the head weights, the positions; in the attention the queries twice (per head, and with the group
    folded in), the chunk's keys and values repeated to the query heads, both outputs (bf16) and their five
    log-sum-exp rows (fp32 a head), and three fp32 outputs of the merge at once (one weighted, the other
    converted and weighted)."""
    qd = s.n_heads * s.head_dim
    block = (3 * s.hidden + s.weight_matrices()["qsa.w_in"][1] + qd) * BF16_BYTES + s.row_bytes \
        + s.index_key_bytes + s.index_heads * BF16_BYTES + POSITION_BYTES
    attention = 6 * qd * BF16_BYTES + 5 * s.n_heads * FP32 + 3 * qd * FP32
    return block + attention + hc_frame_bytes_per_token(s)


def split_attention_bytes(s: ModelShape, T: int, chunk: int) -> int:
    """A QSA layer's peak live bytes over a prompt of T tokens in chunks of `chunk`: at the last full chunk or
    the shorter tail, whichever is more, `split_attention_bytes_per_token` a token plus the prefix's keys and
    values copied contiguous (`row_bytes` a prefix token). A chunk without a prefix (the first) merges nothing
    and holds less than a DeltaNet layer: 0 for a prompt of one chunk."""
    full, tail = divmod(T, chunk)
    points = ([(chunk, (full - 1) * chunk)] if full >= 2 else []) + ([(tail, full * chunk)] if tail and full else [])
    return max((c * split_attention_bytes_per_token(s) + p * s.row_bytes for c, p in points), default=0)


def forward_shape(T: int, budget: int, prompts: int) -> tuple[int, int]:
    """N prompts of T tokens prefilled several to a forward under a token budget, first come, first served
    (`prefill_batch.plan_forward`): (the most requests one forward touches, the longest prefix a forward's first
    request already holds). Forward j covers the tokens [j budget, (j + 1) budget) of the prompts laid end to end."""
    total, most, prefix = T * prompts, 0, 0
    for a in range(0, total, budget):
        e = min(total, a + budget)
        most = max(most, (e - 1) // T - a // T + 1)
        prefix = max(prefix, a % T)
        if most >= prompts and prefix >= T - math.gcd(budget, T):      # nothing later can be larger
            break
    return most, prefix


def activation_bytes(s: ModelShape, T: int, chunk: int, dn_kernel: str = "torch",
                     attention_kernel: str = "sdpa", batched: bool = False, prompts: int = 1) -> int:
    """The activations at the peak of a prompt's forwards in chunks of `chunk` with these kernels: the DeltaNet
    layer's live set, or the routed experts' or with the split attention a QSA layer's where either is more
    (SDPA's per-KV-head calls hold a fraction of the DeltaNet layer's: no term). With a batched forward the
    DeltaNet scan and the attention hold one request's rows at a time, the experts all the forward's. `batched`: `chunk` is the token budget of forwards over several
    of the `prompts` (module docstring): a QSA layer's split attention then holds the forward's rows and the
    longest prefix a forward's first request brings."""
    if dn_kernel not in DN_KERNELS or attention_kernel not in ATTENTION_KERNELS:
        raise ValueError(f"unknown kernels dn {dn_kernel!r}, attention {attention_kernel!r}: choose from "
                         f"{', '.join(DN_KERNELS)} and {', '.join(ATTENTION_KERNELS)}")
    if dn_kernel == "fla":
        dn = chunk * fla_activation_bytes_per_token(s) + fla_activation_fixed_bytes(s)
    else:
        dn = chunk * activation_bytes_per_token(s) + activation_fixed_bytes(s)
    if s.moe:          # the routed experts' live set, where it is more (not at the reference shape: 0.63 of fla's)
        dn = max(dn, chunk * moe_activation_bytes_per_token(s) + moe_activation_fixed_bytes(s))
    if attention_kernel != "split":
        return dn
    if not batched:
        return max(dn, split_attention_bytes(s, T, chunk))
    prefix = forward_shape(T, chunk, prompts)[1]
    return max(dn, (chunk * split_attention_bytes_per_token(s) + prefix * s.row_bytes) if prefix else 0)


def padded(T: int) -> int:
    """The cache holds whole pages: a slot of T tokens takes T rounded up to the page size."""
    return -(-T // PAGE_SIZE) * PAGE_SIZE


def slot_bytes(s: ModelShape, T: int, kv_on_device: bool) -> int:
    """Device bytes of one prompt held (its slot of the cache)."""
    st, cv = dn_state_shapes(s)
    Tp = padded(T)
    dn = s.deltanet_layers * (math.prod(st) * FP32 + math.prod(cv) * BF16_BYTES)
    table = (Tp // PAGE_SIZE) * 8 + 8                     # page-table row, int64 length
    kv = s.attn_layers * Tp * s.row_bytes if kv_on_device else 0
    return s.attn_layers * Tp * s.index_key_bytes + dn + table + kv


def prefix_bytes(s: ModelShape, T: int, kv_on_device: bool, in_forward: int = 1) -> int:
    """The prefix buffers of the prompts being prefilled: sync's one layer (one for all the requests of a forward:
    their attentions run one after another), or four rotating buffers for each of the `in_forward` requests."""
    return T * s.row_bytes if kv_on_device else in_forward * rotating_buffer_bytes(T, s.row_bytes, s.attn_layers)


def prompt_bytes(s: ModelShape, T: int, n: int) -> int:
    """The N prompts' token ids (int64) and one row of logits kept per prompt (bf16)."""
    return n * (T * 8 + s.vocab * BF16_BYTES)


@dataclass(frozen=True)
class Fit:
    """One configuration under a cap: the chunk and in-flight count chosen and the bytes that chose them."""
    config: str
    chunk: int                   # tokens per forward (0: nothing fits)
    in_flight: int               # prompts held at once (0: nothing fits)
    weight_bytes: int
    slot_bytes: int              # per prompt held
    prefix_bytes: int
    activation_bytes: int        # at `chunk`
    prompt_bytes: int
    reserve_bytes: int
    cap_bytes: int
    dn_kernel: str = "torch"           # the kernels `activation_bytes` assumed (`DN_KERNELS`, `ATTENTION_KERNELS`)
    attention_kernel: str = "sdpa"
    batched: bool = False              # `chunk` is the token budget of forwards over several prompts
    per_forward: int = 1               # the most prompts one forward touches (each holds its slot)

    @property
    def fits(self) -> bool:
        return self.chunk > 0 and self.in_flight > 0

    @property
    def predicted_bytes(self) -> int:
        """The device peak the formulas predict at the chosen chunk and in-flight count (reserve included);
        when nothing fits, what one prompt at the smallest chunk would need."""
        return (self.weight_bytes + max(self.per_forward, self.in_flight) * self.slot_bytes + self.prefix_bytes
                + self.activation_bytes + self.prompt_bytes + self.reserve_bytes)

    def row(self) -> dict:
        return {**asdict(self), "predicted_bytes": self.predicted_bytes}

    def why_not(self, T: int) -> str:
        """Why nothing fits, one line."""
        return (f"config {self.config}: one prompt of {T} tokens at the smallest chunk needs {size(self.predicted_bytes)} "
                f"of device memory (weights {size(self.weight_bytes)}, its slot {size(self.slot_bytes)}, prefix buffers "
                f"{size(self.prefix_bytes)}, reserve {size(self.reserve_bytes)}); the cap is {size(self.cap_bytes)}")


def size(n: float) -> str:
    """Bytes for a reader: GiB down to 1 GiB, then MiB, then KiB (toy shapes on a CPU)."""
    for unit, b in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= b:
            return f"{n / b:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def chunk_step(chunk_max: int) -> int:
    """Chunks are multiples of the recurrence chunk (a shorter tail is padded to it), or of a smaller maximum."""
    return min(DN_CHUNK, chunk_max)


def fit(s: ModelShape, T: int, prompts: int, cap: float, config: str, chunk_max: int, reserve: float = 0.0,
        dn_kernel: str = "torch", attention_kernel: str = "sdpa", batched: bool = False,
        weight_bytes: int | None = None) -> Fit:
    """The largest chunk (a multiple of `chunk_step`, at most `chunk_max` and the prompt) that fits `cap` with one
    prompt held, then the most prompts held (at most `prompts`) that fit beside that chunk. The chunk goes
    first: it is paid on every forward, while a second slot only lets a finished prompt's hand-off overlap the
    next prompt (module docstring of `measure`). The kernels: those the engine takes on the device
    (`measure.prefill_kernels`; the defaults are a CPU's). `batched`: the chunk is the token budget of forwards over
    several prompts, at most `chunk_max` (not the prompt), and a chunk fits only with a slot (and with rotating
    buffers, their four) for every prompt a forward touches. `weight_bytes`: the weights held (default the
    shape's, all of them in bf16: `held_weight_bytes` for another holding). Nothing fits: chunk and in_flight 0,
    the smallest chunk's bytes."""
    on_dev = KV_ON_DEVICE[config]
    slot = slot_bytes(s, T, on_dev)
    weights = s.weight_bytes() if weight_bytes is None else int(weight_bytes)
    fixed = weights + prompt_bytes(s, T, prompts) + int(reserve)
    base = dict(config=config, weight_bytes=weights, slot_bytes=slot, prompt_bytes=prompt_bytes(s, T, prompts),
                reserve_bytes=int(reserve), cap_bytes=int(cap), dn_kernel=dn_kernel, attention_kernel=attention_kernel,
                batched=batched)

    def held(c: int) -> int:               # prompts one forward of c tokens touches
        return forward_shape(T, c, prompts)[0] if batched else 1

    def need(c: int) -> tuple[int, int, int]:  # (bytes with the prompts a forward touches held, prefix, activations)
        pre, act = prefix_bytes(s, T, on_dev, held(c)), activation_bytes(s, T, c, dn_kernel, attention_kernel,
                                                                        batched, prompts)
        return fixed + pre + held(c) * slot + act, pre, act

    step, top = chunk_step(chunk_max), chunk_max if batched else min(chunk_max, T)
    # the top, then the multiples of the step below it, largest first (a QSA layer's prefix term makes the
    # activations a step function of the chunk, not a line; batched, so do the prompts a forward touches)
    chunk = next((c for c in [top, *range((top - 1) // step * step, 0, -step)] if need(c)[0] <= cap), 0)
    if chunk <= 0:
        c = min(step, T)
        return Fit(chunk=0, in_flight=0, prefix_bytes=need(c)[1], activation_bytes=need(c)[2], per_forward=held(c),
                   **base)
    total, pre, act = need(chunk)
    more = (cap - total) // slot               # slots beyond those the forward needs
    in_flight = min(prompts, held(chunk) + int(more))
    return Fit(chunk=chunk, in_flight=in_flight, prefix_bytes=pre, activation_bytes=act, per_forward=held(chunk),
               **base)


def cap_holding(s: ModelShape, T: int, prompts: int, held: int, chunk_max: int, reserve: float = 0.0,
                dn_kernel: str = "torch", attention_kernel: str = "sdpa", weight_bytes: int | None = None) -> int:
    """The smallest cap at which `none` (KV on the device) holds `held` prompts at the largest chunk (one
    request's chunk a forward), `weight_bytes` held (default as `fit`'s)."""
    return ((s.weight_bytes() if weight_bytes is None else int(weight_bytes)) + held * slot_bytes(s, T, True) + prefix_bytes(s, T, True) + prompt_bytes(s, T, prompts)
            + int(reserve) + activation_bytes(s, T, min(chunk_max, T), dn_kernel, attention_kernel))
