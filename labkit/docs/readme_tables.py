"""The measured tables in README.md and docs/*.md, generated from committed run folders (never typed).

    labkit docs            # print every block
    labkit docs --write    # rewrite every block between its markers, in the file that holds it

A block sits between `<!-- BEGIN generated:NAME -->` and `<!-- END generated:NAME -->` in the one file that
`docs/runs.toml` names for it (`[files]`); the same file names the runs behind every table (`[runs]`). Tests
check that every file holds exactly what this module generates from the committed runs, and that every block
sits in exactly one file.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pandas as pd

from ..costmodel import gpu, gpu_for_name, predict_table
from ..experiments.crossmodel.measure import headline
from ..stats.intervals import paired, pooled, text as interval_text
from ..report import summary as S
from ..experiments.pulse_blocks.figures import QUALITY_POLICY, selection_table as selection_rows
from ..report.targets import TARGETS
from ..report.units import tokens_label as _ctx
from ..results import REPO, load_run
from ..experiments.serve_sweep.figures import crosscheck_table
from ..shapes import metrics_shape
from ..stats import Interval, across_runs, perplexity_ratio
from ..experiments.trace_windows import REFERENCE, first_window_runs, single_window
from .claims import blocks as claims_blocks
from .reference_tables import blocks as reference_blocks
from .roofline_tables import blocks as roofline_blocks
from .roofline_tables import capacity_rows, decode_ratio_rows, gemv_chain, prefill_rows, pulse_rows
from .runs import RUNS, RUNS_FILE, TOML as _TOML    # noqa: F401  (RUNS_FILE: the tests')

BLOCK_FILES: dict[str, str] = {b: f for f, names in _TOML["files"].items() for b in names}

DECODE_RUN, PROBE_RUN, MULTIGPU_RUNS, PREFILL_RUNS = RUNS["decode"], RUNS["probe"], RUNS["multigpu"], RUNS["prefill"]
PULSE_RUNS = {"blocks": RUNS["pulse_blocks"], "scaling": RUNS["pulse_scaling"], "trace": RUNS["pulse_trace"][0]}
PULSE_COALESCED_RUNS, PULSE_TRACE_RUNS = RUNS["pulse_coalesced"], RUNS["pulse_trace"]
PULSE_SWITCH_RUNS = [tuple(x) for x in RUNS["pulse_switch"]]
PULSE_SELECTION_BLOCKS_RUN = RUNS["pulse_selection_blocks"]
PULSE_SCALING_COMPILED_RUNS = [tuple(x) for x in RUNS["pulse_scaling_compiled"]]
QUALITY_BLOCK_RUNS = [tuple(x) for x in RUNS["quality_blocks"]]
QUALITY_RUN = RUNS["quality"]
QUALITY_SPARSE_PREFILL_RUN = RUNS["quality_sparse_prefill"]
DECODE_TRACE_RUNS = [tuple(x) for x in RUNS["decode_trace"]]
CROSSCHECK_RUN, CAPACITY_RUN, HOT_DENSITY_RUN = RUNS["serve_crosscheck"], RUNS["capacity"], RUNS["hot_density"]
HOT_DECODE_RUNS = [tuple(x) for x in RUNS["hot_decode"]]
XFER_FRONTIER_RUN, XFER_RANK_RUN, XFER_FULL_RUN = RUNS["xfer_frontier"], RUNS["xfer_rank"], RUNS["xfer_full"]
XFER_TTFT_RUN, XFER_VLLM_RANK_RUN = RUNS["xfer_ttft"], RUNS["xfer_vllm_rank"]
XFER_ABLATION_RUN, XFER_VLLM_TTFT_RUN = RUNS["xfer_ablation"], RUNS["xfer_vllm_ttft"]
XFER_N10_RUN = RUNS["xfer_n10"]
XFER_PROSE_RUN = RUNS.get("xfer_modern_prose", "")
PHASE_ORDER = ["weights", "deltanet", "index_score", "selection", "transfer", "attention", "head"]


def _span(lo: float, hi: float) -> str:
    """A min-max range at two decimals, three where two would print the same number twice."""
    for d in (2, 3):
        a, b = f"{lo:.{d}f}", f"{hi:.{d}f}"
        if a != b:
            return f"{a}–{b}"
    return a


_md = S.md_table


def decode_tables(m: pd.DataFrame) -> str:
    d = S.decode_table(m)
    out = []
    for c in sorted(d["concurrency"].unique()):
        dc = d[d["concurrency"] == c]
        piv = dc.pivot(index="context_len", columns="strategy", values="tok_s")
        zc = dc[dc["strategy"] == "zero_copy"].set_index("context_len")
        rows = []
        for ctx in piv.index:
            r = {"context": _ctx(ctx)}
            r.update({s: f"{piv.loc[ctx, s]:.1f}" for s in piv.columns})
            if ctx in zc.index:
                z = zc.loc[ctx]
                r["zero_copy step ms (min–max)"] = f"{z['step_ms_median']:.2f} ({z['step_ms_min']:.2f}–{z['step_ms_max']:.2f})"
                if "resident" in piv.columns:
                    r["zero_copy / resident"] = f"{piv.loc[ctx, 'zero_copy'] / piv.loc[ctx, 'resident']:.2f}"
            rows.append(r)
        title = "Concurrency 1 (tok/s)" if c == 1 else f"Concurrency {int(c)} (aggregate tok/s)"
        out.append(f"{title}\n\n{_md(pd.DataFrame(rows))}")
    return "\n\n".join(out)


def targets_table(m: pd.DataFrame) -> str:
    t = S.targets(m)
    t = t[t["threshold"].notna()]

    def fmt(v):
        return "—" if v is None or v != v else f"{v:.3f}"
    rows = [{"target": r["target"], "measured": fmt(r["value"]), "goal": f"{'≥' if r['target'] and _higher(r) else '≤'} {r['threshold']:g}",
             "met": {True: "met", False: "missed", None: "—"}[r["met"]], "how": r["detail"]} for _, r in t.iterrows()]
    return _md(pd.DataFrame(rows))


def _higher(r) -> bool:
    return next(t.higher_is_better for t in TARGETS.values() if t.what == r["target"])


def anatomy_table(m: pd.DataFrame, contexts: tuple | None = (65536, 1 << 20)) -> str:
    """The step anatomy per strategy, concurrency and context (`contexts`; None: every context of the run)."""
    d = m[(m["experiment"] == "decode") & (m["status"] == "ok") & (m["axis"] == "context")]
    if contexts is not None:
        d = d[d["context_len"].isin(list(contexts))]
    d = d.sort_values(["concurrency", "strategy", "context_len"])
    rows = []
    for _, r in d.iterrows():
        row = {"strategy": r["strategy"], "c": int(r["concurrency"]), "context": _ctx(r["context_len"])}
        row.update({ph: f"{r[f'anat_{ph}_ms']:.2f}" for ph in PHASE_ORDER})
        row["sum / step"] = f"{r['anat_closure']:.3f}"
        row["step ms"] = f"{r['step_ms_median']:.2f}"
        rows.append(row)
    return _md(pd.DataFrame(rows))


def selection_table(m: pd.DataFrame) -> str:
    p = m[(m["experiment"] == "probe") & (m["strategy"].isin(["index_score", "select", "topk_sort", "score_select"]))]
    rows = []
    for (b, ctx), g in p.groupby(["concurrency", "context_len"]):
        ms = g.set_index("strategy")["step_ms_median"] * 1e3
        rows.append({"batch": int(b), "context": _ctx(ctx), "index score µs": f"{ms['index_score']:.0f}",
                     "radix select µs": f"{ms['select']:.0f}", "torch.topk + sort µs": f"{ms['topk_sort']:.0f}",
                     "score + select µs": f"{ms['score_select']:.0f}"})
    return _md(pd.DataFrame(rows))


def agreement_table() -> str:
    t = pd.read_csv(REPO / PROBE_RUN / "agreement.csv")
    rows = [{"path": r["path"], "reference probe GB/s": f"{r['shared_gbps']:.1f}", "labkit probe GB/s": f"{r['labkit_gbps']:.1f}",
             "ratio": f"{r['ratio']:.3f}", "within 5%": "yes" if r["within"] else "no"} for _, r in t.iterrows()]
    return _md(pd.DataFrame(rows))


def prediction_table(m: pd.DataFrame) -> str:
    tab = predict_table(m, metrics_shape(m),
                        gpu_for_name(str(m["gpu_name"].dropna().iloc[0])), gpu("rtx3090"), 3,
                        contexts=[8192, 65536, 1 << 20], concurrency=[1, 4])
    tab = tab[tab["strategy"].isin(["resident", "zero_copy"])]
    rows = [{"strategy": r["strategy"], "c": int(r["concurrency"]), "context": _ctx(r["context_len"]),
             "PREDICTED tok/s": f"{r['predicted_tok_s']:.1f}" if r["fits"] else "does not fit",
             "GiB per GPU": f"{r['memory_gib_per_gpu']:.1f}"} for _, r in tab.iterrows()]
    return _md(pd.DataFrame(rows))


def validation_summary(m: pd.DataFrame) -> str:
    err = S.cost_model_errors(m)
    g = err.groupby("strategy")["error"]
    rows = [{"strategy": s, "points": len(e), "median abs error": f"{e.abs().median():.1%}", "worst": f"{e.abs().max():.1%}"}
            for s, e in g]
    return _md(pd.DataFrame(rows))


def multigpu_table() -> str:
    """1 GPU vs the layers split over two (stages taking turns) vs pipelined micro-batches; the rerun's
    points where it has them, concurrency 1 from the first run; gather scaling and hand-off beside."""
    first, rerun = (load_run(REPO / r).metrics for r in MULTIGPU_RUNS)
    dec = lambda m: m[(m.experiment == "decode") & (m.status == "ok")]
    d = pd.concat([dec(first)[dec(first).concurrency == 1], dec(rerun)])
    best = d.sort_values("tok_s").groupby(["strategy", "context_len", "concurrency", "layout"]).last().reset_index()
    rows = []
    for (s, c, n), g in best.groupby(["strategy", "context_len", "concurrency"]):
        by = g.set_index("layout")
        one = by.tok_s.get("1gpu")
        r = {"strategy": s, "context": _ctx(c), "requests": int(n), "1 GPU tok/s": f"{one:.1f}" if one else "does not fit",
             "split tok/s (bubble)": f"{by.tok_s['split']:.1f} ({by.bubble_share['split']:.0%})"}
        if "pipelined" in by.index:
            pp = by.loc["pipelined"]
            r["pipelined tok/s (micro-batches, bubble)"] = f"{pp.tok_s:.1f} ({int(pp.micro_batches)}, {pp.bubble_share:.0%})"
            r["pipelined / 1 GPU"] = f"{pp.tok_s / one:.2f}" if one else "–"
        else:
            r["pipelined tok/s (micro-batches, bubble)"] = "–"
            r["pipelined / 1 GPU"] = "–"
        r["split / 1 GPU"] = f"{by.tok_s['split'] / one:.2f}" if one else "–"
        rows.append(r)
    g = rerun[(rerun.experiment == "gather") & (rerun.status == "ok")]
    alone = g[g["mode"] == "alone"].gbps.max()
    agg = g[g["mode"] == "together"].gbps_aggregate.iloc[0]
    h = first[(first.experiment == "handoff") & (first.status == "ok")]
    lead = (f"Zero-copy gather of one decode step (48 MiB), each GPU over its own link: one GPU {alone:.1f} GB/s, "
            f"both at once {agg:.1f} GB/s (**{agg / alone:.2f}x**). Hand-off of one step's activations "
            f"cuda:0 -> cuda:1 (NVLink): {h.us_median.median():.0f} µs.")
    return lead + "\n\n" + _md(pd.DataFrame(rows))


def prefill_table() -> str:
    rows = []
    for run in PREFILL_RUNS:
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


def prefill_anatomy_table() -> str:
    """The whole prompt per engine variant: tok/s against the first variant, the bound, attention's rate, and
    seconds per phase (summed over chunks)."""
    run = load_run(REPO / RUNS["prefill_anatomy"])
    m = run.metrics
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


def prefill_kernels_table() -> str:
    """scripts/prefill_kernels_bench.py's JSON: attention per prefix and the delta rule, against the GEMM peak."""
    r = json.loads((REPO / RUNS["prefill_kernels"] / "prefill_kernels.json").read_text())
    peak = r["gemm"]["tflops"]
    rows = [{"kernel": a["kernel"], "keys": _ctx(a["S"]), "ms (min–max)": f"{a['ms_median']:.2f} ({a['ms_min']:.2f}–{a['ms_max']:.2f})",
             "TFLOPS": f"{a['tflops']:.0f}", "of GEMM peak": f"{a['of_gemm_peak']:.0%}"} for a in r["attention"]]
    rows += [{"kernel": d["kernel"], "keys": f"{_ctx(d['T'])} tokens", "ms (min–max)": f"{d['ms_median']:.2f} ({d['ms_min']:.2f}–{d['ms_max']:.2f})",
              "TFLOPS": "–", "of GEMM peak": "–"} for d in r["deltanet"] if "ms_median" in d]
    return f"GEMM peak {peak:.0f} TFLOPS (8192³ bf16, same process)\n\n" + _md(pd.DataFrame(rows))


def hot_conc_table() -> str:
    """hot_cache against resident per concurrency on one point: tok/s, the ratio, the weights phase's excess."""
    m = load_run(REPO / RUNS["hot_conc"]).metrics
    m = m[(m["experiment"] == "decode") & (m["status"] == "ok") & m["concurrency"].notna()]
    by = m.set_index(["concurrency", "strategy"])
    rows = []
    for c in sorted(m["concurrency"].unique()):
        r, h = by.loc[(c, "resident")], by.loc[(c, "hot_cache")]
        rows.append({"context": _ctx(r["context_len"]), "requests": int(c), "resident tok/s": f"{r['tok_s']:,.1f}",
                     "hot_cache tok/s": f"{h['tok_s']:,.1f}", "hot_cache / resident": f"**{h['tok_s'] / r['tok_s']:.3f}**",
                     "weights phase above resident's": f"{h['anat_weights_ms'] - r['anat_weights_ms']:.2f} ms",
                     "hit rate": f"{h['hot_hit_rate']:.3f}"})
    return _md(pd.DataFrame(rows))


def sparse_prefill_table() -> str:
    """QSA's sparse prefill: the select (beside the same bench before the collect pass moved to wgmma and key
    ranges) and the attention per layer-chunk by prefix, the collect pass's tiles swept at one prefix, then whole
    prompts through it beside the dense prompt of the anatomy run, seconds per phase."""
    b = json.loads((REPO / RUNS["sparse_prefill_kernels"] / "sparse_prefill_bench.json").read_text())
    before = json.loads((REPO / RUNS["sparse_prefill_kernels_before"] / "sparse_prefill_bench.json").read_text())
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
    dense = load_run(REPO / RUNS["prefill_anatomy"]).metrics
    dense = dense[(dense["experiment"] == "prefill") & (dense["status"] == "ok") & (dense["mode"] == "resident")]
    whole = [dense[dense["engine_variant"] == "prefill_attn=split,dn_prefill=fla"]]
    whole += [load_run(REPO / run).metrics for run in [RUNS["prefill_now"], *RUNS["prefill_sparse"]]]
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


def capacity_table() -> str:
    g = load_run(REPO / CAPACITY_RUN).table("goodput")
    rows = [{"configuration": r.config, "requests held": int(r.requests), "batch under TPOT limit": int(r.good_batch),
             "TPOT ms": f"{r.tpot_ms:.2f}", "goodput tok/s": f"{r.goodput_tok_s:.0f}", "vs none": f"{r.goodput_vs_none:.2f}"}
            for r in g.itertuples()]
    return _md(pd.DataFrame(rows))


def pulse_blocks_table() -> str:
    m = load_run(REPO / PULSE_RUNS["blocks"]).metrics
    m = m[m.status == "ok"]
    rows = [{"selection": r.selection, "block": int(r.block), "unit": f"{int(r.unit_bytes) // 1024} KiB", "units": int(r.units),
             "variant": r.strategy, "GB/s": f"{r.gbps:.2f}", "vs contiguous": f"{r.ratio_to_contiguous:.3f}"}
            for r in m.itertuples()]
    return _md(pd.DataFrame(rows))


def pulse_coalesced_table() -> str:
    """Each variant's GB/s as a ratio to the contiguous copy of the same bytes in the same run, per
    run, selection, block and number of requests' selections moved at once."""
    cols = ["coalesced", "coalesced_pipelined", "gather_only", "coalesced_copy", "zero_copy", "batched_dma",
            "batched_dma_default"]
    rows = []
    for run in PULSE_COALESCED_RUNS:
        m = load_run(REPO / run).metrics
        m = m[m.status == "ok"]
        split = sorted({x for x in m.strategy if x.startswith("batched_dma_per")}, key=lambda x: int(x[15:]))
        for (req, sel, blk), g in m.groupby(["requests", "selection", "block"], sort=True):
            r = g.set_index("strategy")
            row = {"run": run.split("-")[1], "requests": int(req), "MiB": f"{r['bytes'].iloc[0] / 2**20:.0f}",
                   "selection": sel, "block": int(blk), "unit": f"{int(r['unit_bytes'].iloc[0]) // 1024} KiB",
                   "contiguous GB/s": f"{r.loc['contiguous', 'gbps']:.1f}"}
            row.update({c: f"{r.loc[c, 'ratio_to_contiguous']:.2f}" if c in r.index else "–" for c in cols + split})
            rows.append(row)
    return _md(pd.DataFrame(rows).fillna("–"))


def pulse_switch_table() -> str:
    """The switched round (4 offloaded requests at 64K beside 4 normal at 8K) per transfer mechanism and
    selection granularity, every measurement of it."""
    rows = []
    for run, names in PULSE_SWITCH_RUNS:
        for name in names:
            r = json.loads((REPO / run / f"{name}.json").read_text())[0]
            tr = [x["end_ms"] - x["start_ms"] for x in r["timeline"] if x["kind"] == "transfer"]
            hint, per = r.get("dma_prefer_overlap"), r.get("dma_units_per_call")
            rows.append({"run": run.split("-")[1], "offloaded batch's transfer": r["strategy"],
                         "select block": r.get("select_block", 1),
                         "DMA hint": "–" if hint is None else ("overlap" if hint else "default"),
                         "units per DMA call": "–" if per is None else (f"{per}" if per else "all"),
                         "sequential ms": f"{r['sequential_ms']:.2f}", "switched ms": f"{r['switched_ms']:.2f}",
                         "switched / sequential": f"{r['switched_ms'] / r['sequential_ms']:.3f}",
                         "bound ms": f"{r['bound_ms']:.2f}" if "bound_ms" in r else "–",
                         "offloaded step alone ms": f"{r['offload_only_ms']:.2f}",
                         "transfer per layer ms (median)": f"{sorted(tr)[len(tr) // 2]:.2f}",
                         "overlap ms": f"{r['overlap_ms']:.2f}", "switches / stalls": f"{r['switches']} / {r['stalls']}"})
    return _md(pd.DataFrame(rows))


def pulse_scaling_table() -> str:
    m = load_run(REPO / PULSE_RUNS["scaling"]).metrics
    m = m[m.status == "ok"]
    piv = m.pivot_table(index="concurrency", columns="mode", values="tok_s")
    b = m[m["mode"] == "no_switch"].set_index("concurrency")
    rows = [{"requests": int(n), "one batch tok/s": f"{piv.loc[n, 'no_switch']:.1f}",
             "two switched tok/s": f"{piv.loc[n, 'switched']:.1f}" if pd.notna(piv.loc[n].get("switched")) else "–",
             "resident tok/s": f"{piv.loc[n, 'resident']:.1f}", "bound: one batch ms": f"{b.loc[n, 'no_switch_model_ms']:.2f}",
             "bound: switched ≥ ms": f"{b.loc[n, 'switched_floor_ms']:.2f}", "transfer ms": f"{b.loc[n, 'transfer_ms']:.2f}",
             "2nd weight pass ms": f"{b.loc[n, 'extra_weight_ms']:.2f}"} for n in piv.index]
    first = m.iloc[0]
    lead = (f"Link {first.link_gbps:.1f} GB/s and HBM {first.hbm_gbps:.0f} GB/s measured in the run; the physics crossover "
            f"(weights / HBM vs one request's rows / link) is {first.crossover_physics:.1f} requests; steps are CUDA graphs "
            f"without torch.compile (launch-bound).")
    return lead + "\n\n" + _md(pd.DataFrame(rows))


def pulse_scaling_compiled_table() -> str:
    """Aggregate tok/s at 1M with every request offloaded, compiled steps: per request count and offload
    transfer, one batch vs two switched, switched against the best one-batch transfer (zero_copy, the
    last run) and the bound's two floors (the same for every transfer: they use the contiguous link)."""
    runs = []
    for run, label in PULSE_SCALING_COMPILED_RUNS:
        m = load_run(REPO / run).metrics
        runs.append((m[m.status == "ok"].pivot_table(index="concurrency", columns="mode", values="tok_s"), m, label))
    ref_piv, ref, _ = runs[-1]
    b = ref[ref["mode"] == "no_switch"].set_index("concurrency")
    rows = []
    for n in sorted(set().union(*(p.index for p, _, _ in runs))):
        for p, _, label in runs:
            if n not in p.index:
                continue
            one, two = p.loc[n, "no_switch"], p.loc[n].get("switched")
            best = ref_piv.loc[n, "no_switch"] if n in ref_piv.index else float("nan")
            rows.append({"requests": int(n), "offload transfer": label, "one batch tok/s": f"{one:.0f}",
                         "two switched tok/s": f"{two:.0f}" if pd.notna(two) else "–",
                         "switched / one batch": f"{two / one:.2f}" if pd.notna(two) else "–",
                         "switched / zero_copy one batch": f"{two / best:.2f}" if pd.notna(two) and pd.notna(best) else "–",
                         "resident tok/s": f"{p.loc[n, 'resident']:.0f}",
                         "bound: one batch ms": f"{b.loc[n, 'no_switch_model_ms']:.2f}" if n in b.index else "–",
                         "bound: switched ≥ ms": f"{b.loc[n, 'switched_floor_ms']:.2f}" if n in b.index else "–"})
    first = ref.iloc[0]
    lead = (f"Link {first.link_gbps:.1f} GB/s and HBM {first.hbm_gbps:.0f} GB/s measured in the zero_copy run; the "
            f"physics crossover (weights / HBM vs one request's rows / link) is {first.crossover_physics:.1f} requests; "
            "steps are CUDA graphs of torch.compile'd pieces; block_dma selects blocks of 16, zero_copy single "
            "positions; the bounds are the zero_copy run's.")
    return lead + "\n\n" + _md(pd.DataFrame(rows))


def pulse_selection_table(requests: int = 4, budgets=(256, 2048)) -> str:
    """Per-head vs retrieval-head selection side by side: link bytes per step, transfer and
    step time per mechanism (per layer measured x QSA layers; step = the measured resident step of the
    same batch + the transfer), quality from the quality lab at blocks of 16 (per-KV-head oracle vs the
    layer's retrieval head, mean over corpora)."""
    bl = load_run(REPO / PULSE_SELECTION_BLOCKS_RUN).metrics
    sc = load_run(REPO / PULSE_SCALING_COMPILED_RUNS[-1][0]).metrics
    comp = float(sc[(sc["mode"] == "resident") & (sc["concurrency"] == requests)]["step_ms_median"].iloc[0])
    variants = ("coalesced_pipelined", "batched_dma", "batched_dma_per512", "zero_copy")
    t = selection_rows(bl, None, comp, metrics_shape(bl).attn_layers, block=16,
                        variants=variants, requests=requests)
    q = load_run(REPO / QUALITY_BLOCK_RUNS[1][0]).table("quality_summary")
    rows = []
    for r in t.itertuples():
        row = {"selection": r.selection, "unit": f"{r.unit_bytes // 1024} KiB", "units per layer": r.units_per_layer,
               "link MiB per step": f"{r.link_bytes_per_step / 2**20:.0f}"}
        for v in variants:
            row[f"{v} ms/step"] = f"{getattr(r, f'{v}_ms_per_step'):.2f}"
        row["step ms (zero_copy)"] = f"{r.step_ms_zero_copy:.2f}"
        row["step ms (batched_dma_per512)"] = f"{r.step_ms_batched_dma_per512:.2f}"
        for b in budgets:
            g = q[(q.policy == QUALITY_POLICY[r.selection]) & (q.budget == b)]
            row[f"ppl ratio @{b}"] = f"{g.ppl_ratio.mean():.3f}"
            row[f"mass recall @{b}"] = f"{g.mass_recall.mean():.3f}"
        rows.append(row)
    lead = (f"{requests} requests' selections at once (budget {int(bl.budget.iloc[0])} at 64K, blocks of 16), "
            f"run `{PULSE_SELECTION_BLOCKS_RUN.split('/')[-1]}`; resident step of {requests} requests at 1M "
            f"{comp:.2f} ms (`{PULSE_SCALING_COMPILED_RUNS[-1][0].split('/')[-1]}`); quality: SmolLM2-135M, 4K-token "
            f"sequences, `{QUALITY_BLOCK_RUNS[1][0].split('/')[-1]}` (per-head = the per-KV-head oracle).")
    return lead + "\n\n" + _md(pd.DataFrame(rows))


def f2(v) -> str:
    """A ratio to two decimals, "-" where there is none."""
    return "-" if pd.isna(v) else f"{v:.2f}"


def span(ws) -> str:
    """Window numbers as a range: "2–9", "3", or "none"."""
    return f"{min(ws)}–{max(ws)}" if len(ws) > 1 else str(ws[0]) if ws else "none"


def pulse_ladder_table() -> str:
    """PulseInfer's ladder (`RUNS["pulse_ladder"]`): per rung, throughput and p99 TPOT as ratios to the first rung
    on the same test window (median, min, max, 95% bootstrap interval over the windows), and what each rung moved
    (bytes per copy, copies per step, the most requests running at once: medians over the test windows)."""
    run = RUNS.get("pulse_ladder")
    if not run:
        return "No ladder run is named in docs/runs.toml yet."
    lr = load_run(REPO / run)
    mf, prm, m = lr.manifest, lr.manifest["parameters"], lr.metrics
    s = lr.table("window_summary").set_index("arm")
    test = m[(m["window_role"] == "test") & m["rung"].notna()]
    rows = []
    for arm, r in s.iterrows():
        mine = test[test["rung"] == arm]
        kib = mine["bytes_per_copy"].median() / 1024
        rows.append({"rung": f"`{arm}`", "setting": r["policy"], "windows": int(r["throughput_ratio_n"]),
                     "tok/s ratio median": f2(r["throughput_ratio"]),
                     "min–max": f"{f2(r['throughput_ratio_min'])}–{f2(r['throughput_ratio_max'])}",
                     "95% interval": f"[{f2(r['throughput_ratio_lo'])}, {f2(r['throughput_ratio_hi'])}]",
                     "p99 TPOT ratio median": f2(r["tpot_p99_ratio"]),
                     "p99 95% interval": f"[{f2(r['tpot_p99_ratio_lo'])}, {f2(r['tpot_p99_ratio_hi'])}]",
                     "KiB per copy": "-" if pd.isna(kib) else f"{kib:.1f}",
                     "copies per step": "-" if pd.isna(mine["copies_per_step"].median()) else f"{mine['copies_per_step'].median():,.0f}",
                     "most running": f"{mine['max_running'].median():.0f}"})
    ratios = lr.table("window_ratios")
    vs = ratios[(ratios["role"] == "test") & (ratios["arm"] == "adaptive")]["throughput_vs_no_offload"]
    lead = (f"Run `{mf['run_id']}` ({mf.get('gpu_name') or 'CPU'}; {len(mf.get('resumed_from') or [])} earlier pieces "
            f"resumed): {prm['windows']} windows of {prm['window_size']} Mooncake requests (inputs × "
            f"{float(prm['length_scale']):g}, ≤ {prm['max_output']} output tokens), windows {span(mf['calibration'])} "
            f"calibrate, {span(mf['test'])} test; device KV cap {prm['device_kv_tokens']:,} tokens. Ratios to "
            f"`per_head` on the same window, rungs in an order turned per window.")
    tail = (f"Full PulseInfer (`adaptive`) / `no_offload` under the same cap, per test window: median "
            f"{vs.median():.2f}×, {vs.min():.2f}–{vs.max():.2f}.")
    return lead + "\n\n" + _md(pd.DataFrame(rows)) + "\n\n" + tail


def pulse_trace_table() -> str:
    """The trace replayed over disjoint windows (`RUNS["pulse_trace_windows"]`, when one is committed): per
    policy, median, min and max over the test windows of its throughput and p99 TPOT as ratios to the
    reference on the same window, thresholds chosen on the calibration windows; the one-window replays of
    the trace's first requests with the same serving (window 0, or the first windows as one) as a row
    each. Then every one-window replay, per policy, throughput as a ratio to "noswitch" of the same run
    (same requests, same strategy)."""
    cols = {"policy": "policy", "completed": "requests done", "output_throughput": "output tok/s",
            "ttft_ms_p99": "p99 TTFT ms", "tpot_ms_p50": "p50 TPOT ms", "tpot_ms_p90": "p90 TPOT ms",
            "tpot_ms_p99": "p99 TPOT ms", "share_offloaded": "share offloaded", "switched_rounds": "switched rounds",
            "stalls": "stalls"}
    parts = []
    for run in PULSE_TRACE_RUNS:
        lr = load_run(REPO / run)
        m, prm = lr.metrics, lr.manifest["parameters"]
        t = m[list(cols)].rename(columns=cols)
        base = float(m.loc[m.policy.str.startswith("noswitch"), "output_throughput"].iloc[0])
        t.insert(3, "vs noswitch", (m["output_throughput"] / base).map(lambda v: f"{v:.2f}"))
        sb, per = prm.get("select_block", 1), prm.get("dma_units_per_call", 0)
        lane = f"{m.strategy.iloc[0]}" + (f", blocks of {sb}" if sb > 1 else "") + (f", calls of {per}" if per else "")
        t.insert(0, "run", run.split("-")[1])
        t.insert(1, "offload lane", lane)
        t.insert(2, "steps", "graphs" if prm.get("graphs") in (True, "true", "True") else "eager")
        t.insert(3, "requests × inputs / outputs", f"{int(m.n_requests.iloc[0])} × {float(prm.get('length_scale') or 1):g} "
                 f"/ ≤ {prm.get('max_output')}")
        parts.append(t)
    t = pd.concat(parts, ignore_index=True)
    for c in ("output tok/s", "p99 TTFT ms", "p50 TPOT ms", "p90 TPOT ms", "p99 TPOT ms", "share offloaded"):
        t[c] = t[c].map(lambda v: f"{v:.2f}" if abs(v) < 10 else f"{v:.0f}")
    single = _md(t)
    win = RUNS.get("pulse_trace_windows")
    if not win:
        return single
    lr = load_run(REPO / win)
    mf, prm = lr.manifest, lr.manifest["parameters"]
    s, ref = lr.table("window_summary"), prm["reference"]
    rows = []
    for _, r in s[s["arm"] != REFERENCE].iterrows():
        rows.append({"policy": r["arm"], "setting": r["policy"], "windows": f"test {span(mf['test'])} ({int(r['throughput_ratio_n'])})",
                     "tok/s ratio median": f2(r["throughput_ratio"]), "min": f2(r["throughput_ratio_min"]),
                     "max": f2(r["throughput_ratio_max"]),
                     "95% interval of the median": f"[{f2(r['throughput_ratio_lo'])}, {f2(r['throughput_ratio_hi'])}]",
                     "p99 TPOT ratio median": f2(r["tpot_p99_ratio"]), "p99 min": f2(r["tpot_p99_ratio_min"]),
                     "p99 max": f2(r["tpot_p99_ratio_max"]),
                     "p99 95% interval": f"[{f2(r['tpot_p99_ratio_lo'])}, {f2(r['tpot_p99_ratio_hi'])}]"})
    for d in first_window_runs([REPO / x for x in PULSE_TRACE_RUNS], prm, ignore=("dma_units_per_call",)):
        one = load_run(d)
        per = one.manifest["parameters"].get("dma_units_per_call", 0)
        covers = int(one.metrics["n_requests"].iloc[0]) // int(prm["window_size"])
        where = "0 alone (1)" if covers == 1 else f"0–{covers - 1} as one (1)"
        for _, r in single_window(one.metrics).query("arm != @REFERENCE").iterrows():
            v, q = f2(r["throughput_ratio"]), f2(r["tpot_p99_ratio"])
            rows.append({"policy": f"{r['policy']} (run {d.name.split('-')[1]}, DMA {f'in calls of {per}' if per else 'in one call'})",
                         "setting": "read off its window", "windows": where, "tok/s ratio median": v, "min": v,
                         "max": v, "95% interval of the median": "-", "p99 TPOT ratio median": q, "p99 min": q,
                         "p99 max": q, "p99 95% interval": "-"})
    chosen = ", ".join(c for c in (mf.get("chosen") or {}).values() if c) or "none"
    lead = (f"Run `{mf['run_id']}` ({mf.get('gpu_name') or 'CPU'}): {prm['windows']} disjoint windows of {prm['window_size']} "
            f"trace requests (inputs × {float(prm['length_scale']):g}, ≤ {prm['max_output']} output tokens); windows "
            f"{span(mf['calibration'])} calibrate (chosen there: {chosen}), windows {span(mf['test'])} are test windows. "
            f"Ratios to `{ref}` on the same window (its policies in an order turned per window, after untimed warm-up "
            f"replays); median, min and max over the test windows (`labkit.stats.spread`), 95% bootstrap interval of "
            f"the median over windows.")
    return (lead + "\n\n" + _md(pd.DataFrame(rows)) + "\n\nEvery one-window replay (thresholds read off the window "
            "they are reported on):\n\n" + single)


def _quality_interval(g: pd.DataFrame, col: str, digits: int = 3) -> str:
    """One summary row's `value [lo, hi]` (labkit.stats.Interval.text)."""
    r = g.iloc[0]
    return Interval(r[col], r[f"{col}_lo"], r[f"{col}_hi"], int(r[f"{col}_n"])).text(digits)


def _quality_lead(run: str, mf: dict) -> str:
    p = mf["parameters"]
    ctx = p["seq_len"] - p["eval_tokens"]
    return (f"SmolLM2-135M on CPU, run `{run.split('/')[-1]}`: per corpus n = {p['n_sequences']} sequences of "
            f"{p['seq_len']:,} tokens drawn with seed {p['seed']} from the eval split"
            + (" (yaml: non-overlapping windows of its one eval document)" if "yaml" in p["corpora"] else "")
            + f", the last {p['eval_tokens']} decoded sparsely after a {ctx:,}-token dense "
            f"prefill; value [95% bootstrap interval over sequences], perplexity pooled over a corpus's sequences; "
            f"wall {mf['wall_s'] / 60:.0f} min on {mf.get('cpu_count')} shared CPU cores"
            + (f", {mf['torch_threads']} torch thread" + ("s" if mf["torch_threads"] > 1 else "") if "torch_threads" in mf else "")
            + ".")


def quality_table() -> str:
    """Perplexity ratio to dense per corpus and policy (single-token selection) at every budget of the run, and
    attention-mass recall at 256, each with its 95% bootstrap interval over the evaluation sequences and n."""
    run = load_run(REPO / QUALITY_RUN)
    q = run.table("quality_summary")
    q = q[(q.policy != "dense") & (q.selection == "token")]
    rows = []
    for (corpus, pol), g in q.groupby(["corpus", "policy"], sort=True):
        g = g.set_index("budget")
        row = {"corpus": corpus, "policy": pol}
        for b in sorted(q.budget.unique()):
            row[f"ppl ratio @{b}"] = _quality_interval(g.loc[[b]], "ppl_ratio")
        row["mass recall @256"] = _quality_interval(g.loc[[256]], "mass_recall")
        row["n"] = int(g["ppl_ratio_n"].min())
        rows.append(row)
    return _quality_lead(QUALITY_RUN, run.manifest) + "\n\n" + _md(pd.DataFrame(rows))


def quality_blocks_table() -> str:
    """Perplexity ratio to dense (pooled over a corpus's sequences) and attention-mass recall per policy,
    selected per token or in whole blocks of 16, at the budgets the run measured blocks at, each with its 95%
    bootstrap interval over the evaluation sequences and n."""
    run = load_run(REPO / QUALITY_RUN)
    q = run.table("quality_summary")
    budgets = sorted(q[q.block > 1].budget.unique())
    q = q[q.budget.isin(budgets) & ~q.policy.isin(["dense", "oracle_shared"])]
    rows = []
    for (pol, corpus, block), g in q.groupby(["policy", "corpus", "block"], sort=True):
        g = g.set_index("budget")
        row = {"policy": pol, "selection": g["selection"].iloc[0], "corpus": corpus}
        for b in budgets:
            row[f"ppl ratio @{b}"] = _quality_interval(g.loc[[b]], "ppl_ratio")
            row[f"mass recall @{b}"] = _quality_interval(g.loc[[b]], "mass_recall")
        row["n"] = int(g["ppl_ratio_n"].min())
        rows.append(row)
    return _quality_lead(QUALITY_RUN, run.manifest) + "\n\n" + _md(pd.DataFrame(rows))


def quality_sparse_prefill_table() -> str:
    """Per corpus, policy and budget: the perplexity ratio to dense with the prefix prefilled densely and with it
    prefilled under the same selection, what sparse prefill adds (the sparse-prefill perplexity over the
    dense-prefill one, paired per sequence), and the prefix rows' attention-mass recall and recall@budget against
    the shared oracle; each with its 95% bootstrap interval over the evaluation sequences and n."""

    run = load_run(REPO / QUALITY_SPARSE_PREFILL_RUN)
    mf, q, m = run.manifest, run.table("quality_summary"), run.metrics
    p = mf["parameters"]
    q = q[(q.policy != "dense") & (q.selection == "token")].set_index(["corpus", "policy", "budget", "protocol"])
    m = m[(m.status == "ok") & (m.policy != "dense")]
    rows = []
    for (corpus, pol, b), g in m.groupby(["corpus", "policy", "budget"], sort=True):
        pair = g.pivot_table(index=["document", "start"], columns="protocol", values=["nll_sum", "n_tokens"])
        added = perplexity_ratio(pair["nll_sum"]["sparse_prefill"], pair["nll_sum"]["dense_prefill"],
                                 pair["n_tokens"]["sparse_prefill"])
        sp = q.loc[[(corpus, pol, b, "sparse_prefill")]]
        rows.append({"corpus": corpus, "policy": pol, "budget": int(b),
                     "ppl ratio, dense prefill": _quality_interval(q.loc[[(corpus, pol, b, "dense_prefill")]], "ppl_ratio"),
                     "ppl ratio, sparse prefill": _quality_interval(sp, "ppl_ratio"),
                     "sparse / dense prefill": added.text(3),
                     "prefill mass recall": _quality_interval(sp, "prefill_mass_recall"),
                     "prefill recall@budget": _quality_interval(sp, "prefill_oracle_overlap"),
                     "n": int(sp["ppl_ratio_n"].min())})
    ctx = p["seq_len"] - p["eval_tokens"]
    lead = (f"SmolLM2-135M on CPU, run `{QUALITY_SPARSE_PREFILL_RUN.split('/')[-1]}`: per corpus n = "
            f"{p['n_sequences']} sequences of {p['seq_len']:,} tokens drawn with seed {p['seed']} from the eval split; "
            f"the {ctx:,}-token prefix prefilled densely (dense prefill) or with every row attending to its top-budget "
            f"causal past chosen by the policy (sparse prefill), then the last {p['eval_tokens']} decoded sparsely; "
            f"both against the same dense prefill + dense decode. Prefill recalls are over the prefix rows with more "
            f"past than the budget (recall@budget: the selection's overlap with the shared oracle's). Value [95% "
            f"bootstrap interval over sequences]; wall {mf['wall_s'] / 60:.0f} min on {mf.get('cpu_count')} shared "
            f"CPU cores, {mf.get('torch_threads', 1)} torch thread.")
    return lead + "\n\n" + _md(pd.DataFrame(rows))


def hot_density_table(context_len: int = 1 << 20) -> str:
    """Hot-cache replay of recorded SmolLM2 selections per recording density x corpus x policy at one context:
    hit rate and link bytes against zero_copy's at capacity 1x and 2x budget, the smallest capacity of the
    run that reaches <= 1/3 of zero_copy's bytes, and the share of replayed rows that are the trace's own."""
    d = pd.read_parquet(REPO / HOT_DENSITY_RUN / "hot_replay.parquet")
    d = d[d["context_len"] == context_len]
    rows = []
    for (rv, corpus, pol), g in d.groupby(["ratio_value", "corpus", "policy"], sort=True):
        g = g.set_index("capacity_x").sort_index()
        ok = g.index[g["bytes_vs_zero_copy"] <= 1 / 3]
        r0 = g.iloc[0]
        rows.append({"density": f"{r0['ratio']} ({int(r0['trace_budget'])} of {int(r0['trace_context']):,})",
                     "corpus": corpus, "policy": pol,
                     "hit rate 1x": f"{g.loc[1.0, 'hit_rate']:.3f}", "bytes/zc 1x": f"{g.loc[1.0, 'bytes_vs_zero_copy']:.3f}",
                     "hit rate 2x": f"{g.loc[2.0, 'hit_rate']:.3f}", "bytes/zc 2x": f"{g.loc[2.0, 'bytes_vs_zero_copy']:.3f}",
                     "≤ 1/3 of zero_copy from": f"{ok.min():g}x" if len(ok) else f"no (≤ {g.index.max():g}x)",
                     "trace share": f"{r0['trace_share']:.2f}"})
    lead = (f"Replayed at {_ctx(context_len)} tokens, budget {int(d['budget'].iloc[0])}, 12 QSA layers, one request; "
            f"capacity in rows per layer as a multiple of the budget.")
    return lead + "\n\n" + _md(pd.DataFrame(rows))


def hot_decode_table() -> str:
    """hot_cache against resident and zero_copy at 1M tokens, concurrency 1, budget 2048, capacity 2x budget,
    per selection (the indexer's, random for reuse; recorded traces by density and corpus) and bookkeeping
    order; ratios within each run (the other strategies ran in the same run, beside it)."""
    rows = []
    for run, how in HOT_DECODE_RUNS:
        m = load_run(REPO / run).metrics.set_index("strategy")
        h = m.loc["hot_cache"]
        sel = h["selection"]
        if sel.startswith("trace:"):
            name = Path(sel[6:]).stem.split("indexer-b")
            budget = int(name[1])
            # the density table's nominal label (a power of two: 64 of 8,001 is "1/128")
            sel = f"{name[0].split('-')[-2]} trace, 1/{2 ** round(math.log2(8001 / budget))} ({budget} of 8,001)"
        else:
            sel = "indexer (random)"
        vs = lambda s: f"{m.loc[s, 'step_ms_median'] / h['step_ms_median']:.3f}" if s in m.index else "–"
        rows.append({"selection": sel, "bookkeeping": how, "hot_cache tok/s": f"{h['tok_s']:.1f}",
                     "vs resident": vs("resident"), "vs zero_copy": vs("zero_copy"),
                     "hit rate": f"{h['hot_hit_rate']:.3f}", "link MB/step": f"{h['h2d_bytes_per_step'] / 1e6:.2f}",
                     "run": run.split("/")[-1]})
    return _md(pd.DataFrame(rows))


def crosscheck_block() -> str:
    """labkit's load generator against `vllm bench serve` on one server and load, interleaved rounds."""
    t = crosscheck_table(load_run(REPO / CROSSCHECK_RUN).metrics)
    rows = [{"input / conc.": f"{int(r.input_len)} / {int(r.concurrency)}",
             "TTFT labkit / vLLM (ms)": f"{r.ttft_labkit_ms:,.0f} / {r.ttft_vllm_ms:,.0f}", "TTFT ratio": f"{r.ttft_ratio:.2f}",
             "TPOT labkit / vLLM (ms)": f"{r.tpot_labkit_ms:,.1f} / {r.tpot_vllm_ms:,.1f}", "TPOT ratio": f"{r.tpot_ratio:.2f}",
             "rounds": int(r.rounds)} for r in t.itertuples()]
    within = lambda col: int(((t[col] - 1).abs() <= 0.10).sum())
    lead = (f"Within 10%: TTFT at {within('ttft_ratio')} of {len(t)} points, TPOT at {within('tpot_ratio')} of {len(t)} "
            f"(medians over rounds of each round's median).")
    return lead + "\n\n" + _md(pd.DataFrame(rows))


def decode_trace_table() -> str:
    """zero_copy's step on the indexer's own (random-weight) selections against a recorded SmolLM2 trace
    replayed at the engine's context, same shape and points."""
    rows = []
    for run, label in DECODE_TRACE_RUNS:
        m = load_run(REPO / run).metrics
        z = m[(m.experiment == "decode") & (m.status == "ok") & (m.strategy == "zero_copy")]
        z = z.set_index(["context_len", "concurrency"])["step_ms_median"]
        row = {"zero_copy step ms": label}
        row.update({f"{_ctx(ctx)}, c={c}": f"{z.loc[(ctx, c)]:.2f}" for c in (1, 4) for ctx in (65536, 1 << 20)})
        rows.append(row)
    return _md(pd.DataFrame(rows))


# ---- cross-model KV transfer (labkit.crossmodel) ---------------------------------------------------------------


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


def xfer_frontier_table() -> str:
    """Quality (fitted mappers, held-out windows, 95% intervals over sequences) beside the TTFT speedup
    (shape-only mappers, 2K) per N."""
    run = load_run(REPO / XFER_FRONTIER_RUN)
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


def xfer_n10_table() -> str:
    """The N = 10 anomaly: pooled held-out ppl ratio at N = 8 / 10 / 12 per probe, and the costliest layer of the
    N = 10 mapper from the frontier without exact prefix (attribution: that layer alone mapped, and every layer but it)."""
    run = load_run(REPO / XFER_N10_RUN)
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


def xfer_rank_table() -> str:
    """Reduced-rank mappers at N = 8: quality (95% intervals over sequences) and the mapping's cost beside the
    full ridge mapper."""
    f = load_run(REPO / XFER_RANK_RUN).table("frontier")
    f = f[f["small_layers"] == 8].sort_values("mapper_macs_per_token", ascending=False)
    rows = [{"rank": "full" if not r.rank else int(r.rank), "mapping MACs / token": f"{r.mapper_macs_per_token / 1e6:.2f} M",
             **_xfer_quality_cells(r), "top-1 [95%]": text_iv(r, "top1_agree"),
             "calibration R² gap K / V": "–" if not r.rank else f"{r.rank_gap_k_mean:.4f} / {r.rank_gap_v_mean:.4f}",
             "mapping ms": f"{r.mapping_ms:,.0f}", f"TTFT speedup at {int(r.context_len) // 1024}K": f"**{r.speedup:.2f}×**"}
            for r in f.itertuples()]
    return _md(pd.DataFrame(rows))


def xfer_run_table() -> str:
    """The full `labkit run crossmodel` (default features, backend=both): quality per backend and the vLLM path's TTFT
    per length and concurrency (its transformers TTFT shared the CPU with other work: the clean one is
    `xfer_ttft_table`)."""


    run = load_run(REPO / XFER_FULL_RUN)
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


def xfer_ttft_table() -> str:
    """TTFT per prompt length of the full and the rank-512 mapper (fitted, exact prefix), transformers path and,
    at 8K, through vLLM."""
    rows = []
    for run_dir in (XFER_TTFT_RUN, XFER_VLLM_RANK_RUN):
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


def xfer_ablation_table() -> str:
    """The mapper ablation at N = 8: features, lambda granularity and calibration size against quality."""

    a = pd.read_parquet(REPO / XFER_ABLATION_RUN / "ablation.parquet")
    a = a[a["stage"] != "frontier"]
    seqs = pd.read_parquet(REPO / XFER_ABLATION_RUN / "ablation_rows.parquet")
    per_corpus = json.loads((REPO / XFER_ABLATION_RUN / "ablation.json").read_text())["n_sequences"]
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


def xfer_vllm_ttft_table() -> str:
    """TTFT through the CPU vLLM server, the large model's own prefill against the mapped path, with its stages."""
    m = load_run(REPO / XFER_VLLM_TTFT_RUN).metrics
    m = m[(m["kind"] == "ttft") & (m["status"] == "ok")]
    rows = []
    for n, g in m.groupby("context_len"):
        base, mp = g[g["strategy"] == "large_prefill"].iloc[0], g[g["strategy"] == "mapped"].iloc[0]
        rows.append({"prompt tokens": f"{int(n):,}", "vLLM's own prefill ms": f"{base.ttft_ms_median:,.0f}",
                     "mapped path ms": f"{mp.ttft_ms_median:,.0f}", "speedup": f"{mp.speedup:.2f}",
                     "small prefill": f"{mp.small_prefill_ms:,.0f}", "mapping": f"{mp.mapping_ms:,.0f}",
                     "/dev/shm write": f"{mp.write_ms:,.0f}", "engine (load + last token)": f"{mp.engine_ms:,.0f}"})
    return _md(pd.DataFrame(rows))


def xfer_prose_table() -> str:
    """Quality per corpus of one run: modern English prose (Python's documentation topics) beside Shakespeare,
    the same mapper and protocol, 95% intervals over sequences."""

    run = load_run(REPO / XFER_PROSE_RUN)
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


def xfer_blocks() -> dict[str, str]:
    out = {}
    for name, fn, run in (("xfer-frontier-cpu", xfer_frontier_table, XFER_FRONTIER_RUN),
                          ("xfer-n10-cpu", xfer_n10_table, XFER_N10_RUN),
                          ("xfer-rank-cpu", xfer_rank_table, XFER_RANK_RUN), ("xfer-run-cpu", xfer_run_table, XFER_FULL_RUN),
                          ("xfer-ttft-cpu", xfer_ttft_table, XFER_TTFT_RUN),
                          ("xfer-ablation-cpu", xfer_ablation_table, XFER_ABLATION_RUN),
                          ("xfer-vllm-ttft-cpu", xfer_vllm_ttft_table, XFER_VLLM_TTFT_RUN),
                          ("xfer-prose-cpu", xfer_prose_table, XFER_PROSE_RUN)):
        if run and (REPO / run).is_dir():
            out[name] = fn()
    return out


def _selection_words(run: str) -> str:
    """How a decode run picked its rows, in words: two figures of one ratio from runs that select differently
    differ for that reason, and the line says so instead of putting one outside the other's range."""
    sel = str((load_run(REPO / run).manifest.get("parameters") or {}).get("selection", "indexer"))
    return "on a recorded selection trace" if sel.startswith("trace:") else f"with the {sel}'s own selections"


def headlines() -> str:
    """The README's one line per system, every figure computed here from the same committed runs as the docs'
    tables: ratios within one run, and where a figure was repeated, its range across processes."""
    d = S.decode_table(load_run(REPO / RUNS["decode_now"]).metrics)
    d1 = d[d["concurrency"] == 1].set_index(["strategy", "context_len"])
    top = int(d1.index.get_level_values(1).max())
    lines = [_sparse_offload_line(d1, top), _baseline_line(), _prefill_line(), _hot_cache_line(top), _pulse_line(),
             _xfer_line(), _two_gpus_line()]
    return "\n".join(lines)


def _sparse_offload_line(d1: pd.DataFrame, top: int) -> str:
    rep = across_runs(decode_ratio_rows(RUNS["repeats_hot1m"]), ["figure"], "value").set_index("figure")
    zc_rep = rep.loc[[f for f in rep.index if f.startswith("zero_copy")][0]]
    zc, res = d1.loc[("zero_copy", top)], d1.loc[("resident", top)]
    grow = zc["step_ms_median"] / d1.loc[("zero_copy", 64 << 10), "step_ms_median"] - 1
    return (f"- **Sparse offload** decodes at {_ctx(top)} tokens at {zc['tok_s']:.1f} tok/s with `zero_copy` against "
            f"{res['tok_s']:.1f} fully resident ({zc['tok_s'] / res['tok_s']:.2f}× {_selection_words(RUNS['decode_now'])}; "
            f"{_span(zc_rep['min'], zc_rep['max'])}× across {int(zc_rep['n'])} processes "
            f"{_selection_words(RUNS['repeats_hot1m'][0])}), and its step grows only {grow:.0%} from 64K to {_ctx(top)}: the transfer "
            f"per step is fixed ([results](docs/roofline.md), [spreads](docs/spreads.md)).")


def _prefill_line() -> str:
    """Prefill of the long prompt: today's variant against the first one in the anatomy run, and attention's rate."""
    all_ = load_run(REPO / RUNS["prefill_anatomy"]).metrics
    all_ = all_[(all_["experiment"] == "prefill") & (all_["status"] == "ok")]
    m = all_[all_["mode"] == "resident"]
    first, best = m.iloc[0], m.loc[m["tok_s"].idxmax()]
    rot = all_[(all_["mode"] == "rotating") & (all_["engine_variant"] == best["engine_variant"])]
    return (f"- **Prefill** of a {_ctx(int(best['context_len']))} prompt runs at {best['tok_s']:,.0f} tok/s "
            f"({best['tok_s'] / first['tok_s']:.2f}× the {first['tok_s']:,.0f} before in the same run): attention at "
            f"{best['attention_of_gemm_peak']:.0%} of the GEMM peak measured beside it (two cuDNN calls merged by "
            f"log-sum-exp) and DeltaNet's scan on flash-linear-attention's kernel; the rotating buffers keep "
            f"{float(rot['tok_s'].iloc[0]) / best['tok_s']:.2f}× of it with the KV going to host RAM, and every prefill run "
            f"times its chunks by phase against their bounds. {_prefill_now_words()} ([prefill](docs/prefill-capacity.md)).")


def _prefill_now_words() -> str:
    """Today's dense prompt and QSA's sparse prefill (the short prompt and the longest), from their runs."""
    def ok(run):
        m = load_run(REPO / run).metrics
        return m[(m["experiment"] == "prefill") & (m["status"] == "ok")].iloc[0]
    now = ok(RUNS["prefill_now"])
    sparse = sorted((ok(run) for run in RUNS["prefill_sparse"]), key=lambda r: r["context_len"])
    short, long_ = sparse[0], sparse[-1]
    cap = long_.get("mem_cap_bytes")
    under = f" under a {cap / 2**30:.0f} GiB cap" if cap is not None and pd.notna(cap) else ""
    return (f"With DeltaNet's conv on a kernel of the lab's own the same prompt runs at {now['tok_s']:,.0f} tok/s; QSA's "
            f"sparse prefill (each query's top {int(short['budget']):,} rows) at {short['tok_s']:,.0f} tok/s, and a whole "
            f"{_ctx(int(long_['context_len']))}-token prompt{under} in {long_['step_ms_median'] / 1e3:.0f} s")


def _baseline_line() -> str:
    gshare = gemv_chain(RUNS["gemv_kmajor"])["share_m1"]
    roof = load_run(REPO / RUNS["roofline"]).metrics
    r64 = roof[(roof.experiment == "decode") & (roof.status == "ok") & (roof.strategy == "resident") & (roof.concurrency == 1)].iloc[0]
    bw = float(roof[(roof.experiment == "probe") & (roof.strategy == "hbm_read")]["gbps"].median())
    bound = float(r64.step_weight_bytes) / bw / 1e6
    return (f"- **The baseline**: `resident` steps at {r64.step_ms_median:.2f} ms at 64K ({r64.tok_s:.0f} tok/s), "
            f"{r64.step_ms_median / bound:.1f}× the time to read its weights once from HBM; the lab's one-row GEMV streams "
            f"a step's weight matrices at {gshare['gemv_best']:.0%} of the read bandwidth, cuBLAS at {gshare['cublas']:.0%} "
            f"([roofline](docs/roofline.md)).")


def _hot_cache_line(top: int) -> str:
    caps = across_runs(capacity_rows(RUNS["repeats_capacity"]), ["figure"], "value").set_index("figure")
    cap = caps.loc[[f for f in caps.index if f.startswith("goodput")][0]]
    pre = across_runs(prefill_rows(RUNS["repeats_prefill"]), ["figure"], "value").iloc[0]
    hot = []
    for run, how in HOT_DECODE_RUNS:
        m = load_run(REPO / run).metrics.set_index("strategy")
        if how == HOT_DECODE_RUNS[-1][1] and m.loc["hot_cache", "selection"].startswith("trace:"):   # the latest
            hot.append(m.loc["resident", "step_ms_median"] / m.loc["hot_cache", "step_ms_median"])
    return (f"- **FlashOffloading's hot cache** reaches {min(hot):.3f}–{max(hot):.3f}× resident speed at {_ctx(top)} on recorded "
            f"selections (one process each, with the step of its runs: {HOT_DECODE_RUNS[-1][1].split(', ')[-1]}); its rotating prefill buffers cost nothing against resident prefill "
            f"({pre['median']:.2f}×, {_span(pre['min'], pre['max'])}× across {int(pre['n'])} processes, a 248K prompt with "
            f"the KV going to host RAM) and run a whole 1M-token prompt under a 24 GiB cap, and offload in both "
            f"stages gives {cap['median']:.2f}× the goodput of none ({_span(cap['min'], cap['max'])}× across {int(cap['n'])} "
            f"processes) ([hot cache](docs/hot-cache.md), "
            f"[prefill](docs/prefill-capacity.md)).")


def _pulse_line() -> str:
    pul = across_runs(pulse_rows(RUNS["repeats_pulse_scaling"]), ["figure"], "value").set_index("figure")
    sw = pul.loc[[f for f in pul.index if "switched / one" in f][0]]
    trace = next(r for r in PULSE_TRACE_RUNS if "151530" in r)
    t = load_run(REPO / trace).metrics
    base = float(t.loc[t.policy.str.startswith("noswitch"), "output_throughput"].iloc[0])
    thr = t[t.policy.str.startswith("threshold")]["output_throughput"] / base
    win = load_run(REPO / RUNS["pulse_trace_windows"])
    ws = win.table("window_summary").set_index("arm").loc["threshold (fitted)"]
    return (f"- **PulseInfer's switching** with a static length threshold ({ws['policy'].split(':')[1]}, chosen on "
            f"{len(win.manifest['calibration'])} calibration windows) gives {ws['throughput_ratio']:.2f}× "
            f"({ws['throughput_ratio_min']:.2f}–{ws['throughput_ratio_max']:.2f}) the throughput of offloading without switching "
            f"and {ws['tpot_p99_ratio']:.2f}× ({ws['tpot_p99_ratio_min']:.2f}–{ws['tpot_p99_ratio_max']:.2f}) its p99 TPOT, "
            f"median (min–max) over {int(ws['throughput_ratio_n'])} held-out windows of {win.manifest['parameters']['window_size']} "
            f"Mooncake requests; the {thr.min():.2f}–{thr.max():.2f}× of one {int(t.n_requests.iloc[0])}-request window "
            f"with thresholds read off it does not hold; at 1M two switched "
            f"batches gave {_span(sw['min'], sw['max'])}× one offloaded batch across {int(sw['n'])} processes "
            f"([PulseInfer](docs/pulseinfer.md)).")


def _xfer_line() -> str:
    tt = load_run(REPO / XFER_TTFT_RUN).metrics
    tt = tt[(tt["kind"] == "ttft") & (tt["strategy"] == "mapped") & (tt["backend"] == "transformers")
            & (tt["rank"].fillna(0) == 0)]
    fr = load_run(REPO / XFER_FRONTIER_RUN).table("frontier")
    fr = fr[fr["stage"] == "frontier"].set_index("small_layers")
    n8, n20 = fr.loc[8], fr.loc[int(fr.index.max())]
    iv = lambda r, c: f"{r[c]:.2f} [{r[c + '_lo']:.2f}, {r[c + '_hi']:.2f}]"  # noqa: E731
    return (f"- **Cross-model KV transfer** (CPU, SmolLM2-135M and its first 8 layers) cuts TTFT "
            f"{tt[tt.context_len >= 2048].speedup.min():.1f}–{tt[tt.context_len >= 2048].speedup.max():.1f}× at "
            f"{int(tt[tt.context_len >= 2048].context_len.min()):,}–{int(tt.context_len.max()):,} tokens on the "
            f"transformers path; on held-out text its perplexity ratio at N = 8 is {iv(n8, 'ppl_ratio_prose')} on prose and "
            f"{iv(n8, 'ppl_ratio_code')} on code (95% intervals over {int(n8['ppl_ratio_prose_n'])} sequences each), "
            f"{iv(n20, 'ppl_ratio')} pooled at N = {int(fr.index.max())} ([cross-model](docs/cross-model.md)).")


def _two_gpus_line() -> str:
    first, rerun = (load_run(REPO / r).metrics for r in MULTIGPU_RUNS)
    gth = rerun[(rerun.experiment == "gather") & (rerun.status == "ok")]
    links = gth[gth["mode"] == "together"].gbps_aggregate.iloc[0] / gth[gth["mode"] == "alone"].gbps.max()
    dec = rerun[(rerun.experiment == "decode") & (rerun.status == "ok") & (rerun.strategy == "zero_copy")]
    at = dec[(dec.context_len == dec.context_len.max()) & (dec.concurrency == dec.concurrency.max())]
    best = at.sort_values("tok_s").groupby("layout").last()          # the multi-GPU table's choice per layout
    pipe = best.loc["pipelined", "tok_s"] / best.loc["1gpu", "tok_s"]
    n = int(dec.concurrency.max())
    return (f"- **Two GPUs**: the links add up ({links:.2f}×), and pipelined micro-batches reach {pipe:.2f}× one GPU at "
            f"{_ctx(int(dec.context_len.max()))} × {n} requests with `zero_copy` ([multi-GPU](docs/multi-gpu.md)).")

def blocks() -> dict[str, str]:
    m = load_run(REPO / DECODE_RUN).metrics
    return {"headlines": headlines(), "serve-crosscheck-cpu": crosscheck_block(), "hot-density-cpu": hot_density_table(), "hot-decode-h200": hot_decode_table(), "pulse-blocks-h200": pulse_blocks_table(), "pulse-coalesced-h200": pulse_coalesced_table(), "pulse-switch-h200": pulse_switch_table(), "pulse-scaling-h200": pulse_scaling_table(),
            "pulse-scaling-compiled-h200": pulse_scaling_compiled_table(), "pulse-selection-h200": pulse_selection_table(),
            "pulse-trace-h200": pulse_trace_table(), "pulse-ladder-h200": pulse_ladder_table(), "quality-blocks-cpu": quality_blocks_table(), "quality-cpu": quality_table(), "quality-sparse-prefill-cpu": quality_sparse_prefill_table(), "multigpu-h200x2": multigpu_table(), "prefill-h200": prefill_table(), "prefill-anatomy-h200": prefill_anatomy_table(), "prefill-kernels-h200": prefill_kernels_table(), "sparse-prefill-h200": sparse_prefill_table(), "hot-conc-h200": hot_conc_table(), "capacity-h200": capacity_table(),
            "decode-h200": decode_tables(m), "targets-h200": targets_table(m), "anatomy-h200": anatomy_table(m),
            "selection-h200": selection_table(m), "agreement-h200": agreement_table(), "decode-trace-h200": decode_trace_table(),
            **xfer_blocks(),
            "predict-rtx3090": prediction_table(m), "costmodel-h200": validation_summary(m),
            **roofline_blocks(RUNS, decode_tables, anatomy_table, prediction_table), **reference_blocks(RUNS),
            **_claims_blocks()}


def _claims_blocks() -> dict[str, str]:
    return claims_blocks()


MARKER = re.compile(r"<!-- BEGIN generated:([\w.-]+) -->")


def markers(text: str) -> list[str]:
    """The names of the generated blocks a text holds, in order."""
    return MARKER.findall(text)


def rewrite(text: str, generated: dict[str, str], where: str = "the file") -> str:
    for name, body in generated.items():
        pat = re.compile(rf"(<!-- BEGIN generated:{re.escape(name)} -->\n)(?:.*?\n)?(<!-- END generated:{re.escape(name)} -->)", re.S)
        if not pat.search(text):
            raise ValueError(f"{where} has no block generated:{name}")
        text = pat.sub(lambda mt: mt.group(1) + body + "\n" + mt.group(2), text)
    return text


def by_file(generated: dict[str, str]) -> dict[str, dict[str, str]]:
    """The generated blocks grouped by the file that holds them; a block with no file is refused."""
    unmapped = sorted(set(generated) - set(BLOCK_FILES))
    if unmapped:
        raise ValueError(f"no file for generated block(s) {', '.join(unmapped)}: add them to [files] in docs/runs.toml")
    out: dict[str, dict[str, str]] = {}
    for name, body in generated.items():
        out.setdefault(BLOCK_FILES[name], {})[name] = body
    return out


def write(generated: dict[str, str], repo: Path = REPO) -> list[Path]:
    """Rewrite every block in the file that holds it; every file is checked before any is written."""
    new = {}
    for rel, gen in by_file(generated).items():
        p = repo / rel
        new[p] = rewrite(p.read_text(), gen, where=rel)
    for p, text in new.items():
        p.write_text(text)
    return list(new)


def main(write_files: bool = False) -> int:
    """`labkit docs`: print every block; `labkit docs --write`: rewrite them where they sit."""
    gen = blocks()
    if write_files:
        for p in write(gen):
            print(f"rewrote {sum(BLOCK_FILES[n] == str(p.relative_to(REPO)) for n in gen)} blocks in {p.relative_to(REPO)}")
    else:
        for k, v in gen.items():
            print(f"<!-- {k} -->\n{v}\n")
    return 0

