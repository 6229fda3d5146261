"""What the mapper reads and what it predicts, from real forward passes of Hugging Face decoders.

Features of the small model for a token (a `FeatureSpec`, comma-separated):

- `h:i`       the residual stream entering small layer i (i = Ls is the last layer's output, before the
              final norm; negative i counts from Ls + 1, so `h:-1` is the last layer's output), RMS-normalized
              per token (the attention input of a Llama/Qwen layer is a linear function of it);
- `kv:i`      small layer i's keys before RoPE and its values, all KV heads flattened;
- `h:aligned`, `kv:aligned`: the same at the small layer the layer table aligns with the target layer;
- a suffix `@-k` takes the feature of the token k positions earlier (zeros before the start): a deep
  layer's KV at token t carries context that the residual stream at t alone does not;
- a suffix `@avg` takes the causal mean of the feature over positions 0..t (a running summary of the
  document so far, one of the things deep layers' values carry and no single position's state does);
- a constant 1 (bias) is always appended.

Targets of large layer l: its keys *before* RoPE and its values, [T, kv_heads * head_dim] each. Keys
are mapped before rotation and rotated at the target positions afterwards with the large model's own
rotary embedding (`rotate`); the pre-rotation keys are recovered from a cache by the exact inverse
rotation (`unrotate`), so any model whose attention applies standard RoPE works without hooks inside it.
"""

from __future__ import annotations

from dataclasses import dataclass
import inspect

import torch

from labkit.crossmodel.pair import LayerTable, PairError

FeatureKey = tuple[str, int, int | str]  # ("h", hidden index, shift) | ("kv", layer, shift); shift "avg": causal mean


@dataclass(frozen=True)
class FeatureSpec:
    items: tuple[str, ...]

    @classmethod
    def parse(cls, spec: str | list[str] | tuple) -> "FeatureSpec":
        items = [x.strip() for x in (spec.split(",") if isinstance(spec, str) else spec) if str(x).strip()]
        if not items:
            raise PairError("features: give at least one of h:i, kv:i, h:aligned, kv:aligned")
        for it in items:
            kind, _, where = it.partition(":")
            where, _, shift = where.partition("@")
            if shift and shift != "avg" and not (shift.startswith("-") and shift[1:].isdigit()):
                raise PairError(f"feature {it!r}: suffix must be @-k (k a positive integer) or @avg")
            if kind not in ("h", "kv") or not where:
                raise PairError(f"feature {it!r}: expected h:i, kv:i, h:aligned or kv:aligned")
            if where != "aligned":
                try:
                    int(where)
                except ValueError:
                    raise PairError(f"feature {it!r}: layer must be an integer or 'aligned'") from None
        return cls(tuple(items))

    def keys(self, layer: int, table: LayerTable, small_layers: int) -> tuple[FeatureKey, ...]:
        """Concrete feature keys for large layer `layer` (deduplicated, in order); checks ranges."""
        out: list[FeatureKey] = []
        for it in self.items:
            kind, _, where = it.partition(":")
            where, _, shift = where.partition("@")
            shift = "avg" if shift == "avg" else (-int(shift) if shift else 0)
            i = table.aligned(layer) if where == "aligned" else int(where)
            if kind == "h":
                if i < 0:
                    i += small_layers + 1
                if not 0 <= i <= small_layers:
                    raise PairError(f"feature {it!r}: hidden index out of range [0, {small_layers}] (or -{small_layers + 1}..-1)")
            else:
                if i < 0:
                    i += small_layers
                if not 0 <= i < small_layers:
                    raise PairError(f"feature {it!r}: small layer out of range [0, {small_layers - 1}]")
            k = (kind, i, shift)
            if k not in out:
                out.append(k)
        return tuple(out)

    def __str__(self) -> str:
        return ",".join(self.items)


def feature_dim(keys, hidden: int, kv_width: int) -> int:
    return sum(hidden if k == "h" else 2 * kv_width for k, _, _ in keys) + 1


# ---- caches across transformers versions ---------------------------------------------------------

def cache_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) of one layer of a transformers cache, each [B, kv_heads, T, head_dim] (K rotated)."""
    if hasattr(cache, "layers"):
        lay = cache.layers[layer]
        return lay.keys, lay.values
    return cache.key_cache[layer], cache.value_cache[layer]


def build_cache(model, kv: list[tuple[torch.Tensor, torch.Tensor]]):
    """A DynamicCache holding the given per-layer (K rotated, V), [B, kv_heads, T, head_dim] each."""
    # transformers is the optional `quality` extra: imported where a Hugging Face model is used
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
    except TypeError:
        cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache


def cache_len(cache) -> int:
    return cache_kv(cache, 0)[0].shape[-2]


def call(model, ids: torch.Tensor, cache=None, use_cache: bool = True, **extra):
    """model(input_ids=ids) passing the cache under the name this transformers uses (`cache` from
    5.2x, `past_key_values` before); returns (output, cache)."""
    kw = {}
    if cache is not None:
        names = inspect.signature(type(model).forward).parameters
        kw["cache" if "cache" in names else "past_key_values"] = cache
    out = model(input_ids=ids, use_cache=use_cache, **kw, **extra)
    new = out["cache"] if "cache" in out else out.get("past_key_values", None)
    return out, new


# ---- RoPE ----------------------------------------------------------------------------------------

def rope_cos_sin(model, n: int, offset: int = 0, dtype=torch.float32, device="cpu"):
    """cos, sin [1, 1, n, head_dim] of the model's own rotary embedding at positions offset..offset+n-1."""
    base = model.model if hasattr(model, "model") else model
    pos = torch.arange(offset, offset + n, device=device).view(1, -1)
    cos, sin = base.rotary_emb(torch.zeros(1, n, 1, dtype=dtype, device=device), pos)
    return cos.unsqueeze(1).to(dtype), sin.unsqueeze(1).to(dtype)


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rotate(k: torch.Tensor, cos, sin) -> torch.Tensor:
    """Apply RoPE to keys [B, H, T, D]."""
    return k * cos + _rotate_half(k) * sin


def unrotate(k: torch.Tensor, cos, sin) -> torch.Tensor:
    """The exact inverse of `rotate` (rotation by -theta)."""
    return k * cos - _rotate_half(k) * sin


# ---- forward passes ------------------------------------------------------------------------------

def _base(model):
    return model.model if hasattr(model, "model") and hasattr(model, "lm_head") else model


@torch.no_grad()
def run_with_hidden(model, ids: torch.Tensor, hidden_idx, use_cache: bool = True):
    """Forward of the decoder body (no LM head) over ids [1, T]; returns ({hidden index: [T, hidden]}, cache).

    Hidden index i is the residual stream entering layer i; index L (layers) is the last layer's output.
    """
    base = _base(model)
    layers = base.layers
    L = len(layers)
    want = set(hidden_idx)
    got: dict[int, torch.Tensor] = {}
    hooks = []

    def pre(i):
        def f(mod, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            got[i] = h[0].detach()
        return f

    def post(mod, args, out):
        h = out[0] if isinstance(out, tuple) else out
        got[L] = h[0].detach()

    try:
        for i in sorted(want):
            if i < L:
                hooks.append(layers[i].register_forward_pre_hook(pre(i), with_kwargs=True))
        if L in want:
            hooks.append(layers[L - 1].register_forward_hook(post))
        out, cache = call(base, ids, use_cache=use_cache)
    finally:
        for h in hooks:
            h.remove()
    return got, cache


def rms_normalize(h: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    h = h.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


def pre_rope_kv(model, cache, layer: int, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys before RoPE and values of one layer, each [T, kv_heads * head_dim] (float32)."""
    k, v = cache_kv(cache, layer)
    k = unrotate(k.float(), cos, sin)
    T = k.shape[-2]
    return k[0].transpose(0, 1).reshape(T, -1), v[0].float().transpose(0, 1).reshape(T, -1)


@dataclass
class SmallPass:
    """One small-model prefill: normalized hidden states, its cache, and pre-RoPE K/V on demand."""

    hidden: dict[int, torch.Tensor]
    cache: object
    cos: torch.Tensor
    sin: torch.Tensor
    model: object
    _kv: dict | None = None

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._kv is None:
            self._kv = {}
        if layer not in self._kv:
            self._kv[layer] = pre_rope_kv(self.model, self.cache, layer, self.cos, self.sin)
        return self._kv[layer]

    def features(self, keys) -> torch.Tensor:
        parts = []
        for kind, i, shift in keys:
            if kind == "h":
                p = [rms_normalize(self.hidden[i])]
            else:
                p = list(self.kv(i))
            if shift == "avg":
                pos = torch.arange(1, p[0].shape[0] + 1, dtype=p[0].dtype, device=p[0].device).unsqueeze(1)
                p = [x.cumsum(0) / pos for x in p]
            elif shift:
                p = [torch.cat([x.new_zeros(shift, x.shape[1]), x[:-shift]]) if shift < x.shape[0]
                     else torch.zeros_like(x) for x in p]
            parts += p
        T = parts[0].shape[0]
        parts.append(parts[0].new_ones(T, 1))
        return torch.cat(parts, dim=1)


def small_pass(small, ids: torch.Tensor, hidden_needed) -> SmallPass:
    """Prefill the small model over ids [1, T] capturing the hidden states the features need."""
    hid, cache = run_with_hidden(small, ids, hidden_needed, use_cache=True)
    T = ids.shape[1]
    cos, sin = rope_cos_sin(small, T, device=ids.device)
    return SmallPass({i: h for i, h in hid.items()}, cache, cos, sin, small)
