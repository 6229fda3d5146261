"""Generated blocks of docs/roofline.md and docs/spreads.md: the resident step against the weight-streaming
roofline (a decode run's steps against its own HBM probe), the step's kernels, selection against torch.topk and
the GEMV benches (scripts, no experiment), and the headline ratios across processes (each experiment's rows, from
its tables.py); today's decode tables there are the decode experiment's. Every figure from committed run folders
named in docs/runs.toml (`[runs]`), as the other generated tables."""
from __future__ import annotations

import gzip
import json
import statistics
from functools import partial
from typing import Callable

import pandas as pd

from ..experiments.capacity.tables import capacity_rows
from ..experiments.decode import tables as decode
from ..experiments.prefill.tables import prefill_rows
from ..experiments.pulse_scaling.tables import pulse_rows
from ..results import REPO, load_run
from ..stats import across_runs
from . import box
from .kernels import grouped
from ..report.summary import md_table


_md = md_table


def hbm_read_gbps(m: pd.DataFrame) -> float:
    p = m[(m["experiment"] == "probe") & (m["strategy"] == "hbm_read") & (m["status"] == "ok")]
    return float(p["gbps"].median())


def roofline_block(run: str) -> str:
    """Resident and zero_copy at 64K against weight bytes / HBM read bandwidth, both measured in the run."""
    m = load_run(REPO / run).metrics
    bw = hbm_read_gbps(m)
    d = m[(m["experiment"] == "decode") & (m["status"] == "ok")].sort_values(["strategy", "concurrency"])
    wb = float(d["step_weight_bytes"].iloc[0])
    bound = wb / bw / 1e6
    rows = []
    for _, r in d.iterrows():
        rows.append({"strategy": r.strategy, "c": int(r.concurrency),
                     "step ms (min–max)": f"{r.step_ms_median:.2f} ({r.step_ms_min:.2f}–{r.step_ms_max:.2f})",
                     "tok/s": f"{r.tok_s:.0f}", "step / bound": f"{r.step_ms_median / bound:.2f}",
                     "weights ms": f"{r.anat_weights_ms:.2f}", "DeltaNet ms": f"{r.anat_deltanet_ms:.2f}",
                     "selection ms": f"{r.anat_selection_ms:.2f}", "transfer ms": f"{r.anat_transfer_ms:.2f}"})
    res = d[d["strategy"] == "resident"].set_index("concurrency")["step_ms_median"]
    c4 = f"; resident c = 4 / c = 1: **{res.loc[4] / res.loc[1]:.2f}×** (goal ≤ 1.25×)" if {1, 4} <= set(res.index) else ""
    lead = (f"Weights read per step {wb / 1e9:.2f} GB; contiguous HBM read {bw:.0f} GB/s measured in the same run; "
            f"bound {bound:.2f} ms. Resident at c = 1: **{res.loc[1] / bound:.2f}×** the bound (goal ≤ 1.6×){c4}.")
    return lead + "\n\n" + _md(pd.DataFrame(rows))


def _points(path) -> list[dict]:
    return json.loads(path.read_text())["points"]


def kernels_block(run: str, weight_bw_run: str) -> str:
    """The step at 64K, c = 1, kernel groups: the mixer fused vs not (one process, A B B A), and the GEMV with
    programmatic dependent launch vs cuBLAS (two processes, each point the first timed in its process)."""
    folder = REPO / run
    bw = hbm_read_gbps(load_run(REPO / weight_bw_run).metrics)
    ab = [p for p in _points(folder / "profile_mix_ab.json") if p["conc"] == 1]
    pdl = next(p for p in _points(folder / "profile_gemv_pdl.json") if p["conc"] == 1)
    off = next(p for p in _points(folder / "profile_gemv_off.json") if p["conc"] == 1)
    wb = json.loads((folder / "profile_mix_ab.json").read_text())["weight_bytes"]
    variants = [("mixer fused (today)", [p for p in ab if p["deltanet_mix"] == "fused"]),
                ("mixer unfused", [p for p in ab if p["deltanet_mix"] == "unfused"]),
                ("GEMV + PDL, mixer unfused (other process)", [pdl]),
                ("cuBLAS, mixer unfused (other process)", [off])]
    groups = sorted({g for _, ps in variants for p in ps for g in grouped(p["kernels"])})
    rows = []
    for label, ps in variants:
        g = [grouped(p["kernels"]) for p in ps]
        row = {"variant": label, "step ms": " / ".join(f"{p['step_ms_median']:.2f}" for p in ps),
               "kernels": f"{statistics.median(p['kernels_per_step'] for p in ps):.0f}",
               "kernel time ms": f"{statistics.median(p['kernel_us_per_step'] for p in ps) / 1e3:.2f}",
               "DeltaNet phase ms": f"{statistics.median(p['anatomy_ms']['deltanet'] for p in ps):.2f}"
               if all("anatomy_ms" in p for p in ps) else "–"}
        for name in groups:
            row[name] = f"{statistics.median(x.get(name, {}).get('ms', 0.0) for x in g):.3f}"
        rows.append(row)
    fused = grouped(ab[0]["kernels"])
    gemm = sum(v["ms"] for k, v in fused.items() if k.startswith("weight"))
    lead = (f"Every weight product of the step (GEMM kernels, cuBLAS) takes {gemm:.2f} ms for {wb / 1e9:.2f} GB: "
            f"{wb / gemm / 1e6:.0f} GB/s, **{wb / gemm / 1e6 / bw:.0%}** of the {bw:.0f} GB/s read bandwidth (goal ≥ 85%; "
            f"the bandwidth measured in `{weight_bw_run.split('/')[-1]}`, another device session).")
    return lead + "\n\n" + _md(pd.DataFrame(rows))


def _profile(path) -> dict:
    """A profile_step JSON, gzipped or not (large profiles are committed as .json.gz)."""
    gz = path.with_name(path.name + ".gz")
    return json.loads(gzip.decompress(gz.read_bytes()) if gz.exists() and not path.exists() else path.read_text())


def kernels_now_block(variants: list, weight_bw_run: str, overlapped: bool = False, bw_call: str = "the same device call") -> str:
    """Today's step kernel by kernel at 64K, c = 1 and 4, one row per change in the order made:
    variants = [[folder, profile file, label], ...] (profile_step JSONs, each its own process).
    overlapped: the products run under programmatic dependent launch, so their kernels overlap and a
    kernel's time includes its programs' wait for the kernel before: no weights share from kernel sums.
    bw_call: where the read bandwidth was measured relative to the profiles."""
    bw = hbm_read_gbps(load_run(REPO / weight_bw_run).metrics)
    profs = [(label, _profile(REPO / folder / name)) for folder, name, label in variants]
    pts = [(label, p) for label, d in profs for p in d["points"]]
    groups = sorted({g for _, p in pts for g in grouped(p["kernels"])})
    rows = []
    for label, p in sorted(pts, key=lambda lp: lp[1]["conc"]):       # stable: the variants' order within a c
        g = grouped(p["kernels"])
        row = {"c": p["conc"], "variant": label,
               "step ms (min–max)": f"{p['step_ms_median']:.2f} ({p['step_ms_min']:.2f}–{p['step_ms_max']:.2f})",
               "kernels": f"{p['kernels_per_step']:.0f}", "kernel time ms": f"{p['kernel_us_per_step'] / 1e3:.2f}",
               "between kernels ms": f"{p['step_ms_median'] - p['kernel_us_per_step'] / 1e3:.2f}"}
        for name in groups:
            row[name] = f"{g.get(name, {}).get('ms', 0.0):.3f}"
        rows.append(row)
    if overlapped:
        lead = ("The lab's GEMV runs under programmatic dependent launch: each product's programs start while the "
                "kernel before runs and wait for it, so kernels overlap ('between kernels' below zero) and a "
                "product's kernel time counts that wait. The step, not a sum of kernels, is the figure here; the "
                f"read bandwidth is {bw:.0f} GB/s (`{weight_bw_run.split('/')[-1]}`, {bw_call}).")
        return lead + "\n\n" + _md(pd.DataFrame(rows))
    wb, gemm, share = weights_share(variants, weight_bw_run)
    lead = (f"Last variant at c = 1 ({variants[-1][2]}): the weight products' kernels take {gemm:.2f} ms for "
            f"{wb / 1e9:.2f} GB, {wb / gemm / 1e6:.0f} GB/s, **{share:.0%}** of the {bw:.0f} GB/s read bandwidth "
            f"measured in `{weight_bw_run.split('/')[-1]}` (goal ≥ 85%).")
    return lead + "\n\n" + _md(pd.DataFrame(rows))


def weights_share(variants: list, weight_bw_run: str) -> tuple[float, float, float]:
    """The last profiled variant at c = 1: (weight bytes, ms of weight-product kernels, share of the read
    bandwidth those kernels reach)."""
    folder, name, _ = variants[-1]
    d = _profile(REPO / folder / name)
    last = next(p for p in d["points"] if p["conc"] == 1)
    gemm = sum(v["ms"] for k, v in grouped(last["kernels"]).items() if k.startswith("weight"))
    bw = hbm_read_gbps(load_run(REPO / weight_bw_run).metrics)
    return d["weight_bytes"], gemm, d["weight_bytes"] / gemm / 1e6 / bw


def select_block(run: str) -> str:
    """The selection bench (scripts/select_bench.py): torch.topk + sort against the radix passes, with and
    without the run-maxima bound, and the engine's default choice between them."""
    r = json.loads((REPO / run / "select_bench.json").read_text())
    us = lambda v: "–" if v is None else f"{v * 1e3:.0f}"
    rows = []
    for x in r["rows"]:
        rows.append({"batch": x["B"], "context": f"{x['L'] >> 10}K" if x["L"] < 1 << 20 else f"{x['L'] >> 20}M",
                     "scores": x["scores"],
                     "torch.topk + sort µs": us(x["topk_sort_ms"]),
                     "radix passes µs": us(x["select_plain_ms"]),
                     "with the run-maxima bound µs": us(x["select_bound_ms"]),
                     "default µs": f"{us(x['select_auto_ms'])} ({'bound' if x['bound_default'] else 'passes'})",
                     "default / topk": f"{x['select_auto_ms'] / x['topk_sort_ms']:.2f}",
                     "same values as topk": "yes" if x["same_values_as_topk"] else "NO"})
    return f"Top-{r['k']} of one QSA layer, graph-replayed, {r['device']}.\n\n" + _md(pd.DataFrame(rows))


def spreads_block(hot: list[str], capacity: list[str], pulse: list[str], prefill: list[str]) -> str:
    """Each headline figure per process, then median, min, max over the processes (`labkit.stats.across_runs`)."""
    f = pd.concat([decode.decode_ratio_rows(hot), capacity_rows(capacity), pulse_rows(pulse), prefill_rows(prefill)],
                  ignore_index=True)
    t = across_runs(f, ["figure"], "value")
    per = f.pivot_table(index="figure", columns="process", values="value", sort=False)
    rows = []
    for _, r in t.iterrows():
        vals = per.loc[r["figure"]].dropna()
        rows.append({"figure": r["figure"], "per process": ", ".join(f"{v:.3g}" for v in vals),
                     "median": f"{r['median']:.3g}", "min–max": f"{r['min']:.3g}–{r['max']:.3g}",
                     "spread (max/min − 1)": f"{r['max'] / r['min'] - 1:.1%}" if r["min"] > 0 else "–",
                     "scope": r["scope"]})
    return _md(pd.DataFrame(rows))


def gemv_chain(run: str) -> dict:
    """The weight-streaming bench (scripts/gemv_bench.py): its JSON, with the one-row chain's shares."""
    r = json.loads((REPO / run / "gemv_bench.json").read_text())
    one = next(w for w in r["whole_step"] if w["M"] == 1)
    r["share_m1"] = {k: one[k]["of_read_bw"] for k in ("cublas", "cublas_nk", "gemv", "gemv_best", "gemv_best_nopdl")}
    return r


def gemv_block(run: str) -> str:
    """A step's weight matrices streamed back to back from one graph, per M: cuBLAS on both layouts against
    the lab's GEMV on the layout the bench gave it; then one row per matrix at M = 1."""
    r = gemv_chain(run)
    lay = {"kn": "row-major", "nk": "K-major"}[r.get("gemv_layout", "kn")]
    cell = lambda d: f"{d['ms']:.3f} ({d['of_read_bw']:.0%})" if "ms" in d and d["ms"] == d["ms"] else "failed"  # noqa: E731
    rows = [{"M": w["M"], "matrices": w["matrices"], "GB": f"{w['bytes'] / 1e9:.2f}",
             "cuBLAS, row-major": cell(w["cublas"]), "cuBLAS, K-major": cell(w["cublas_nk"]),
             f"GEMV ({lay}), the sweep's best per matrix": cell(w["gemv_best"]),
             "the same without PDL": cell(w["gemv_best_nopdl"])} for w in r["whole_step"]]
    per = [{"matrix": x["matrix"], "K": x["K"], "N": x["N"], "MB": f"{x['bytes'] / 1e6:.1f}",
            "cuBLAS, row-major GB/s": f"{x['cublas']['GBps']:.0f} ({x['cublas']['of_read_bw']:.0%})",
            "GEMV best GB/s": f"{x['gemv_best']['GBps']:.0f} ({x['gemv_best']['of_read_bw']:.0%})" if "gemv_best" in x else "–",
            "its tile (N × K rows), split, stages": (f"{x['gemv_best']['config']['block_n']} × {x['gemv_best']['config']['block_k']}, "
                                                    f"{x['gemv_best']['config']['split']}, {x['gemv_best']['config']['num_stages']}")
                                                   if "gemv_best" in x else "–"}
           for x in r["per_matrix"] if x["M"] == 1]
    cut = " The sweep stopped early on some shapes (its time budget): 'best' is over the configurations tried." \
        if r.get("sweep_cut_short") else ""
    return (f"A step's weight matrices from one CUDA graph, ms (share of the {r['read_bandwidth']['read_GBps']:.0f} GB/s "
            f"contiguous read measured in the same process), {r['device']}.{cut}\n\n" + _md(pd.DataFrame(rows)) +
            "\n\nOne row (M = 1), per matrix:\n\n" + _md(pd.DataFrame(per)))


def gemv_rows_block(run: str) -> str:
    """The GEMV's tensor-core path at 2-16 rows on K-major weights (scripts/gemv_rows_bench.py): per matrix
    GB/s for cuBLAS, the kernel as x @ w, swapped, and swapped at the sweep's best tiles; then a step's
    matrices back to back, per M and way."""
    r = json.loads((REPO / run / "bench_swap.json").read_text())
    read = r["read"]["read_GBps"]
    ways = {"cublas_nk": "cuBLAS", "dot": "GEMV, x @ w", "swap": "GEMV swapped", "swap_best": "GEMV swapped, best tiles"}
    gbs = lambda x, k: f"{x['K'] * x['N'] * 2 / x[k] / 1e6:.0f}" if x.get(k) else "–"  # noqa: E731
    per = [{"matrix": x["matrix"], "K": x["K"], "N": x["N"], "M": x["M"], **{f"{v} GB/s": gbs(x, k) for k, v in ways.items()},
            "best tile (N × K rows), split": (f"{x['best_cfg']['block_n']} × {x['best_cfg']['block_k']}, {x['best_cfg']['split']}"
                                               if x.get("best_cfg") else "–")} for x in r["rows"]]
    ms = sorted({int(k.rsplit("_M", 1)[1]) for k in r["chain"]})
    swept = {x["M"] for x in r["rows"] if x.get("best_cfg")}      # at other M "best tiles" fell back to the defaults
    shown = lambda k, m: f"{k}_M{m}" in r["chain"] and (k != "swap_best" or m in swept)  # noqa: E731
    chain = [{"M": m, **{v: (f"{r['chain'][f'{k}_M{m}']:.3f} ({r['chain_bytes'] / r['chain'][f'{k}_M{m}'] / 1e6 / read:.0%})"
                             if shown(k, m) else "–") for k, v in ways.items()}} for m in ms]
    return (f"Per matrix (K-major weights; the sweep ran at M = {', '.join(map(str, sorted(swept)))} only), GB/s of weight read; contiguous read {read:.0f} GB/s "
            f"in the same process (`{run.rsplit('/', 1)[-1]}`):\n\n" + _md(pd.DataFrame(per)) +
            f"\n\nA step's matrices back to back (the head left out, {r['chain_bytes'] / 1e9:.2f} GB), one CUDA graph each, "
            "ms (share of the read bandwidth):\n\n" + _md(pd.DataFrame(chain)))


def producers(runs: dict) -> dict[str, Callable[[], str]]:
    """The blocks of docs/roofline.md and docs/spreads.md, each its function bound to its runs (today's decode
    table is the decode experiment's own)."""
    now = runs["decode_now"]
    return {"roofline-h200": partial(roofline_block, runs["roofline"]),
            "kernels-h200": partial(kernels_block, runs["roofline_kernels"], runs["roofline_before"]),
            "kernels-now-h200": partial(kernels_now_block, runs["kernels_now"], runs["roofline_before"]),
            "kernels-norm-h200": partial(kernels_now_block, runs["kernels_norm"], runs["roofline"], overlapped=True),
            "select-h200": partial(select_block, runs["select_bench"]),
            "gemv-kmajor-h200": partial(gemv_block, runs["gemv_kmajor"]),
            "gemv-rows-h200": partial(gemv_rows_block, runs["gemv_rows"]),
            "kernels-rows-h200": partial(kernels_now_block, runs["kernels_rows"], runs["roofline"], overlapped=True,
                                         bw_call="an earlier device call of the same day"),
            "decode-now-h200": partial(decode.decode_tables, now), "anatomy-now-h200": partial(decode.anatomy_table, now),
            "anatomy-all-now-h200": partial(decode.anatomy_table, now, contexts=None),
            "decode-change-h200": partial(decode.ratio_change_block, runs["decode_before"], now),
            "predict-now-rtx3090": partial(box.box_block, now),
            "spreads-h200": partial(spreads_block, runs["repeats_hot1m"], runs["repeats_capacity"],
                                    runs["repeats_pulse_scaling"], runs["repeats_prefill"])}
