"""The claims card's rows for sparse offload of Qwen3.8-Flash-Next (3x RTX 3090, decode to 1M tokens), and the cost
model for that published box that several of them read: the link-rate check of its transfer term
(`link_check`), its decode tok/s (`box_prediction`) and its prefill (`prefill_prediction`)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ...costmodel import gpu, gpu_for_name, predict_prefill
from ...experiments.decode.tables import decode_ratio_rows
from ...experiments.prefill.tables import prefill_rows
from ...report import summary as S
from ...report.units import tokens_label as _ctx
from ...results import REPO, load_run
from ...shapes import FLOP_PHASES, PRESETS
from .. import box
from ..runs import RUNS
from .common import (BOX_GPU, BOX_GPUS, PUBLISHED_CONTEXT, PUBLISHED_SHAPE, across as _across, named_run as _run,
                     ok_metrics as _metrics, one as _one)
from .rule import LINK_CHECK_RATES, LINK_CHECK_TOLERANCE, SYSTEMS, Claim, Figure, Published


# -- the cost model for the published box ---------------------------------------------------------------------
def link_check() -> dict | None:
    """The link-rate run's predicted vs measured step times: rates, worst error, whether the model is checked,
    and the shape it ran (`published`: the published shape's; a stand-in's run checks the stand-in's model only)."""
    run = _run("link_rate")
    if not run:
        return None
    d = _metrics(run)
    need = ["link_gbps", "predicted_step_ms", "step_ms_median"]
    if not set(need) <= set(d.columns):
        return None
    d = d.dropna(subset=need)
    if d.empty:
        return None
    err = (d["predicted_step_ms"] / d["step_ms_median"] - 1).abs()
    rates = sorted(float(x) for x in d["link_gbps"].unique())
    shape = box.run_shape(run)
    return {"run": run, "rates": rates, "worst": float(err.max()), "shape": shape, "published": shape == PUBLISHED_SHAPE,
            "checked": len(rates) >= LINK_CHECK_RATES and bool((err <= LINK_CHECK_TOLERANCE).all())}


def _box_name() -> str:
    return f"{BOX_GPUS}× {gpu(BOX_GPU).name.replace('NVIDIA GeForce ', '')}"


def _box() -> str:
    """The published box in words, its link from labkit/data/gpus.toml."""
    g = gpu(BOX_GPU)
    return f"{_box_name()} (PCIe {g.pcie_gen}.0 x{g.pcie_width})"


def box_prediction(concurrency: int, context_len: int = PUBLISHED_CONTEXT, strategy: str = "zero_copy",
                   over: tuple[int, ...] = ()) -> tuple[Figure, bool]:
    """The cost model's tok/s on the published box, scaled from the published shape's run as `labkit predict`
    scales it (`labkit.docs.box`), with its error band: the worst error at the link-rate run's points when one of
    the published shape is committed, else the worst on the source run's own points. `over`: contexts to predict
    at as well; the figure then carries one point each (its value stays `context_len`'s)."""
    run = box.reference_run()
    src = box.run_setup(run)
    contexts = sorted({int(context_len), *map(int, over)})
    tab = box.box_table(run, contexts=contexts, concurrency=[concurrency])
    tab = tab[tab["strategy"] == strategy].set_index("context_len")["predicted_tok_s"].astype(float)
    chk = link_check()
    if chk and chk["published"]:
        e, how, runs = chk["worst"], (f"± the model's worst error at {len(chk['rates'])} link rates "
                                      f"({', '.join(f'{r:g}' for r in chk['rates'])} GB/s)"), (run, chk["run"])
    else:
        err = box.box_errors(run)
        e = float(err[err["strategy"] == strategy]["error"].abs().max())
        how, runs = (f"± the model's worst {strategy} error on the source run's own points ({e:.0%}); the link-rate "
                     f"check {LINK_PENDING}"), (run,)
    band = lambda p: (p, p / (1 + e), p / max(1 - e, 1e-9))  # noqa: E731
    how = f"scaling {src['words']}; {how}"
    p = float(tab.loc[int(context_len)])
    points = tuple((_ctx(x), *band(float(tab.loc[x]))) for x in sorted(map(int, over)))
    fig = Figure(*band(p), how,
                 f"cost model: {strategy}, c = {concurrency}, layers split over {_box()}, scaling the published "
                 f"shape's run ({src['words']}), as `labkit predict` does", runs, "", "tok/s", points)
    # the link-rate check covers the link term only, and only on the published shape's run
    return fig, (("link",) if chk and chk["published"] and chk["checked"] else ())


def _prefill_predicted(run: str) -> tuple[dict, dict]:
    """The fastest prefill row of a committed run with its FLOPs from the anatomy, and the cost model's prediction
    from it for 3x RTX 3090 (`costmodel.predict_prefill`: compute phases by the datasheets' dense bf16 rates;
    `dense_bound_tok_s`: the prompt's FLOPs at their rate, whatever attention the run used)."""
    lr = load_run(REPO / run)
    m, a = lr.metrics, lr.table("anatomy")
    m = m[(m["experiment"] == "prefill") & (m["status"] == "ok")]
    m = m[m["context_len"] == _nearest_published(m["context_len"])]
    best = m.loc[m["tok_s"].idxmax()].to_dict()
    keys = [k for k in ("engine_variant", "mode", "prefill_attention") if k in a and isinstance(best.get(k), str)]
    sel = a[(a[keys] == pd.Series({k: best[k] for k in keys})).all(axis=1)] if keys else a
    if "context_len" in sel:
        sel = sel[sel["context_len"] == best["context_len"]]
    work = [f"{ph}_flops" for ph in FLOP_PHASES if f"{ph}_flops" in sel]
    best["prefill_flops"] = float(sel[work].sum().sum())
    return best, predict_prefill(best, gpu_for_name(str(best["gpu_name"])), gpu(BOX_GPU), BOX_GPUS)


def prefill_prediction(run: str | None = None) -> Figure:
    """The cost model's prefill on 3x RTX 3090 from the fastest prompt of a committed prefill run with its
    anatomy (default: the published shape's prefill run, `reference_prefill.h100`), with the bound."""
    run = run or _published_prefill_run()
    return _prediction_figure(run, *_prefill_predicted(run))


def _nearest_published(lengths) -> int:
    """Of prompt lengths, the one nearest the published 248K (by ratio; the longer of two as near)."""
    return int(min((int(x) for x in pd.Series(lengths).dropna()),
                   key=lambda x: (abs(np.log(x / PREFILL_248K_TOKENS)), -x)))


def _published_prefill_run() -> str:
    """Of the published shape's prefill runs (`reference_prefill` on the reference GPU: one run or several), the
    one with the prompt nearest the published 248K (a 1M prompt under a cap is not a 248K figure)."""
    runs = RUNS["reference_prefill"][box.REFERENCE_GPU]
    runs = [runs] if isinstance(runs, str) else list(runs)
    lengths = {r: _metrics(r)["context_len"] for r in runs}
    near = _nearest_published(pd.concat(lengths.values()))
    return next(r for r in runs if (lengths[r] == near).any())


def _prediction_figure(run: str, best: dict, p: dict) -> Figure:
    sparse = best.get("prefill_attention") == "sparse"
    how = f"sparse attention (top {int(best['budget']):,} rows a query)" if sparse else "dense attention"
    shape = str(best.get("shape") or "")
    who = (f"the published shape ({shape}, {best.get('weights_dtype') or 'bf16'})" if shape == PUBLISHED_SHAPE
           else f"the stand-in shape ({shape})")
    src = str(best["gpu_name"]).replace("NVIDIA ", "")
    what = (f"cost model: {_ctx(int(best['context_len']))} prompt, {how}, layers split over {_box()} with the "
            f"chunks pipelined, from {who}'s anatomy on one {src} at {best['tok_s']:,.0f} tok/s "
            f"({best.get('engine_variant') or best['mode']}); "
            f"the bound there (the prompt's FLOPs at {BOX_GPUS} × {_rate(BOX_GPU):g} TFLOPS, bf16 with FP32 accumulation) is "
            f"{p['dense_bound_tok_s']:,.0f} tok/s"
            + ("" if sparse or p["dense_bound_tok_s"] >= PREFILL_248K.value else ", below the published figure: it implies sparse "
               "prefill or FP16 accumulation"))
    return Figure(p["tok_s"], p["tok_s"], p["tok_s"], f"{who}'s {_ctx(int(best['context_len']))} prompt on one {src}, its "
                  f"anatomy scaled by datasheet rates; the {'sparse' if sparse else 'dense'} "
                  f"bound on {_box_name()} {p['dense_bound_tok_s']:,.0f} tok/s", what, (run,), "", "tok/s")


def _rate(key: str) -> float:
    """A GPU's dense bf16 tensor rate (FP32 accumulation), TFLOPS, as `data/gpus.toml` gives it with its source."""
    return gpu(key).bf16_tflops


def _with_sparse(dense: Figure, run: str) -> Figure:
    """The dense prediction with QSA's sparse prefill (the committed run `run`) scaled the same way beside it: the
    sparse bound, unlike the dense one, leaves room for the published figure."""
    best, p = _prefill_predicted(run)
    sparse, bound = _prediction_figure(run, best, p), p["dense_bound_tok_s"]
    return Figure(**{**dense.__dict__, "how": f"{dense.how}; stand-in line: the stand-in shape's sparse prefill "
                     f"scaled the same way {sparse.value:,.0f} "
                     f"tok/s, its bound {bound:,.0f} tok/s", "what": f"{dense.what}; {sparse.what}",
                     "runs": tuple(dense.runs) + tuple(sparse.runs)})


def _link_pending() -> str:
    """Where the published shape's link-rate check stands, from the runs docs/runs.toml names."""
    one = bool(_run("link_1m")) and box.run_shape(_run("link_1m")) == PUBLISHED_SHAPE
    return ("not re-run on the published shape at several rates yet: plans/claims.toml `link-rate` (its committed run "
            "is of the stand-in shape" + ("; `link-1m-pcie4`'s, at one rate, is of the published shape)" if one
                                          else ", as is `link-1m-pcie4`'s)"))


LINK_PENDING = _link_pending()
LINK_SETTLE = ("the link-rate check re-run on the published shape on a GPU (plans/claims.toml `link-rate`, "
               "`link-1m-pcie4` with shape qwen3.8-flash-next, W4A16: `link_gbps` at ≥ 3 rates including PCIe 4.0 "
               "x16's, `predicted_step_ms` beside `step_ms_median`, zero_copy at 1M, c = 1 and 4), named `link_rate` "
               "in docs/runs.toml")
PREFILL_SETTLE = ("a 248K prefill of the published shape (qwen3.8-flash-next, W4A16) with its anatomy on a GPU "
                  "(plans/prefill-capacity.toml `prefill-248k` with that shape), named `reference_prefill` in "
                  "docs/runs.toml; then a prefill run on 3× RTX 3090")
PREFILL_SETTLE_BOX = ("a 248K prefill of the published shape on 3× RTX 3090 (the cost model's scaling of the H100 "
                      "run's phases by datasheet rates is unchecked on a second GPU)")


def _reference() -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """The published shape's decode run (`reference.h100`, with `reference_more`'s points): its decode table by
    (strategy, c, context), its metrics, the run."""
    run = box.reference_run()
    m = box.reference_metrics()
    return S.decode_table(m).set_index(["strategy", "concurrency", "context_len"]), m, run


def _stand_in_words(run: str) -> str:
    m = load_run(REPO / run).metrics
    return f"stand-in shape {box.run_shape(run)}, one {str(m['gpu_name'].dropna().iloc[0]).replace('NVIDIA ', '')}"


# -- sparse offload of Qwen3.8-Flash-Next ---------------------------------------------------------------------
DECODE_BELOW = Published(80, "~80 tok/s below the budget", "decode, c = 1, context below the 2048-token budget, "
                         "3× RTX 3090 (PCIe 4.0 x16), vLLM", "absolute", approx=True, unit="tok/s", contrast=60)
DECODE_PAST = Published(60, "~80 → ~60 tok/s once past the budget, to 1M", "decode, c = 1, budget 2048, contexts "
                        "from the budget to 1M, 3× RTX 3090 (PCIe 4.0 x16), vLLM", "absolute", approx=True,
                        unit="tok/s", contrast=80)
DECODE_FLAT = Published(1.0, "then flat as the context keeps growing", "decode, c = 1: tok/s at 1M over tok/s just "
                        "past the budget (flat = 1×, against the 60 / 80 drop the budget causes)", contrast=60 / 80)
DECODE_C4 = Published(150, "~150 tok/s aggregate at 4 requests", "decode, 4 concurrent requests (context not stated: "
                      "judged over 2K–1M), 3× RTX 3090", "absolute", approx=True, unit="tok/s")
PREFILL_248K_TOKENS = 248 * 1024      # the published prompt: the prefill runs' 248K
PREFILL_248K = Published(3701, "3,701 tok/s prefill at 248K", "one 248K-token prompt, 3× RTX 3090", "absolute",
                         unit="tok/s")
BYTES_STEP = Published(48, "48 MiB per step", "12 layers × 2048 rows × 2048 B, c = 1", "absolute", unit="MiB")
LINK_AT_80 = Published(3.9, "~3.9 GB/s at 80 tok/s", "the 48 MiB per step at 80 steps a second over PCIe 4.0 x16",
                       "absolute", approx=True, unit="GB/s")
INDEX_BYTES = Published(66, "66 B per token and layer", "the indexer's compressed index keys on the device, against "
                        "2048 B of K+V", "absolute", unit="B")
ONE_M_BOX = Published(1 << 20, "1M context on 3× RTX 3090 without KV quantization", "decode at 1M tokens, bf16 KV in "
                      "host RAM, 24 GB a GPU", "absolute", unit="tokens")
BELOW_BUDGET = (4, 2)     # "below the budget": the cost model read at a quarter and a half of the run's budget


PCIE_HIDES = Published(1.0, "PCIe 4.0 x16 hides the transfer behind compute with no decode-latency loss at long "
                       "context", "decode with the KV in host RAM against the KV resident, long contexts, 3× RTX 3090 "
                       "(PCIe 4.0 x16): offloaded tok/s over resident tok/s at the same point (1× = no loss)",
                       "absolute", unit="×")


def _sparse_shape_claims(sys, shape, budget: int, d, top: int, gpu_name: str, run: str) -> list[Claim]:
    """The sparse-offload figures that follow from the published shape (bytes a step, the link at ~80 tok/s, index
    bytes), each beside what the engine counted on the published shape's run."""
    out = []
    z1 = d.loc[("zero_copy", 1, top)]
    step = shape.h2d_bytes_per_step(budget, [budget])
    arithmetic = (f"{shape.attn_layers} QSA layers × {budget:,} rows × {shape.row_bytes:,} B")
    rows = d.xs(("zero_copy", 1), level=("strategy", "concurrency"))
    mib = rows["h2d_bytes_per_step"] / 2**20
    hot = d.loc[("hot_cache", 1, top)]
    out.append(Claim("sparse-bytes-step", sys, BYTES_STEP,
                     construction=_one(step / 2**20, f"the shape's arithmetic ({shape.name}), {arithmetic}", [run],
                                       "MiB", how="arithmetic"),
                     terms=Figure(float(mib.median()), float(mib.min()), float(mib.max()),
                                  f"min–max over {len(mib)} contexts ({_ctx(rows.index.min())}–{_ctx(rows.index.max())})",
                                  f"host-to-device bytes per decode step counted by the engine, zero_copy, c = 1, budget "
                                  f"{budget:,}", (run,), f"the same layout and budget; one {gpu_name}", "MiB"),
                     strongest=_one(hot["h2d_bytes_per_step"] / 2**20, f"the hot cache's bytes per step at {_ctx(top)}, "
                                    "c = 1 (only misses cross)", [run, *box.reference_more()], "MiB",
                                    how="one process")))
    rate = DECODE_BELOW.value     # the published ~80 tok/s the ~3.9 GB/s is quoted at
    out.append(Claim("sparse-link-at-80", sys, LINK_AT_80,
                     construction=_one(step * rate / 1e9, f"the shape's arithmetic ({shape.name}), ({arithmetic}) × "
                                       f"{rate:g} steps a second", [run], "GB/s", how="arithmetic"),
                     strongest=_one(z1["h2d_bytes_per_step"] * z1["tok_s"] / 1e9, f"what the link carried at "
                                    f"{_ctx(top)}, c = 1 on one {gpu_name}: bytes per step × {z1['tok_s']:.0f} tok/s",
                                    [run], "GB/s", how="one process")))
    out.append(Claim("sparse-index-bytes", sys, INDEX_BYTES,
                     construction=_one(shape.index_key_bytes, f"the shape's arithmetic ({shape.name}), "
                                       f"{shape.index_dim} fp8 values + an fp16 scale a token and QSA layer (the public "
                                       f"config's indexer, which compresses {PRESETS[PUBLISHED_SHAPE].index_compress} "
                                       "tokens into one entry, would take half: the shape's note)",
                                       [run], "B", how="arithmetic")))
    return out


def _pcie_points(d: pd.DataFrame, contexts, value) -> tuple:
    """(label, v, v, v) for zero_copy and the hot cache against resident at each (c, context) where both ran."""
    pts = []
    for strategy in ("zero_copy", "hot_cache"):
        for c in (1, 4):
            for x in contexts:
                if (strategy, c, x) in d.index and ("resident", c, x) in d.index:
                    v = value(strategy, c, x)
                    pts.append((f"{strategy} {_ctx(x)} c={c}", v, v, v))
    return tuple(pts)


def _pcie_claim(sys, d: pd.DataFrame, m: pd.DataFrame, run: str, gpu_name: str) -> Claim:
    """The transfer hidden behind compute with no decode-latency loss: offloaded over resident tok/s on the
    published shape's decode grid, beside the cost model's step ratio on the published box."""
    contexts = sorted(int(x) for x in d.index.get_level_values("context_len").unique())
    pts = _pcie_points(d, contexts, lambda s, c, x: float(d.loc[(s, c, x), "tok_s"] / d.loc[("resident", c, x), "tok_s"]))
    vals = [p[1] for p in pts]
    top = max(contexts)
    z = m[(m["strategy"] == "zero_copy") & (m["concurrency"] == 1) & (m["context_len"] == top)].iloc[0]
    terms = Figure(float(pd.Series(vals).median()), min(vals), max(vals), "one process a point",
                   f"offloaded / resident tok/s on the published shape's decode grid, one {gpu_name}; at {_ctx(top)}, "
                   f"c = 1 the zero_copy step's transfer phase alone is {z['anat_transfer_ms']:.2f} ms of "
                   f"{z['step_ms_median']:.2f} ms (anatomy)", (run,),
                   f"one {gpu_name}, its PCIe 5.0 x16 link, not 3× RTX 3090 on PCIe 4.0 x16", points=pts)
    tab = box.box_table(run, contexts=contexts, concurrency=[1, 4]).set_index(["strategy", "concurrency", "context_len"])
    step = tab["predicted_step_ms"].astype(float)
    mpts = _pcie_points(tab, contexts, lambda s, c, x: float(step.loc[("resident", c, x)] / step.loc[(s, c, x)]))
    mv = [p[1] for p in mpts]
    model = Figure(float(pd.Series(mv).median()), min(mv), max(mv),
                   f"a ratio of two predictions of one fitted model, scaling {box.run_setup(run)['words']}",
                   f"cost model: resident / offloaded predicted step on {_box()}, scaling the published shape's run "
                   "(resident's step where its KV would not fit the cards: the model's step, a hypothetical)", (run,),
                   "", "×", mpts)
    return Claim("sparse-pcie4-hides", sys, PCIE_HIDES, terms=terms, model=model,
                 proxy=f"one {gpu_name}'s PCIe 5.0 x16 link for the published PCIe 4.0 x16",
                 settle=f"the published shape's decode at PCIe 4.0 x16's rate ({LINK_PENDING})")


def _decode_claims(sys, d, run: str, budget: int, gpu_name: str) -> list[Claim]:
    """~80 below the budget, ~60 past it to 1M, flat, ~150 at c = 4: the cost model over the published range,
    scaling the published shape's run; ours on that run beside it (a stand-in run only in a line that says so)."""
    top = PUBLISHED_CONTEXT
    measured = sorted(int(x) for x in d.xs(("zero_copy", 1), level=("strategy", "concurrency")).index)
    published_range = tuple([budget] + [x for x in measured if budget < x <= top])
    rep = decode_ratio_rows(RUNS["repeats_hot1m"])
    zc = rep[rep["figure"].str.startswith("zero_copy")]["value"]
    out = []
    below, below_chk = box_prediction(1, context_len=budget // BELOW_BUDGET[-1],
                                      over=tuple(budget // k for k in BELOW_BUDGET))
    out.append(Claim("sparse-decode-below-budget", sys, DECODE_BELOW, model=below, model_checked=below_chk,
                     settle=LINK_SETTLE))
    z1, r1 = d.loc[("zero_copy", 1, top)], d.loc[("resident", 1, top)]
    strongest = _one(z1["tok_s"] / r1["tok_s"], f"zero_copy / resident tok/s at {_ctx(top)}, c = 1, the published "
                     f"shape on one {gpu_name} ({z1['tok_s']:.0f} vs {r1['tok_s']:.0f} tok/s); stand-in line: "
                     f"{_stand_in_words(RUNS['repeats_hot1m'][0])}, {len(zc)} processes, {zc.median():.2f}× "
                     f"({zc.min():.2f}–{zc.max():.2f})", [run, *RUNS["repeats_hot1m"]], how="one process")
    past, past_chk = box_prediction(1, over=published_range)
    out.append(Claim("sparse-decode-c1", sys, DECODE_PAST, strongest=strongest, model=past, model_checked=past_chk,
                     settle=LINK_SETTLE))
    lo_pt, hi_pt = past.points[0], past.points[-1]
    flat_model = Figure(hi_pt[1] / lo_pt[1], hi_pt[1] / lo_pt[1], hi_pt[1] / lo_pt[1],
                        f"a ratio of two predictions of one fitted model, scaling {box.run_setup(run)['words']}", f"cost model: tok/s at {hi_pt[0]} / at "
                        f"{lo_pt[0]} on {_box()} ({hi_pt[1]:.1f} vs {lo_pt[1]:.1f} tok/s)", past.runs)
    zrows = d.xs(("zero_copy", 1), level=("strategy", "concurrency"))["tok_s"]
    flat_ours = _one(zrows.loc[top] / zrows.loc[min(zrows.index)],
                     f"zero_copy tok/s at {_ctx(top)} / at {_ctx(min(zrows.index))}, c = 1, the published shape "
                     f"measured on one {gpu_name} ({zrows.loc[top]:.0f} vs {zrows.loc[min(zrows.index)]:.0f} tok/s)",
                     [run], how="one process")
    out.append(Claim("sparse-decode-flat", sys, DECODE_FLAT, strongest=flat_ours, model=flat_model,
                     model_checked=past_chk, settle=LINK_SETTLE))
    at = max(x for x in measured if ("resident", 4, x) in d.index)
    z4, r4 = d.loc[("zero_copy", 4, at)], d.loc[("resident", 4, at)]
    c4, c4_chk = box_prediction(4, over=published_range)
    out.append(Claim("sparse-decode-c4", sys, DECODE_C4,
                     strongest=_one(z4["tok_s"] / r4["tok_s"], f"zero_copy / resident aggregate tok/s at {_ctx(at)} "
                                    f"(the longest context resident ran at c = 4), c = 4, the published shape on one "
                                    f"{gpu_name} ({z4['tok_s']:.0f} vs {r4['tok_s']:.0f} tok/s)", [run],
                                    how="one process"),
                     model=c4, model_checked=c4_chk, settle=LINK_SETTLE))
    return out


def _prefill_claim(sys) -> Claim:
    """3,701 tok/s at 248K: the published shape's prefill scaled to the box from its prompt nearest 248K (outside
    the published regime while that prompt is not 248K); the stand-in's 248K prompts in lines that say so."""
    pre = prefill_rows(RUNS["repeats_prefill"])
    toks = [float(_metrics(r).set_index("mode").loc["rotating", "tok_s"]) for r in RUNS["repeats_prefill"]]
    ctx = int(_metrics(RUNS["repeats_prefill"][0])["context_len"].max())
    model = _with_sparse(prefill_prediction(), RUNS["prefill_sparse"][0])
    run = _published_prefill_run()
    longest = _nearest_published(_metrics(run)["context_len"])
    return Claim("sparse-prefill-248k", sys, PREFILL_248K,
                 strongest=_across(toks, RUNS["repeats_prefill"],
                                   f"stand-in line: prefill tok/s of a {_ctx(ctx)} prompt, "
                                   f"{_stand_in_words(RUNS['repeats_prefill'][0])}, KV to host RAM through rotating "
                                   f"buffers ({pre['value'].median():.2f}× resident prefill)", unit="tok/s"),
                 model=model, model_basis="prefill phases scaled by datasheet bf16 rates, unchecked on another GPU",
                 regime="" if longest == PREFILL_248K_TOKENS else (
                     f"the published shape's prefill prompt nearest the published 248K is {_ctx(longest)} "
                     f"(the cost model scales its anatomy: "
                     f"{model.value:,.0f} tok/s on {_box_name()}, not a 248K figure)"),
                 settle=PREFILL_SETTLE if longest != PREFILL_248K_TOKENS else PREFILL_SETTLE_BOX)


def sparse_claims() -> list[Claim]:
    sys = SYSTEMS["sparse"]
    d, m, run = _reference()
    # figures that follow from the shape are read off the published shape's run (its manifest's shape)
    shape, budget = box.run_setup(run)["shape"], int(m["budget"].dropna().iloc[0])
    gpu_name = str(m["gpu_name"].dropna().iloc[0]).replace("NVIDIA ", "")
    out = _decode_claims(sys, d, run, budget, gpu_name)
    out.append(_pcie_claim(sys, d, m, run, gpu_name))
    out.append(_prefill_claim(sys))
    out += _sparse_shape_claims(sys, shape, budget, d, PUBLISHED_CONTEXT, gpu_name, run)
    out.append(Claim("sparse-1m-box", sys, ONE_M_BOX,
                     untestable=f"the lab has no {_box_name()}; its 1M runs are on one {gpu_name} (the published "
                                "shape) and one H200 (the stand-in)",
                     settle=f"a 1M-token decode on {_box()} with bf16 KV in host RAM (`labkit run decode` there)"))
    return out
