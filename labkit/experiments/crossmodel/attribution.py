"""Where a fitted `first:N` mapper loses its perplexity: per mapped layer, and per prompt length.

For each mapper file and prompt length, on the corpora's eval split (as `labkit.experiments.crossmodel.ablation` scores):

- `all`: every mapped layer predicted (the ablation's number);
- `only:l`: layer l predicted, every other layer's K/V true — what l's error costs on its own;
- `but:l`: every mapped layer predicted except l (true) — what repairing l alone would buy;
- with `--prefix k,...`: `all|prefix:k`, every mapped layer predicted except at the first k positions, whose K/V
  are the large model's own (the attention sink at position 0 is a row in 512 of the calibration text);
- with `--split L,...`: `only:l:K` / `only:l:V` and `but:l:K` / `but:l:V`, the same for l's keys or values alone.

Prompt lengths shorter than the longest take the *same* continuation with a shorter context (its last
`prompt_len - 1` tokens, positions from 0), so rows differ in the context only. Calibration chunks are
`calib_seq_len` (512) tokens: a feature whose distribution moves with the position (`@avg`, a causal mean
over 0..t) is fitted on t < 512 only and extrapolated beyond; comparing prompt lengths 513 and 1025 shows
whether a mapper's loss comes from there.

    labkit study crossmodel-attribution -p mappers=A.safetensors,B.safetensors -p out=DIR [-p prompt_lens=513,1025]
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from labkit.experiments.crossmodel.ablation import large_pass, small_view
from labkit.crossmodel.features import cache_kv, rotate
from labkit.crossmodel.mapper import Mapper
from labkit.crossmodel.quality import logits_with_kv
from labkit.atomic import open_replacing, write_text
from labkit.crossmodel.pair import plan_pair
from labkit.models import load_model
from labkit.params import keywords
from labkit.quality.corpora import sequences


@torch.no_grad()
def run(mapper_paths, large_name="smollm2-135m", corpora=("code", "prose"), n_sequences=6, prompt_lens=(513, 1025),
        cont_len=128, per_layer=True, split=(), prefixes=(), log=print) -> pd.DataFrame:
    mappers = {}
    for path in mapper_paths:
        meta_n = Mapper.load(path).small["layers"]
        pair = plan_pair(large_name, f"first:{meta_n}", derive=False)
        mappers[str(path)] = (Mapper.load(path, expect=pair), int(meta_n))
    large, tok = load_model(pair.large.path, dtype=torch.float32, device="cpu", attn_implementation="sdpa")
    large.eval()
    L, H, D = pair.large.layers, pair.large.kv_heads, pair.large.head_dim
    hid_need = {i for mp, n in mappers.values() for l_ in mp.weights for k, i, _ in mp.keys(l_) if k == "h"}
    kv_need = set(range(min(n for _, n in mappers.values()), L))
    longest = max(prompt_lens)
    rows = []
    t0 = time.perf_counter()
    for corpus in corpora:
        for name, ids in sequences(tok, corpus, longest + cont_len, n_sequences, split="eval"):
            ids = ids.view(1, -1)
            block = ids[:, longest - 1: longest + cont_len]
            for p_len in prompt_lens:
                ctx = ids[:, longest - p_len: longest - 1]
                hidden, kv, cache, cos, sin = large_pass(large, ctx, hid_need | {0}, kv_need)
                true_kv = [cache_kv(cache, i) for i in range(L)]
                nll_true = float(F.cross_entropy(logits_with_kv(large, block, true_kv)[:-1], block[0, 1:], reduction="sum"))
                T = ctx.shape[1]
                for path, (mp, n) in mappers.items():
                    sp = small_view(hidden, kv, n, cos, sin)
                    feats, pred = {}, {}
                    for l_ in sorted(mp.weights):
                        keys = mp.keys(l_)
                        if keys not in feats:
                            feats[keys] = mp.project(sp.features(keys), l_)
                        k, v = mp.predict(feats[keys], l_)
                        pred[l_] = (rotate(k.view(T, H, D).transpose(0, 1).unsqueeze(0), cos, sin),
                                    v.view(T, H, D).transpose(0, 1).unsqueeze(0))
                    # variant -> {layer: (K predicted?, V predicted?)}; layers not named keep their true K/V
                    variants = {"all": {l_: (1, 1) for l_ in pred}}
                    if per_layer:
                        variants |= {f"only:{l_}": {l_: (1, 1)} for l_ in pred}
                        variants |= {f"but:{l_}": {i: (1, 1) for i in pred if i != l_} for l_ in pred}
                    for l_ in split:
                        variants |= {f"only:{l_}:K": {l_: (1, 0)}, f"only:{l_}:V": {l_: (0, 1)},
                                     f"but:{l_}:K": {i: (i != l_, 1) for i in pred},
                                     f"but:{l_}:V": {i: (1, i != l_) for i in pred}}
                    for k in prefixes:
                        variants[f"all|prefix:{k}"] = {l_: (1, 1) for l_ in pred}
                    for var, mapped in variants.items():
                        kvs = [tuple(pred[i][j] if mapped.get(i, (0, 0))[j] else true_kv[i][j] for j in (0, 1))
                               for i in range(L)]
                        if "|prefix:" in var:   # the first k positions' K/V true in every layer
                            k = int(var.split(":")[-1])
                            kvs = [tuple(torch.cat([t[j][:, :, :k], x[:, :, k:]], dim=2) for j, x in enumerate(kv_))
                                   for t, kv_ in zip(true_kv, kvs)]
                        nll = float(F.cross_entropy(logits_with_kv(large, block, kvs)[:-1], block[0, 1:], reduction="sum"))
                        rows.append({"mapper": Path(path).name, "small_layers": n, "features": str(mp.features),
                                     "rank": mp.rank, "prompt_len": p_len, "variant": var,
                                     "layer": int(var.split(":")[1]) if ":" in var and "|" not in var else -1,
                                     "part": var.split(":")[2] if var.count(":") == 2 else "KV", "corpus": corpus,
                                     "document": name, "n_tokens": cont_len, "nll_sum": nll, "nll_true": nll_true})
            if log:
                log(f"{corpus}/{name} done ({time.perf_counter() - t0:.0f}s)")
    return pd.DataFrame(rows)


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Token-pooled perplexity ratio per (mapper, prompt length, variant), overall and per corpus."""
    out = []
    keys = ["mapper", "small_layers", "features", "rank", "prompt_len", "variant", "layer", "part"]
    for k, g in df.groupby(keys, sort=False):
        r = dict(zip(keys, k), ppl_ratio=math.exp((g["nll_sum"].sum() - g["nll_true"].sum()) / g["n_tokens"].sum()))
        for c, gc in g.groupby("corpus"):
            r[f"ppl_ratio_{c}"] = math.exp((gc["nll_sum"].sum() - gc["nll_true"].sum()) / gc["n_tokens"].sum())
        out.append(r)
    return pd.DataFrame(out)


DEFAULTS = {
    'mappers': None,
    'large': "smollm2-135m",
    'prompt_lens': "513,1025",
    'n_sequences': 6,
    'cont_len': 128,
    'no_per_layer': False,
    'prefix': "",
    'split': "",
    'threads': 1,
    'out': None,
}
REQUIRED = ('mappers', 'out')


def study(**given) -> int:
    """Per-layer attribution of the mapped KV's quality cost, into a folder of CSVs. Keywords: DEFAULTS' names (REQUIRED ones must be given); one BadInput line on an unknown or missing one."""
    a = keywords(given, DEFAULTS, REQUIRED, __name__)
    torch.set_num_threads(a.threads)
    df = run([Path(x) for x in a.mappers.split(",")], a.large, n_sequences=a.n_sequences,
             prompt_lens=tuple(int(x) for x in a.prompt_lens.split(",")), cont_len=a.cont_len,
             per_layer=not a.no_per_layer, split=tuple(int(x) for x in a.split.split(",") if x),
             prefixes=tuple(int(x) for x in a.prefix.split(",") if x), log=lambda m: print(time.strftime("%H:%M:%S"), m, flush=True))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    s = summarize(df)
    for name, table in (("attribution_rows.csv", df), ("attribution.csv", s)):
        with open_replacing(out / name) as f:              # whole, never through a planted link
            table.to_csv(f, index=False)
    write_text(out / "attribution.json", json.dumps(vars(a), indent=1))
    print(s[s["variant"] == "all"].round(3).to_string())
    return 0
