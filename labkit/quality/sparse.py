"""Top-k sparse attention inside a Hugging Face decoder, as decode sees it.

`instrument(model)` registers the attention function `labkit_sparse` with transformers'
`AttentionInterface` and switches the model to it. A `SparseController` attached to every attention
module then decides, per layer, how that layer attends:

- no `LayerPolicy` for the layer: dense causal attention (torch SDPA; fast path);
- a `LayerPolicy(policy, budget)`: each query row attends to at most `budget` of its causal past
  positions (itself included), the rest masked out before the softmax. The full score matrix is
  computed and the non-selected entries are set to -inf, so the result is exactly what an engine
  that fetched only the selected KV rows would compute — the right thing for measuring quality, not
  for speed. Works for a whole sequence at once (every row is one decode step's query, "prefill as
  decode") and for real decode steps with a KV cache (one query row).

Policies (score -> top-`budget` positions per row, restricted to the causal past):

| name            | granularity            | score                                                        |
|-----------------|------------------------|--------------------------------------------------------------|
| `oracle`        | per KV head            | dense attention probabilities summed over the head's query group |
| `oracle_qhead`  | per query head         | the head's own dense attention probabilities (upper bound)   |
| `oracle_shared` | one set per layer      | dense probabilities summed over all heads of the layer        |
| `indexer`       | one set per layer      | compressed index key (64 fp8 values + fp16 scale = 66 B/token) . projected query (`labkit.quality.indexer`) |
| `retrieval_head`| one set per layer      | the layer's retrieval head's probabilities, sink and recent windows forced in first |

Block granularity (`SparseController.block = b > 1`, PulseInfer's blocks of 16 tokens): the key axis is cut
into blocks of `b` positions and whole blocks are selected, `budget // b` of them per row: a block's score is
the sum of its positions' scores for the probability-based policies (the attention mass it holds) and
their maximum for `indexer` (its scores are logits). Sink and recent bonuses of `retrieval_head` are summed
with the rest, so those blocks still come first.

Statistics gathered while running (per layer, only on rows that are really sparsified, i.e. rows
whose causal past is longer than the budget): attention-mass recall (share of the dense attention
mass, averaged over query heads, that falls on the selected positions), and for layer-shared
policies the overlap of the selected set with `oracle_shared`'s (recall@budget against the oracle).

Limits: batch of unpadded sequences (the padding mask is ignored; the causal mask is rebuilt from
the key/query lengths), left-to-right decoders whose attention modules carry `layer_idx`,
`num_key_value_groups` (Llama, Qwen2/3, Mistral, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTN_NAME = "labkit_sparse"
POLICIES = ("oracle", "oracle_qhead", "oracle_shared", "indexer", "retrieval_head")
SHARED_POLICIES = ("oracle_shared", "indexer", "retrieval_head")


@dataclass(frozen=True)
class LayerPolicy:
    policy: str
    budget: int

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}: choose from {', '.join(POLICIES)}")
        if int(self.budget) < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")


@dataclass
class LayerStats:
    """Running sums for one layer; means are sum / count."""

    recall_sum: float = 0.0
    recall_n: int = 0
    overlap_sum: float = 0.0
    overlap_n: int = 0
    # mid-context share per query head (sum over rows, rows counted)
    mid_sum: torch.Tensor | None = None
    mid_n: int = 0


@dataclass
class SparseController:
    """Per-layer policies plus what the attention function records while it runs.

    sink_window / recent_window: the start and end of the causal past that `retrieval_head` always
    keeps and that the mid-context share excludes (middle = [sink, t - recent], t the query position).
    """

    layers: dict[int, LayerPolicy] = field(default_factory=dict)
    sink_window: int = 16
    recent_window: int = 64
    indexer: object | None = None  # labkit.quality.indexer.Indexer
    retrieval_heads: dict[int, int] = field(default_factory=dict)  # layer -> query head
    block: int = 1  # select whole blocks of this many positions (1: single positions)
    collect_overlap: bool = True
    collect_head_share: bool = False  # mid-context share per head (forces the explicit path)
    record_selection: bool = False  # keep the last call's selected positions (decode traces)
    stats: dict[int, LayerStats] = field(default_factory=dict)
    last_selection: dict[int, torch.Tensor] = field(default_factory=dict)
    calibration_sink: object | None = None  # callable(layer, q, k) collecting indexer calibration data

    def set_all(self, policy: str | None, budget: int | None, n_layers: int, layers=None) -> None:
        """One policy for `layers` (default: all); policy None (or budget None) means dense."""
        self.layers = {}
        if policy is None or policy == "dense" or budget is None:
            return
        for i in (range(n_layers) if layers is None else layers):
            self.layers[int(i)] = LayerPolicy(policy, int(budget))

    def reset_stats(self) -> None:
        self.stats = {}
        self.last_selection = {}

    def layer_stats(self, i: int) -> LayerStats:
        return self.stats.setdefault(i, LayerStats())

    def mass_recall(self) -> float:
        s = sum(v.recall_sum for v in self.stats.values())
        n = sum(v.recall_n for v in self.stats.values())
        return s / n if n else float("nan")

    def oracle_overlap(self) -> float:
        s = sum(v.overlap_sum for v in self.stats.values())
        n = sum(v.overlap_n for v in self.stats.values())
        return s / n if n else float("nan")

    def head_share(self) -> torch.Tensor:
        """[layers, q_heads] mean mid-context attention share (NaN for layers not seen)."""
        ids = sorted(i for i, v in self.stats.items() if v.mid_sum is not None)
        if not ids:
            return torch.empty(0, 0)
        h = self.stats[ids[0]].mid_sum.numel()
        out = torch.full((max(ids) + 1, h), float("nan"))
        for i in ids:
            st = self.stats[i]
            out[i] = st.mid_sum / max(st.mid_n, 1)
        return out


def _topk_mask(score: torch.Tensor, k: int, causal: torch.Tensor) -> torch.Tensor:
    """Bool mask of the top-k entries of `score` along the last dim, restricted to `causal`.

    Rows whose causal past has at most k positions keep their whole past.
    """
    n = score.shape[-1]
    if k >= n:
        return causal.expand(score.shape).clone()
    idx = torch.topk(score, k, dim=-1, sorted=False).indices
    mask = torch.zeros(score.shape, dtype=torch.bool, device=score.device)
    mask.scatter_(-1, idx, True)
    return mask & causal


def _block_topk_mask(score: torch.Tensor, k: int, causal: torch.Tensor, block: int, pool: str) -> torch.Tensor:
    """`_topk_mask` over blocks of `block` key positions: the top `k // block` blocks (a block's score is
    the `pool` -- sum or max -- of its causal positions' scores), expanded back to positions."""
    n = score.shape[-1]
    if k >= n:
        return causal.expand(score.shape).clone()
    nb, pad = -(-n // block), -n % block
    fill = 0.0 if pool == "sum" else float("-inf")
    s = torch.nn.functional.pad(score.masked_fill(~causal, fill), (0, pad), value=fill)
    s = s.unflatten(-1, (nb, block))
    bs = s.sum(-1) if pool == "sum" else s.amax(-1)
    bc = torch.nn.functional.pad(causal, (0, pad)).unflatten(-1, (nb, block)).any(-1)    # block has a causal key
    bs = bs.masked_fill(~bc, float("-inf"))
    kb = max(1, k // block)
    if kb >= nb:
        return causal.expand(score.shape).clone()
    idx = torch.topk(bs, kb, dim=-1, sorted=False).indices
    bm = torch.zeros(bs.shape, dtype=torch.bool, device=score.device).scatter_(-1, idx, True) & bc
    return bm.repeat_interleave(block, dim=-1)[..., :n] & causal


def select(ctl: "SparseController", layer: int, policy: str, budget: int, p: torch.Tensor, query, key,
           qpos: torch.Tensor, kpos: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    if getattr(ctl, "block", 1) > 1:
        b = ctl.block

        def topk(score, k, c):
            return _block_topk_mask(score, k, c, b, "max" if policy == "indexer" else "sum")
    else:
        topk = _topk_mask
    return _select(ctl, layer, policy, budget, p, query, key, qpos, kpos, causal, topk)


def _select(ctl, layer, policy, budget, p, query, key, qpos, kpos, causal, _topk_mask) -> torch.Tensor:
    """(`_topk_mask` here is the position or block top-k that `select` chose.) Selected positions as a bool mask broadcastable to p [B,Hkv,G,Tq,Tk].

    p: dense attention probabilities; qpos/kpos: absolute positions; causal: [Tq,Tk].
    Shapes of the mask: [B,Hkv,G,..] (oracle_qhead), [B,Hkv,1,..] (oracle), [B,1,1,..] (layer-shared).
    """
    g = p.shape[2]
    if policy == "oracle_qhead":
        return _topk_mask(p, budget, causal)
    if policy == "oracle":
        return _topk_mask(p.sum(2, keepdim=True), budget, causal)
    if policy == "oracle_shared":
        return _topk_mask(p.sum((1, 2), keepdim=True), budget, causal)
    if policy == "indexer":
        if ctl.indexer is None:
            raise RuntimeError("policy 'indexer' needs a calibrated indexer (labkit.quality.indexer.calibrate)")
        score = ctl.indexer.scores(layer, query, key)  # [B,Tq,Tk]
        return _topk_mask(score.masked_fill(~causal, float("-inf"))[:, None, None], budget, causal)
    if policy == "retrieval_head":
        if layer not in ctl.retrieval_heads:
            raise RuntimeError(f"policy 'retrieval_head' has no head chosen for layer {layer}")
        h = ctl.retrieval_heads[layer]
        score = p[:, h // g, h % g].clone()  # [B,Tq,Tk], probabilities in [0, 1]
        score += 2.0 * (kpos < ctl.sink_window)[None, None, :]  # sink first,
        score += 1.0 * (kpos[None, :] > qpos[:, None] - ctl.recent_window)[None]  # then the recent window
        return _topk_mask(score.masked_fill(~causal, float("-inf"))[:, None, None], budget, causal)
    raise ValueError(f"unknown policy {policy!r}: choose from {', '.join(POLICIES)}")


def selection_recall(sel: torch.Tensor, ref: torch.Tensor, budget: int) -> torch.Tensor:
    """|sel ∩ ref| / budget per row (last dim = key positions): recall@budget of sel against ref."""
    return (sel & ref).sum(-1).float() / budget


def _dense_sdpa(query, key, value, scaling, q_off):
    tq, tk = query.shape[2], key.shape[2]
    g = query.shape[1] // key.shape[1]
    if g > 1:
        key = key.repeat_interleave(g, dim=1)
        value = value.repeat_interleave(g, dim=1)
    if tq == tk:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    elif tq == 1:
        out = F.scaled_dot_product_attention(query, key, value, scale=scaling)
    else:
        qpos = torch.arange(q_off, q_off + tq, device=query.device)
        m = torch.arange(tk, device=query.device)[None, :] <= qpos[:, None]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=m, scale=scaling)
    return out.transpose(1, 2).contiguous()


def sparse_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: query [B,Hq,Tq,D], key/value [B,Hkv,Tk,D] -> ([B,Tq,Hq,D], None)."""
    ctl: SparseController | None = getattr(module, "_labkit_ctl", None)
    li = int(module.layer_idx)
    b, hq, tq, d = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    g = hq // hkv
    scaling = d**-0.5 if scaling is None else scaling
    q_off = tk - tq
    lp = ctl.layers.get(li) if ctl is not None else None
    if ctl is not None and ctl.calibration_sink is not None:
        ctl.calibration_sink(li, query, key)
    need_explicit = lp is not None or (ctl is not None and ctl.collect_head_share)
    if not need_explicit:
        return _dense_sdpa(query, key, value, scaling, q_off), None

    dev = query.device
    qf = query.float().view(b, hkv, g, tq, d)
    kf = key.float()
    s = torch.einsum("bhgtd,bhsd->bhgts", qf, kf).mul_(scaling)  # [B,Hkv,G,Tq,Tk]
    qpos = torch.arange(q_off, q_off + tq, device=dev)
    kpos = torch.arange(tk, device=dev)
    causal = kpos[None, :] <= qpos[:, None]  # [Tq,Tk]
    s.masked_fill_(~causal, float("-inf"))
    p = torch.softmax(s, dim=-1)  # dense probabilities
    st = ctl.layer_stats(li)

    if ctl.collect_head_share:
        mid = (kpos[None, :] >= ctl.sink_window) & (kpos[None, :] <= qpos[:, None] - ctl.recent_window)
        rows = qpos >= 2 * (ctl.sink_window + ctl.recent_window)  # rows with a real middle
        if rows.any():
            share = (p * mid).sum(-1)[..., rows].sum(-1)  # [B,Hkv,G]
            share = share.sum(0).reshape(hq).cpu()
            st.mid_sum = share if st.mid_sum is None else st.mid_sum + share
            st.mid_n += int(rows.sum()) * b

    if lp is None:
        out = torch.einsum("bhgts,bhsd->bhgtd", p, value.float())
        return out.reshape(b, hq, tq, d).transpose(1, 2).to(query.dtype).contiguous(), None

    k_budget = int(lp.budget)
    pol = lp.policy
    mask = select(ctl, li, pol, k_budget, p, query, key, qpos, kpos, causal)
    sparse_rows = (qpos + 1) > k_budget
    if sparse_rows.any():
        rec = (p * mask).sum(-1)[..., sparse_rows]  # [B,Hkv,G,rows]
        st.recall_sum += float(rec.sum())
        st.recall_n += rec.numel()
        if ctl.collect_overlap and pol in SHARED_POLICIES:
            ref = _topk_mask(p.sum((1, 2), keepdim=True), k_budget, causal)
            ov = selection_recall(mask, ref, k_budget)[..., sparse_rows]
            st.overlap_sum += float(ov.sum())
            st.overlap_n += ov.numel()
    if ctl.record_selection:
        ctl.last_selection[li] = mask[:, :, :, -1].any(dim=(1, 2))  # [B,Tk] selected for the last query row
    del p
    s.masked_fill_(~mask, float("-inf"))
    pw = torch.softmax(s, dim=-1)
    out = torch.einsum("bhgts,bhsd->bhgtd", pw, value.float())
    return out.reshape(b, hq, tq, d).transpose(1, 2).to(query.dtype).contiguous(), None


def _register() -> None:
    # transformers is the optional `quality` extra: imported where a Hugging Face model is used
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, sparse_attention_forward)


def attention_modules(model) -> list:
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")]
    if not mods:
        raise ValueError(f"{type(model).__name__}: no attention modules with layer_idx/num_key_value_groups found")
    return mods


def instrument(model, controller: SparseController | None = None) -> SparseController:
    """Switch `model` to `labkit_sparse` attention driven by `controller` (returned).

    Without a controller the one already attached is kept (a fresh one if none): idempotent.
    """
    _register()
    mods = attention_modules(model)
    ctl = controller or getattr(mods[0], "_labkit_ctl", None) or SparseController()
    for m in mods:
        m._labkit_ctl = ctl
    try:
        model.set_attn_implementation(ATTN_NAME)
    except Exception:  # older transformers: set the config field directly
        model.config._attn_implementation = ATTN_NAME
    return ctl


def uninstrument(model, attn_implementation: str = "eager") -> None:
    for m in attention_modules(model):
        if hasattr(m, "_labkit_ctl"):
            del m._labkit_ctl
    try:
        model.set_attn_implementation(attn_implementation)
    except Exception:
        model.config._attn_implementation = attn_implementation


def n_layers(model) -> int:
    return int(model.config.num_hidden_layers)
