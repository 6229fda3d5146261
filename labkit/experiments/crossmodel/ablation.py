"""Which mapper and which N: a feature / λ / calibration-text ablation and the quality side of the N
frontier, for `first:N` pairs, from one set of large-model passes.

Why one pass serves every N: the small model `first:N` *is* the large model's first N layers, so its
residual stream h:0..N and its K/V of layers 0..N-1 are the large model's on the same tokens. The
ablation reads them from one large-model forward (hooks) instead of running each small model, and a
`Fitter` per (N, calibration tier) accumulates XᵀX / XᵀY for a *superset* of features; every feature
subset is cut out of it with `restrict` (no new passes), λ is chosen per layer (or per KV head) on the
held-out calibration chunks. The official path (`labkit run crossmodel`, a real small model) reproduces the
default's row — the run folder shows both.

Quality per config on the corpora's eval split (never used for fitting), as `quality.evaluate` does it:
the cache covers `prompt_len - 1` tokens, the continuation's perplexity is teacher-forced, top-1
agreement is against the true cache's greedy decode. Rows also carry the mapper's cost (feature width,
mapped columns, multiply-adds per prompt token) — what the TTFT side of the frontier pays for it.

    labkit study crossmodel-ablation -p out=results/<run> (labkit study crossmodel-ablation --help lists the keywords)
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from labkit.crossmodel.heldout import EVAL_SEED
from labkit.stats.intervals import text as iv_text
from labkit.crossmodel.features import FeatureSpec, SmallPass, cache_kv, pre_rope_kv, rope_cos_sin, rotate, run_with_hidden
from labkit.crossmodel.mapper import Fitter, restrict
from labkit.crossmodel.pair import plan_pair
from labkit.crossmodel.quality import logits_with_kv, greedy
from labkit.atomic import open_replacing, write_text
from labkit.crossmodel import heldout
from labkit.stats.intervals import pooled as pooled_columns
from labkit.crossmodel.mapped_cache import calibration_chunks
from labkit.models import load_model
from labkit.params import keywords

# N=8: the feature ablation; every other N: the frontier (a smaller superset keeps the passes cheap)
SUPERSET_ABLATION = "h:-1,h:0,h:-1@-1,h:-2,h:-1@-2,kv:-1,h:-1@avg"
SUPERSET_FRONTIER = "h:-1,h:0,h:-1@-1,h:-1@avg"
# λ grid of the sweeps here: the values first:8 fits ever chose (1e-5 only for the exactly linear layer N,
# where 1e-3 loses nothing measurable); five instead of eight factorizations per config keeps CPU runs short
GRID = (1e-3, 1e-2, 3e-2, 0.1, 0.3)
FEATURE_CONFIGS = [  # (name, features) evaluated at the ablation's N
    ("h_last", "h:-1"),
    ("old_default", "h:-1,h:0,h:-1@-1"),
    ("+h_prev_layer", "h:-1,h:0,h:-1@-1,h:-2"),
    ("+kv_last_layer", "h:-1,h:0,h:-1@-1,kv:-1"),
    ("+shift2", "h:-1,h:0,h:-1@-1,h:-1@-2"),
    ("+causal_mean", "h:-1,h:0,h:-1@-1,h:-1@avg"),
    ("all_hidden", "h:-1,h:0,h:-1@-1,h:-2,h:-1@avg"),
]


def merged(a: Fitter, b: Fitter) -> Fitter:
    """One Fitter holding the sums of both (same pair and features): more calibration text, no new pass."""
    out = Fitter(a.pair, a.features, a.rope)
    out.sums = {s: a.sums[s].merged(b.sums[s]) for s in ("fit", "val")}
    out.tokens = {s: a.tokens[s] + b.tokens[s] for s in ("fit", "val")}
    return out


def small_view(hidden: dict, kv: dict, n: int, cos, sin) -> SmallPass:
    """The SmallPass that first:n would produce, read off the large model's pass."""
    return SmallPass({i: h for i, h in hidden.items() if i <= n}, None, cos, sin, None,
                     {i: x for i, x in kv.items() if i < n})


@torch.no_grad()
def large_pass(large, ids: torch.Tensor, hidden_idx, kv_layers):
    """Hidden states {i: [T, hidden]}, pre-RoPE (K, V) {l: [T, w]} and the cache of one large forward."""
    hidden, cache = run_with_hidden(large, ids, hidden_idx, use_cache=True)
    T = ids.shape[1]
    cos, sin = rope_cos_sin(large, T)
    return hidden, {l_: pre_rope_kv(large, cache, l_, cos, sin) for l_ in kv_layers}, cache, cos, sin


def mapper_cost(mp) -> dict:
    """Feature width d, rank (0: full) and multiply-adds per prompt token of the mapping (all mapped layers)."""
    return {"feature_dim": max(mp.input_dim(l_) for l_ in mp.weights), "rank": mp.rank,
            "mapped_layers": len(mp.weights), "mapper_macs_per_token": mp.macs_per_token()}


def layer_macs_per_token(pair) -> int:
    """Multiply-adds per token of one large decoder layer's projections (attention's T-dependent part aside)."""
    cfg = json.loads((Path(pair.large.path) / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * pair.large.head_dim
    kv = pair.large.kv_heads * pair.large.head_dim
    return h * q + 2 * h * kv + q * h + 3 * h * inter


def run(large_name="smollm2-135m", ns=(8, 10, 12, 16, 20, 24), ablation_n=8, corpora=("code", "prose"),
        calib_tiers=(8192, 32768), calib_seq_len=512, n_sequences=16, prompt_len=1025, cont_len=128,
        agree_tokens=32, out: Path | None = None, mapper_dir: Path | None = None, log=print,
        superset_ablation=SUPERSET_ABLATION, superset_frontier=SUPERSET_FRONTIER, sums_cache: Path | None = None,
        frontier_only: str = "", ranks=(), grid=GRID, exact_prefix: int = 1, eval_seed: int = EVAL_SEED,
        val_by: str = "document"):
    t_start = time.perf_counter()
    pairs = {n: plan_pair(large_name, f"first:{n}", derive=False) for n in ns}
    pair0 = pairs[ns[0]]
    large, tok = load_model(pair0.large.path, dtype=torch.float32, device="cpu", attn_implementation="sdpa")
    large.eval()
    L = pair0.large.layers
    if frontier_only and not sums_cache:  # only the frontier, these features at every N (no ablation superset)
        superset_frontier = superset_ablation = frontier_only
    supers = {n: FeatureSpec.parse(superset_ablation if n == ablation_n else superset_frontier) for n in ns}
    fitters = {(n, t): Fitter(pairs[n], supers[n]) for n in ns for t in range(len(calib_tiers))}
    hid_need = set().union(*[f.hidden_needed for f in fitters.values()])
    kv_need = set(range(min(ns) - 1, L))

    # calibration: chunks of the largest tier; a chunk's tier is where it falls in its corpus' order
    calib = calibration_chunks(tok, list(corpora), calib_seq_len, calib_tiers[-1], val_by=val_by)
    # evaluation windows: drawn by the seed from documents (and families) the calibration never read
    seqs = heldout.draw(tok, corpora, prompt_len + cont_len, n_sequences, seed=eval_seed)
    heldout.check_disjoint(calib, seqs)
    overlaps = heldout.overlap(calib, seqs)
    split_rec = heldout.split_record(calib, seqs, eval_seed, overlaps)
    log(f"split: {len(calib)} calibration chunks (lambda held out by {val_by}); {len(seqs)} evaluation windows, seed "
        f"{eval_seed}, calibration 8-gram overlap max {max(overlaps):.3f}")
    t0 = time.perf_counter()
    _calibrate(fitters, large, calib, calib_tiers, ns, pairs, hid_need, kv_need, sums_cache, log)
    fit_s = time.perf_counter() - t0

    ev = _true_passes(large, seqs, overlaps, prompt_len, cont_len, agree_tokens, hid_need, kv_need, L)
    score = _Scorer(large, fitters, ev, pair0, calib_tiers, grid, exact_prefix, cont_len, log)
    results, mappers, full = score.results, score.mappers, len(calib_tiers)
    if frontier_only:
        for n in ns:
            score("frontier", n, frontier_only, "layer", full, stage="frontier")
            if n == ablation_n:
                for r in ranks:   # reduced-rank factorizations of the same mapper (Fitter.reduced)
                    score(f"rank{r}", n, frontier_only, "layer", full, stage="rank", rank=r)
        return _write(results, mappers, out, mapper_dir, ablation_n, {
            "large": large_name, "ns": list(ns), "ablation_n": ablation_n, "corpora": list(corpora),
            "calib_tiers_tokens_per_corpus": list(calib_tiers), "calib_seq_len": calib_seq_len,
            "n_sequences": n_sequences, "prompt_len": prompt_len, "cont_len": cont_len, "agree_tokens": agree_tokens,
            "frontier_recipe": {"features": frontier_only, "lambda_per": "layer", "tiers": full}, "ranks": list(ranks),
            "exact_prefix": exact_prefix, "eval_seed": eval_seed, "val_by": val_by, "split": split_rec,
            "lambda_grid": list(grid), "calibration_seconds": round(fit_s, 1),
            "wall_seconds": round(time.perf_counter() - t_start, 1), "layer_macs_per_token": layer_macs_per_token(pair0),
            "torch_threads": torch.get_num_threads()})
    best, best_val, frontier = _ablate(score, results, ns, ablation_n, calib_tiers, superset_ablation, superset_frontier)
    meta = {"large": large_name, "ns": list(ns), "ablation_n": ablation_n, "corpora": list(corpora),
            "calib_tiers_tokens_per_corpus": list(calib_tiers), "calib_seq_len": calib_seq_len,
            "n_sequences": n_sequences, "prompt_len": prompt_len, "cont_len": cont_len, "agree_tokens": agree_tokens,
            "superset_ablation": superset_ablation, "superset_frontier": superset_frontier,
            "eval_seed": eval_seed, "val_by": val_by, "split": split_rec,
            "best": dict(best, ppl_ratio=best_val), "frontier_recipe": frontier,
            "lambda_grid": list(grid), "calibration_seconds": round(fit_s, 1), "wall_seconds": round(time.perf_counter() - t_start, 1),
            "layer_macs_per_token": layer_macs_per_token(pair0), "torch_threads": torch.get_num_threads()}
    return _write(results, mappers, out, mapper_dir, ablation_n, meta)


class _Scorer:
    """`score(name, n, features, lambda_per, tiers, stage, rank)`: a mapper fitted for the recipe (once; rank
    variants reuse it), its rows over the evaluation sequences kept in `results` and the mapper in `mappers`;
    returns the pooled ppl ratio."""

    def __init__(self, large, fitters: dict, ev: list, pair0, calib_tiers, grid, exact_prefix: int, cont_len: int, log):
        self.large, self.fitters, self.ev, self.calib_tiers, self.grid = large, fitters, ev, calib_tiers, grid
        self.exact_prefix, self.cont_len, self.log = exact_prefix, cont_len, log
        self.L, self.H, self.D = pair0.large.layers, pair0.large.kv_heads, pair0.large.head_dim
        self.results, self.mappers = [], {}
        self.fitted: dict = {}   # (n, features, λ per, tiers) -> (Fitter, full mapper): rank variants reuse both

    def fitter_for(self, n, features, tiers):
        f = self.fitters[(n, 0)]
        for t in range(1, tiers):
            f = merged(f, self.fitters[(n, t)])
        return restrict(f, FeatureSpec.parse(features))

    def evaluate(self, mp, n, tag: dict) -> list[dict]:
        return [_scored(self.large, e, mp, n, tag, self.L, self.H, self.D, self.exact_prefix, self.cont_len)
                for e in self.ev]

    def __call__(self, name, n, features, lambda_per="layer", tiers=None, stage="features", rank=0):
        calib_tiers, log = self.calib_tiers, self.log
        tiers = len(calib_tiers) if tiers is None else tiers
        t = time.perf_counter()
        key = (n, features, lambda_per, tiers)
        if key not in self.fitted:
            f = self.fitter_for(n, features, tiers)
            self.fitted[key] = f, f.mapper(grid=self.grid, sweep_dtype=torch.float32, lambda_per=lambda_per,
                                           corpus={"ablation": name, "calib_tokens_per_corpus": calib_tiers[tiers - 1]})
        f, mp = self.fitted[key]
        if rank:
            mp = f.reduced(mp, rank)
        gap = {"rank_gap_k_mean": sum(g[0] for g in mp.rank_gap.values()) / len(mp.rank_gap),
               "rank_gap_v_mean": sum(g[1] for g in mp.rank_gap.values()) / len(mp.rank_gap)} if rank else {}
        tag = dict(stage=stage, config=name, small_layers=n, features=features, lambda_per=lambda_per,
                   exact_prefix=self.exact_prefix, calib_tokens_per_corpus=calib_tiers[tiers - 1],
                   fit_tokens=f.tokens["fit"], val_tokens=f.tokens["val"],
                   **mapper_cost(mp), r2_val_k_mean=sum(r[0] for r in mp.r2_val.values()) / len(mp.r2_val),
                   r2_val_v_mean=sum(r[1] for r in mp.r2_val.values()) / len(mp.r2_val), **gap)
        rows = self.evaluate(mp, n, tag)
        self.results.extend(rows)
        s = pooled(pd.DataFrame(rows))
        self.mappers[(name, n)] = mp
        if log:
            log(f"N={n} {stage}/{name} [{features}; lambda per {lambda_per}; {calib_tiers[tiers - 1]} tok/corpus]: "
                f"ppl ratio {iv_text(s, 'ppl_ratio')} ("
                + ", ".join(f"{c} {iv_text(s, f'ppl_ratio_{c}')}" for c in sorted({e['corpus'] for e in self.ev}))
                + f"), top1 {s['top1_agree']:.3f} ({time.perf_counter() - t:.0f}s)")
        return s["ppl_ratio"]


def _calibrate(fitters: dict, large, calib: list, calib_tiers, ns, pairs: dict, hid_need, kv_need,
               sums_cache: Path | None, log) -> None:
    """One large-model pass per calibration chunk into every N's fitter of the chunk's tier (a chunk's tier is
    where it falls in its corpus' order), or the sums an earlier run with the same arguments cached."""
    if sums_cache and sums_cache.is_file():  # the passes of an earlier run with the same arguments
        saved = torch.load(sums_cache, weights_only=False)
        for k, f in fitters.items():
            f.sums, f.tokens = saved[k]
        log(f"calibration sums loaded from {sums_cache}")
        return
    seen: dict[str, int] = {}
    t0 = time.perf_counter()
    for i, (split, name, ids) in enumerate(calib):
        corpus = name.split("/")[0]
        tier = next(t for t, lim in enumerate(calib_tiers) if seen.get(corpus, 0) < lim)
        seen[corpus] = seen.get(corpus, 0) + ids.numel()
        hidden, kv, _, cos, sin = large_pass(large, ids.view(1, -1), hid_need, kv_need)
        for n in ns:
            sp = small_view(hidden, kv, n, cos, sin)
            fitters[(n, tier)].add(split, sp, {l_: kv[l_] for l_ in pairs[n].table.mapped_layers})
        if log and (i + 1) % 16 == 0:
            log(f"calibration {i + 1}/{len(calib)} chunks ({time.perf_counter() - t0:.0f}s)")
    if sums_cache:
        sums_cache.parent.mkdir(parents=True, exist_ok=True)
        torch.save({k: (f.sums, f.tokens) for k, f in fitters.items()}, sums_cache)


def _true_passes(large, seqs, overlaps, prompt_len: int, cont_len: int, agree_tokens: int, hid_need, kv_need,
                 L: int) -> list[dict]:
    """One true pass per evaluation sequence: hidden states for every N's features, the true cache, the
    reference continuation's NLL and greedy tokens."""
    ev = []
    for s_, ov in zip(seqs, overlaps):
        corpus, name, ids = s_.corpus, s_.document, s_.ids.view(1, -1)
        ctx, block = ids[:, : prompt_len - 1], ids[:, prompt_len - 1: prompt_len + cont_len]
        hidden, kv, cache, cos, sin = large_pass(large, ctx, hid_need, kv_need)
        true_kv = [cache_kv(cache, i) for i in range(L)]
        lg = logits_with_kv(large, block, true_kv)
        nll_true = float(F.cross_entropy(lg[:-1], block[0, 1:], reduction="sum"))
        ref = greedy(large, block[:, :1], true_kv, agree_tokens)
        forced = torch.cat([block[:, :1], ref[:-1].view(1, -1)], dim=1)
        ev.append(dict(corpus=corpus, document=name, offset=s_.offset, overlap=ov, hidden=hidden, kv=kv, true_kv=true_kv, cos=cos, sin=sin,
                       block=block, nll_true=nll_true, ref=ref, forced=forced))
    return ev


def _scored(large, e: dict, mp, n: int, tag: dict, L: int, H: int, D: int, exact_prefix: int, cont_len: int) -> dict:
    """One evaluation sequence with layers n.. mapped by `mp`: its NLL beside the true cache's, top-1 agreement."""
    sp = small_view(e["hidden"], e["kv"], n, e["cos"], e["sin"])
    kvs = list(e["true_kv"][:n])
    T = e["cos"].shape[2]
    feats = {}
    for l_ in range(n, L):
        keys = mp.keys(l_)
        if keys not in feats:
            feats[keys] = mp.project(sp.features(keys), l_)
        kp, v = mp.predict(feats[keys], l_)
        kp = kp.view(T, H, D).transpose(0, 1).unsqueeze(0)
        kvs.append((rotate(kp, e["cos"], e["sin"]), v.view(T, H, D).transpose(0, 1).unsqueeze(0)))
    if exact_prefix:   # the first k positions the large model's own (transfer.mapped_kv's exact_prefix)
        k = exact_prefix
        kvs[n:] = [tuple(torch.cat([t[:, :, :k], x[:, :, k:]], dim=2) for t, x in zip(e["true_kv"][l_], kv_))
                   for l_, kv_ in zip(range(n, L), kvs[n:])]
    lg = logits_with_kv(large, e["block"], kvs)
    nll = float(F.cross_entropy(lg[:-1], e["block"][0, 1:], reduction="sum"))
    agree = float((logits_with_kv(large, e["forced"], kvs).argmax(-1) == e["ref"]).float().mean())
    return dict(tag, corpus=e["corpus"], document=e["document"], offset=e["offset"],
                calib_overlap_8gram=e["overlap"], n_tokens=cont_len, nll_sum=nll,
                nll_true=e["nll_true"], top1_agree=agree)


def _ablate(score, results: list, ns, ablation_n: int, calib_tiers, superset_ablation: str,
            superset_frontier: str) -> tuple[dict, float, dict]:
    """1. feature sets at the ablation's N; 2. λ per KV head and less calibration text on the best; 3. the
    frontier: the best recipe whose features the frontier superset holds, at every N. Returns the best recipe
    (with its config name), its ppl ratio and the frontier's recipe."""
    full = len(calib_tiers)
    best_name, best_feat, best_val = None, None, math.inf
    sup_ab = set(FeatureSpec.parse(superset_ablation).items)
    for name, feats in FEATURE_CONFIGS:
        if not set(FeatureSpec.parse(feats).items) <= sup_ab:
            continue
        v = score(name, ablation_n, feats)
        if v < best_val:
            best_name, best_feat, best_val = name, feats, v
    # 2. λ per KV head, more calibration text, on the best features
    best = {"features": best_feat, "lambda_per": "layer", "tiers": full}
    v = score(best_name + "|lambda_per_head", ablation_n, best_feat, "head", full, stage="lambda")
    if v < best_val:
        best_val, best["lambda_per"] = v, "head"
    for t in range(1, full):  # less calibration text: what the amount of text buys
        score(best_name + f"|calib_{calib_tiers[t - 1]}", ablation_n, best_feat, best["lambda_per"], t, stage="calibration")
    # 3. the frontier: the best recipe whose features the frontier superset holds, at every N
    sup = set(FeatureSpec.parse(superset_frontier).items)
    front_feat = best_feat if set(FeatureSpec.parse(best_feat).items) <= sup else max(
        (f for _, f in FEATURE_CONFIGS if set(FeatureSpec.parse(f).items) <= sup),
        key=lambda f: -pooled(pd.DataFrame([r for r in results if r["features"] == f and r["small_layers"] == ablation_n]))["ppl_ratio"]
        if any(r["features"] == f for r in results) else -math.inf)
    frontier = {"features": front_feat, "lambda_per": best["lambda_per"], "tiers": full}
    for n in ns:
        score("frontier", n, front_feat, best["lambda_per"], full, stage="frontier")
    return dict(best, config=best_name), best_val, frontier


def _write(results, mappers, out, mapper_dir, ablation_n, meta):
    if mapper_dir:
        mapper_dir.mkdir(parents=True, exist_ok=True)
        for (name, n), mp in mappers.items():
            if name.startswith(("frontier", "rank")) or n == ablation_n:
                mp.save(mapper_dir / f"first{n}-{name.replace('|', '-')}.safetensors")
    df = pd.DataFrame(results)
    summary = summarize(df)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        for name, table in (("ablation_rows.csv", df), ("ablation.csv", summary)):
            with open_replacing(out / name) as f:          # whole, never through a planted link
                table.to_csv(f, index=False)
        write_text(out / "ablation.json", json.dumps(meta, indent=1))
    return df, summary, meta


def pooled(df: pd.DataFrame) -> dict:
    """Pooled perplexity ratio overall and per corpus with 95% intervals over sequences and the per-sequence
    min / max, mean top-1 agreement with its interval (`labkit.stats.intervals`)."""
    return pooled_columns(df)


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    keys = ["stage", "config", "small_layers", "features", "lambda_per", "exact_prefix", "calib_tokens_per_corpus", "feature_dim",
            "rank", "mapped_layers", "mapper_macs_per_token", "r2_val_k_mean", "r2_val_v_mean", "rank_gap_k_mean",
            "rank_gap_v_mean"]
    keys = [k for k in keys if k in df]
    rows = []
    for k, g in df.groupby(keys, sort=False, dropna=False):
        rows.append(dict(zip(keys, k), **pooled(g), n_sequences=len(g),
                         calib_overlap_8gram_max=float(g["calib_overlap_8gram"].max()) if "calib_overlap_8gram" in g else None))
    return pd.DataFrame(rows)


DEFAULTS = {
    'large': "smollm2-135m",
    'ns': "8,10,12,16,20,24",
    'ablation_n': 8,
    'calib_tiers': "8192,32768",
    'n_sequences': 16,
    'eval_seed': EVAL_SEED,
    'val_by': "document",
    'prompt_len': 1025,
    'cont_len': 128,
    'agree_tokens': 32,
    'calib_seq_len': 512,
    'threads': 1,
    'superset_ablation': SUPERSET_ABLATION,
    'superset_frontier': SUPERSET_FRONTIER,
    'frontier_only': "",
    'lambda_grid': ",".join(str(x) for x in GRID),
    'exact_prefix': 1,
    'ranks': "",
    'sums_cache': "",
    'out': None,
    'mapper_dir': str(Path.home() / ".cache" / "labkit" / "xfer" / "ablation"),
}
REQUIRED = ('out',)


def study(**given) -> int:
    """The mapper ablation over feature sets and small-model depths N, into a folder of CSVs (ablation.csv, ablation_rows.csv, ablation.json). Keywords: DEFAULTS' names (REQUIRED ones must be given); one BadInput line on an unknown or missing one."""
    a = keywords(given, DEFAULTS, REQUIRED, __name__)
    torch.set_num_threads(a.threads)
    _, summary, meta = run(a.large, tuple(int(x) for x in a.ns.split(",")), a.ablation_n,
                           calib_tiers=tuple(int(x) for x in a.calib_tiers.split(",")), n_sequences=a.n_sequences,
                           prompt_len=a.prompt_len, cont_len=a.cont_len, agree_tokens=a.agree_tokens,
                           calib_seq_len=a.calib_seq_len, out=Path(a.out),
                           mapper_dir=Path(a.mapper_dir) if a.mapper_dir else None,
                           log=lambda m: print(time.strftime("%H:%M:%S"), m, flush=True),
                           superset_ablation=a.superset_ablation, superset_frontier=a.superset_frontier,
                           sums_cache=Path(a.sums_cache) if a.sums_cache else None, frontier_only=a.frontier_only,
                           ranks=tuple(int(x) for x in a.ranks.split(",") if x),
                           grid=tuple(float(x) for x in a.lambda_grid.split(",")), exact_prefix=a.exact_prefix,
                           eval_seed=a.eval_seed, val_by=a.val_by)
    print(summary.to_string())
    print(json.dumps(meta.get("best") or meta.get("frontier_recipe")))
    return 0
