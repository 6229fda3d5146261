"""The cross-model experiment's generated tables in docs/cross-model.md (`labkit docs`): quality and TTFT per
number of small-model layers, the N = 10 anomaly, reduced-rank mappers, the full run per backend, TTFT per prompt
length, the mapper ablation, TTFT through vLLM, and modern prose beside Shakespeare. Each reads the committed run
folders it is given: docs/runs.toml names them, labkit/docs binds each block to its function and runs."""
from __future__ import annotations

import json
import math

import pandas as pd

from ...report.summary import md_table as _md
from ...results import REPO, load_run
from ...stats.intervals import paired, pooled, text as interval_text
from .measure import headline


def _xfer_quality_cells(r, corpora=("code", "prose")) -> dict:
    """Ratio cells with their 95% intervals over sequences and n: one cell per corpus, the pooled one, the
    per-sequence spread (`labkit.stats.intervals` columns)."""

    n = " + ".join(str(int(getattr(r, f"ppl_ratio_{c}_n"))) for c in corpora)
    return {**{f"ppl ratio {c} [95%]": interval_text(r, f"ppl_ratio_{c}") for c in corpora},
            "ppl ratio **pooled** [95%]": f"**{interval_text(r, 'ppl_ratio')}**", "n": n,
            "per-sequence min–max": f"{r.ppl_ratio_seq_min:.2f}–{r.ppl_ratio_seq_max:.2f}"}


def _xfer_split_line(run) -> str:
    """What the quality of a run folder was measured on, from its manifest."""
    mf = run.manifest
    q, sp = mf.get("quality", {}), mf.get("split", {})
    ev = sp.get("evaluation", {})
    cal = sp.get("calibration", {})
    per = ", ".join(f"{c} {v['n']}" for c, v in ev.items())
    fit = ", ".join(f"{c} {len(v['fit_documents'])} + {len(v['lambda_documents'])}" for c, v in cal.items())
    return (f"Held-out windows per corpus: {per} (seed {sp.get('eval_seed')}, one window of {q.get('prompt_len')} + "
            f"{q.get('cont_len')} tokens per eval document at a seeded offset, no document or family shared with "
            f"the calibration text; calibration documents fitted on + held out for λ: {fit}); intervals: 95% "
            f"bootstrap over sequences.")


def xfer_frontier_table(folder: str) -> str:
    """Quality (fitted mappers, held-out windows, 95% intervals over sequences) beside the TTFT speedup
    (shape-only mappers, 2K) per N."""
    run = load_run(REPO / folder)
    f = run.table("frontier")
    f = f[f["stage"] == "frontier"].sort_values("small_layers")
    rows = [{"N": int(r.small_layers), "mapping MACs / token": f"{r.mapper_macs_per_token / 1e6:.1f} M",
             **_xfer_quality_cells(r), "top-1 [95%]": text_iv(r, "top1_agree"),
             "R² held-out K / V": f"{r.r2_val_k_mean:.3f} / {r.r2_val_v_mean:.3f}",
             f"TTFT speedup at {int(r.context_len) // 1024}K": f"**{r.speedup:.2f}×**",
             "small prefill ms": f"{r.small_prefill_ms:,.0f}", "mapping ms": f"{r.mapping_ms:,.0f}"} for r in f.itertuples()]
    lead = (f"Large model's own prefill + first token at {int(f.context_len.iloc[0]):,} tokens: "
            f"{f.large_ttft_ms.median():,.0f} ms (median of {int(run.metrics.repeats.max())} after a warm-up); "
            f"features d = {int(f.feature_dim.iloc[0]):,}. " + _xfer_split_line(run))
    return lead + "\n\n" + _md(pd.DataFrame(rows))


def text_iv(r, prefix: str) -> str:

    return interval_text(r, prefix)


# Probes the N = 10 run took over from an earlier committed run, by the table they came from (`source`): their
# names in that data are of the day; the docs name them by what they are.
TAKEN_OVER_PROBES = {"results/20261130-xfer-frontier-smollm2-cpu/ablation.parquet": "frontier without exact prefix"}


def probe_label(probe: str, source: str) -> str:
    return TAKEN_OVER_PROBES.get(source, probe)


def xfer_n10_table(folder: str) -> str:
    """The N = 10 anomaly: pooled held-out ppl ratio at N = 8 / 10 / 12 per probe, and the costliest layer of the
    N = 10 mapper from the frontier without exact prefix (attribution: that layer alone mapped, and every layer but it)."""
    run = load_run(REPO / folder)
    pr = run.table("n10_probe")
    rows = []
    for (probe, feats), g in pr.groupby(["probe", "features"], sort=False):
        v = g.set_index("small_layers")
        rows.append({"probe": probe_label(probe, g["source"].iloc[0]), "features": f"`{feats}`", "λ grid": g["lambda_grid"].iloc[0],
                     **{f"N = {n}": (f"**{v.loc[n, 'ppl_ratio']:.3f}**" if n == 10 else f"{v.loc[n, 'ppl_ratio']:.3f}")
                        if n in v.index else "–" for n in (8, 10, 12)}})
    a = run.table("attribution")
    only = a[a["variant"].str.startswith("only:")].sort_values("ppl_ratio", ascending=False)
    worst = only.iloc[0]
    but = a[a["variant"] == f"but:{int(worst.layer)}"].iloc[0]
    allm = a[a["variant"] == "all"].iloc[0]
    lead = (f"Pooled ratios over 12 held-out sequences (6 per corpus, the openings of eval documents; no per-sequence "
            f"rows were kept, so no intervals). The N = 10 mapper of the frontier without exact prefix, one layer at a time (the rest true): layer {int(worst.layer)} "
            f"alone costs {worst.ppl_ratio:.3f} (next: " + ", ".join(f"{int(r.layer)}: {r.ppl_ratio:.3f}" for r in only.iloc[1:4].itertuples())
            + f"); every layer mapped but {int(worst.layer)}: {but.ppl_ratio:.3f} (all mapped: {allm.ppl_ratio:.3f}).")
    return lead + "\n\n" + _md(pd.DataFrame(rows))


def xfer_rank_table(run: str) -> str:
    """Reduced-rank mappers at N = 8: quality (95% intervals over sequences) and the mapping's cost beside the
    full ridge mapper."""
    f = load_run(REPO / run).table("frontier")
    f = f[f["small_layers"] == 8].sort_values("mapper_macs_per_token", ascending=False)
    rows = [{"rank": "full" if not r.rank else int(r.rank), "mapping MACs / token": f"{r.mapper_macs_per_token / 1e6:.2f} M",
             **_xfer_quality_cells(r), "top-1 [95%]": text_iv(r, "top1_agree"),
             "calibration R² gap K / V": "–" if not r.rank else f"{r.rank_gap_k_mean:.4f} / {r.rank_gap_v_mean:.4f}",
             "mapping ms": f"{r.mapping_ms:,.0f}", f"TTFT speedup at {int(r.context_len) // 1024}K": f"**{r.speedup:.2f}×**"}
            for r in f.itertuples()]
    return _md(pd.DataFrame(rows))


def xfer_run_table(folder: str) -> str:
    """The full `labkit run crossmodel` (default features, backend=both): quality per backend and the vLLM path's TTFT
    per length and concurrency (its transformers TTFT shared the CPU with other work: the clean one is
    `xfer_ttft_table`)."""


    run = load_run(REPO / folder)
    m, q = run.metrics, run.table("quality_summary")
    ok = m[(m["kind"] == "ttft") & (m["status"] == "ok") & (m["backend"] == "vllm")]
    rows = []
    for (backend, n, c), g in ok.groupby(["backend", "context_len", "concurrency"]):
        base, mp = g[g["strategy"] == "large_prefill"].iloc[0], g[g["strategy"] == "mapped"].iloc[0]
        rows.append({"backend": backend, "prompt tokens": f"{int(n):,}", "concurrency": int(c),
                     "own prefill ms": f"{base.ttft_ms_median:,.0f}", "mapped path ms": f"{mp.ttft_ms_median:,.0f}",
                     "speedup": f"**{mp.speedup:.2f}×**",
                     "small prefill / mapping / exact prefix ms": "–" if pd.isna(mp.get("small_prefill_ms")) else
                     f"{mp.small_prefill_ms:,.0f} / {mp.mapping_ms:,.0f} / {mp.prefix_ms:,.0f}"})
    h = headline(m, q)
    h = h[h["backend"] == "vllm"]

    seqs = m[(m["kind"] == "quality") & (m["status"] == "ok")]
    qrows = []
    for b, g in q[q["mode"].isin(["true", "mapped"])].groupby("backend", sort=False):
        tr, mp = g[g["mode"] == "true"], g[g["mode"] == "mapped"]
        ppl = lambda x: math.exp(x["nll_sum"].sum() / x["n_tokens"].sum())  # noqa: E731
        pr = paired(seqs[seqs["backend"] == b])
        iv = pd.Series(pooled(pr[pr["mode"] == "mapped"]))
        qrows.append({"backend": b, "true-cache ppl": f"{ppl(tr):.6f}", "mapped-cache ppl": f"{ppl(mp):.6f}",
                      **_xfer_quality_cells(iv), "top-1 [95%]": text_iv(iv, "top1_agree")})
    head = "; ".join(f"{r.backend}: **{r.speedup:.2f}×** at {int(r.prompt_tokens):,} tokens (c = 1), ppl ratio "
                     f"{r.ppl_ratio:.3f}, top-1 {r.top1_agree:.3f}" for r in h.itertuples())
    return "Headline — " + head + ".\n\n" + _md(pd.DataFrame(qrows)) + "\n\n" + _md(pd.DataFrame(rows))


def xfer_ttft_table(folders: list[str]) -> str:
    """TTFT per prompt length of the full and the rank-512 mapper (fitted, exact prefix), transformers path and,
    at 8K, through vLLM."""
    rows = []
    for run_dir in folders:
        if not (REPO / run_dir).is_dir():
            continue
        m = load_run(REPO / run_dir).metrics
        if "kind" not in m:
            continue
        t = m[(m["kind"] == "ttft") & (m["strategy"] == "mapped")].sort_values(["backend", "context_len", "rank"])
        for r in t.itertuples():
            rows.append({"backend": r.backend, "prompt tokens": f"{int(r.context_len):,}", "concurrency": int(r.concurrency),
                         "mapper": "full" if not r.rank else f"rank {int(r.rank)}",
                         "own prefill ms": f"{r.ttft_ms_median * r.speedup:,.0f}", "mapped path ms": f"{r.ttft_ms_median:,.0f}",
                         "speedup": f"**{r.speedup:.2f}×**", "small prefill / mapping / exact prefix ms":
                         f"{r.small_prefill_ms:,.0f} / {r.mapping_ms:,.0f} / {r.prefix_ms:,.0f}"})
    return _md(pd.DataFrame(rows))


def xfer_ablation_table(folder: str) -> str:
    """The mapper ablation at N = 8: features, lambda granularity and calibration size against quality."""

    a = pd.read_parquet(REPO / folder / "ablation.parquet")
    a = a[a["stage"] != "frontier"]
    seqs = pd.read_parquet(REPO / folder / "ablation_rows.parquet")
    per_corpus = json.loads((REPO / folder / "ablation.json").read_text())["n_sequences"]
    rows = []
    for r in a.itertuples():
        g = seqs[(seqs["stage"] == r.stage) & (seqs["config"] == r.config)]
        if g.empty:   # this run kept per-sequence rows for its frontier only: the pooled figures, no interval
            cells = {"ppl ratio code / prose / **pooled**": f"{r.ppl_ratio_code:.3f} / {r.ppl_ratio_prose:.3f} / "
                     f"**{r.ppl_ratio:.3f}**", "n": f"{per_corpus} + {per_corpus}", "top-1 (pooled)": f"{r.top1_agree:.3f}"}
        else:
            iv = pd.Series(pooled(g))
            cells = {**_xfer_quality_cells(iv), "top-1 (pooled)": text_iv(iv, "top1_agree")}
        rows.append({"stage": r.stage, "config": r.config, "features": f"`{r.features}`", "λ per": r.lambda_per,
                     "calib tokens / corpus": f"{int(r.calib_tokens_per_corpus):,}", "d": f"{int(r.feature_dim):,}", **cells})
    return _md(pd.DataFrame(rows))


def xfer_vllm_ttft_table(run: str) -> str:
    """TTFT through the CPU vLLM server, the large model's own prefill against the mapped path, with its stages."""
    m = load_run(REPO / run).metrics
    m = m[(m["kind"] == "ttft") & (m["status"] == "ok")]
    rows = []
    for n, g in m.groupby("context_len"):
        base, mp = g[g["strategy"] == "large_prefill"].iloc[0], g[g["strategy"] == "mapped"].iloc[0]
        rows.append({"prompt tokens": f"{int(n):,}", "vLLM's own prefill ms": f"{base.ttft_ms_median:,.0f}",
                     "mapped path ms": f"{mp.ttft_ms_median:,.0f}", "speedup": f"{mp.speedup:.2f}",
                     "small prefill": f"{mp.small_prefill_ms:,.0f}", "mapping": f"{mp.mapping_ms:,.0f}",
                     "/dev/shm write": f"{mp.write_ms:,.0f}", "engine (load + last token)": f"{mp.engine_ms:,.0f}"})
    return _md(pd.DataFrame(rows))


def xfer_prose_table(folder: str) -> str:
    """Quality per corpus of one run: modern English prose (Python's documentation topics) beside Shakespeare,
    the same mapper and protocol, 95% intervals over sequences."""

    run = load_run(REPO / folder)
    s = run.table("quality_summary")
    p = run.manifest.get("parameters", {})
    names = {"prose": "Shakespeare (prose)", "pydoc": "Python's documentation topics (pydoc)", "code": "CPython stdlib (code)"}
    rows = []
    for r in s[s["mode"] == "mapped"].itertuples():
        tr = s[(s["corpus"] == r.corpus) & (s["mode"] == "true")].iloc[0]
        rows.append({"corpus": names.get(r.corpus, r.corpus), "small model": p.get("small", ""),
                     "true-cache ppl": f"{tr.ppl:.2f}", "mapped-cache ppl": f"{r.ppl:.2f}",
                     "ppl ratio [95%]": f"**{interval_text(r, 'ppl_ratio')}**", "top-1 [95%]": interval_text(r, "top1_agree"),
                     "n": int(r.n_sequences)})
    return _md(pd.DataFrame(rows))
