"""The measuring code of `labkit run quality` (its SPEC: `labkit.experiments.quality`): one call from the notebook or `labkit run quality` to a run folder.

Parameters (same names in `notebooks/quality.ipynb`'s `parameters` cell and `labkit run quality -p`):
see `SPEC`. Steps, each writing into the run folder as it goes:

1. validate everything (one line on bad input, nothing loaded yet), load the model;
2. draw `n_sequences` evaluation sequences per corpus from its *eval* split with `seed`
   (`corpora.draw_sequences`) -> `sequences.parquet` (corpus, document, start token, unit); the split
   rule and document counts -> the manifest's `splits`;
3. calibrate what the policies need on the *calibration* split: the indexer projections (one fit over
   the calibration text of every corpus of the run) and the retrieval heads (mid-context attention
   share per head) -> `head_share.parquet` (split column), `retrieval_heads.parquet`;
4. the table: per evaluation sequence and `protocol`, dense prefill (`dense_prefill`) or sparse prefill under
   the same selection (`sparse_prefill`) + sparse decode of the last `eval_tokens` tokens per (policy, budget)
   at granularity `block`, and per (policy, block_budget) at each of `block_variants`, against one dense
   reference per sequence -> one `metrics.parquet` row each (DESIGN columns + corpus, document, start,
   protocol, policy, budget, block, selection, nll_sum, nll_dense, n_tokens, ppl, ppl_dense, ppl_ratio,
   mass_recall, oracle_overlap, indexer_recall; sparse prefill adds prefill_mass_recall,
   prefill_oracle_overlap, prefill_seconds); `quality_summary.parquet` per (corpus, protocol, policy, block,
   budget): pooled perplexity ratio and recalls with 95% bootstrap intervals over sequences (`x`, `x_lo`,
   `x_hi`, `x_n`);
5. the eval-split head map -> `head_share.parquet` (split=eval);
6. selection traces from greedy decoding after a `trace_prompt_len`-token prompt of each corpus
   per (trace policy, trace budget) -> `traces/<corpus>-<policy>-<budget>.npz`,
   `locality.parquet` (per step and layer), `locality_summary.parquet`, `reuse_distance.parquet`.
"""

from __future__ import annotations

import time

import pandas as pd
import torch

from labkit import stats, sweep
from labkit.models import ModelNotFound, load_model, resolve as resolve_model
from labkit.params import BadInput, fill_auto, resolve_device
from labkit.quality.corpora import SPLIT_RULE, documents, draw_sequences, sequences
from labkit.quality.evaluate import head_share_map, prepare_policies, quality_sweep, summarize, validate
from labkit.quality.sparse import SHARED_POLICIES
from labkit.quality.traces import locality, locality_summary, record_traces, reuse_distance, save_trace
from labkit.stats import Interval
from labkit.telemetry import Sampler

from . import QualityPlan

EXPERIMENT = "quality"



def check(given: dict, declared: list) -> QualityPlan:
    """Decide the "auto" ones for this device (`declared`: the experiment's SPEC, handed over by its plan) and
    check what the SPEC cannot declare; raises BadInput (one line) before anything is loaded. Returns the plan."""
    p = dict(given)
    dev = resolve_device(p["device"])
    p["device"] = str(dev)
    fill_auto(declared, p, dev.type)      # dtype for this device; then the declared bounds and choices
    plan = QualityPlan.from_params(p)
    try:
        validate(list(plan.corpora), list(plan.budgets), list(plan.policies), plan.seq_len, plan.n_sequences,
                 plan.eval_tokens, plan.seed, list(plan.block_variants), list(plan.block_budgets),
                 list(plan.protocol))
        resolve_model(plan.model)
    except (ValueError, ModelNotFound) as ex:
        raise BadInput(str(ex)) from None
    bad = [x for x in plan.trace_policies if x not in SHARED_POLICIES]
    if bad:
        raise BadInput(f"trace_policies must be layer-shared ({', '.join(SHARED_POLICIES)}), got {bad[0]!r}")
    if plan.trace_steps and not (max(plan.trace_budgets or [1]) < plan.trace_prompt_len <= 8192 - plan.trace_steps):
        raise BadInput(f"trace_prompt_len must exceed the trace budgets and leave room for trace_steps in 8192, "
                       f"got {plan.trace_prompt_len}")
    if any(b % plan.block for b in plan.budgets):
        raise BadInput(f"block must divide every budget, got block {plan.block}")
    if plan.block_variants and not plan.block_budgets:
        raise BadInput("block_variants need block_budgets to measure them at")
    return plan


def run_quality(plan: QualityPlan, run=None, log=print):
    """Measure a checked plan (`experiments.quality.plan`) into a run folder (labkit.results.Run); returns the Run."""
    if run is None:
        run = sweep.open_run(plan.params, EXPERIMENT)
    dev = torch.device(plan.device)
    tel = Sampler(gpus=[dev.index or 0] if dev.type == "cuda" else []).start()
    run.update_manifest(telemetry=tel.reason or "nvml")
    base = {"experiment": EXPERIMENT, "device": plan.device, "gpu_name": run.manifest.get("gpu_name") or "cpu",
            "shape": plan.model, "strategy": None, "concurrency": 1, "repeats": 1}
    t_start = time.perf_counter()
    try:
        if dev.type == "cpu":
            torch.set_num_threads(max(torch.get_num_threads(), 1))
            # OMP_NUM_THREADS=1 is faster on cores other processes share (threads stall at each barrier)
            run.update_manifest(torch_threads=torch.get_num_threads())
        model, tok = load_model(plan.model, dtype=getattr(torch, plan.dtype), device=plan.device)
        cfg = model.config
        run.update_manifest(model_info={"layers": cfg.num_hidden_layers, "q_heads": cfg.num_attention_heads,
                                        "kv_heads": cfg.num_key_value_heads,
                                        "head_dim": getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads),
                                        "dtype": plan.dtype})
        # the evaluation sequences first: a corpus that cannot give n_sequences fails before any compute
        units = _draw_sequences(run, tok, plan)
        ctl, calib_share = _prepare_policies(run, model, tok, plan, log)

        def on_record(row):
            rec = dict(base, **row)
            rec["indexer_recall"] = row.get("oracle_overlap") if row.get("policy") == "indexer" else None
            run.add(rec)

        df = quality_sweep(model, tok, plan.corpora, plan.budgets, plan.policies, plan.seq_len, plan.n_sequences,
                           plan.eval_tokens, controller=ctl, on_record=on_record, log=log, seed=plan.seed,
                           block=plan.block, block_variants=plan.block_variants, block_budgets=plan.block_budgets,
                           units=units, progress_bar=log is not None, protocols=plan.protocol)
        qs = summarize(df)
        run.write_table("quality_summary", qs)
        eval_share = head_share_map(model, tok, plan.corpora, plan.seq_len, 1, plan.eval_tokens, "eval",
                                    plan.sink_window, plan.recent_window)
        run.write_table("head_share", pd.concat([calib_share, eval_share], ignore_index=True))

        if plan.trace_steps:
            _record_traces(run, model, tok, ctl, plan, log)
    except BadInput:
        raise
    except Exception as ex:
        sweep.fail_run(run, ex, base)
        raise
    finally:
        tel.stop()
        run.write_table("telemetry", tel.frame())
    run.finish(wall_compute_s=round(time.perf_counter() - t_start, 1))
    sweep.headline(sweep.summary_lines(lambda: closing_lines(qs)), log is not None, EXPERIMENT)
    return run


def _draw_sequences(run, tok, plan: QualityPlan) -> dict:
    """The evaluation sequences of every corpus, drawn by the seed, into `sequences.parquet` and the manifest
    (the split rule, the draw, the intervals' method)."""
    units = {c: draw_sequences(tok, c, plan.seq_len, plan.n_sequences, plan.seed) for c in plan.corpora}
    run.write_table("sequences", pd.DataFrame([dict(u.record(), seed=plan.seed) for c in plan.corpora
                                               for u in units[c]]))
    run.update_manifest(
        splits={c: {"rule": SPLIT_RULE[c], "calibration_documents": len(documents(c, "calibration")),
                    "eval_documents": len(documents(c, "eval")),
                    "eval_units": sorted({u.unit for u in units[c]})} for c in plan.corpora},
        sequence_draw={"seed": plan.seed, "per_corpus": plan.n_sequences, "table": "sequences.parquet",
                       "rule": "first seq_len tokens of eval documents in a seeded order; non-overlapping "
                               "seq_len windows of the long eval documents, drawn by the seed, where a "
                               "corpus has fewer such documents than n_sequences"},
        intervals={"method": "percentile bootstrap over sequences (labkit.stats)", "level": stats.LEVEL,
                   "n_boot": stats.N_BOOT, "seed": stats.BOOT_SEED})
    return units


def _prepare_policies(run, model, tok, plan: QualityPlan, log):
    """The selection controller calibrated on the calibration split (indexer fit, retrieval heads), recorded
    in the run; returns it with the calibration split's head-share map."""
    ctl, calib_share = prepare_policies(model, tok, plan.policies, plan.corpora, plan.seq_len, plan.calib_sequences,
                                        plan.eval_tokens, plan.sink_window, plan.recent_window, log=log)
    ctl.block = plan.block  # calibration ran dense; the sweep and the traces select in blocks
    if calib_share is None:  # retrieval heads still worth reporting
        calib_share = head_share_map(model, tok, plan.corpora, plan.seq_len, plan.calib_sequences, plan.eval_tokens,
                                     "calibration", plan.sink_window, plan.recent_window)
    if ctl.retrieval_heads:
        run.write_table("retrieval_heads", pd.DataFrame(
            [{"layer": k, "head": v} for k, v in sorted(ctl.retrieval_heads.items())]))
    run.update_manifest(indexer={"bytes_per_token": ctl.indexer.bytes_per_token, "rank": ctl.indexer.rank,
                                 "fit": "closed-form rank-64 from query/key second moments on the calibration split",
                                 "calibration_corpora": list(plan.corpora), "calib_sequences": plan.calib_sequences}
                        if ctl.indexer is not None else None)
    return ctl, calib_share


def _record_traces(run, model, tok, ctl, plan: QualityPlan, log) -> None:
    """Greedy decode steps over one eval document per corpus, their selections saved as traces (what the
    engine and the hot cache replay) with their locality and reuse distances."""
    locs, sums, rds = [], [], []
    for corpus in plan.corpora:
        (name, ids), = sequences(tok, corpus, plan.trace_prompt_len, 1, split="eval")
        traces = record_traces(model, ids, plan.trace_policies, plan.trace_budgets, plan.trace_steps,
                               controller=ctl, meta={"model": plan.model, "corpus": corpus, "document": name},
                               log=log)
        for (pol, b), tr in traces.items():
            save_trace(tr, run.path / "traces" / f"{corpus}-{pol}-{b}.npz")
            locs.append(locality(tr).assign(corpus=corpus, policy=pol, budget=b))
            rds.append(reuse_distance(tr).assign(corpus=corpus, policy=pol, budget=b))
        sums.append(locality_summary(traces).assign(corpus=corpus))
    run.write_table("locality", pd.concat(locs, ignore_index=True))
    run.write_table("locality_summary", pd.concat(sums, ignore_index=True))
    run.write_table("reuse_distance", pd.concat(rds, ignore_index=True))


def _with_protocol(summary: pd.DataFrame) -> pd.DataFrame:
    """Summaries from before the sparse-prefill protocol are dense prefill."""
    s = summary.copy()
    s["protocol"] = s["protocol"].fillna("dense_prefill") if "protocol" in s.columns else "dense_prefill"
    return s


def closing_lines(summary: pd.DataFrame) -> list[str]:
    """Perplexity against dense per policy (and protocol, where the run has both) at the smallest and largest
    token-granular budget, the mean over the corpora (the report gives each corpus with its interval)."""
    s = _with_protocol(summary[summary["policy"] != "dense"])
    if "selection" in s:
        s = s[s["selection"].fillna("token") == "token"] if (s["selection"].fillna("token") == "token").any() else s
    both = s["protocol"].nunique() > 1
    lines = []
    for b in sorted({int(s["budget"].min()), int(s["budget"].max())}):
        per = s[s["budget"] == b].groupby(["protocol", "policy"], sort=False)["ppl_ratio"].mean()
        lines.append(f"perplexity / dense at budget {b} (mean over corpora): "
                     + ", ".join(f"{pol}{f' ({pr})' if both else ''} {v:.3f}" for (pr, pol), v in per.items()))
    return lines


def headline(summary: pd.DataFrame, budgets=(256, 2048)) -> pd.DataFrame:
    """ppl_ratio per (corpus, policy, selection, protocol) at the given budgets as `value [lo, hi]` text (n
    sequences in its own column)."""

    s = _with_protocol(summary[summary["budget"].isin(budgets) & (summary["policy"] != "dense")])
    if "selection" not in s.columns:
        s["selection"] = "token"
    if "ppl_ratio_lo" not in s.columns:          # runs from before intervals: the point only
        s["ppl_ratio_lo"] = s["ppl_ratio_hi"] = float("nan")
        s["ppl_ratio_n"] = s["n_sequences"]
    s["text"] = [Interval(v, lo, hi, int(n)).text() for v, lo, hi, n in
                 s[["ppl_ratio", "ppl_ratio_lo", "ppl_ratio_hi", "ppl_ratio_n"]].itertuples(index=False)]
    keys = ["corpus", "policy", "selection", "protocol"]
    t = s.pivot_table(index=keys, columns="budget", values="text", aggfunc="first")
    t.columns = [f"ppl ratio @{b}" for b in t.columns]
    n = s.groupby(keys)["ppl_ratio_n"].min().rename("n")
    return t.join(n).fillna("–")
