"""Tables of the published model's runs (`plans/reference-model.toml`): the decode grid on each GPU, the cost model
checked across two real GPUs, the portable path beside the native one, the layer split's memory plan against the
allocator, and the reference box predicted beside a peer's measurements of the same model on RTX 3090s.

Each block is made only where `docs/runs.toml` names its runs (`reference` = {h200 = ..., h100 = ...},
`reference_portable`, `reference_split_memory`); `readme_tables.producers` gathers them with the rest.
"""
from __future__ import annotations

import json
import statistics
from functools import partial
from typing import Callable

import pandas as pd

from .. import costmodel as C
from .. import peer as P
from ..results import REPO, load_run
from ..engine.memory_plan import GIB, plan_split
from ..shapes import FLOP_PHASES, PRESETS, metrics_shape
from ..report import summary as S
from ..report.units import tokens_label as _ctx

_md = S.md_table

# the peer's points a prediction of the box is checked on: one request at four depths, and 4K at c = 1-8
PEER_DEPTHS = (4096, 32768, 131072, 263800)
PEER_CONCURRENCY = (1, 2, 4, 8)
# the two ways the box is predicted: the peer's (each card a quarter of every layer, experts included) and the
# published sparse-offload system's (the layers in three stages)
BOX_SPLITS = (("tensor", 4, "4x RTX 3090, tensor parallel"), ("layers", 3, "3x RTX 3090, layers in 3 stages"))


def _run(path: str):
    run = load_run(REPO / path)
    return run, metrics_shape(run.metrics)


def _source_gpu(mf: dict) -> C.GPU:
    g = C.gpu_for_name(mf.get("gpu_name") or "")
    if g is None:
        raise ValueError(f"{mf.get('run_id')}: its GPU ({mf.get('gpu_name')}) is not in gpus.toml")
    return g


# ---- the shape's costs (no run: arithmetic on the public config) ------------------------------------------------
def step_bytes_table(name: str = "qwen3.8-flash-next", concurrency=(1, 2, 4, 8)) -> str:
    """Weight bytes one decode step reads, by part, in bf16 and W4A16, as the batch grows (the distinct routed
    experts a layer reads grow with it), beside the stand-in the lab used before the public config."""
    s, standin = PRESETS[name], PRESETS[f"{name}-standin"]
    rows = []
    for wd in ("bf16", "w4a16"):
        for c in concurrency:
            e = s.expected_experts(c)
            parts = s.step_weight_bytes(c, wd, e)
            rows.append({"weights": wd, "c": c, "experts read / layer": f"{e:.1f}",
                         **{f"{k} GB": f"{v / 1e9:.2f}" for k, v in parts.items()},
                         "step GB": f"{sum(parts.values()) / 1e9:.2f}",
                         "per request GB": f"{sum(parts.values()) / 1e9 / c:.2f}"})
    old = sum(standin.step_weight_bytes(1, "bf16").values())
    return (f"{_md(pd.DataFrame(rows))}\n\nThe stand-in read {old / 1e9:.2f} GB a step in bf16 at any batch (a dense "
            f"FFN, no routed experts). Held weights: {s.weight_bytes('bf16') / 1e9:.1f} GB in bf16, "
            f"{s.weight_bytes('w4a16') / 1e9:.1f} GB in W4A16; the n-gram embedding's table "
            f"({s.ngram_table_bytes / GIB:.0f} GiB) stays in host RAM and sends {s.ngram_fetch_bytes:,} B a token "
            f"over the host link.")


def split_plan_table(name: str = "qwen3.8-flash-next", cards: int = 3, context_len: int = 1 << 20,
                     cap_gib: float = 24.0) -> str:
    """The layer split over `cards` cards of `cap_gib` at `context_len`, W4A16, per card and part
    (`memory_plan.plan_split`), for one and four requests with zero_copy and four with the hot cache."""
    s = PRESETS[name]
    rows = []
    for c, strategy in ((1, "zero_copy"), (4, "zero_copy"), (4, "hot_cache")):
        for p in plan_split(s, cards, context_len, c, "w4a16", strategy=strategy, max_steps=64):
            rows.append({"point": f"{strategy} c={c}", "card": p.card, "layers": f"{p.layers[0]}–{p.layers[1] - 1}",
                         **{k.replace("_", " ") + " GiB": f"{v / GIB:.2f}" for k, v in p.parts.items()},
                         "card GiB": f"{p.total / GIB:.2f}", "host KV GiB": f"{p.host_kv / GIB:.1f}",
                         f"fits {cap_gib:g} GiB": "yes" if p.fits(cap_gib) else "no"})
    return (f"{_ctx(context_len)} context, W4A16 weights, {cards} cards of {cap_gib:g} GiB (less a CUDA context's "
            f"share, kept off each card):\n\n{_md(pd.DataFrame(rows).fillna('—'))}")


# ---- the grid as measured --------------------------------------------------------------------------------------
def _with_more(path: str, more: tuple = ()):
    """(the run at `path`, its shape, its metrics with the decode points of the runs `more` joined, and the
    paths named): a grid whose strategies a device sitting measured in two processes is one table."""
    run = load_run(REPO / path, [REPO / p for p in more])
    m = run.metrics
    return run, metrics_shape(m), m, ", ".join(f"`{p}`" for p in (path, *more))


def grid_table(path: str, more: tuple = ()) -> str:
    """Decode tok/s per strategy at each context and concurrency, the experts a step read, and prefill tok/s;
    `more`: runs whose decode points join the table (the same GPU, shape and weights)."""
    run, shape, m, named = _with_more(path, more)
    d = m[(m["experiment"] == "decode") & (m["status"] == "ok")]
    if "axis" in d:
        d = d[d["axis"] == "context"]
    rows = []
    for (c, ctx), g in d.groupby(["concurrency", "context_len"]):
        r = {"c": int(c), "context": _ctx(ctx)}
        for _, x in g.sort_values("strategy").iterrows():
            r[f"{x['strategy']} tok/s"] = f"{x['tok_s']:.1f} ({x['step_ms_min']:.2f}–{x['step_ms_max']:.2f} ms)"
        if "experts_read_per_layer" in g:
            r["experts read / layer"] = f"{g['experts_read_per_layer'].median():.1f}"
        rows.append(r)
    failed = m[(m["experiment"] == "decode") & (m["status"] != "ok")]
    out = [f"{shape.name}, {run.manifest.get('parameters', {}).get('weights_dtype', 'bf16')} weights, on "
           f"{run.manifest.get('gpu_name')} ({named}); tok/s with the step's fastest–slowest repeat.",
           "", _md(pd.DataFrame(rows).fillna("—"))]
    if not failed.empty:
        out += ["", "Points that did not run: " + "; ".join(
            f"{r['strategy']} {_ctx(r['context_len'])} c={int(r['concurrency'])} ({str(r['error'])[:80]})"
            for _, r in failed.iterrows())]
    p = m[(m["experiment"] == "prefill") & (m["status"] == "ok")]
    if not p.empty:
        out += ["", "Prefill: " + ", ".join(f"{_ctx(r['context_len'])} at {r['tok_s']:,.0f} tok/s"
                                            for _, r in p.sort_values("context_len").iterrows())]
    return "\n".join(out)


def _anatomy_points(m: pd.DataFrame) -> pd.DataFrame:
    """A grid's decode points that measured an anatomy (the context axis where the run has several)."""
    d = m[(m["experiment"] == "decode") & (m["status"] == "ok") & m["anat_closure"].notna()]
    return d[d["axis"] == "context"] if "axis" in d else d


def anatomy_of(path: str, more: tuple = ()) -> str:
    """Where each decode step's time goes, phase by phase (the runner's anatomy: a graph with an event at every
    phase boundary), for every point of the run's grid (and of `more`, as `grid_table`); only the phases this
    shape has."""
    run, shape, d, named = _with_more(path, more)
    d = _anatomy_points(d)
    phases = [c[5:-3] for c in d.columns if c.startswith("anat_") and c.endswith("_ms") and c != "anat_marked_step_ms"
              and d[c].fillna(0).max() > 0.005]
    rows = []
    for _, r in d.sort_values(["concurrency", "context_len", "strategy"]).iterrows():
        row = {"c": int(r["concurrency"]), "context": _ctx(r["context_len"]), "strategy": r["strategy"]}
        row.update({ph: f"{r[f'anat_{ph}_ms']:.2f}" for ph in phases})
        row["sum / step"] = f"{r['anat_closure']:.3f}"
        row["step ms"] = f"{r['step_ms_median']:.2f}"
        rows.append(row)
    return (f"{shape.name}, {run.manifest.get('parameters', {}).get('weights_dtype', 'bf16')} weights, on "
            f"{run.manifest.get('gpu_name')} ({named}); ms per phase of the step, the phases' sum over the unmarked "
            f"step as the accounting's check:\n\n{_md(pd.DataFrame(rows))}")


# the anatomy's phases that stream bytes a step, and the bytes each must read: a weight part of the shape (at the
# distinct experts the point read), the index keys, or the rows that cross the host link
PHASE_BYTES = (("experts", ("experts",)), ("hc", ("hc",)), ("weights + deltanet", ("weights", "deltanet")),
               ("head", ("head",)), ("index_score", ("index_score",)), ("transfer", ("transfer",)))


def phase_bounds(r: pd.Series, shape, weights_dtype: str, hbm_gbps: float, link_gbps: float) -> dict:
    """One decode point's streaming phases: {phase: (ms, bound ms)}, each bound its bytes at the rate the run
    measured (HBM read; the host link for `transfer`). `weights + deltanet` reads the dense products (the QSA and
    DeltaNet projections); `index_score` the index keys of every request's context."""
    c = int(r["concurrency"])
    wb = shape.step_weight_bytes(c, weights_dtype, r.get("experts_read_per_layer"))
    need = {"experts": wb["experts"], "hc": wb["hc"], "weights + deltanet": wb["dense"], "head": wb["head"],
            "index_score": c * int(r["context_len"]) * shape.index_key_bytes * shape.attn_layers,
            "transfer": float(r.get("h2d_bytes_per_step") or 0.0)}
    out = {}
    for name, cols in PHASE_BYTES:
        ms = sum(float(r.get(f"anat_{c_}_ms") or 0.0) for c_ in cols)
        rate = link_gbps if name == "transfer" else hbm_gbps
        if need[name] > 0 and ms > 0 and rate == rate:         # a NaN rate: not measured in the run
            out[name] = (ms, need[name] / (rate * 1e6))
    return out


def anatomy_bounds(path: str, more: tuple = ()) -> str:
    """Each streaming phase of each point against its own bound (its bytes at the rate measured in the same run),
    so the next bottleneck is read off the row: ms / bound, with the bound in ms beside the first point's."""
    run, shape, d, named = _with_more(path, more)
    hbm, link = C._probe_gbps(d, "hbm_read"), C._probe_gbps(d, "zero_copy")     # a run without the link probe:
    if not hbm:                                                                    # no transfer bound
        raise ValueError(f"{path}: no hbm_read row to take the bounds from")
    held = run.manifest.get("parameters", {}).get("weights_dtype") or "bf16"
    d = _anatomy_points(d)
    rows = []
    for _, r in d.sort_values(["concurrency", "context_len", "strategy"]).iterrows():
        b = phase_bounds(r, shape, held, hbm, link or float("nan"))
        row = {"c": int(r["concurrency"]), "context": _ctx(r["context_len"]), "strategy": r["strategy"]}
        row.update({name: f"{ms / lim:.1f}× ({lim:.2f})" for name, (ms, lim) in b.items()})
        weights = sum(lim for name, (_, lim) in b.items() if name in ("experts", "hc", "weights + deltanet", "head"))
        row["step / weight bound"] = f"{r['step_ms_median'] / weights:.2f}×"
        rows.append(row)
    return (f"{shape.name}, {held} weights, on {run.manifest.get('gpu_name')} ({named}): each phase's ms over its "
            f"bound, the bound's ms in brackets (its bytes at {hbm:,.0f} GB/s of HBM read"
            + (f", `transfer` at the {link:.1f} GB/s host link" if link else "") + ", measured in the run); "
            f"`weights + deltanet` is the dense "
            f"products' phases, `index_score` reads every request's index keys:\n\n{_md(pd.DataFrame(rows).fillna('—'))}")


# ---- the cost model across two GPUs --------------------------------------------------------------------------
def cross_frame(a_path: str, b_path: str, a_more: tuple = (), b_more: tuple = ()) -> pd.DataFrame:
    """Every point measured in both runs predicted in both directions (`costmodel.cross_check`); `a_more`,
    `b_more`: runs whose decode points join each side's (a grid measured in two processes)."""
    (ra, sa, _, _), (rb, _, _, _) = _with_more(a_path, a_more), _with_more(b_path, b_more)
    ga, gb = _source_gpu(ra.manifest), _source_gpu(rb.manifest)
    out = []
    for src, tgt, gs, gt in ((ra, rb, ga, gb), (rb, ra, gb, ga)):
        x = C.cross_check(src.metrics, tgt.metrics, sa, gs, gt)
        x.insert(0, "direction", f"{gs.key} → {gt.key}")
        out.append(x)
    return pd.concat(out, ignore_index=True)


def cross_summary(x: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for d, g in x.groupby("direction", sort=False):
        e = g["error"].abs()
        rows.append({"direction": d, "points": len(g), "median |error|": f"{e.median():.1%}",
                     "worst": f"{g.loc[e.idxmax(), 'error']:+.1%}", "within 10%": f"{(e <= 0.10).sum()} of {len(g)}"})
    return pd.DataFrame(rows)


def cross_table(a_path: str, b_path: str, a_more: tuple = (), b_more: tuple = ()) -> str:
    x = cross_frame(a_path, b_path, a_more, b_more)
    rows = [{"direction": r["direction"], "kind": r["kind"], "strategy": r["strategy"], "context": _ctx(r["context_len"]),
             "c": int(r["concurrency"]), "source ms": f"{r['source_ms']:.2f}", "predicted ms": f"{r['predicted_ms']:.2f}",
             "measured ms": f"{r['measured_ms']:.2f}", "error": f"{r['error']:+.1%}"} for _, r in x.iterrows()]
    return f"{_md(cross_summary(x))}\n\n{_md(pd.DataFrame(rows))}"


# ---- the portable path beside the native one ------------------------------------------------------------------
def portable_table(path: str) -> str:
    """Each point on the native and the portable path (`arch`) of one GPU, and what portability costs."""
    run, _ = _run(path)
    m = run.metrics[run.metrics["status"] == "ok"]
    if "arch" not in m:
        raise ValueError(f"{path}: no arch column: not a run over arch=auto,portable")
    key = ["experiment", "strategy", "context_len", "concurrency"]
    piv = m.pivot_table(index=key, columns="arch", values="tok_s", aggfunc="median")
    native = next((a for a in ("native", "auto") if a in piv.columns), None)
    if native is None or "portable" not in piv.columns:
        raise ValueError(f"{path}: needs both a native (or auto) and a portable arch, has {list(piv.columns)}")
    rows = [{"experiment": e, "strategy": s, "context": _ctx(ctx), "c": int(c), "native tok/s": f"{r[native]:.1f}",
             "portable tok/s": f"{r['portable']:.1f}", "portable / native": f"{r['portable'] / r[native]:.2f}"}
            for (e, s, ctx, c), r in piv.iterrows()]
    return f"On {run.manifest.get('gpu_name')} (`{path}`):\n\n{_md(pd.DataFrame(rows))}"


# ---- the layer split's memory -----------------------------------------------------------------------------------
def split_memory_table(path: str) -> str:
    """`scripts/split_memory_check.py`'s JSON: per card and point, the plan against the allocator's peak."""
    doc = json.loads((REPO / path).read_text())
    gib = 1 << 30
    rows = []
    for r in doc["rows"]:
        peak = r.get("peak_bytes")
        rows.append({"card": r["card"], "layers": r["layers"], "point": f"{r['strategy']} c={r['concurrency']}",
                     "planned GiB": f"{r['planned_bytes'] / gib:.2f}",
                     "peak GiB": f"{peak / gib:.2f}" if peak else "—",
                     "peak / plan": f"{r['peak_over_plan']:.3f}" if r.get("peak_over_plan") else "—",
                     "status": r["status"]})
    return f"Under a {doc['rows'][0]['cap_gib']:g} GiB cap on {doc['device']} (`{path}`):\n\n{_md(pd.DataFrame(rows))}"


# ---- the weight stream ---------------------------------------------------------------------------------------
# the parts and batches a swept bench is summarised at
PARTS_C = [("dense", 1), ("dense", 4), ("experts", 1), ("experts", 4)]


# what each W4A16 kernel of the bench is (`scripts/weights_bench.py`'s VARIANTS and REFERENCES), in column order
BENCH_KERNELS = {"default": "the engine's choice", "rows": "FMA row kernel", "rows-no-pdl": "FMA, no PDL",
                 "dot": "tensor-core kernel", "dot-no-pdl": "tensor-core, no PDL", "torch-int4pack": "torch int4pack",
                 "gemlite": "gemlite", "dequant": "dequantising kernel"}


def weights_bench_table(path: str) -> str:
    """`scripts/weights_bench.py`'s JSON: one decode step's weight products per part and dtype, against the HBM read
    bandwidth measured in the same process (the physical bound of a step that only streams weights). A bench that
    names each row's kernel (the lab's or an existing library's) is one row per part and batch, a column per kernel;
    earlier benches one row per part, dtype and variant."""
    doc = json.loads((REPO / path).read_text())
    if any("kernel" in r for r in doc["rows"]):
        return _kernels_table(doc, path)
    # a bench of one kernel per dtype has no variant column (the earlier runs); else the variant names the kernel
    variants = len({r.get("variant", "default") for r in doc["rows"]}) > 1
    # a sweep of the tiles and splits: the engine's kernel and the earlier one in full, the rest as the best of them
    swept = [r for r in doc["rows"] if r.get("variant", "default") not in ("default", "dequant")]
    shown = [r for r in doc["rows"] if r not in swept] if len(swept) > 4 * len(PARTS_C) else doc["rows"]
    rows = [{"part": r["part"], "weights": r["weights"],
             **({"kernel": "lab's" if r["weights"] == "bf16" else r.get("variant", "default")} if variants else {}),
             "c": r["concurrency"], "GB read": f"{r['bytes'] / 1e9:.2f}",
             "ms (min–max)": f"{r['ms_median']:.2f} ({r['ms_min']:.2f}–{r['ms_max']:.2f})",
             "GB/s": f"{r['gbps']:.0f}", "of HBM read": f"{r['of_hbm_read']:.0%}"} for r in shown]
    floor = (f"; a kernel of no work in a graph: {doc['launch_floor_us']:.2f} µs" if doc.get("launch_floor_us")
             else "")
    text = (f"{doc['shape']} on {doc['device']} (`{path}`); HBM read measured in the same process: "
            f"{doc['hbm_read_gbps']:.0f} GB/s{floor}.\n\n{_md(pd.DataFrame(rows))}")
    if shown is not doc["rows"]:
        text += "\n\n" + _best_swept(doc["rows"], swept)
    return text



def _kernels_table(doc: dict, path: str) -> str:
    """The bench as a grid: W4A16 per part and batch, ms and share of the HBM read for each kernel, bf16's the lab's
    bf16 products where the bench timed them; then each dense matrix kind alone, µs a product."""
    floor = f"; a kernel of no work in a graph: {doc['launch_floor_us']:.2f} µs" if doc.get("launch_floor_us") else ""
    variants = list(dict.fromkeys(r["variant"] for r in doc["rows"] if r["weights"] == "w4a16"))
    variants.sort(key=lambda v: list(BENCH_KERNELS).index(v) if v in BENCH_KERNELS else len(BENCH_KERNELS))
    grid = []
    for part, c in PARTS_C:
        at = {r["variant"]: r for r in doc["rows"] if (r["part"], r["concurrency"], r["weights"]) == (part, c, "w4a16")}
        if not at:
            continue
        bf = next((r for r in doc["rows"] if (r["part"], r["concurrency"], r["weights"]) == (part, c, "bf16")), None)
        row = {"part": part, "c": c, "W4A16 GB": f"{next(iter(at.values()))['bytes'] / 1e9:.2f}"}
        if bf is not None:
            row["bf16 (lab's)"] = f"{bf['ms_median']:.2f} ({bf['of_hbm_read']:.0%})"
        for v in variants:
            r = at.get(v)
            row[BENCH_KERNELS.get(v, v)] = f"{r['ms_median']:.2f} ({r['of_hbm_read']:.0%})" if r else "—"
        grid.append(row)
    text = (f"{doc['shape']} on {doc['device']} (`{path}`); HBM read measured in the same process: "
            f"{doc['hbm_read_gbps']:.0f} GB/s{floor}. ms for the step's products at c requests (median of the "
            f"graph's replays) and their share of the read:\n\n{_md(pd.DataFrame(grid))}")
    hc = [r for r in doc["rows"] if r["part"] == "hc" and "us_per_mix" in r]
    if hc:
        def mix(c, variant):
            r = next((r for r in hc if (r["concurrency"], r["variant"]) == (c, variant)), None)
            return f"{r['us_per_mix']:.1f} µs ({r['of_hbm_read']:.0%})" if r else "—"
        each = hc[0]["bytes"] / hc[0]["mixes"]
        text += (f"\n\nThe hyper-connections' mixes ({hc[0]['mixes']} back to back, {each / 1e6:.1f} MB of bf16 weights a "
                 f"mix: {each / doc['hbm_read_gbps'] / 1e3:.1f} µs at the read rate), a mix and its share of the read: "
                 + "; ".join(f"c = {c}: two launches {mix(c, 'two-launch')}, the compiled pieces {mix(c, 'compiled')}"
                             for c in sorted({r['concurrency'] for r in hc})) + ".")
    pm = [r for r in doc.get("per_matrix", []) if "error" not in r]
    if pm:
        kernels = list(dict.fromkeys(r["kernel"] for r in pm))
        mats = []
        for name in dict.fromkeys(r["matrix"] for r in pm):
            at = {r["kernel"]: r for r in pm if r["matrix"] == name}
            first = next(iter(at.values()))
            row = {"matrix": name, "K × N": f"{first['K']:,} × {first['N']:,}",
                   "MB": f"{first['bytes'] / first['count'] / 1e6:.2f}",
                   "bound µs": f"{first['bytes'] / first['count'] / doc['hbm_read_gbps'] / 1e3:.1f}"}
            for k in kernels:
                r = at.get(k)
                row[BENCH_KERNELS.get(k, k)] = f"{r['us_per_product']:.1f} ({r['of_hbm_read']:.0%})" if r else "—"
            mats.append(row)
        text += ("\n\nEach dense matrix kind alone, its copies back to back at one row (µs a product, its share of "
                 f"the read; the bound is its bytes at the read rate):\n\n{_md(pd.DataFrame(mats))}")
    checks = doc.get("checks", [])
    if checks:
        def worst(cs):
            return max(c["rel_err"] for c in cs) if cs else float("nan")
        libs = [c for c in checks if c["kernel"] in ("torch-int4pack", "gemlite")]
        lab = [c for c in checks if c not in libs]
        text += (f"\n\nEvery kernel's products checked against the definition in the same process, fresh inputs "
                 f"({len(checks)} checks): relative error at most {worst(lab):.1e} for the lab's kernels"
                 + (f", {worst(libs):.1e} for the libraries (gemlite folds the zero into a bf16 offset, zero x "
                    f"scale, rounded once more)" if libs else "") + ".")
    return text


def _best_swept(all_rows: list[dict], swept: list[dict]) -> str:
    """The fastest of the swept tiles and splits at each part and batch, against the engine's kernel."""
    out = []
    for part, c in PARTS_C:
        at = [r for r in swept if (r["part"], r["concurrency"]) == (part, c)]
        base = next((r for r in all_rows if (r["part"], r["weights"], r.get("variant"), r["concurrency"])
                     == (part, "w4a16", "default", c)), None)
        if not at or base is None:
            continue
        best = min(at, key=lambda r: r["ms_median"])
        out.append({"part": part, "c": c, "swept": len(at), "fastest": best["variant"],
                    "ms": f"{best['ms_median']:.2f}", "of HBM read": f"{best['of_hbm_read']:.0%}",
                    "against default": f"{best['ms_median'] / base['ms_median']:.2f}×"})
    return (f"The other tiles and splits swept ({len({r['variant'] for r in swept})} of them, every row in the file), "
            f"the fastest at each part and batch:\n\n{_md(pd.DataFrame(out))}")


# ---- prefill of the published shape -------------------------------------------------------------------------
PREFILL_PHASES = ("weights", "experts", "hc", "ngram", "deltanet", "attention", "kv_write", "kv_load")


def prefill_table(paths: str | list[str]) -> str:
    """The prefill experiment's anatomy at each prompt of one or several runs: tok/s against the bound (its FLOPs and
    bytes at the GPU's rates), each timed phase in seconds over the prompt (a dash where a run's anatomy did not
    name the phase yet), and what no phase names (`other`) with its share of the prompt's time.

    The bound is recomputed from the run's chunks with today's `prefill_chunk_work`, which counts the routed experts
    a token computes: runs made before that stored a weights bound for every expert of every layer (about 20x the
    FLOPs at this shape). The GEMM rate is the one the run measured (a chunk's stored FLOPs over their bound)."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    rows, first = [], None
    for path in paths:
        m = load_run(REPO / path).metrics
        m = m[(m["experiment"] == "prefill") & (m["status"] == "ok") & m["context_len"].notna()]
        a = pd.read_parquet(REPO / path / "anatomy.parquet")
        shape = metrics_shape(m)
        first = first if first is not None else m.iloc[0]
        for r in m.to_dict("records"):
            bound_tok_s = _prompt_bound_tok_s(shape, a, r)
            rows.append({"prompt": _ctx(r["context_len"]), "mode": r["mode"], "tok/s": f"{r['tok_s']:,.0f}",
                         "bound tok/s": f"{bound_tok_s:,.0f}", "of bound": f"{r['tok_s'] / bound_tok_s:.1%}",
                         **{f"{ph} s": _seconds(r.get(f"anatomy_{ph}_ms")) for ph in PREFILL_PHASES},
                         "other s": f"{r['anatomy_other_ms'] / 1e3:.2f}",
                         "other of the prompt": f"{r['anatomy_other_ms'] / r['anatomy_chunk_ms']:.0%}",
                         "closure": f"{r['anatomy_closure']:.2f}"})
    how = (f"{first['shape']}, {first['weights_dtype']} weights, on {first['gpu_name']} "
           f"({', '.join(f'`{p}`' for p in paths)}); seconds per phase summed over the prompt's chunks, the phases' "
           f"sum over the unmarked prompt as the accounting's check; the bound counts the routed experts a token "
           f"computes")
    return f"{how}:\n\n{_md(pd.DataFrame(rows))}"


def prefill_points(paths: str | list[str]) -> pd.DataFrame:
    """Each prompt of the prefill runs at `paths`: shape, weights, GPU, prompt, mode, tok/s and the bound's tok/s
    (`prefill_table`'s, recomputed from the run's chunks)."""
    out = []
    for path in [paths] if isinstance(paths, str) else paths:
        m = load_run(REPO / path).metrics
        m = m[(m["experiment"] == "prefill") & (m["status"] == "ok") & m["context_len"].notna()]
        a = pd.read_parquet(REPO / path / "anatomy.parquet")
        shape = metrics_shape(m)
        for r in m.to_dict("records"):
            bound = _prompt_bound_tok_s(shape, a, r)
            out.append({"shape": r["shape"], "weights_dtype": r["weights_dtype"], "gpu_name": r["gpu_name"],
                        "context_len": int(r["context_len"]), "mode": r["mode"], "tok_s": float(r["tok_s"]),
                        "bound_tok_s": bound, "seconds": float(r["step_ms_median"]) / 1e3,
                        "mem_cap_gib": (r.get("mem_cap_bytes") or 0) / 2**30, "run": path})
    return pd.DataFrame(out)


def _prompt_bound_tok_s(shape, anatomy: pd.DataFrame, r: dict) -> float:
    """A prompt's bound in tok/s: its chunks' bounds (`_chunk_bound_ms`) summed."""
    ch = anatomy[(anatomy["mode"] == r["mode"]) & (anatomy["context_len"] == r["context_len"])]
    return r["context_len"] / sum(_chunk_bound_ms(shape, c) for c in ch.to_dict("records")) * 1e3


def _seconds(ms) -> str:
    """A phase's seconds; a dash where the run's anatomy did not name the phase (runs before it was timed apart)."""
    return "—" if ms is None or ms != ms else f"{ms / 1e3:.2f}"


def _chunk_bound_ms(shape, c: dict) -> float:
    """One chunk's bound: its FLOP phases at the GEMM rate the run measured, its byte phases as stored."""
    ph = next(ph for ph in ("weights", "attention", "deltanet") if (c.get(f"{ph}_bound_ms") or 0) > 0)
    peak_flops_per_ms = c[f"{ph}_flops"] / c[f"{ph}_bound_ms"]   # any FLOP phase: one rate for all of them
    w = shape.prefill_chunk_work(int(c["start"]), int(c["end"]))
    flop_ms = sum(w[f"{ph}_flops"] / peak_flops_per_ms for ph in FLOP_PHASES)
    return flop_ms + sum(_num(c.get(f"{ph}_bound_ms")) for ph in ("kv_write", "kv_load", "ngram"))


def _num(v) -> float:
    return 0.0 if v is None or v != v else float(v)


# ---- the reference box beside the peer's measurements --------------------------------------------------------
def box_predictions(m: pd.DataFrame, shape, source: C.GPU, strategy: str = "resident",
                    weights_dtype: str = "w4a16", **how) -> pd.DataFrame:
    """The box's decode step at the peer's points, per split: rows of context_len, concurrency, metric, predicted,
    split, gpus, step_ms (for `peer.compare`)."""
    cm = C.CostModel.fit(m, shape, strategy, *C.fit_point(m, strategy), source)
    box = C.gpu("rtx3090")
    points = [(ctx, 1) for ctx in PEER_DEPTHS] + [(PEER_DEPTHS[0], c) for c in PEER_CONCURRENCY[1:]]
    rows = []
    for split, n, _ in BOX_SPLITS:
        for ctx, c in points:
            p = cm.predict(box, ctx, c, 2048, n, split=split, weights_dtype=weights_dtype, **how)
            base = {"split": split, "gpus": n, "context_len": ctx, "concurrency": c, "step_ms": p.step_ms,
                    "fits": p.fits, **{f"{k}_ms": v for k, v in p.phases_ms.items()}}
            rows.append({**base, "metric": "tpot_ms", "predicted": p.step_ms})
            rows.append({**base, "metric": "decode_tok_s" if c == 1 else "decode_aggregate_tok_s",
                         "predicted": c * 1e3 / p.step_ms})
    return pd.DataFrame(rows)


def peer_fit() -> dict:
    """The peer's step against its batch at 4K (least squares over c = 1-8): the part that does not grow with
    the batch (`fixed_ms`) and what one more request adds (`per_request_ms`)."""
    pts = P.headline()
    t = pts[(pts["metric"] == "tpot_ms") & (pts["context_len"] == PEER_DEPTHS[0])].sort_values("concurrency")
    cs, ms = list(t["concurrency"].astype(float)), list(t["median"].astype(float))
    slope, icpt = statistics.linear_regression(cs, ms)
    depth = pts[(pts["metric"] == "tpot_ms") & (pts["concurrency"] == 1)]
    return {"fixed_ms": icpt, "per_request_ms": slope, "c1_ms": dict(zip(depth["context_len"], depth["median"]))}


def peer_bound_table(name: str = "qwen3.8-flash-next", cards: int = 4) -> str:
    """The peer's measured step at each of its points beside the bytes each of its cards must read from memory
    at that point (the public config in W4A16, each card a quarter of every layer, the KV heads' rows split
    over the cards as far as they go, KV resident as the peer ran it) and the time those bytes take at the RTX
    3090's memory bandwidth: how far the peer's stack runs from the card's memory bound. No run of the lab's
    is used: the shape's arithmetic and the datasheet."""
    s, box = PRESETS[name], C.gpu("rtx3090")
    pts = P.headline()
    step = pts[pts["metric"] == "tpot_ms"].set_index(["context_len", "concurrency"])["median"]
    points = [(ctx, 1) for ctx in PEER_DEPTHS] + [(PEER_DEPTHS[0], c) for c in PEER_CONCURRENCY[1:]]
    kv_split = min(cards, s.n_kv_heads)
    split = {"weights": cards, "deltanet": cards, "experts": cards, "hc": cards, "head": cards,
             "transfer": kv_split, "attention": kv_split}
    rows = []
    for ctx, c in points:
        by = C.phase_bytes(s, "resident", ctx, c, 2048, "w4a16")
        card = sum(v / split.get(ph, 1) for ph, v in by.items() if ph != "ngram")
        bound = card / (box.hbm_gbps * 1e6)
        rows.append({"point": f"{_ctx(ctx)} c={c}", "peer's step ms": f"{step[(ctx, c)]:.2f}",
                     "read per card GB": f"{card / 1e9:.2f}", f"at {box.hbm_gbps:g} GB/s ms": f"{bound:.2f}",
                     "bound / step": f"{bound / step[(ctx, c)]:.0%}"})
    return (f"The peer's decode step (its tpot_ms; c > 1: the step while the whole batch decodes) against the "
            f"bytes each of its {cards} cards reads a step, timed at the {box.name}'s {box.hbm_gbps:g} GB/s "
            f"(the n-gram rows cross the host link and are left out):\n\n{_md(pd.DataFrame(rows))}")


def _band_label(lats) -> str:
    return f"{lats[0]:g} µs (measured)" if len(lats) == 1 else f"{lats[0]:g}–{lats[-1]:g} µs (unmeasured)"


def _latencies_within(step_at, lats, lo_ms: float, hi_ms: float) -> tuple[float, float] | None:
    """The all-reduce latencies in `lats`' band at which the predicted step lies in [lo_ms, hi_ms] (the step is
    linear in the latency: every layer's two all-reduces each wait it once), or None."""
    if len(lats) == 1:
        return (lats[0], lats[0]) if lo_ms <= step_at[0] <= hi_ms else None
    k = (step_at[-1] - step_at[0]) / (lats[-1] - lats[0])
    a, b = lats[0] + (lo_ms - step_at[0]) / k, lats[0] + (hi_ms - step_at[0]) / k
    a, b = max(a, lats[0]), min(b, lats[-1])
    return (a, b) if a <= b else None


def peer_tensor_rows(path: str, strategy: str = "resident", allreduce_us: float | None = None) -> list[dict]:
    """The peer's setup (4 cards, tensor parallel) predicted at each of its points: the step at each end of the
    all-reduce band (or at the measured latency), the latencies in the band at which it is within 15%, the same
    with a fixed term fitted on points it is not judged on (at c = 1 the other three depths' c = 1 points, at
    c > 1 the four c = 1 points), and the peer's step less that (what a term the model lacks would have to add)."""
    run, shape = _run(path)
    src = _source_gpu(run.manifest)
    lats = (allreduce_us,) if allreduce_us is not None else C.ALLREDUCE_BAND_US
    preds = [box_predictions(run.metrics, shape, src, strategy, allreduce_us=x) for x in lats]
    preds = [p[p["split"] == "tensor"] for p in preds]
    steps = [p[p["metric"] == "tpot_ms"].set_index(["context_len", "concurrency"])["step_ms"] for p in preds]
    cmp = P.compare(preds[0][["context_len", "concurrency", "metric", "predicted"]], P.load())
    pf = peer_fit()
    tol = P.TOLERANCE
    out = []
    for _, r in cmp.iterrows():
        if pd.isna(r["median"]):
            continue
        ctx, c, key = int(r["context_len"]), int(r["concurrency"]), (int(r["context_len"]), int(r["concurrency"]))
        tpot = r["metric"] == "tpot_ms"
        as_value = (lambda st: st) if tpot else (lambda st, c=c: c * 1e3 / st)
        peer_step = r["median"] if tpot else c * 1e3 / r["median"]
        # the step range that puts the value within the tolerance of the peer's median
        lo_ms, hi_ms = ((r["median"] * (1 - tol), r["median"] * (1 + tol)) if tpot else
                        (c * 1e3 / (r["median"] * (1 + tol)), c * 1e3 / (r["median"] * (1 - tol))))
        at = [s[key] for s in steps]
        fit_on = [d for d in PEER_DEPTHS if (d, 1) != key]
        fixed = statistics.fmean(pf["c1_ms"][d] - steps[0][(d, 1)] for d in fit_on)
        with_fixed = as_value(at[0] + fixed)        # the latency's part cancels: it is in every step alike
        ok = _latencies_within(at, lats, lo_ms, hi_ms)
        out.append({"metric": r["metric"], "context_len": ctx, "concurrency": c, "median": r["median"],
                    "min": r["min"], "max": r["max"], "predicted": [as_value(x) for x in at],
                    "error": [as_value(x) / r["median"] - 1 for x in at], "within": ok,
                    "fixed_ms": fixed, "fixed_on": "the other c = 1 depths" if c == 1 else "the c = 1 points",
                    "with_fixed": with_fixed, "with_fixed_error": with_fixed / r["median"] - 1,
                    "missing_after_fixed_ms": peer_step - (at[0] + fixed)})
    return out


def _missing(r: dict, tol: float) -> str:
    """The term the model lacks where neither a latency of the band nor the fixed term fitted elsewhere brings the
    point within the tolerance: the peer's step less the prediction with that fixed term, and by request."""
    if r["within"] is not None and abs(r["with_fixed_error"]) <= tol + 1e-9:
        return "—"
    gap = r["missing_after_fixed_ms"]
    if r["concurrency"] == 1:
        return f"{gap:+.1f} ms a step after the fixed term: a fixed part that changes with depth"
    return (f"{gap:+.1f} ms a step after the fixed term, {gap / (r['concurrency'] - 1):+.2f} ms for each request "
            f"beyond the first: a per-request term (expert-parallel imbalance, the serving stack's per-request work)")


def peer_table(path: str, strategy: str = "resident", allreduce_us: float | None = None) -> str:
    """The peer's own setup (4 cards, tensor parallel) predicted from a committed run's anatomy and checked against
    the peer's 2026-08-28 measurements, over the all-reduce band unless a latency is measured; then the published
    sparse-offload system's box (3 cards, layers in stages) as a prediction only, which nothing of the peer's checks."""
    run, shape = _run(path)
    src = _source_gpu(run.manifest)
    lats = (allreduce_us,) if allreduce_us is not None else C.ALLREDUCE_BAND_US
    band = _band_label(lats)
    rows = peer_tensor_rows(path, strategy, allreduce_us)
    tol = P.TOLERANCE
    table = []
    for r in rows:
        unit = "ms" if r["metric"] == "tpot_ms" else "tok/s"
        p, e = r["predicted"], r["error"]
        w = r["within"]
        within = ("no" if w is None else "yes" if (w[0], w[1]) == (lats[0], lats[-1]) else
                  f"at {w[0]:.0f}–{w[1]:.0f} µs")
        table.append({"peer's point": f"{r['metric']} {_ctx(r['context_len'])} c={r['concurrency']}",
                      "peer (median, min–max)": f"{r['median']:.1f} ({r['min']:.1f}–{r['max']:.1f}) {unit}",
                      f"predicted, all-reduce {band}": " – ".join(f"{x:.1f}" for x in p) + f" {unit}",
                      "error": " to ".join(f"{x:+.0%}" for x in e), f"within {tol:.0%}": within,
                      "+ a fixed term fitted elsewhere":
                          f"{r['with_fixed']:.1f} {unit} ({r['with_fixed_error']:+.1%}; fitted on {r['fixed_on']})",
                      "missing": _missing(r, tol)})
    n = len(rows)
    whole = sum(1 for r in rows if r["within"] is not None and tuple(r["within"]) == (lats[0], lats[-1]))
    some = sum(1 for r in rows if r["within"] is not None)
    fixed_ok = sum(1 for r in rows if abs(r["with_fixed_error"]) <= tol + 1e-9)
    common = None
    if some == n:
        a, b = max(r["within"][0] for r in rows), min(r["within"][1] for r in rows)
        common = (a, b) if a <= b else None
    if len(lats) == 1:
        head = (f"4x RTX 3090, tensor parallel (the peer's setup), all-reduce {band}: {whole} of {n} points within "
                f"{tol:.0%}")
    else:
        head = (f"4x RTX 3090, tensor parallel (the peer's setup), all-reduce latency unmeasured: {whole} of {n} "
                f"points within {tol:.0%} over the whole {lats[0]:g}–{lats[-1]:g} µs band, {some} of {n} at some "
                f"latency in it"
                + (f" ({common[0]:.0f}–{common[1]:.0f} µs puts all {n} within; a latency chosen to fit, not a "
                   f"check, until it is measured)" if common else
                   f", but no one latency puts every point within (the c = 1 points need at most "
                   f"{min(r['within'][1] for r in rows):.0f} µs, the largest batch at least "
                   f"{max(r['within'][0] for r in rows):.0f})" if some == n else ""))
    head += (f"; with a fixed term fitted on points it is not judged on (each c = 1 point: the other three depths; "
             f"c > 1: the four c = 1 points): {fixed_ok} of {n}.")
    why = _peer_why(run, shape, src, strategy, lats)
    tp_label = f"**4x RTX 3090, tensor parallel** (the peer's setup; predicted from {src.name}'s anatomy, {strategy}, W4A16)"
    return "\n\n".join([head, f"{tp_label}:\n\n{_md(pd.DataFrame(table))}", why,
                         _layers_block(run, shape, src, strategy)])


def _layers_block(run, shape, src, strategy: str) -> str:
    """The published sparse-offload system's box (3 cards, layers in stages) at the peer's points: a prediction
    only, with no peer column (the peer did not run this setup)."""
    layers = box_predictions(run.metrics, shape, src, strategy)
    layers = layers[(layers["split"] == "layers") & (layers["metric"] == "tpot_ms")]
    lrows = [{"point": f"{_ctx(r['context_len'])} c={int(r['concurrency'])}", "step ms": f"{r['step_ms']:.1f}",
              "tok/s": f"{r['concurrency'] * 1e3 / r['step_ms']:.1f}", "fits 24 GiB": "yes" if r["fits"] else "no"}
             for _, r in layers.iterrows()]
    label = (f"**3x RTX 3090, layers in 3 stages** (the published sparse-offload system's box; predicted from "
             f"{src.name}'s anatomy, {strategy}, W4A16): a prediction, not a check: the peer ran 4 cards tensor "
             f"parallel, so none of its points measures this setup")
    return f"{label}:\n\n{_md(pd.DataFrame(lrows))}"


def _peer_why(run, shape, src, strategy: str, lats) -> str:
    """What the model's 4-card step counts against the peer's fixed and per-request parts, and how the columns
    of the peer table are made."""
    tol = P.TOLERANCE
    pf = peer_fit()
    tp = box_predictions(run.metrics, shape, src, strategy, allreduce_us=lats[0])
    tp = tp[(tp["split"] == "tensor") & (tp["metric"] == "tpot_ms")]
    one = tp[(tp["concurrency"] == 1) & (tp["context_len"] == PEER_DEPTHS[0])].iloc[0]
    eight = tp[(tp["concurrency"] == PEER_CONCURRENCY[-1])].iloc[0]
    phases = [c[:-3] for c in tp.columns if c.endswith("_ms") and c != "step_ms" and pd.notna(one[c]) and one[c] > 0.005]
    anatomy = ", ".join(f"{ph} {one[ph + '_ms']:.2f}" for ph in phases)
    model_slope = (eight["step_ms"] - one["step_ms"]) / (PEER_CONCURRENCY[-1] - 1)
    box = C.gpu("rtx3090")
    wb = shape.step_weight_bytes(1, "w4a16", shape.expected_experts(1))
    per_card = sum(wb.values()) / BOX_SPLITS[0][1]
    ar_ms = 2 * shape.layers / 1e3
    why = (f"The peer's step at 4K grows {pf['per_request_ms']:.2f} ms per request from a part that does not grow "
           f"with the batch of {pf['fixed_ms']:.1f} ms (least squares over c = 1–8), and at c = 1 it stays "
           f"{min(pf['c1_ms'].values()):.1f}–{max(pf['c1_ms'].values()):.1f} ms from 1K to 260K tokens. The model's "
           f"4-card step at 4K, c = 1 is {one['step_ms']:.2f} ms at {lats[0]:g} µs an all-reduce ({anatomy} ms) and "
           f"grows {model_slope:.2f} ms per request: what it counts is the bytes each card reads and the all-reduces, "
           f"2 a layer x {shape.layers} layers, so each µs of all-reduce latency adds {ar_ms:.3f} ms a step"
           + (f" (the latency is unmeasured on PCIe 3090s: the table gives the step at each end of "
              f"{lats[0]:g}–{lats[-1]:g} µs; a measured latency, `labkit predict --allreduce-us` or a calibration's `allreduce_us`, replaces the band)"
              if len(lats) > 1 else "") + ". "
           f"The bytes say the same: a 4K step at c = 1 reads "
           f"{per_card / 1e9:.2f} GB per card, which in the peer's {pf['c1_ms'][PEER_DEPTHS[0]]:.1f} ms is "
           f"{per_card / pf['c1_ms'][PEER_DEPTHS[0]] / 1e6:.0f} GB/s, "
           f"{per_card / pf['c1_ms'][PEER_DEPTHS[0]] / 1e6 / box.hbm_gbps:.0%} "
           f"of the card's {box.hbm_gbps:g} GB/s. The fixed-term column adds the peer's c = 1 step less the model's as "
           f"one constant, never fitted on the point it is judged on: a c = 1 point's from the other three depths, a "
           f"c > 1 point's from the four c = 1 points (the all-reduce latency cancels from it: every step waits it "
           f"alike; at c = 1 it cannot be told from a longer all-reduce). \"missing\" is, where the point is not within "
           f"{tol:.0%} with that term (or at no latency of the band), the peer's step less the prediction with the "
           f"term, and the term the model lacks that it measures.")
    return why


def producers(runs: dict) -> dict[str, Callable[[], str]]:
    """The shape's arithmetic, and the blocks whose runs `docs/runs.toml` names, each its function bound to its run."""
    out = {"reference-step-bytes": partial(step_bytes_table), "reference-split-plan": partial(split_plan_table),
           "peer-bound": partial(peer_bound_table)}
    ref = runs.get("reference") or {}
    more = runs.get("reference_more") or {}
    for gpu, path in ref.items():
        out[f"reference-grid-{gpu}"] = partial(grid_table, path, tuple(more.get(gpu, ())))
        out[f"reference-anatomy-{gpu}"] = partial(anatomy_of, path, tuple(more.get(gpu, ())))
        out[f"reference-bounds-{gpu}"] = partial(anatomy_bounds, path, tuple(more.get(gpu, ())))
    if {"h100", "h200"} <= set(ref):
        out["costmodel-cross"] = partial(cross_table, ref["h200"], ref["h100"], tuple(more.get("h200", ())),
                                         tuple(more.get("h100", ())))
    if ref:
        out["peer-rtx3090"] = partial(peer_table, ref.get("h200") or next(iter(ref.values())))
    if runs.get("reference_portable"):
        out["portable-h200"] = partial(portable_table, runs["reference_portable"])
    if runs.get("reference_weights_bench"):
        out["weights-bench"] = partial(weights_bench_table, runs["reference_weights_bench"])
    if runs.get("reference_split_memory"):
        out["split-memory"] = partial(split_memory_table, runs["reference_split_memory"])
    for gpu, paths in (runs.get("reference_prefill") or {}).items():
        out[f"reference-prefill-{gpu}"] = partial(prefill_table, paths)
    return out
