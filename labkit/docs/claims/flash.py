"""The claims card's rows for FlashOffloading: prefill throughput with prefill-only offload (sparse and dense
attention) and decode throughput at a TPOT limit, each with the regime its committed runs lie in, read from them."""
from __future__ import annotations

import pandas as pd

from ...experiments.capacity.tables import capacity_rows
from ...experiments.prefill.tables import prefill_rows
from ...report.units import tokens_label as _ctx
from ...results import REPO, load_run
from .. import box
from ..box import run_shape
from ..runs import RUNS
from .common import PUBLISHED_CONTEXT, PUBLISHED_TPOT_MS, across as _across, ok_metrics as _metrics
from .rule import SYSTEMS, Claim, Figure, Published


FLASH_PREFILL = Published(1.38, "1.38× prefill throughput", "prefill-only offload vs no offload, GLM-5.2 (MTP3), "
                          "Ascend 910C, prefill/decode disaggregated, up to 1M tokens")
FLASH_DENSE = Published(1.38, "the prefill gain holds for dense attention too", "prefill offload with dense attention "
                        "(the decode gain needs a built-in sparse indexer; the prefill gain does not)")
FLASH_DECODE = Published(1.91, "1.91× decode throughput at a 30 ms TPOT limit", "offload in both stages vs none, same "
                         "accelerator memory, GLM-5.2 (MTP3), Ascend 910C")
FLASH_SAME = Published(0, "the set of attended tokens does not change, only where it is stored",
                       "decode with the KV offloaded against resident: results identical", "absolute",
                       unit="points that differ")

_PREFILL_SETTLE = ("a FlashOffloading prefill-throughput run at a point where the device cap squeezes `none`'s chunk below "
                   "`prefill`'s, or where `none` cannot hold one prompt (docs/prefill-capacity.md names such points), "
                   "or an engine that batches several requests' chunks in one forward, named `prefill_throughput` in "
                   "docs/runs.toml")


def _prefill_regime(m: pd.DataFrame | None) -> str:
    """Why a prefill-throughput point cannot show the published gain, read from its rows ("" when it can): the cap
    leaves `none` the same tokens per forward as `prefill` (its chunk, or with `batched` its token budget), so
    what the freed memory buys adds no throughput (the lab's byte model predicts ~1.0× there). One-request runs
    say so with prompts held (they buy nothing: one request's chunk a forward); batched runs with the prompts a
    forward touches. Rows of several lengths: "" when any length can show it. With no run, the stand-in is one
    prompt with no device cap: nothing for freed memory to buy."""
    if m is None:
        return ("the stand-in prefills one prompt with no device cap, so there is no freed memory to buy anything: "
                "the lab's own model predicts ~1.0× there")
    if not {"config", "chunk"} <= set(m.columns):
        return ""
    lengths = sorted(m["context_len"].unique()) if "context_len" in m else [None]
    out = []
    for T in lengths:
        g = (m if T is None else m[m["context_len"] == T]).groupby("config").median(numeric_only=True)
        if not {"none", "prefill"} <= set(g.index) or g.loc["none", "chunk"] < g.loc["prefill", "chunk"]:
            return ""
        at = "" if T is None or len(lengths) == 1 else f" at {_ctx(int(T))}"
        if bool(g.loc["prefill"].get("batched", False)):
            out.append(f"the device cap leaves `none` the same {g.loc['none', 'chunk']:,.0f}-token budget per forward "
                       f"as `prefill`{at}, so both run the same batched forwards")
            continue
        held = (f" ({g.loc['none', 'in_flight']:.0f} vs {g.loc['prefill', 'in_flight']:.0f} prompts held)"
                if "in_flight" in g else "")
        out.append(f"the device cap leaves `none` the same {g.loc['none', 'chunk']:,.0f}-token chunks as "
                   f"`prefill`{at}{held}, and the engine prefills one request's chunk per forward")
    return (("at this point " if len(lengths) == 1 else "") + "; ".join(out) + ", so the lab's own byte model predicts ~1.0× here: the point cannot show the "
            "published effect")


def _prefill_runs() -> list[str]:
    """The committed prefill-throughput runs docs/runs.toml names under `prefill_throughput`: one run, or a list
    (a length's configs may be measured in separate runs, each length in its own)."""
    v = RUNS.get("prefill_throughput", "")
    runs = [v] if isinstance(v, str) else list(v)
    return [r for r in runs if r and (REPO / r / "manifest.json").is_file()]


def _prefill_terms(runs: list[str], m: pd.DataFrame) -> Figure | None:
    """Prompts per second, prefill-only offload over none, in the published terms: one figure, or with several
    lengths one point per length where none held a prompt (where it could not, the gain is unbounded: said in
    the figure's words, not a point). None when no length has both."""
    lengths = sorted(m["context_len"].unique()) if "context_len" in m else [None]
    points, unbounded, both = [], [], []
    for T in lengths:
        g = (m if T is None else m[m["context_len"] == T]).groupby("config").median(numeric_only=True)
        num = g.loc["prefill" if "prefill" in g.index else "both"] if {"prefill", "both"} & set(g.index) else None
        if num is None:
            continue
        if "none" not in g.index:
            unbounded.append(_ctx(int(T)) if T is not None else "this length")
            continue
        den = g.loc["none"]
        lo = num.get("prompts_per_s_min", num["prompts_per_s"]) / den.get("prompts_per_s_max", den["prompts_per_s"])
        hi = num.get("prompts_per_s_max", num["prompts_per_s"]) / den.get("prompts_per_s_min", den["prompts_per_s"])
        label = _ctx(int(T)) if T is not None and len(lengths) > 1 else ""
        points.append((label or _ctx(int(T)) if T is not None else label, float(num["prompts_per_s"] / den["prompts_per_s"]), float(lo), float(hi)))
        if "both" in g.index:
            both.append(f"{label} {g.loc['both', 'prompts_per_s'] / den['prompts_per_s']:.2f}×".strip())
    if not points:
        return None
    how = "slowest–fastest repeat" if "prompts_per_s_min" in m else "one measurement"
    batched = "batched" in m and bool(m["batched"].fillna(False).astype(bool).any())
    what = ("prompts prefilled per second, prefill-only offload / none, under a device cap"
            + (", several prompts a forward" if batched else "")
            + (f"; both stages {', '.join(both)}" if both else "")
            + (f"; at {', '.join(unbounded)} none cannot hold one prompt (unbounded gain, no point)" if unbounded else ""))
    shape = f"{run_shape(runs[0])}'s shape"      # the manifest's shape and revision: a stand-in says so
    dev = (str(m["gpu_name"].dropna().iloc[0]).replace("NVIDIA ", "") if "gpu_name" in m and m["gpu_name"].notna().any()
           else "our GPU")
    held = (f", {m['weights_dtype'].dropna().iloc[0]} weights" if "weights_dtype" in m and m["weights_dtype"].notna().any()
            else "")
    differs = f"{shape}{held} on one {dev} (dense attention), not GLM-5.2 on Ascend 910C"
    if len(points) == 1:
        _, v, lo, hi = points[0]
        return Figure(v, lo, hi, how, what, tuple(runs), differs)
    vals = [p[1] for p in points]
    return Figure(float(pd.Series(vals).median()), min(p[2] for p in points), max(p[3] for p in points), how, what,
                  tuple(runs), differs, points=tuple(points))


def _goodput_regime(runs: list[str], limit: float) -> str:
    """Why capacity runs cannot test a throughput at a TPOT limit ("" when they can): the limit never binds, memory
    sets every batch (each configuration's batch is every request it holds, its TPOT under the limit)."""
    rows = pd.concat([_metrics(r) for r in runs])
    if not {"batch", "requests", "tpot_ms", "config"} <= set(rows.columns):
        return ""
    if not ((rows["batch"] >= rows["requests"]) & (rows["tpot_ms"] < limit)).all():
        return ""
    g = rows.groupby("config")[["batch", "tpot_ms"]].median()
    return (f"the {limit:g} ms TPOT limit never binds: memory sets every batch (" + ", ".join(
        f"{k}: {v['batch']:.0f} requests at {v['tpot_ms']:.1f} ms" for k, v in g.iterrows())
        + "); the published figure is throughput where the limit decides the batch")


def differing_points(m: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """(the offloaded decode rows that have a resident row at the same context, batch, budget and step count,
    the labels of those whose `logits_sha` is not the resident's)."""
    key = ["context_len", "concurrency", "budget", "logits_after_steps"]
    res = m[m["strategy"] == "resident"].set_index(key)["logits_sha"]
    res = res[~res.index.duplicated()]         # a point measured twice: its first resident row
    off = m[(m["strategy"] != "resident") & m.set_index(key).index.isin(res.index)]
    differ = [f"{r.strategy} {_ctx(r.context_len)} c={int(r.concurrency)}" for r in off.itertuples()
              if r.logits_sha != res.loc[tuple(getattr(r, k) for k in key)]]
    return off, differ


def _same_outputs(sys) -> Claim:
    """Offloaded decode's outputs against resident's, point for point, on the published shape's decode grid: the
    logits after the same steps (`logits_sha`) of every offloaded strategy against the resident strategy's at the
    same context, batch and budget (a count of the points that differ; the publication's is zero)."""
    run = box.reference_run()
    m = box.reference_metrics()
    m = m[(m["experiment"] == "decode") & (m["status"] == "ok")]
    settle = ("the published shape's decode grid re-run with each point's `logits_sha` (plans/reference-model.toml "
              "`decode-w4a16`), named `reference` in docs/runs.toml")
    if "logits_sha" not in m or m["logits_sha"].isna().all():
        return Claim("flash-same-tokens", sys, FLASH_SAME, settle=settle)
    off, differ = differing_points(m)
    n, gpu_name = len(off), str(m["gpu_name"].dropna().iloc[0]).replace("NVIDIA ", "")
    strategies = ", ".join(sorted(off["strategy"].unique()))
    what = (f"decode points whose logits after the same steps (SHA-256) differ from the resident strategy's at the same "
            f"context, batch and budget: {strategies} against resident, {n} points"
            + (f" (differ: {', '.join(differ)})" if differ else ""))
    terms = Figure(float(len(differ)), float(len(differ)), float(len(differ)), "one process a point", what,
                   (run, *box.reference_more()), f"the published shape in W4A16 on one {gpu_name}; the lab's selection "
                   "and attention, not FlashOffloading's fused kernel", "points")
    return Claim("flash-same-tokens", sys, FLASH_SAME, terms=terms, settle=settle)


def flash_claims() -> list[Claim]:
    HOT_DECODE_RUNS = [tuple(x) for x in RUNS["hot_decode"]]
    sys = SYSTEMS["flash"]
    out = []
    pre = prefill_rows(RUNS["repeats_prefill"])
    gpu_name = str(_metrics(RUNS["repeats_prefill"][0])["gpu_name"].dropna().iloc[0]).replace("NVIDIA ", "")
    one_prompt = _across(list(pre["value"]), RUNS["repeats_prefill"],
                         f"one {_ctx(int(_metrics(RUNS['repeats_prefill'][0])['context_len'].max()))} prompt's prefill "
                         f"speed, rotating buffers (KV to host RAM) / resident, one {gpu_name}")
    terms, m = None, None
    runs = _prefill_runs()
    if runs:
        m = pd.concat([_metrics(r) for r in runs], ignore_index=True)
        terms = _prefill_terms(runs, m)
    regime = _prefill_regime(m)
    for key, pub in (("flash-prefill-throughput", FLASH_PREFILL), ("flash-prefill-dense", FLASH_DENSE)):
        out.append(Claim(key, sys, pub, terms=terms, strongest=one_prompt, stand_in=one_prompt, regime=regime,
                         settle=_PREFILL_SETTLE))
    cap = capacity_rows(RUNS["repeats_capacity"])
    good = cap[cap["figure"].str.startswith("goodput")]
    prm = load_run(REPO / RUNS["repeats_capacity"][0]).manifest["parameters"]
    limit = float(prm.get("tpot_ms", float("nan")))
    hot = []
    for r, how in HOT_DECODE_RUNS:
        if how == HOT_DECODE_RUNS[-1][1]:
            mm = _metrics(r).set_index("strategy")
            hot.append((r, mm.loc["resident", "step_ms_median"] / mm.loc["hot_cache", "step_ms_median"]))
    cap_gpu = str(_metrics(RUNS["repeats_capacity"][0])["gpu_name"].dropna().iloc[0]).replace("NVIDIA ", "")
    out.append(Claim("flash-decode-goodput", sys, FLASH_DECODE,
                     terms=_across(list(good["value"]), RUNS["repeats_capacity"],
                                   f"decode goodput (tok/s of the largest batch within a {limit:g} ms TPOT limit), offload "
                                   f"in both stages / none, requests of {_ctx(prm['context_len'])} tokens",
                                   differs=f"{run_shape(RUNS['repeats_capacity'][0])}'s shape under a {prm['mem_cap_gib']:g} GiB device cap on one "
                                           f"{cap_gpu}; no speculative decoding"
                                           + ("" if limit == PUBLISHED_TPOT_MS else f"; TPOT limit {limit:g} ms")),
                     strongest=_across([v for _, v in hot], [r for r, _ in hot],
                                       f"the hot cache's decode speed / resident at {_ctx(PUBLISHED_CONTEXT)}, c = 1, "
                                       "recorded selections (one process per selection trace)"),
                     regime=_goodput_regime(RUNS["repeats_capacity"], limit),
                     settle="a capacity run where the TPOT limit binds: a device cap and request length at which none's "
                            "and both's largest batches within the limit are smaller than the batches memory allows"))
    out.append(_same_outputs(sys))
    return out

