"""Markdown tables of cross-model transfer run folders for the docs (generated, never typed)."""

from __future__ import annotations

import pandas as pd



def _fmt(x, nd=3):
    return "–" if x is None or (isinstance(x, float) and pd.isna(x)) else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def quality_table(run) -> str:
    s = run.table("quality_summary")
    if s.empty:
        return ""
    if "backend" not in s:
        s["backend"] = "transformers"
    lines = ["| backend | corpus | mode | ppl | ppl ratio | top-1 agreement | tokens |", "|---|---|---|---|---|---|---|"]
    for r in s.sort_values(["backend", "corpus", "mode"]).itertuples():
        lines.append(f"| {r.backend} | {r.corpus} | {r.mode} | {r.ppl:.3f} | {r.ppl_ratio:.3f} | {r.top1_agree:.3f} | {r.n_tokens} |")
    return "\n".join(lines)


def ttft_table(run) -> str:
    m = run.metrics
    if "kind" not in m:
        return ""
    t = m[(m["kind"] == "ttft") & (m["status"] == "ok")]
    if t.empty:
        return ""
    lines = ["| backend | c | prompt tokens | large prefill TTFT ms (min–max) | mapped TTFT ms (min–max) | speedup |",
             "|---|---|---|---|---|---|"]
    for (b, c, n), g in t.groupby(["backend", "concurrency", "context_len"]):
        g = g.set_index("strategy")
        if not {"large_prefill", "mapped"} <= set(g.index):
            continue
        a, mm = g.loc["large_prefill"], g.loc["mapped"]
        lines.append(f"| {b} | {c} | {n} | {a.ttft_ms_median:.0f} ({a.ttft_ms_min:.0f}–{a.ttft_ms_max:.0f}) | "
                     f"{mm.ttft_ms_median:.0f} ({mm.ttft_ms_min:.0f}–{mm.ttft_ms_max:.0f}) | {mm.speedup:.2f} |")
    return "\n".join(lines)


def r2_line(run) -> str:
    r2 = run.table("r2")
    if r2.empty:
        return ""
    g = r2.groupby("part")["r2"]
    return ", ".join(f"{p}: mean {g.mean()[p]:.3f} (min {g.min()[p]:.3f}, max {g.max()[p]:.3f})" for p in g.mean().index)


def ablation_table(run) -> str:
    a = run.table("ablation")
    if a.empty:
        return ""
    lines = ["| stage | config | N | features | λ per | calib tok/corpus | d | ppl ratio (code / prose / pooled) | top-1 (code / prose) | R² val K / V |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in a.itertuples():
        lines.append(f"| {r.stage} | {r.config} | {r.small_layers} | `{r.features}` | {r.lambda_per} | {r.calib_tokens_per_corpus} | "
                     f"{r.feature_dim} | {r.ppl_ratio_code:.3f} / {r.ppl_ratio_prose:.3f} / **{r.ppl_ratio:.3f}** | "
                     f"{r.top1_agree_code:.3f} / {r.top1_agree_prose:.3f} | {r.r2_val_k_mean:.3f} / {r.r2_val_v_mean:.3f} |")
    return "\n".join(lines)


def frontier_table(run) -> str:
    f = run.table("frontier")
    if f.empty:
        return ""
    lines = ["| prompt tokens | N | ppl ratio (pooled) | top-1 | TTFT speedup | large prefill ms | mapped ms | small prefill ms | mapping ms | shm write+read ms | last token ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in f.sort_values(["context_len", "small_layers"]).itertuples():
        lines.append(f"| {r.context_len} | {r.small_layers} | {_fmt(r.ppl_ratio)} | {_fmt(r.top1_agree)} | {r.speedup:.2f} | "
                     f"{r.large_ttft_ms:.0f} | {r.ttft_ms_median:.0f} | {r.small_prefill_ms:.0f} | {r.mapping_ms:.0f} | "
                     f"{r.write_ms + r.read_ms:.0f} | {r.decode_first_ms:.0f} |")
    return "\n".join(lines)
