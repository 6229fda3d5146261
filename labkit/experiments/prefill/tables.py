"""The prefill experiment's generated tables in docs/prefill-capacity.md (`labkit docs`): last tokens over a cached
prefix and whole prompts per mode and cap, the whole prompt per engine variant with its anatomy, the prefill
kernels' bench (attention per prefix, the delta rule), QSA's sparse prefill (its bench and whole prompts through
it), and the rotating buffers against resident per process. Each reads the committed run folders it is given:
docs/runs.toml names them, labkit/docs binds each block to its function and runs."""
from __future__ import annotations

import json

import pandas as pd

from ...report.summary import md_table as _md
from ...report.units import tokens_label as _ctx
from ...results import REPO, load_run


def prefill_table(runs: list[str]) -> str:
    """Every prompt of the runs: mode, memory cap, tok/s against resident, time and the device's peak."""
    rows = []
    for run in runs:
        m = load_run(REPO / run).metrics
        for _, r in m.iterrows():
            cap = r.get("mem_cap_bytes")
            rows.append({"prompt": _ctx(r.context_len), "computed (last tokens)": _ctx(r.tail_tokens) if r.get("tail_tokens") else "all",
                         "mode": r["mode"], "cap": f"{cap / 2**30:.0f} GiB" if pd.notna(cap) else "none",
                         "status": r.status, "tok/s": f"{r.tok_s:.0f}" if pd.notna(r.tok_s) else "–",
                         "vs resident": f"{r.vs_resident:.3f}" if pd.notna(r.get("vs_resident")) else "–",
                         "time s": f"{r.step_ms_median / 1e3:.1f}" if pd.notna(r.step_ms_median) else "–",
                         "device peak": f"{r.device_mem_peak_bytes / 2**30:.1f} GiB" if pd.notna(r.get("device_mem_peak_bytes")) else "–"})
    return _md(pd.DataFrame(rows))


def prefill_anatomy_table(run: str) -> str:
    """The whole prompt per engine variant: tok/s against the first variant, the bound, attention's rate, and
    seconds per phase (summed over chunks)."""
    m = load_run(REPO / run).metrics
    m = m[(m["experiment"] == "prefill") & (m["status"] == "ok")]
    first = m[m["mode"] == "resident"]["tok_s"].iloc[0]
    rows = []
    for r in m.to_dict("records"):
        rows.append({"prompt": _ctx(r["context_len"]), "mode": r["mode"], "engine variant": r.get("engine_variant") or "–",
                     "tok/s": f"{r['tok_s']:,.0f}", "vs the first resident": f"{r['tok_s'] / first:.2f}x",
                     "bound tok/s": f"{r['bound_tok_s']:,.0f}",
                     "attention TFLOPS (of GEMM peak)": f"{r['attention_tflops']:.0f} ({r['attention_of_gemm_peak']:.0%})",
                     **{f"{ph} s": f"{r[f'anatomy_{ph}_ms'] / 1e3:.1f}" for ph in ("weights", "deltanet", "attention")},
                     "kv s": f"{(r['anatomy_kv_write_ms'] + r['anatomy_kv_load_ms']) / 1e3:.2f}",
                     "closure": f"{r['anatomy_closure']:.2f}"})
    return _md(pd.DataFrame(rows))


def prefill_kernels_table(run: str) -> str:
    """scripts/prefill_kernels_bench.py's JSON: attention per prefix and the delta rule, against the GEMM peak."""
    r = json.loads((REPO / run / "prefill_kernels.json").read_text())
    peak = r["gemm"]["tflops"]
    rows = [{"kernel": a["kernel"], "keys": _ctx(a["S"]), "ms (min–max)": f"{a['ms_median']:.2f} ({a['ms_min']:.2f}–{a['ms_max']:.2f})",
             "TFLOPS": f"{a['tflops']:.0f}", "of GEMM peak": f"{a['of_gemm_peak']:.0%}"} for a in r["attention"]]
    rows += [{"kernel": d["kernel"], "keys": f"{_ctx(d['T'])} tokens", "ms (min–max)": f"{d['ms_median']:.2f} ({d['ms_min']:.2f}–{d['ms_max']:.2f})",
              "TFLOPS": "–", "of GEMM peak": "–"} for d in r["deltanet"] if "ms_median" in d]
    return f"GEMM peak {peak:.0f} TFLOPS (8192³ bf16, same process)\n\n" + _md(pd.DataFrame(rows))


def sparse_prefill_table(bench: str, bench_before: str, anatomy: str, now: str, sparse: list[str]) -> str:
    """QSA's sparse prefill: the select (beside the same bench before the collect pass moved to wgmma and key
    ranges) and the attention per layer-chunk by prefix, the collect pass's tiles swept at one prefix, then whole
    prompts through it beside the dense prompt of the anatomy run and today's dense one (`now`), seconds per phase.
    `bench`, `bench_before`: scripts/sparse_prefill_bench.py's folders; `sparse`: the runs of whole sparse prompts."""
    b = json.loads((REPO / bench / "sparse_prefill_bench.json").read_text())
    before = json.loads((REPO / bench_before / "sparse_prefill_bench.json").read_text())
    before = {r["S"]: r["select_ms"] for r in before["rows"]}
    ms = lambda v: f"{v:,.1f}" if v is not None else "–"
    rows = [{"prefix": _ctx(r["S"]), "select ms": ms(r["select_ms"]), "before ms": ms(before.get(r["S"])),
             "bound / collect / pick ms": f"{r['bound_ms']:.1f} / {r['collect_ms']:.1f} / {r['pick_ms']:.1f}",
             "keys above the bound, mean / max (cap)": f"{r['above_mean']:,.0f} / {r['above_max']:,.0f} ({r['cap']:,})",
             "exact passes taken": f"{r['fallback_queries']} of {b['T']:,}",
             "exact select ms": ms(r["select_exact_ms"]), "attention ms": ms(r["attention_ms"]),
             "sparse ms": ms(r["sparse_ms"]), "dense ms": ms(r["dense_ms"])} for r in b["rows"]]
    switch = lambda t: ", ".join(f"{k}={v}" for k, v in t.items() if k in ("prefetch", "stages_sampled", "hoist")) or "–"
    tiles = [{"queries x keys a tile": f"{t['bt_sampled']} x {t['bs_sampled']}", "warps": t["warps_sampled"],
              "key ranges": t["splits"], "switches": switch(t), "select ms": f"{t['select_ms']:.1f}",
              "collect ms": f"{t['collect_ms']:.1f}"} for t in b["sweep"]]
    dense = load_run(REPO / anatomy).metrics
    dense = dense[(dense["experiment"] == "prefill") & (dense["status"] == "ok") & (dense["mode"] == "resident")]
    whole = [dense[dense["engine_variant"] == "prefill_attn=split,dn_prefill=fla"]]
    whole += [load_run(REPO / run).metrics for run in [now, *sparse]]
    prompts = []
    for m in whole:
        for r in m[(m["experiment"] == "prefill") & (m["status"] == "ok")].to_dict("records"):
            cap = r.get("mem_cap_bytes")
            cap = cap / 2**30 if cap is not None and pd.notna(cap) else 0
            prompts.append({"prompt": _ctx(r["context_len"]), "attention": r.get("prefill_attention") or "dense",
                            "mode": r["mode"], "cap": f"{cap:.0f} GiB" if cap else "none", "tok/s": f"{r['tok_s']:,.0f}",
                            "time s": f"{r['step_ms_median'] / 1e3:.1f}",
                            "index + select s": f"{(r['anatomy_index_score_ms'] + r['anatomy_selection_ms']) / 1e3:.1f}",
                            **{f"{ph} s": f"{r[f'anatomy_{ph}_ms'] / 1e3:.1f}" for ph in ("weights", "deltanet", "attention")},
                            "device peak": f"{r['device_mem_peak_bytes'] / 2**30:.1f} GiB"})
    return (f"One layer and 8K-token chunk ({b['device']}, k = {b['k']:,}):\n\n" + _md(pd.DataFrame(rows))
            + f"\n\nThe collect pass's tiles at {_ctx(b['sweep'][0]['prefix'])}:\n\n" + _md(pd.DataFrame(tiles))
            + "\n\nWhole prompts:\n\n" + _md(pd.DataFrame(prompts)))


def prefill_rows(runs: list[str]) -> pd.DataFrame:
    """Rotating buffers against resident prefill of the same prompt, one row per process (docs/spreads.md, the
    README's headlines and the claims card take the spread across processes)."""
    out = []
    for i, run in enumerate(runs, 1):
        m = load_run(REPO / run).metrics
        d = m[(m["experiment"] == "prefill") & (m["status"] == "ok")].set_index("mode")
        ctx = int(d["context_len"].max())
        out.append({"figure": f"prefill tok/s, rotating buffers (KV to host RAM) / resident, {ctx >> 10}K prompt",
                    "process": i, "value": d.loc["rotating", "tok_s"] / d.loc["resident", "tok_s"]})
    return pd.DataFrame(out)
