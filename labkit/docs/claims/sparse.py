"""The claims card's rows for sparse offload of Qwen3.8-Flash-Next (3x RTX 3090, decode to 1M tokens), and the cost
model for that published box that several of them read: the link-rate check of its transfer term
(`link_check`), its decode tok/s (`box_prediction`) and its prefill (`prefill_prediction`)."""
from __future__ import annotations

import pandas as pd

from ...costmodel import gpu, gpu_for_name, predict_prefill, predict_table
from ...experiments.decode.tables import decode_ratio_rows
from ...experiments.prefill.tables import prefill_rows
from ...report import summary as S
from ...report.units import tokens_label as _ctx
from ...results import REPO, load_run
from ...shapes import PRESETS, metrics_shape
from ..runs import RUNS
from .common import (BOX_GPU, BOX_GPUS, PUBLISHED_CONTEXT, across as _across, named_run as _run,
                     ok_metrics as _metrics, one as _one)
from .rule import LINK_CHECK_RATES, LINK_CHECK_TOLERANCE, SYSTEMS, Claim, Figure, Published


# -- the cost model for the published box ---------------------------------------------------------------------
def link_check() -> dict | None:
    """The link-rate run's predicted vs measured step times: rates, worst error, whether the model is checked."""
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
    return {"run": run, "rates": rates, "worst": float(err.max()),
            "checked": len(rates) >= LINK_CHECK_RATES and bool((err <= LINK_CHECK_TOLERANCE).all())}


def _box_name() -> str:
    return f"{BOX_GPUS}× {gpu(BOX_GPU).name.replace('NVIDIA GeForce ', '')}"


def _box() -> str:
    """The published box in words, its link from labkit/data/gpus.toml."""
    g = gpu(BOX_GPU)
    return f"{_box_name()} (PCIe {g.pcie_gen}.0 x{g.pcie_width})"




def box_prediction(concurrency: int, context_len: int = PUBLISHED_CONTEXT, strategy: str = "zero_copy",
                   over: tuple[int, ...] = ()) -> tuple[Figure, bool]:
    """The cost model's tok/s on the published box (fitted on today's decode run), with its error band: the worst
    error at the link-rate run's points when one is committed, else the worst on the H200's own points. `over`:
    contexts to predict at as well; the figure then carries one point each (its value stays `context_len`'s)."""
    run = RUNS["decode_now"]
    m = load_run(REPO / run).metrics
    contexts = sorted({int(context_len), *map(int, over)})
    tab = predict_table(m, metrics_shape(m), gpu_for_name(str(m["gpu_name"].dropna().iloc[0])), gpu(BOX_GPU),
                        BOX_GPUS, contexts=contexts, concurrency=[concurrency])
    tab = tab[tab["strategy"] == strategy].set_index("context_len")["predicted_tok_s"].astype(float)
    chk = link_check()
    if chk:
        e, how, runs = chk["worst"], (f"± the model's worst error at {len(chk['rates'])} link rates "
                                      f"({', '.join(f'{r:g}' for r in chk['rates'])} GB/s)"), (run, chk["run"])
    else:
        err = S.cost_model_errors(m)
        e = float(err[err["strategy"] == strategy]["error"].abs().max())
        how, runs = f"± the model's worst {strategy} error on the H200's own points ({e:.0%})", (run,)
    band = lambda p: (p, p / (1 + e), p / max(1 - e, 1e-9))  # noqa: E731
    p = float(tab.loc[int(context_len)])
    points = tuple((_ctx(x), *band(float(tab.loc[x]))) for x in sorted(map(int, over)))
    fig = Figure(*band(p), how,
                 f"cost model: {strategy}, c = {concurrency}, layers split over {_box()}, fitted on one "
                 f"{str(m['gpu_name'].dropna().iloc[0]).replace('NVIDIA ', '')}", runs, "", "tok/s", points)
    # the link-rate check covers the link term only; compute, bandwidth and shape stay unchecked on a second GPU
    return fig, (("link",) if chk and chk["checked"] else ())


def _prefill_predicted(run: str) -> tuple[dict, dict]:
    """The fastest prefill row of a committed run with its FLOPs from the anatomy, and the cost model's prediction
    from it for 3x RTX 3090 (`costmodel.predict_prefill`: compute phases by the datasheets' dense bf16 rates;
    `dense_bound_tok_s`: the prompt's FLOPs at their rate, whatever attention the run used)."""
    lr = load_run(REPO / run)
    m, a = lr.metrics, lr.table("anatomy")
    m = m[(m["experiment"] == "prefill") & (m["status"] == "ok")]
    best = m.loc[m["tok_s"].idxmax()].to_dict()
    keys = [k for k in ("engine_variant", "mode", "prefill_attention") if k in a and isinstance(best.get(k), str)]
    sel = a[(a[keys] == pd.Series({k: best[k] for k in keys})).all(axis=1)] if keys else a
    work = [c for c in ("weights_flops", "attention_flops", "deltanet_flops", "index_score_flops") if c in sel]
    best["prefill_flops"] = float(sel[work].sum().sum())
    return best, predict_prefill(best, gpu_for_name(str(best["gpu_name"])), gpu(BOX_GPU), BOX_GPUS)


def prefill_prediction(run: str | None = None) -> Figure:
    """The cost model's 248K prefill on 3x RTX 3090 from the fastest variant of a committed prefill run with its
    anatomy (default: the dense prompt with today's kernels), with the bound."""
    run = run or RUNS["prefill_now"]
    return _prediction_figure(run, *_prefill_predicted(run))


def _prediction_figure(run: str, best: dict, p: dict) -> Figure:
    sparse = best.get("prefill_attention") == "sparse"
    how = f"sparse attention (top {int(best['budget']):,} rows a query)" if sparse else "dense attention"
    what = (f"cost model: {_ctx(int(best['context_len']))} prompt, {how}, layers split over {_box()} with the "
            f"chunks pipelined, from the H200's anatomy at {best['tok_s']:,.0f} tok/s ({best.get('engine_variant') or best['mode']}); "
            f"the bound there (the prompt's FLOPs at {BOX_GPUS} × {_rate(BOX_GPU):g} TFLOPS, bf16 with FP32 accumulation) is "
            f"{p['dense_bound_tok_s']:,.0f} tok/s"
            + ("" if sparse or p["dense_bound_tok_s"] >= PREFILL_248K.value else ", below the published figure: it implies sparse "
               "prefill or FP16 accumulation"))
    return Figure(p["tok_s"], p["tok_s"], p["tok_s"], f"one anatomy scaled by datasheet rates; the {'sparse' if sparse else 'dense'} "
                  f"bound on {_box_name()} {p['dense_bound_tok_s']:,.0f} tok/s", what, (run,), "", "tok/s")


def _rate(key: str) -> float:
    """A GPU's dense bf16 tensor rate (FP32 accumulation), TFLOPS, as `data/gpus.toml` gives it with its source."""
    return gpu(key).bf16_tflops


def _with_sparse(dense: Figure, run: str) -> Figure:
    """The dense prediction with QSA's sparse prefill (the committed run `run`) scaled the same way beside it: the
    sparse bound, unlike the dense one, leaves room for the published figure."""
    best, p = _prefill_predicted(run)
    sparse, bound = _prediction_figure(run, best, p), p["dense_bound_tok_s"]
    return Figure(**{**dense.__dict__, "how": f"{dense.how}; sparse prefill scaled the same way {sparse.value:,.0f} "
                     f"tok/s, its bound {bound:,.0f} tok/s", "what": f"{dense.what}; {sparse.what}",
                     "runs": tuple(dense.runs) + tuple(sparse.runs)})


LINK_SETTLE = ("a link-rate decode run (`link_gbps` at ≥ 3 rates including PCIe 4.0 x16's, `predicted_step_ms` beside "
               "`step_ms_median`, zero_copy at 1M, c = 1 and 4), named `link_rate` in docs/runs.toml")


def _decode_now() -> pd.DataFrame:
    d = S.decode_table(load_run(REPO / RUNS["decode_now"]).metrics)
    return d.set_index(["strategy", "concurrency", "context_len"])


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


def _sparse_shape_claims(sys, shape, budget: int, d, top: int, gpu_name: str) -> list[Claim]:
    """The sparse-offload figures that follow from the shape (bytes a step, the link at ~80 tok/s, index bytes),
    each beside what the engine counted."""
    out = []
    z1 = d.loc[("zero_copy", 1, top)]
    step = shape.h2d_bytes_per_step(budget, [budget])
    arithmetic = (f"{shape.attn_layers} QSA layers × {budget:,} rows × {shape.row_bytes:,} B")
    rows = d.xs(("zero_copy", 1), level=("strategy", "concurrency"))
    mib = rows["h2d_bytes_per_step"] / 2**20
    hot = d.loc[("hot_cache", 1, top)]
    out.append(Claim("sparse-bytes-step", sys, BYTES_STEP,
                     construction=_one(step / 2**20, f"the shape's arithmetic, {arithmetic}", [RUNS["decode_now"]],
                                       "MiB", how="arithmetic"),
                     terms=Figure(float(mib.median()), float(mib.min()), float(mib.max()),
                                  f"min–max over {len(mib)} contexts ({_ctx(rows.index.min())}–{_ctx(rows.index.max())})",
                                  f"host-to-device bytes per decode step counted by the engine, zero_copy, c = 1, budget "
                                  f"{budget:,}", (RUNS["decode_now"],), f"the same layout and budget; one {gpu_name}", "MiB"),
                     strongest=_one(hot["h2d_bytes_per_step"] / 2**20, f"the hot cache's bytes per step at {_ctx(top)}, "
                                    "c = 1 (only misses cross)", [RUNS["decode_now"]], "MiB", how="one process")))
    rate = DECODE_BELOW.value     # the published ~80 tok/s the ~3.9 GB/s is quoted at
    out.append(Claim("sparse-link-at-80", sys, LINK_AT_80,
                     construction=_one(step * rate / 1e9, f"the shape's arithmetic, ({arithmetic}) × {rate:g} steps a "
                                       "second", [RUNS["decode_now"]], "GB/s", how="arithmetic"),
                     strongest=_one(z1["h2d_bytes_per_step"] * z1["tok_s"] / 1e9, f"what the link carried at "
                                    f"{_ctx(top)}, c = 1 on one {gpu_name}: bytes per step × {z1['tok_s']:.0f} tok/s",
                                    [RUNS["decode_now"]], "GB/s", how="one process")))
    out.append(Claim("sparse-index-bytes", sys, INDEX_BYTES,
                     construction=_one(shape.index_key_bytes, f"the shape's arithmetic, {shape.index_dim} fp8 values + an "
                                       "fp16 scale a token and QSA layer (the public config's indexer, which compresses "
                                       f"{PRESETS['qwen3.8-flash-next'].index_compress} tokens into one entry, would take "
                                       "half: the shape's note)",
                                       [RUNS["decode_now"]], "B", how="arithmetic")))
    return out


def sparse_claims() -> list[Claim]:
    sys = SYSTEMS["sparse"]
    d, top = _decode_now(), PUBLISHED_CONTEXT
    now = load_run(REPO / RUNS["decode_now"]).metrics
    # figures that follow from the shape are read off the shape the run was made with
    shape, budget = metrics_shape(now), int(now["budget"].dropna().iloc[0])
    measured = sorted(int(x) for x in d.xs(("zero_copy", 1), level=("strategy", "concurrency")).index)
    published_range = tuple([budget] + [x for x in measured if budget < x <= top])
    out = []
    rep = decode_ratio_rows(RUNS["repeats_hot1m"])
    zc = rep[rep["figure"].str.startswith("zero_copy")]
    gpu_name = str(now["gpu_name"].dropna().iloc[0]).replace("NVIDIA ", "")
    # ~80 below the budget, ~60 past it to 1M, flat, ~150 at c = 4: the cost model over the published range
    below, below_chk = box_prediction(1, context_len=budget // BELOW_BUDGET[-1],
                                      over=tuple(budget // k for k in BELOW_BUDGET))
    out.append(Claim("sparse-decode-below-budget", sys, DECODE_BELOW, model=below, model_checked=below_chk,
                     settle=LINK_SETTLE))
    z1, r1 = d.loc[("zero_copy", 1, top)], d.loc[("resident", 1, top)]
    strongest = _across(list(zc["value"]), RUNS["repeats_hot1m"],
                        f"zero_copy / resident tok/s at {_ctx(top)}, c = 1, one {gpu_name}, the indexer's selections "
                        f"(on the decode table's recorded trace: {z1['tok_s']:.0f} vs {r1['tok_s']:.0f} tok/s, "
                        f"{z1['tok_s'] / r1['tok_s']:.2f}×)")
    past, past_chk = box_prediction(1, over=published_range)
    out.append(Claim("sparse-decode-c1", sys, DECODE_PAST, strongest=strongest, model=past, model_checked=past_chk,
                     settle=LINK_SETTLE))
    lo_pt, hi_pt = past.points[0], past.points[-1]
    flat_model = Figure(hi_pt[1] / lo_pt[1], hi_pt[1] / lo_pt[1], hi_pt[1] / lo_pt[1],
                        "a ratio of two predictions of one fitted model", f"cost model: tok/s at {hi_pt[0]} / at "
                        f"{lo_pt[0]} on {_box()} ({hi_pt[1]:.1f} vs {lo_pt[1]:.1f} tok/s)", past.runs)
    zrows = d.xs(("zero_copy", 1), level=("strategy", "concurrency"))["tok_s"]
    flat_ours = _one(zrows.loc[top] / zrows.loc[min(zrows.index)],
                     f"zero_copy tok/s at {_ctx(top)} / at {_ctx(min(zrows.index))}, c = 1, measured on one {gpu_name} "
                     f"({zrows.loc[top]:.0f} vs {zrows.loc[min(zrows.index)]:.0f} tok/s)", [RUNS["decode_now"]],
                     how="one process")
    out.append(Claim("sparse-decode-flat", sys, DECODE_FLAT, strongest=flat_ours, model=flat_model,
                     model_checked=past_chk, settle=LINK_SETTLE))
    z4, r4 = d.loc[("zero_copy", 4, top)], d.loc[("resident", 4, top)]
    c4, c4_chk = box_prediction(4, over=published_range)
    out.append(Claim("sparse-decode-c4", sys, DECODE_C4,
                     strongest=_one(z4["tok_s"] / r4["tok_s"], f"zero_copy / resident aggregate tok/s at {_ctx(top)}, "
                                    f"c = 4, one {gpu_name} ({z4['tok_s']:.0f} vs {r4['tok_s']:.0f} tok/s)",
                                    [RUNS["decode_now"]], how="one process"),
                     model=c4, model_checked=c4_chk, settle=LINK_SETTLE))
    pre = prefill_rows(RUNS["repeats_prefill"])
    toks = [float(_metrics(r).set_index("mode").loc["rotating", "tok_s"]) for r in RUNS["repeats_prefill"]]
    ctx = int(_metrics(RUNS["repeats_prefill"][0])["context_len"].max())
    out.append(Claim("sparse-prefill-248k", sys, PREFILL_248K,
                     strongest=_across(toks, RUNS["repeats_prefill"],
                                       f"prefill tok/s of a {_ctx(ctx)} prompt on one {gpu_name}, KV to host RAM through "
                                       f"rotating buffers ({pre['value'].median():.2f}× resident prefill)", unit="tok/s"),
                     model=_with_sparse(prefill_prediction(), RUNS["prefill_sparse"][0]),
                     model_basis="prefill phases scaled by datasheet bf16 rates, unchecked on another GPU",
                     settle=f"a prefill run on {_box_name()}"))
    out += _sparse_shape_claims(sys, shape, budget, d, top, gpu_name)
    out.append(Claim("sparse-1m-box", sys, ONE_M_BOX,
                     untestable=f"the lab has no {_box_name()}; its 1M runs are on one {gpu_name}",
                     settle=f"a 1M-token decode on {_box()} with bf16 KV in host RAM (`labkit run decode` there)"))
    return out

