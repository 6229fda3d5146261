"""The measuring code of `labkit run crossmodel` (once `xfer`; its SPEC: `labkit.experiments.crossmodel`) and
`notebooks/crossmodel.ipynb` (same parameter names), over the cross-model library `labkit.crossmodel`.

Steps, each writing into the run folder as it goes:

1. validate everything (one line on bad input, nothing loaded or written): the pair (tokenizers, layer
   table), features, a given mapper file's models, prompt lengths against the context, /dev/shm space;
2. the mapper: load `mapper` (a path) or the cached fit for these parameters
   (`$LABKIT_CACHE/xfer/<key>.safetensors`), else fit on the corpora's calibration split and cache it
   (mapper files are large: never in a run folder); held-out calibration R² and λ -> `mapper_fit.parquet`;
3. quality in plain transformers on `n_sequences` evaluation windows per corpus drawn by `eval_seed` from
   documents whose family the calibration never read (`labkit.crossmodel.heldout`; the split goes into the
   manifest): per (corpus, sequence, mode) summed NLL of the real continuation, ratio to the true cache,
   top-1 agreement -> `metrics.parquet` rows (kind=quality); per (corpus, mode) and pooled ratios with 95%
   intervals over sequences -> `quality_summary.parquet`, `quality_pooled.parquet`; per-layer R² on
   eval text -> `r2.parquet`;
4. TTFT, transformers backend: the large model's own prefill + first token against the producer path
   (small prefill + mapping + /dev/shm write + read into a cache + the large model's last-token
   forward), per prompt length, warm-up then `repeats` -> rows kind=ttft with the stage breakdown;
5. with `backend` including vllm: the same comparison through a vLLM server with the labkit connector
   (`labkit.crossmodel.vllm_path`), at each concurrency, and the vLLM path's perplexity.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import pandas as pd
import torch

from labkit import sweep
from labkit.crossmodel import heldout, shm
from labkit.crossmodel import quality as q
from labkit.crossmodel.features import FeatureSpec
from labkit.crossmodel.heldout import eval_documents
from labkit.crossmodel.mapped_cache import EXACT_PREFIX, MODES, calibration_chunks, fit_mapper, load_models
from labkit.crossmodel.mapper import Mapper, check_compatible, read_metadata
from labkit.crossmodel.pair import PairError, plan_pair
from labkit.crossmodel.producer import Producer
from labkit.crossmodel.ttft import large_ttft_once, mapped_ttft_once, ttft_rows
from labkit.crossmodel.vllm_path import run_vllm
from labkit.models.loader import cache_dir
from labkit.params import BadInput, one_line
from labkit.quality.corpora import sequences
from labkit.results import load_run
from . import CrossmodelPlan, seeded

EXPERIMENT = "crossmodel"



def check(given: dict) -> CrossmodelPlan:
    """Validate resolved parameters (`experiments.crossmodel`); raises BadInput (one line) before anything is loaded
    or written. Returns the plan (nothing here is "auto"); weights other than checkpoint are `seeded.check`'s."""
    if given["weights"] != "checkpoint":
        return seeded.check(given)
    p = dict(given)
    try:
        pair = plan_pair(p["large"], p["small"], p["layer_table"] or None, derive=False)
        feats = FeatureSpec.parse(p["features"])
        for layer in pair.table.mapped_layers:
            feats.keys(layer, pair.table, pair.small.layers)
        if p["mapper"]:
            if not Path(p["mapper"]).is_file():
                raise BadInput(f"mapper file {p['mapper']} does not exist")
            check_compatible(read_metadata(p["mapper"]), pair, p["mapper"])
    except PairError as ex:
        raise BadInput(str(ex)) from None
    if p["exact_prefix"] < 0:
        raise BadInput(f"exact_prefix must be >= 0, got {p['exact_prefix']}")
    if p["rank"] < 0:
        raise BadInput(f"rank must be >= 0 (0: full ridge), got {p['rank']}")
    if p["rope"] not in ("pre", "post"):
        raise BadInput(f"rope must be pre or post, got {p['rope']!r}")
    if p["backend"] not in ("transformers", "vllm", "both"):
        raise BadInput(f"backend must be transformers, vllm or both, got {p['backend']!r}")
    if p["dtype"] not in ("float32", "bfloat16"):
        raise BadInput(f"dtype must be float32 or bfloat16, got {p['dtype']!r}")
    bad = [m for m in p["modes"] if m not in MODES]
    if bad:
        raise BadInput(f"unknown mode {bad[0]!r}: choose from {', '.join(MODES)}")
    cfg = json.loads((Path(pair.large.path) / "config.json").read_text())
    ctx = int(cfg.get("max_position_embeddings", 8192))
    if not 2 <= p["prompt_len"] or p["prompt_len"] + p["cont_len"] > ctx:
        raise BadInput(f"prompt_len + cont_len must fit the large model's context of {ctx}, got "
                       f"{p['prompt_len']} + {p['cont_len']}")
    if not 1 <= p["agree_tokens"] <= p["cont_len"]:
        raise BadInput(f"agree_tokens must be in [1, cont_len={p['cont_len']}]")
    for n in p["ttft_lens"]:
        if not 2 <= n <= ctx - 1:
            raise BadInput(f"ttft_lens: {n} tokens does not fit the large model's context of {ctx} (leave 1 to decode)")
    if any(c < 1 for c in p["concurrency"]) or p["repeats"] < 1 or p["n_sequences"] < 1:
        raise BadInput("concurrency, repeats and n_sequences must be >= 1")
    if p["calib_seq_len"] < 16 or p["calib_tokens"] < p["calib_seq_len"]:
        raise BadInput("calib_seq_len must be >= 16 and calib_tokens >= calib_seq_len")
    if p["calib_val"] not in ("document", "chunk"):
        raise BadInput(f"calib_val must be document or chunk, got {p['calib_val']!r}")
    if p["eval_seed"] < 0:
        raise BadInput(f"eval_seed must be >= 0, got {p['eval_seed']}")
    for c in p["corpora"]:
        try:
            have = len(eval_documents(c))
        except ValueError as ex:   # an unknown corpus, or its texts not installed
            raise BadInput(one_line(ex)) from None
        if have < p["n_sequences"]:
            raise BadInput(f"n_sequences={p['n_sequences']}: corpus {c!r} has {have} evaluation documents outside "
                           f"the calibration's families")
    if p["ttft_lens"]:
        root = shm.default_root()
        need = shm.expected_bytes(pair.large.layers, max(p["ttft_lens"]), pair.large.kv_heads, pair.large.head_dim)
        need *= max(p["concurrency"]) if p["backend"] != "transformers" else 1
        try:
            shm.check_space(root, need)
        except shm.ShmError as ex:
            raise BadInput(str(ex)) from None
    # the pair checked here is not kept in the plan: the models stage plans it again, deriving the small model
    return CrossmodelPlan.from_params(p)


def mapper_cache_path(plan: CrossmodelPlan, pair) -> Path:
    """Where the fit for these parameters and models is cached: the key hashes what the fit depends on, so a
    mapper fitted before keeps its file (the corpora a JSON list either way, from the plan's tuple)."""
    key = json.dumps({"features": plan.features, "rope": plan.rope, "calib_tokens": plan.calib_tokens,
                      "calib_seq_len": plan.calib_seq_len, "corpora": plan.corpora, "layer_table": plan.layer_table}
                     | {"large": pair.large.fingerprint, "small": pair.small.fingerprint}
                     | ({"rank": plan.rank} if plan.rank else {})   # full-rank keys as before
                     | ({"calib_val": plan.calib_val} if plan.calib_val != "chunk" else {}),  # chunk: as before
                     sort_keys=True)
    return cache_dir().parent / "xfer" / f"{pair.large.name.replace('/', '_')}-{plan.small.replace(':', '')}-" \
        f"{hashlib.sha256(key.encode()).hexdigest()[:12]}.safetensors"


def get_mapper(plan: CrossmodelPlan, models, log=print, calib=None):
    """The mapper file `plan.mapper`, else the cached fit for this plan, else a fit on `calib` (or the plan's
    calibration chunks) saved to the cache: (mapper, its path, whether it was fitted now)."""
    pair = models.pair
    path = Path(plan.mapper) if plan.mapper else mapper_cache_path(plan, pair)
    if path.is_file():
        log(f"mapper: {path}")
        return Mapper.load(path, expect=pair), path, False
    calib = calib or calibration_chunks(models.tokenizer, plan.corpora, plan.calib_seq_len, plan.calib_tokens,
                                        val_by=plan.calib_val)
    log(f"fitting the mapper on {len(calib)} calibration chunks of {plan.calib_seq_len} tokens")
    mp = fit_mapper(models, FeatureSpec.parse(plan.features), calib, rope=plan.rope, log=log, rank=plan.rank)
    mp.save(path)
    log(f"mapper saved: {path} ({path.stat().st_size / 2**20:.0f} MiB)")
    return mp, path, True


@torch.no_grad()
def ttft_transformers(models, mapper, tokenizer, lens, repeats: int, root: Path, log=print,
                      exact_prefix: int = EXACT_PREFIX) -> list[dict]:
    """Per prompt length: the large model's prefill + first token vs the producer path, in-process."""

    prod = Producer(models, mapper, root, dtype=next(models.large.parameters()).dtype, exact_prefix=exact_prefix)
    rows = []
    docs = {n: sequences(tokenizer, "prose", n, repeats + 1, split="eval") for n in lens}
    for n in lens:
        t_large, t_map, parts, eq = [], [], [], []
        for r in range(repeats + 1):
            ids = docs[n][r % len(docs[n])][1].view(1, -1)
            tl, first_true = large_ttft_once(models.large, ids)
            tm, part, first_mapped = mapped_ttft_once(prod, models, ids)
            if r == 0:
                continue  # warm-up
            t_large.append(tl)
            t_map.append(tm)
            parts.append(part)
            eq.append(first_true == first_mapped)
        rows += ttft_rows(n, t_large, t_map, parts, eq, prod.bytes_for(n - 1))
        if log:
            log(f"TTFT transformers {n} tokens: large {rows[-2]['ttft_ms_median']:.0f} ms, mapped "
                f"{rows[-1]['ttft_ms_median']:.0f} ms ({rows[-1]['speedup']:.2f}x)")
    return rows


def run_crossmodel(plan: CrossmodelPlan, run=None, log=print):
    """Measure everything into a run folder (labkit.results.Run); returns the Run."""
    shown = log is not None
    log = log or (lambda *a, **k: None)
    if run is None:
        run = sweep.open_run(plan.params, EXPERIMENT)      # the manifest records the plan as a dict
    ttft_in_process = bool(plan.ttft_lens) and plan.backend in ("transformers", "both")     # transformers' TTFT
    through_vllm = plan.backend in ("vllm", "both")
    stages = ["models", "mapper", "quality"] + ["ttft"] * ttft_in_process + ["vllm"] * through_vllm
    bar = sweep.bar(len(stages), EXPERIMENT, shown)

    def stage(name: str) -> None:       # the bar says which part of the run is under way
        if bar.n < len(stages) and name != "models":
            bar.update()
        bar.set_postfix_str(name)
    base = {"experiment": EXPERIMENT, "device": "cpu", "gpu_name": "cpu", "shape": plan.large}
    t_start = time.perf_counter()
    try:
        stage("models")
        models, calib, seqs = _models_and_texts(plan, run)
        stage("mapper")
        mp, mpath, fitted = get_mapper(plan, models, log=log, calib=calib)
        _record_mapper(run, mp, mpath, fitted, calib)

        def on_row(row):
            run.add(dict(base, kind="quality", backend="transformers", strategy=row["mode"], status="ok", error=None,
                         context_len=row["prompt_len"], concurrency=1, repeats=1, **row))

        stage("quality")
        df, r2 = q.evaluate(models, mp, seqs, plan.prompt_len, plan.cont_len, plan.agree_tokens, plan.modes,
                            on_row=on_row, log=log, exact_prefix=plan.exact_prefix)
        run.write_table("quality_summary", q.summarize(df).assign(backend="transformers"))
        run.write_table("quality_pooled", q.pooled(df).assign(backend="transformers"))
        run.write_table("r2", r2)
        if ttft_in_process:
            stage("ttft")
            for row in ttft_transformers(models, mp, models.tokenizer, plan.ttft_lens, plan.repeats,
                                         shm.default_root(), log=log, exact_prefix=plan.exact_prefix):
                run.add(dict(base, status="ok", error=None, **row))
        if through_vllm:
            stage("vllm")
            run_vllm(models, mp, mpath, seqs, run, base, prompt_len=plan.prompt_len, cont_len=plan.cont_len,
                     agree_tokens=plan.agree_tokens, ttft_lens=plan.ttft_lens, concurrency=plan.concurrency,
                     repeats=plan.repeats, exact_prefix=plan.exact_prefix, log=log)
    except BadInput:
        raise
    except Exception as ex:
        sweep.fail_run(run, ex, base)
        raise
    finally:
        bar.update(len(stages) - bar.n)
        bar.close()
    run.finish(wall_compute_s=round(time.perf_counter() - t_start, 1))
    sweep.headline(sweep.summary_lines(lambda: closing_lines(run)), shown, EXPERIMENT)
    return run


def _models_and_texts(plan: CrossmodelPlan, run):
    """The pair's models, the calibration chunks and the held-out evaluation sequences (disjoint by document and
    family), recorded in the manifest."""
    pair = plan_pair(plan.large, plan.small, plan.layer_table or None, derive=True)
    models = load_models(pair, dtype=getattr(torch, plan.dtype))
    run.update_manifest(pair=pair.to_dict(), small_note=(
        f"small model = the large model's first {pair.shared_layers} layers + final norm + head (no training); "
        f"layers 0..{pair.shared_layers - 1} are copied exactly, {pair.shared_layers}..{pair.large.layers - 1} mapped")
        if pair.shared_layers else "")
    calib = calibration_chunks(models.tokenizer, plan.corpora, plan.calib_seq_len, plan.calib_tokens,
                               val_by=plan.calib_val)
    seqs = q.eval_sequences(models.tokenizer, plan.corpora, plan.prompt_len + plan.cont_len, plan.n_sequences,
                            seed=plan.eval_seed)
    heldout.check_disjoint(calib, seqs)   # no evaluation window from a calibration document or family
    run.update_manifest(split=heldout.split_record(calib, seqs, plan.eval_seed, heldout.overlap(calib, seqs)))
    return models, calib, seqs


def _record_mapper(run, mp, mpath, fitted: bool, calib) -> None:
    """What the mapper is and how it was fitted, into the manifest and the `mapper_fit` table."""
    sha = heldout.calib_sha(calib)
    run.update_manifest(split=dict(run.manifest["split"], mapper_fitted_on_this_calibration=all(
        (mp.corpus or {}).get(k) == v for k, v in sha.items())))
    run.update_manifest(mapper={"path": str(mpath), "bytes": mpath.stat().st_size, "fitted_in_this_run": fitted,
                                "features": str(mp.features), "rope": mp.rope, "rank": mp.rank,
                                "macs_per_token": mp.macs_per_token(), "corpus": mp.corpus})
    run.write_table("mapper_fit", pd.DataFrame(
        [{"layer": l_, "lambda_k": mp.lambda_kv(l_)[0], "lambda_v": mp.lambda_kv(l_)[1], "r2_val_k": mp.r2_val[l_][0],
          "r2_val_v": mp.r2_val[l_][1]} for l_ in sorted(mp.weights)]))


def closing_lines(run) -> list[str]:
    """Per backend: quality against the large model's own prefill and TTFT against it at the longest prompt."""
    lr = load_run(run.path)
    lines = []
    for r in headline(lr.metrics, lr.table("quality_summary")).to_dict("records"):
        lines.append(f"{r['backend']}: mapped KV perplexity {r['ppl_ratio']:.3f}x the true cache's, top-1 agreement "
                     f"{r['top1_agree']:.2f}; TTFT at {r['prompt_tokens']} tokens {r['ttft_mapped_ms']:.0f} ms "
                     f"({r['speedup']:.2f}x faster than the large model prefilling the prompt itself)")
    if not lines:        # no TTFT measured: the quality alone
        s = lr.table("quality_summary")
        s = s[s["mode"] != "true"] if "mode" in s else s
        lines.append("perplexity vs the true cache: " + ", ".join(
            f"{m}: top-1 agreement {g['top1_agree'].mean():.2f}" for m, g in s.groupby("mode", sort=False)))
    return lines


def headline(metrics: pd.DataFrame, summary: pd.DataFrame) -> pd.DataFrame:
    """Per backend: TTFT speedup at the longest prompt (c=1) beside the ppl ratio and top-1 agreement."""
    out = []
    ttft = metrics[(metrics.get("kind") == "ttft") & (metrics["status"] == "ok")] if "kind" in metrics else metrics[:0]
    for backend, g in ttft.groupby("backend"):
        g1 = g[(g["concurrency"] == 1) & (g["strategy"] == "mapped")]
        if g1.empty:
            continue
        top = g1.loc[g1["context_len"].idxmax()]
        s = summary[(summary["mode"] == "mapped") & (summary["backend"] == backend)] if "backend" in summary else summary[:0]
        out.append({"backend": backend, "prompt_tokens": int(top["context_len"]), "speedup": top["speedup"],
                    "ttft_mapped_ms": top["ttft_ms_median"],
                    "ppl_ratio": math.exp(s["nll_sum"].sum() / s["n_tokens"].sum()) /
                    math.exp(summary[(summary["mode"] == "true") & (summary["backend"] == backend)]["nll_sum"].sum() /
                             summary[(summary["mode"] == "true") & (summary["backend"] == backend)]["n_tokens"].sum())
                    if not s.empty else float("nan"),
                    "top1_agree": s["top1_agree"].mean() if not s.empty else float("nan")})
    return pd.DataFrame(out)
