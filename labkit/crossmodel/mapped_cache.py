"""The transfer itself in plain transformers: fit a mapper, and build the large model's cache from a
small-model prefill (`mapped_kv`), with the ablations that show what the mapper buys.

`mapped_kv(pair, mapper, ids, mode)` returns per large layer (K rotated, V) [1, kv_heads, T, head_dim]:

| mode         | copied layers (first:N)  | mapped layers                                          |
|--------------|--------------------------|--------------------------------------------------------|
| `mapped`     | the small model's own KV | the mapper's prediction, keys rotated at positions 0..T-1 |
| `zeros`      | the small model's own KV | zeros (no information: attention degenerates to a mean of zeros) |
| `copy_last`  | the small model's own KV | the small model's KV of the aligned layer (first:N: layer N-1) |

`exact_prefix=k` (default 1): in `mapped` mode the first k positions of every mapped layer hold the large
model's own K/V, from a k-token forward of the large model (k/T of its prefill). Position 0 is the
attention sink most deep-layer heads put their mass on; it is one row in 512 of the calibration text and
the linear map predicts it badly; that one position carried 43% (first:8: 1.67 -> 1.34) and 60% (first:10:
1.91 -> 1.30) of the log perplexity ratio at k = 1 (`labkit study crossmodel-attribution -p prefix=...`).

The same function feeds the pure-transformers quality reference and the /dev/shm producer.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import torch

from labkit.crossmodel.features import (SmallPass, cache_kv, pre_rope_kv, rope_cos_sin, rotate, run_with_hidden,
                                  small_pass)
from labkit.crossmodel.mapper import Fitter, Mapper
from labkit.crossmodel.pair import PairSpec
from labkit.crossmodel.mapper import LAMBDA_GRID
from labkit.models import load_model
from labkit.quality.corpora import read_document, documents

MODES = ("mapped", "zeros", "copy_last")
EXACT_PREFIX = 1   # positions whose K/V the large model computes itself (the attention sink)


@dataclass
class Models:
    pair: PairSpec
    large: object
    small: object
    tokenizer: object


def load_models(pair: PairSpec, dtype=torch.float32, device: str = "cpu", large_model=None) -> Models:
    """Load both checkpoints (the small one from its folder; `first:N` shares nothing at run time)."""
    # transformers is the optional `quality` extra: imported where a Hugging Face model is used
    from transformers import AutoModelForCausalLM

    if large_model is None:
        large, tok = load_model(pair.large.path, dtype=dtype, device=device, attn_implementation="sdpa")
    else:
        large, tok = large_model
    small = AutoModelForCausalLM.from_pretrained(pair.small.path, dtype=dtype, attn_implementation="sdpa")
    small.to(device).eval()
    return Models(pair, large, small, tok)


@torch.no_grad()
def true_cache(large, ids: torch.Tensor):
    """The large model's own prefill cache over ids [1, T] (decoder body only, no LM head)."""
    return run_with_hidden(large, ids, (), use_cache=True)[1]


@torch.no_grad()
def large_targets(large, cache, layers, rope: str = "pre") -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) [T, kv_width] per layer from a cache: keys unrotated for rope='pre', as stored for 'post'."""
    k0 = cache_kv(cache, 0)[0]
    T = k0.shape[-2]
    cos, sin = rope_cos_sin(large, T, device=k0.device)
    out = {}
    for l_ in layers:
        if rope == "pre":
            out[l_] = pre_rope_kv(large, cache, l_, cos, sin)
        else:
            k, v = cache_kv(cache, l_)
            out[l_] = (k[0].float().transpose(0, 1).reshape(T, -1), v[0].float().transpose(0, 1).reshape(T, -1))
    return out


def fit_mapper(models: Models, features, calib: list[tuple[str, str, torch.Tensor]], grid=None, rope: str = "pre",
               log=print, rank: int = 0) -> Mapper:
    """Fit on calibration chunks [(split 'fit'|'val', name, ids[T])]; λ chosen on the 'val' chunks; `rank` > 0
    factorizes the ridge solution (`Fitter.reduced`)."""
    fitter = Fitter(models.pair, features, rope)
    mapped = models.pair.table.mapped_layers
    h = {"fit": hashlib.sha256(), "val": hashlib.sha256()}
    t0 = time.perf_counter()
    for i, (split, name, ids) in enumerate(calib):
        ids2 = ids.view(1, -1)
        sp = small_pass(models.small, ids2, fitter.hidden_needed)
        tc = true_cache(models.large, ids2)
        fitter.add(split, sp, large_targets(models.large, tc, mapped, rope))
        h[split].update(name.encode() + ids.numpy().tobytes())
        if log and (i + 1) % max(1, len(calib) // 8) == 0:
            log(f"calibration {i + 1}/{len(calib)} sequences ({time.perf_counter() - t0:.0f}s)")
    corpus = {"fit_sha256": h["fit"].hexdigest()[:16], "val_sha256": h["val"].hexdigest()[:16],
              "fit_sequences": sum(s == "fit" for s, _, _ in calib), "val_sequences": sum(s == "val" for s, _, _ in calib),
              "fit_seconds": round(time.perf_counter() - t0, 1)}
    return fitter.mapper(grid or LAMBDA_GRID, corpus=corpus, log=log, rank=rank)


def calibration_chunks(tokenizer, corpora, seq_len: int, tokens_per_corpus: int, val_every: int = 5,
                       val_by: str = "document"):
    """Chunks of `seq_len` tokens from the corpora's *calibration* split (never the eval split).

    Documents in hash order, consecutive chunks of each (at most 8 per document so that one long play
    does not make up a corpus), until `tokens_per_corpus`. Held out for choosing λ (split 'val'):
    `val_by="document"` every `val_every`-th document of a corpus, all its chunks (the held-out R² is then
    on text of other documents, not on the next scene of a play fitted on); `"chunk"` every chunk whose
    name hashes to 0 mod `val_every` (how mappers were fitted before; kept to reproduce them). A corpus
    left without a held-out chunk holds out its last document (its last chunk if it has one document); with
    `"chunk"`, as before, the last chunk overall if none is held out.
    """
    if val_by not in ("document", "chunk"):
        raise ValueError(f"val_by must be 'document' or 'chunk', got {val_by!r}")
    out = []
    for corpus in corpora:
        n, start, used = 0, len(out), 0
        for name, path in documents(corpus, "calibration"):
            ids = tokenizer(read_document(path, corpus), add_special_tokens=False)["input_ids"]
            if len(ids) < seq_len:
                continue
            doc_val = val_by == "document" and used % val_every == val_every - 1
            used += 1
            for j in range(min(len(ids) // seq_len, 8)):
                cname = f"{corpus}/{name}#{j}"
                if val_by == "chunk":
                    split = "val" if int(hashlib.sha1(cname.encode()).hexdigest()[:8], 16) % val_every == 0 else "fit"
                else:
                    split = "val" if doc_val else "fit"
                out.append((split, cname, torch.tensor(ids[j * seq_len:(j + 1) * seq_len], dtype=torch.long)))
                n += seq_len
                if n >= tokens_per_corpus:
                    break
            if n >= tokens_per_corpus:
                break
        mine = out[start:]
        if val_by == "document" and mine and not any(s == "val" for s, _, _ in mine):
            last = mine[-1][1].rsplit("#", 1)[0]
            whole = all(c.rsplit("#", 1)[0] == last for _, c, _ in mine)   # one document: hold out its last chunk
            out[start:] = [("val" if (c == mine[-1][1] if whole else c.rsplit("#", 1)[0] == last) else s, c, t)
                           for s, c, t in mine]
    if val_by == "chunk" and out and not any(s == "val" for s, _, _ in out):   # tiny budgets: hold out the last chunk
        s, n_, ids = out[-1]
        out[-1] = ("val", n_, ids)
    return out


@torch.no_grad()
def mapped_kv(models: Models, mapper: Mapper | None, ids: torch.Tensor, mode: str = "mapped",
              sp: SmallPass | None = None, timings: dict | None = None,
              exact_prefix: int = EXACT_PREFIX) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per large layer (K rotated, V) [1, kv_heads, T, head_dim] from a small-model prefill of ids [1, T]; in
    `mapped` mode the first `exact_prefix` positions of the mapped layers are the large model's own."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: choose from {', '.join(MODES)}")
    pair, large = models.pair, models.large
    t0 = time.perf_counter()
    if sp is None:
        need = set()
        if mapper is not None and mode == "mapped":
            for l_ in pair.table.mapped_layers:
                need |= {i for k, i, _ in mapper.keys(l_) if k == "h"}
        sp = small_pass(models.small, ids, need)
    sync = torch.cuda.synchronize if timings is not None and ids.is_cuda else (lambda: None)
    sync()   # on a GPU the stage times below are the device's, not the launches'
    t1 = time.perf_counter()
    T = ids.shape[1]
    H, D = pair.large.kv_heads, pair.large.head_dim
    dtype = cache_kv(sp.cache, 0)[0].dtype
    zeros = lambda: torch.zeros(1, H, T, D, dtype=dtype, device=ids.device)  # noqa: E731
    cos, sin = rope_cos_sin(large, T, device=ids.device)
    out = []
    feats: dict = {}
    for l_, (kind, s) in enumerate(pair.table.entries):
        if kind == "copy" or mode == "copy_last":
            k, v = cache_kv(sp.cache, s)
            if k.shape[1] != H or k.shape[-1] != D:
                k, v = zeros(), zeros()
            out.append((k, v))
        elif mode == "zeros":
            out.append((zeros(), zeros()))
        else:
            keys = mapper.keys(l_)
            if keys not in feats:  # features (and a reduced-rank mapper's projection) once per feature group
                feats[keys] = mapper.project(sp.features(keys), l_)
            kp, v = mapper.predict(feats[keys], l_)
            kp = kp.view(T, H, D).transpose(0, 1).unsqueeze(0)
            v = v.view(T, H, D).transpose(0, 1).unsqueeze(0)
            k = rotate(kp, cos, sin) if mapper.rope == "pre" else kp
            out.append((k.to(dtype), v.to(dtype)))
    sync()
    t2 = time.perf_counter()
    k = min(int(exact_prefix), T) if mode == "mapped" else 0
    if k:   # a k-token forward of the large model: its own K/V at the first k positions (the sink)
        tc = true_cache(large, ids[:, :k])
        for l_ in pair.table.mapped_layers:
            tk, tv = cache_kv(tc, l_)
            mk, mv = out[l_]
            out[l_] = (torch.cat([tk.to(mk.dtype), mk[:, :, k:]], dim=2), torch.cat([tv.to(mv.dtype), mv[:, :, k:]], dim=2))
    sync()
    if timings is not None:
        timings["small_prefill_s"] = t1 - t0
        timings["mapping_s"] = t2 - t1
        timings["prefix_s"] = time.perf_counter() - t2
    return out
