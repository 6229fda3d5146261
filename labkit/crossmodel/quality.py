"""Quality of a mapped cache against the large model's own, in plain transformers (the reference).

Protocol per held-out sequence of `prompt_len + cont_len` tokens (`labkit.crossmodel.heldout`: a window at a
seeded offset in an eval document whose family the calibration never read), as a KV connector runs it: the cache covers the first `prompt_len - 1` tokens (an
engine recomputes the prompt's last token itself), then the large model processes the last prompt token
and the continuation:

- **perplexity** of the real continuation (`cont_len` next-token predictions), teacher-forced on top
  of the true cache and on top of each mode's cache; `ppl_ratio = ppl(mode) / ppl(true)`;
- **top-1 agreement**: the large model greedily decodes `agree_tokens` tokens from the true cache
  (reference); each mode's cache is teacher-forced on the reference tokens and we count the positions
  whose argmax equals the reference token (a copied-only pair, or the true cache, gives 1.0);
- **R² per layer** of the mapper's K (before RoPE) and V on the prompt tokens:
  1 − Σ(y − ŷ)² / Σ(y − ȳ)², pooled over the eval sequences of a corpus.

Rows are tidy dicts, one per (sequence, mode), with the summed NLL; `summarize` pools perplexities
token-weighted per (corpus, mode) and `pooled` over the corpora per mode, both with 95% intervals over
sequences (`labkit.stats.intervals`).
"""

from __future__ import annotations

import math
import time

import pandas as pd
import torch
import torch.nn.functional as F

from labkit.crossmodel.features import build_cache, cache_kv, call
from labkit.crossmodel.heldout import as_seq
from labkit.crossmodel.mapped_cache import EXACT_PREFIX, MODES, Models, large_targets, mapped_kv, true_cache
from labkit.crossmodel.features import rope_cos_sin, unrotate
from labkit.crossmodel.heldout import EVAL_SEED, draw
from labkit.stats.intervals import agree_columns, paired, ratio_columns


def eval_sequences(tokenizer, corpora, total_len: int, n: int, seed: int | None = None):
    """`n` evaluation windows per corpus (`heldout.Seq`), drawn by `seed` (`heldout.EVAL_SEED` if None)."""
    return draw(tokenizer, corpora, total_len, n, seed=EVAL_SEED if seed is None else seed)


@torch.no_grad()
def logits_with_kv(large, block: torch.Tensor, kv) -> torch.Tensor:
    cache = build_cache(large, [(k.clone(), v.clone()) for k, v in kv])
    return call(large, block, cache)[0].logits[0].float()


@torch.no_grad()
def greedy(large, first: torch.Tensor, kv, steps: int) -> torch.Tensor:
    """`steps` greedy tokens decoded one at a time after `first` [1, 1] on top of a copy of kv."""
    cache = build_cache(large, [(k.clone(), v.clone()) for k, v in kv])
    tok, out = first, []
    for _ in range(steps):
        logits = call(large, tok, cache)[0].logits[0, -1]
        tok = logits.argmax().view(1, 1)
        out.append(int(tok))
    return torch.tensor(out, dtype=torch.long)


def _kv_list(cache, layers: int):
    return [cache_kv(cache, i) for i in range(layers)]


@torch.no_grad()
def evaluate(models: Models, mapper, seqs, prompt_len: int, cont_len: int, agree_tokens: int = 32,
             modes=MODES, on_row=None, log=print, exact_prefix: int = EXACT_PREFIX) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per sequence x mode rows, per corpus x layer R² rows)."""
    large, pair = models.large, models.pair
    L = pair.large.layers
    rows, r2acc = [], {}
    for s in map(as_seq, seqs):
        corpus, name, ids = s.corpus, s.document, s.ids.view(1, -1)
        ctx = ids[:, : prompt_len - 1]
        block = ids[:, prompt_len - 1: prompt_len + cont_len]
        t0 = time.perf_counter()
        tc = true_cache(large, ctx)
        t_true = time.perf_counter() - t0
        true_kv = _kv_list(tc, L)
        logits = logits_with_kv(large, block, true_kv)
        nll_true = float(F.cross_entropy(logits[:-1], block[0, 1:], reduction="sum"))
        ref = greedy(large, block[:, :1], true_kv, agree_tokens)
        forced = torch.cat([block[:, :1], ref[:-1].view(1, -1)], dim=1)
        base = {"corpus": corpus, "document": name, "offset": s.offset, "prompt_len": prompt_len, "cont_len": cont_len,
                "n_tokens": cont_len, "agree_tokens": agree_tokens}

        def score(kv):
            lg = logits_with_kv(large, block, kv)
            nll = float(F.cross_entropy(lg[:-1], block[0, 1:], reduction="sum"))
            agree = float((logits_with_kv(large, forced, kv).argmax(-1) == ref).float().mean())
            return nll, agree

        nll_t, agree_t = score(true_kv)
        row = dict(base, mode="true", nll_sum=nll_true, ppl=math.exp(nll_true / cont_len), ppl_true=math.exp(nll_true / cont_len),
                   ppl_ratio=1.0, top1_agree=agree_t, prefill_s=t_true)
        rows.append(row)
        if on_row:
            on_row(row)
        targets = None
        if mapper is not None:
            targets = large_targets(large, tc, pair.table.mapped_layers, mapper.rope)
        for mode in modes:
            if mode == "mapped" and mapper is None:
                continue
            tm = {}
            kv = mapped_kv(models, mapper, ctx, mode, timings=tm, exact_prefix=exact_prefix)
            nll, agree = score(kv)
            row = dict(base, mode=mode, nll_sum=nll, ppl=math.exp(nll / cont_len), ppl_true=math.exp(nll_true / cont_len),
                       ppl_ratio=math.exp((nll - nll_true) / cont_len), top1_agree=agree,
                       prefill_s=tm["small_prefill_s"], mapping_s=tm["mapping_s"])
            rows.append(row)
            if on_row:
                on_row(row)
            if log:
                log(f"{corpus}/{name} {mode}: ppl {row['ppl']:.3f} (true {row['ppl_true']:.3f}) ratio "
                    f"{row['ppl_ratio']:.4f} top1 {agree:.3f}")
            if mode == "mapped" and targets is not None:
                w = pair.large.kv_heads * pair.large.head_dim
                T = ctx.shape[1]
                for l_ in pair.table.mapped_layers:
                    k, v = kv[l_]
                    if mapper.rope == "pre":
                        cos, sin = rope_cos_sin(large, T)
                        k = unrotate(k.float(), cos, sin)
                    pk = k[0].float().transpose(0, 1).reshape(T, w)
                    pv = v[0].float().transpose(0, 1).reshape(T, w)
                    for part, pred, y in (("K", pk, targets[l_][0]), ("V", pv, targets[l_][1])):
                        a = r2acc.setdefault((corpus, l_, part), [0.0, 0.0, 0.0, 0])
                        a[0] += float(((y - pred) ** 2).sum())
                        a[1] += float((y.double() ** 2).sum())
                        a[2] = a[2] + y.double().sum(0) if isinstance(a[2], torch.Tensor) else y.double().sum(0)
                        a[3] += T
    r2rows = []
    for (corpus, l_, part), (sse, yy, ys, n) in sorted(r2acc.items()):
        sst = yy - float((ys * ys).sum()) / n
        r2rows.append({"corpus": corpus, "layer": l_, "part": part, "r2": 1 - sse / sst, "sse": sse, "sst": sst,
                       "tokens": n})
    return pd.DataFrame(rows), pd.DataFrame(r2rows)


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per (corpus, mode): token-weighted ppl, its ratio to the true cache with a 95% interval over sequences
    (`ppl_ratio_lo/_hi/_n`) and the per-sequence min / max, mean top-1 agreement with its interval."""
    g = df.groupby(["corpus", "mode"], as_index=False).agg(nll_sum=("nll_sum", "sum"), n_tokens=("n_tokens", "sum"),
                                                           top1_agree=("top1_agree", "mean"),
                                                           n_sequences=("document", "nunique"))
    g["ppl"] = (g["nll_sum"] / g["n_tokens"]).map(math.exp)
    true = g[g["mode"] == "true"].set_index("corpus")["ppl"]
    g["ppl_ratio"] = g["ppl"] / g["corpus"].map(true)
    pr = paired(df)
    extra = {(c, m): {**ratio_columns(x), **agree_columns(x)} for (c, m), x in pr.groupby(["corpus", "mode"])}
    cols = sorted({k for v in extra.values() for k in v} - {"ppl_ratio", "top1_agree"})
    for k in cols:
        g[k] = [extra.get((c, m), {}).get(k, math.nan) for c, m in zip(g["corpus"], g["mode"])]   # true: no interval
    return g


def pooled(df: pd.DataFrame) -> pd.DataFrame:
    """Per mode, over every corpus: the pooled ratio with its interval over sequences, per-sequence min / max,
    top-1 agreement with its interval."""
    pr = paired(df)
    return pd.DataFrame([{"mode": m, "n_sequences": len(x), "corpora": ",".join(sorted(x["corpus"].unique())),
                          **ratio_columns(x), **agree_columns(x)} for m, x in pr.groupby("mode", sort=False)])
