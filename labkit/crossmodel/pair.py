"""The model pair of a cross-model KV transfer: a small model that prefills, a large one that decodes.

`small` is either a local checkpoint (any Hugging Face causal LM sharing the large model's tokenizer,
e.g. Qwen3-0.6B for Qwen3-1.7B) or `first:N`: a real, cheaper model derived from the large one without
training — its first N decoder layers with the final norm and the LM head, saved once as a checkpoint
folder under `$LABKIT_CACHE/models/<large>-first<N>/`. For `first:N` the first N layers' KV of the two
models is the same computation, so those layers are *copied* (exact) and only layers N.. are mapped.

Layer alignment (`LayerTable`): for every large layer, either `copy` of a small layer (only for
`first:N`, where the layers are the same weights) or `map` from the small model's features, with an
*aligned* small layer that `h:aligned` / `kv:aligned` features refer to: proportional by default
(large layer l -> small layer round(l * (Ls - 1) / (Ll - 1))), or a table `l:s,l:s,...`.

Everything that can be checked without weights (tokenizers equal, layer table in range, head counts)
raises `PairError` (a ValueError, one line) before a model is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
import shutil

import torch

from labkit.models import ModelNotFound, resolve as resolve_model
from labkit.models.loader import cache_dir, checkpoint_path


class PairError(ValueError):
    """A model pair / layer table / mapper that cannot work; the message is one line."""


@dataclass(frozen=True)
class ModelInfo:
    """What identifies a checkpoint for a mapper: a name, its shapes, and a fingerprint."""

    name: str
    path: str
    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    fingerprint: str  # sha256 of config.json + weight file names and sizes

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def model_info(path: str | os.PathLike, name: str | None = None) -> ModelInfo:
    """Shapes and fingerprint of a checkpoint folder, from its config.json (no weights read)."""
    path = Path(path)
    cfg = _config(path)
    cfg = cfg.get("text_config", cfg)
    h = hashlib.sha256((path / "config.json").read_bytes())
    for w in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        h.update(f"{w.name}:{w.stat().st_size}".encode())
    heads = cfg["num_attention_heads"]
    return ModelInfo(name=name or path.name, path=str(path), layers=int(cfg["num_hidden_layers"]),
                     kv_heads=int(cfg.get("num_key_value_heads") or heads),
                     head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
                     hidden=int(cfg["hidden_size"]), vocab=int(cfg["vocab_size"]), fingerprint=h.hexdigest()[:16])


def tokenizer_fingerprint(path: str | os.PathLike) -> str:
    """sha256 over the tokenizer's vocabulary and special tokens (files, not the loaded object)."""
    path = Path(path)
    f = path / "tokenizer.json"
    if f.is_file():
        tj = json.loads(f.read_text())
        model = tj.get("model", {})
        payload = json.dumps({"vocab": model.get("vocab"), "merges": model.get("merges"),
                              "added": [(t.get("id"), t.get("content")) for t in tj.get("added_tokens", [])]},
                             sort_keys=True, default=str)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]
    files = [p for n in ("vocab.json", "merges.txt", "tokenizer.model") if (p := path / n).is_file()]
    if not files:
        raise PairError(f"{path}: no tokenizer files (tokenizer.json, vocab.json, tokenizer.model)")
    h = hashlib.sha256()
    for p in files:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def derive_first_layers(large_ckpt: Path, n: int, out: Path | None = None) -> Path:
    """A checkpoint folder with the large model's first `n` layers, final norm and head (saved once)."""
    # transformers is the optional `quality` extra: imported where a Hugging Face model is used
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = out or cache_dir() / f"{Path(large_ckpt).name}-first{n}"
    if (out / "config.json").is_file():
        return out
    cfg = AutoConfig.from_pretrained(large_ckpt)
    if not 1 <= n < cfg.num_hidden_layers:
        raise PairError(f"first:{n}: N must be in [1, {cfg.num_hidden_layers - 1}] for a {cfg.num_hidden_layers}-layer model")
    large = AutoModelForCausalLM.from_pretrained(large_ckpt, dtype="auto")  # keep the stored dtype: exact copies
    dtype = next(large.parameters()).dtype
    cfg.num_hidden_layers = n
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:n]
    if getattr(cfg, "max_window_layers", None):
        cfg.max_window_layers = min(cfg.max_window_layers, n)
    small = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    sd = {k: v for k, v in large.state_dict().items()
          if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= n)}
    missing, unexpected = small.load_state_dict(sd, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]  # tied heads are re-tied below
    if missing or unexpected:
        raise PairError(f"first:{n}: state dict mismatch (missing {missing[:3]}, unexpected {unexpected[:3]})")
    small.tie_weights()
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    small.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(large_ckpt).save_pretrained(tmp)
    (tmp / "SOURCE.txt").write_text(f"first {n} decoder layers + final norm + LM head of {large_ckpt}; no training\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


@dataclass(frozen=True)
class LayerTable:
    """Per large layer: ('copy', s) or ('map', aligned small layer s)."""

    entries: tuple[tuple[str, int], ...]

    @property
    def copy_layers(self) -> list[int]:
        return [i for i, (k, _) in enumerate(self.entries) if k == "copy"]

    @property
    def mapped_layers(self) -> list[int]:
        return [i for i, (k, _) in enumerate(self.entries) if k == "map"]

    def aligned(self, layer: int) -> int:
        return self.entries[layer][1]

    def to_list(self) -> list:
        return [list(e) for e in self.entries]

    @classmethod
    def from_list(cls, rows) -> "LayerTable":
        return cls(tuple((str(k), int(s)) for k, s in rows))


def layer_table(large_layers: int, small_layers: int, shared: int = 0, table: str | dict | None = None) -> LayerTable:
    """Alignment of `large_layers` to `small_layers`; the first `shared` layers are copies (first:N).

    `table`: None/'' or 'proportional' (default), or 'l:s,l:s,...' / {l: s} for any subset of the mapped
    layers (the rest proportional). Out-of-range entries raise PairError (one line).
    """
    if shared > small_layers or shared >= large_layers:
        raise PairError(f"{shared} shared layers do not fit a {small_layers}-layer small / {large_layers}-layer large pair")
    given: dict[int, int] = {}
    if isinstance(table, dict):
        given = {int(k): int(v) for k, v in table.items()}
    elif table and table != "proportional":
        for item in str(table).split(","):
            try:
                l_, s_ = item.split(":")
                given[int(l_)] = int(s_)
            except ValueError:
                raise PairError(f"layer table entry {item!r}: expected large:small, e.g. 12:5") from None
    for l_, s_ in given.items():
        if not 0 <= l_ < large_layers:
            raise PairError(f"layer table: large layer {l_} out of range [0, {large_layers - 1}]")
        if not 0 <= s_ < small_layers:
            raise PairError(f"layer table: small layer {s_} out of range [0, {small_layers - 1}] (large layer {l_})")
        if l_ < shared:
            raise PairError(f"layer table: large layer {l_} is a copied layer (first {shared} layers are exact)")
    entries = []
    for l_ in range(large_layers):
        if l_ < shared:
            entries.append(("copy", l_))
        elif l_ in given:
            entries.append(("map", given[l_]))
        elif shared:  # a truncated model: its deepest layer is the nearest to what follows
            entries.append(("map", small_layers - 1))
        else:
            entries.append(("map", round(l_ * (small_layers - 1) / max(large_layers - 1, 1))))
    return LayerTable(tuple(entries))


@dataclass
class PairSpec:
    """Resolved checkpoint folders and what was checked; models are not loaded."""

    large: ModelInfo
    small: ModelInfo
    table: LayerTable
    shared_layers: int  # N for first:N, else 0
    small_spec: str
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"large": self.large.to_dict(), "small": self.small.to_dict(), "layer_table": self.table.to_list(),
                "shared_layers": self.shared_layers, "small_spec": self.small_spec}


def parse_small(small: str) -> int | None:
    """N for 'first:N', None for a checkpoint path or name."""
    s = str(small).strip()
    if s.startswith("first:"):
        try:
            n = int(s.split(":", 1)[1])
        except ValueError:
            raise PairError(f"small model {s!r}: expected first:N with an integer N") from None
        return n
    return None


def plan_pair(large: str, small: str, table: str | None = None, derive: bool = True) -> PairSpec:
    """Resolve both models, check tokenizers, layer counts and the layer table; one line on error.

    With `derive=False` a `first:N` small model is checked against the large config only (nothing
    written); with True its checkpoint folder is made if missing (reads the large weights once).
    """
    try:
        kind, _ = resolve_model(large)
        if kind != "hf" and not derive:
            large_ckpt = cache_dir() / str(large).lower() if kind == "preset" else None
            if large_ckpt is None or not (large_ckpt / "config.json").is_file():
                large_ckpt = checkpoint_path(large)
        else:
            large_ckpt = checkpoint_path(large)
    except ModelNotFound as ex:
        raise PairError(str(ex)) from None
    linfo = model_info(large_ckpt, name=str(large))
    n = parse_small(small)
    if n is not None:
        if not 1 <= n < linfo.layers:
            raise PairError(f"small model first:{n}: N must be in [1, {linfo.layers - 1}] for {large} ({linfo.layers} layers)")
        if derive:
            small_path = str(derive_first_layers(large_ckpt, n))
        else:
            small_path = ""
        # a derived model is identified by the large model and N (its folder is a cache)
        sinfo = ModelInfo(f"{large}:first{n}", small_path, n, linfo.kv_heads, linfo.head_dim, linfo.hidden,
                          linfo.vocab, f"{linfo.fingerprint}:first{n}")
        tab = layer_table(linfo.layers, n, shared=n, table=table)
        return PairSpec(linfo, sinfo, tab, n, str(small))
    try:
        skind, _ = resolve_model(small)
        small_ckpt = checkpoint_path(small)
    except ModelNotFound as ex:
        raise PairError(str(ex)) from None
    sinfo = model_info(small_ckpt, name=str(small))
    if tokenizer_fingerprint(large_ckpt) != tokenizer_fingerprint(small_ckpt):
        raise PairError(f"{large} and {small} have different tokenizers: a KV transfer needs one token sequence for both")
    tab = layer_table(linfo.layers, sinfo.layers, shared=0, table=table)
    return PairSpec(linfo, sinfo, tab, 0, str(small))
