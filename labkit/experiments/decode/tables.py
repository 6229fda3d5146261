"""The decode experiment's generated tables in README.md and docs/*.md (`labkit docs`): tok/s per strategy and
context, the lab's goals, the step's anatomy, the predicted 3x RTX 3090 and the cost model's error, the step on a
recorded selection trace, the hot cache against resident, one table before and after a change, and the headline
ratios per process. Each reads the committed run folders it is given: docs/runs.toml names them, labkit/docs
binds each block to its function and runs."""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from ...costmodel import gpu, gpu_for_name, predict_table
from ...report import summary as S
from ...report.targets import TARGETS
from ...report.units import tokens_label as _ctx
from ...results import REPO, load_run
from ...shapes import metrics_shape

_md = S.md_table
PHASE_ORDER = ["weights", "deltanet", "index_score", "selection", "transfer", "attention", "head"]


def _metrics(run: str) -> pd.DataFrame:
    return load_run(REPO / run).metrics


def decode_tables(run: str) -> str:
    """tok/s per strategy and context, a table per concurrency, zero_copy's step (min–max) and ratio beside."""
    d = S.decode_table(_metrics(run))
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


def targets_table(run: str) -> str:
    t = S.targets(_metrics(run))
    t = t[t["threshold"].notna()]

    def fmt(v):
        return "—" if v is None or v != v else f"{v:.3f}"
    rows = [{"target": r["target"], "measured": fmt(r["value"]), "goal": f"{'≥' if r['target'] and _higher(r) else '≤'} {r['threshold']:g}",
             "met": {True: "met", False: "missed", None: "—"}[r["met"]], "how": r["detail"]} for _, r in t.iterrows()]
    return _md(pd.DataFrame(rows))


def _higher(r) -> bool:
    return next(t.higher_is_better for t in TARGETS.values() if t.what == r["target"])


def anatomy_table(run: str, contexts: tuple | None = (65536, 1 << 20)) -> str:
    """The step anatomy per strategy, concurrency and context (`contexts`; None: every context of the run)."""
    m = _metrics(run)
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


def prediction_table(run: str) -> str:
    """The run's anatomy carried to 3x RTX 3090 (`costmodel.predict_table`): resident and zero_copy."""
    m = _metrics(run)
    tab = predict_table(m, metrics_shape(m),
                        gpu_for_name(str(m["gpu_name"].dropna().iloc[0])), gpu("rtx3090"), 3,
                        contexts=[8192, 65536, 1 << 20], concurrency=[1, 4])
    tab = tab[tab["strategy"].isin(["resident", "zero_copy"])]
    rows = [{"strategy": r["strategy"], "c": int(r["concurrency"]), "context": _ctx(r["context_len"]),
             "PREDICTED tok/s": f"{r['predicted_tok_s']:.1f}" if r["fits"] else "does not fit",
             "GiB per GPU": f"{r['memory_gib_per_gpu']:.1f}"} for _, r in tab.iterrows()]
    return _md(pd.DataFrame(rows))


def validation_summary(run: str) -> str:
    """The cost model's error on the run's own points, per strategy."""
    err = S.cost_model_errors(_metrics(run))
    g = err.groupby("strategy")["error"]
    rows = [{"strategy": s, "points": len(e), "median abs error": f"{e.abs().median():.1%}", "worst": f"{e.abs().max():.1%}"}
            for s, e in g]
    return _md(pd.DataFrame(rows))


def decode_trace_table(runs: list[tuple[str, str]]) -> str:
    """zero_copy's step on the indexer's own (random-weight) selections against a recorded SmolLM2 trace
    replayed at the engine's context, same shape and points."""
    rows = []
    for run, label in runs:
        m = load_run(REPO / run).metrics
        z = m[(m.experiment == "decode") & (m.status == "ok") & (m.strategy == "zero_copy")]
        z = z.set_index(["context_len", "concurrency"])["step_ms_median"]
        row = {"zero_copy step ms": label}
        row.update({f"{_ctx(ctx)}, c={c}": f"{z.loc[(ctx, c)]:.2f}" for c in (1, 4) for ctx in (65536, 1 << 20)})
        rows.append(row)
    return _md(pd.DataFrame(rows))


def hot_conc_table(run: str) -> str:
    """hot_cache against resident per concurrency on one point: tok/s, the ratio, the weights phase's excess."""
    m = _metrics(run)
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


def hot_decode_table(runs: list[tuple[str, str]]) -> str:
    """hot_cache against resident and zero_copy at 1M tokens, concurrency 1, budget 2048, capacity 2x budget,
    per selection (the indexer's, random for reuse; recorded traces by density and corpus) and bookkeeping
    order; ratios within each run (the other strategies ran in the same run, beside it)."""
    rows = []
    for run, how in runs:
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


def ratio_change_block(before: str, now: str) -> str:
    """Each offload strategy / resident tok/s at 64K and 1M, c = 1 and 4: the decode table measured with
    the slower resident step (before) and re-measured (now), two runs of the same parameters."""
    def ratios(run):
        m = load_run(REPO / run).metrics
        d = m[(m["experiment"] == "decode") & (m["status"] == "ok")]
        piv = d.pivot_table(index=["concurrency", "context_len"], columns="strategy", values="tok_s")
        return piv.div(piv["resident"], axis=0), piv["resident"]
    (rb, resb), (rn, resn) = ratios(before), ratios(now)
    rows = []
    for (c, ctx) in rn.index:
        c, ctx = int(c), int(ctx)
        if ctx not in (65536, 1 << 20) or (c, ctx) not in rb.index:
            continue
        row = {"c": c, "context": "1M" if ctx == 1 << 20 else f"{ctx >> 10}K",
               "resident tok/s, before → now": f"{resb.loc[(c, ctx)]:.0f} → {resn.loc[(c, ctx)]:.0f}"}
        for s in ("zero_copy", "host_gather", "hot_cache"):
            if s in rn.columns and s in rb.columns:
                row[f"{s} / resident"] = f"{rb.loc[(c, ctx), s]:.3f} → {rn.loc[(c, ctx), s]:.3f}"
        rows.append(row)
    return (f"Before: `{before.split('/')[-1]}`; now: `{now.split('/')[-1]}` (same parameters, one process each).\n\n"
            + _md(pd.DataFrame(rows)))


def decode_ratio_rows(runs: list[str]) -> pd.DataFrame:
    """The headline figures of the same decode point measured in separate processes, one row per figure and
    process (docs/spreads.md, the README's headlines and the claims card take their spread across processes)."""
    out = []
    for i, run in enumerate(runs, 1):
        m = load_run(REPO / run).metrics
        d = m[(m["experiment"] == "decode") & (m["status"] == "ok")].set_index("strategy")
        ctx = int(d["context_len"].max())
        for s in ("zero_copy", "hot_cache"):
            if s in d.index:
                out.append({"figure": f"{s} / resident tok/s, {ctx >> 20}M, c = 1, indexer selections",
                            "process": i, "value": d.loc[s, "tok_s"] / d.loc["resident", "tok_s"]})
        out.append({"figure": f"resident step ms, {ctx >> 20}M, c = 1", "process": i, "value": d.loc["resident", "step_ms_median"]})
    return pd.DataFrame(out)
