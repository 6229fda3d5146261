"""Prefill speed by where the prompt's KV goes (FlashOffloading's prefill): `resident` (the pool in device
memory: the baseline the lab did not measure before), `sync` (pool in pinned host RAM, each chunk's
prefix read back on the compute stream: the engine's default) and `rotating` (four layer-sized device
buffers, loads and write-backs on their own streams: `engine/prefill_buffers.py`).

    labkit run prefill --out DIR -p context_lens=248K -p modes=resident,sync,rotating
    labkit run prefill --out DIR -p context_lens=1M -p modes=rotating,resident \
        -p mem_cap_gib=24 -p tail_tokens=16K

`mem_cap_gib` caps the device memory this process may allocate (`torch.cuda.set_per_process_memory_fraction`:
an allocation past it fails as an out-of-memory would on a card that size); a mode that does not fit
is a failed row with the allocator's message. `tail_tokens` > 0 computes only the last `tail_tokens`
positions of the prompt over a prefix already in the cache (seeded random rows, `fill_random_`): the
memory footprint and the per-chunk cost at that depth are the whole prompt's last chunks', in a
fraction of its time (the row says `tail_tokens`; `tok_s` is over the computed tokens only). With
`tail_tokens=0` the whole prompt is prefilled and the time of every chunk goes to `chunks.csv`.

The anatomy (`anatomy=true`): every chunk's time split into phases by CUDA events on the compute stream
(`engine/model/prefill_marks.py`: weights, experts, hc, ngram, deltanet, kv_write, kv_load, attention, other), each
phase beside
its own bound: FLOPs (`ModelShape.prefill_chunk_work`) at the dense bf16 peak of an 8192^3 GEMM measured at
the start of the run, bytes at the device's measured read bandwidth or the link's measured contiguous rate
(both `probe` rows of this run). `anatomy.parquet` holds one row per chunk (its position in the prompt:
early / middle / last third); the metrics row sums them, with `anatomy_closure` = the phases' sum over the
prefill's wall time (1 when the GPU never waits on the host) and `bound_tok_s` the speed at every phase's
bound. The engine switches (`prefill_attn`, `dn_prefill`, ...) are parameters: several values, one pass each.

Writes a run folder: manifest.json, metrics.parquet + metrics.csv (one row per mode and length,
`vs_resident` the ratio of tok/s to resident's in the same run), chunks.csv (each chunk's enqueue time,
appended as it goes). Bad parameters: one line,
exit 2, before anything is allocated.
"""
from __future__ import annotations

import time

import pandas as pd
import torch

from ... import envs
from ...atomic import open_append
from ...engine import Engine, HybridModel, OffloadCache, get_strategy
from ...engine.model.prefill_buffers import rotating_buffer_bytes
from ...engine.model.attention import prefill_kernel
from ...engine.model.layers import dn_prefill_kernel
from ...engine.model.prefill_marks import PHASES, PrefillMarks
from ...results import Run
from ...shapes import FLOP_PHASES, ModelShape, model_kwargs, planned_shape
from ...params import BadInput, check_positive, fill_auto, resolve_device
from ... import sweep
from ...sweep import sync
from . import MODES, SPEC, PrefillPlan
from ..device_cap import apply_cap, check_cap
from ..device_rates import gemm_peak, hbm_read_gbps, probe_contiguous

EXPERIMENT = "prefill"
HOW = {"resident": ("resident", "sync"), "sync": ("zero_copy", "sync"), "rotating": ("zero_copy", "rotating")}   # per mode

def check(p: dict) -> PrefillPlan:
    """Validate resolved parameters and decide the "auto" ones; BadInput (one line) before anything is
    allocated. Returns the plan."""
    p = dict(p)
    dev = resolve_device(p["device"])
    fill_auto(SPEC, p, dev.type)          # "auto" per device, then the declared bounds and choices
    p["device"] = str(dev)
    envs.check_switch_params(p)           # the engine switches' values in their canonical form
    plan = PrefillPlan.from_params(p)
    shape = planned_shape(plan.shape)
    if not plan.modes:
        raise BadInput(f"modes: none given; choose from {', '.join(MODES)}")
    check_positive("context_lens", list(plan.context_lens) or [0])     # none given
    if any(plan.tail_tokens >= n for n in plan.context_lens):
        raise BadInput(f"tail_tokens={plan.tail_tokens} must be >= 0 and below every context length")
    check_cap(plan.mem_cap_gib, shape, dev, plan.weights_dtype, plan.expert_banks)
    return plan


def measure(model, mode: str, T: int, plan: PrefillPlan, chunk_log=None, attention: str = "dense",
            rates: dict | None = None) -> dict:
    """One prefill of T tokens (or its last `tail_tokens`) in `mode` with `attention` dense or sparse; a record.
    `rates`: the anatomy bounds' denominators measured at the run's start (`probe_rates`)."""
    dev, shape = model.device, model.shape
    strategy, pmode = HOW[mode]
    st = get_strategy(strategy)
    tail = plan.tail_tokens
    start = T - tail if tail else 0
    gen = torch.Generator().manual_seed(plan.seed)
    tokens = torch.randint(0, shape.vocab, (T,), generator=gen).to(dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    cache = OffloadCache.allocate(model, st.medium, 1, T)
    if start:
        cache.fill_random_([start], seed=plan.seed)
    e = Engine(model, cache, st, plan.budget, prefill_chunk=plan.chunk, prefill_mode=pmode,
               prefill_attention=attention)
    marks = PrefillMarks(dev) if plan.anatomy else None
    warm = plan.warmup_tokens or 2 * plan.chunk
    with torch.inference_mode():   # warm-up: kernels, workspaces (a slot of its own would need a second pool)
        e.prefill(0, tokens[:min(warm, T)])
        sync(dev)
        cache.pages.release(0)
        if start:
            cache.pages.reserve(0, T)
        t0 = time.perf_counter()
        chunks = e.prefill_chunks(0, tokens, start=start, marks=marks)
        while True:
            try:
                a, b = next(chunks)
            except StopIteration as done:
                logits = done.value
                break
            if chunk_log is not None:      # host time at the chunk's enqueue (the GPU runs behind by <= a chunk)
                chunk_log(mode, T, b, time.perf_counter() - t0)
        sync(dev)
        dt = time.perf_counter() - t0
    n = T - start
    on_dev = st.medium == "device"
    kv = T * shape.kv_bytes_per_token()
    rec = {"experiment": EXPERIMENT, "status": "ok", "error": None, "strategy": strategy, "prefill_mode": pmode,
           "mode": mode, "context_len": T, "tail_tokens": tail, "computed_tokens": n, "prefill_chunk": plan.chunk,
           "prefill_attention": attention, "budget": plan.budget if attention == "sparse" else 0,
           "attention_kernel": prefill_kernel(dev), "dn_kernel": dn_prefill_kernel(dev),   # what "auto" resolved to "concurrency": 1, "repeats": 1, "steps": 1,
           "step_ms_median": dt * 1e3, "step_ms_min": dt * 1e3, "step_ms_max": dt * 1e3, "tok_s": n / dt,
           "device_kv_bytes": kv if on_dev else 0, "host_kv_bytes": 0 if on_dev else kv,
           "prefill_buffer_bytes": rotating_buffer_bytes(T, shape.row_bytes, shape.attn_layers) if pmode == "rotating"
           else (T * shape.row_bytes),
           "device_index_bytes": cache.index.nbytes, "weight_bytes": model.weight_bytes(),
           "mem_cap_bytes": int(plan.mem_cap_gib * 2**30) or None,
           "device_mem_peak_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
           "logits_finite": bool(torch.isfinite(logits.float()).all())}
    anatomy = []
    if marks is not None:
        anatomy = anatomy_rows(marks.chunks(), shape, mode, T, rates or {}, attention, plan.budget)
        rec.update(anatomy_totals(anatomy, dt * 1e3, n))
    del e, cache
    return rec, anatomy


def _position(end: int, T: int) -> str:
    return "early" if end <= T / 3 else ("last" if end > 2 * T / 3 else "middle")


def anatomy_rows(chunks: list[dict], shape: ModelShape, mode: str, T: int, rates: dict, attention: str = "dense",
                 budget: int = 0) -> list[dict]:
    """Per chunk: the phases' ms and each phase's bound in ms (FLOPs at the GEMM peak, bytes at the measured
    read bandwidth or link rate; a phase without a rate gets no bound)."""
    peak, hbm, h2d, d2h = (rates.get(k) for k in ("gemm_tflops", "hbm_gbps", "h2d_gbps", "d2h_gbps"))
    on_host = HOW[mode][0] != "resident"
    out = []
    for c in chunks:
        w = shape.prefill_chunk_work(c["start"], c["end"], budget=budget if attention == "sparse" else 0)
        b = {}
        if peak:
            for ph in FLOP_PHASES:
                b[f"{ph}_bound_ms"] = w[f"{ph}_flops"] / (peak * 1e9)
        if h2d and w["ngram_bytes"]:                                # the n-gram rows cross the link in every mode
            b["ngram_bound_ms"] = w["ngram_bytes"] / (h2d * 1e6)
        write_rate = d2h if on_host and mode == "sync" else hbm     # rotating: into a device buffer, DMA overlapped
        if write_rate:
            b["kv_write_bound_ms"] = w["kv_write_bytes"] / (write_rate * 1e6)
        read_rate = h2d if on_host else hbm
        if read_rate:                                               # rotating: the loads overlap, no bound on this line
            b["kv_load_bound_ms"] = 0.0 if mode == "rotating" else w["kv_read_bytes"] / (read_rate * 1e6)
        out.append({"mode": mode, "prefill_attention": attention, "context_len": T, "position": _position(c["end"], T), **c,
                    "tokens": c["end"] - c["start"], **b, **{k: v for k, v in w.items()}})
    return out


def anatomy_totals(rows: list[dict], wall_ms: float, tokens: int) -> dict:
    """The metrics row's share of the anatomy: phase sums, closure, the bound and attention's rate."""
    df = pd.DataFrame(rows)
    tot = {f"{ph}_ms": float(df[f"{ph}_ms"].sum()) for ph in PHASES}
    chunk_ms = float(df["chunk_ms"].sum())
    bounds = [c for c in df.columns if c.endswith("_bound_ms")]
    bound_ms = float(df[bounds].sum().sum()) if bounds else float("nan")
    att = tot["attention_ms"]
    return {**{f"anatomy_{k}": v for k, v in tot.items()}, "anatomy_chunk_ms": chunk_ms,
            "anatomy_closure": chunk_ms / wall_ms if wall_ms else float("nan"),
            "bound_ms": bound_ms, "bound_tok_s": tokens / bound_ms * 1e3 if bound_ms == bound_ms and bound_ms else None,
            "attention_tflops": float(df["attention_flops"].sum()) / att / 1e9 if att else None,
            "prefill_flops": float(df[[f"{ph}_flops" for ph in FLOP_PHASES]].sum().sum())}


def probe_rates(dev: torch.device, repeats: int = 10) -> tuple[dict, list[dict]]:
    """The bounds' denominators, measured in this process: the dense bf16 peak (an 8192^3 GEMM), the device's
    read bandwidth and the link's contiguous rates (256 MiB each way). CUDA only; ({}, []) elsewhere."""
    if dev.type != "cuda":
        return {}, []
    rows = [gemm_peak(dev, repeats), hbm_read_gbps(dev, repeats=repeats), *probe_contiguous(dev, repeats, (256,))]
    torch.cuda.empty_cache()          # the probes' buffers (2 GiB for the read) leave nothing held under a cap
    rates = {"gemm_tflops": rows[0]["tflops"], "hbm_gbps": rows[1]["gbps"],
             **{f"{r['direction']}_gbps": r["gbps"] for r in rows[2:]}}
    return rates, rows


def run(plan: PrefillPlan, progress_bar: bool = True) -> Run:
    """Every (engine variant, length, mode) of a checked plan into a run folder."""
    shape, dev = ModelShape.from_name(plan.shape), torch.device(plan.device)
    apply_cap(plan.mem_cap_gib, dev)
    r = sweep.open_run(plan.params, EXPERIMENT)        # the manifest records the plan as a dict
    base = {"device": plan.device, "gpu_name": r.manifest.get("gpu_name") or "cpu", "shape": shape.name}
    rates, probe_rows = probe_rates(dev) if plan.anatomy else ({}, [])
    for row in probe_rows:
        r.add({**base, **row})
    model = HybridModel(shape, dev, seed=plan.seed, **model_kwargs(plan.params))    # weights_dtype, ... by name
    r.update_manifest(weight_bytes=model.weight_bytes(), shape_info=shape.summary(), bound_rates=rates,
                      holding=model.holding())
    base |= {"weights_dtype": model.weights_dtype, "expert_banks": model.expert_banks or None}
    chunks_csv = r.path / "chunks.csv"
    r.write_file(chunks_csv.name, "engine_variant,mode,context_len,chunk_end,t_s\n")
    anatomy: list[dict] = []

    def free(ex):
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    variants = envs.variants(plan.params)       # envs reads the switch parameters by their names
    points = sweep.grid(T=plan.context_lens, attention=plan.prefill_attention, mode=plan.modes)
    with sweep.bar(len(points) * len(variants), f"{EXPERIMENT} {shape.name}", progress_bar) as bar:
        for variant in variants:
            before = envs.apply(variant)
            tag = {"engine_variant": envs.variant_name(variant), **variant} if variant else {}

            def chunk_log(mode, T, end, t, name=tag.get("engine_variant", "")):   # appended as it goes: a run
                with open_append(chunks_csv) as fh:                               # cut short says how far it got
                    fh.write(f"{name},{mode},{T},{end},{t:.3f}\n")

            for pt in points:
                T, mode, att = pt["T"], pt["mode"], pt["attention"]
                bar.set_postfix_str(f"{mode} {att} T={T}" + (f" {tag['engine_variant']}" if tag else ""))
                # a mode that does not fit the cap is a row, the run goes on
                got = sweep.attempt(lambda: _record(model, mode, T, plan, chunk_log, anatomy, tag, att, rates),
                                    {"experiment": EXPERIMENT}, on_fail=free, mode=mode, strategy=HOW[mode][0],
                                    prefill_attention=att,
                                    prefill_mode=HOW[mode][1], context_len=T, tail_tokens=plan.tail_tokens,
                                    mem_cap_bytes=int(plan.mem_cap_gib * 2**30) or None, **tag)
                r.add({**base, **tag, **envs.in_force(), **got})
                bar.update()
            envs.apply(before)
    df = r.metrics()
    ok = df[(df["status"] == "ok") & (df["experiment"] == EXPERIMENT)]
    keys = ["context_len", "prefill_attention"] + (["engine_variant"] if "engine_variant" in df else [])
    for _, g in ok.groupby(keys, dropna=False):
        res = g[g["mode"] == "resident"]
        if len(res):
            df.loc[g.index, "vs_resident"] = g["tok_s"] / float(res["tok_s"].iloc[0])
    if rates and "attention_tflops" in df:
        df["attention_of_gemm_peak"] = df["attention_tflops"] / rates["gemm_tflops"]
    r.records = df.to_dict("records")
    r.write_table("metrics", df)
    r.write_csv("metrics", df)
    if anatomy:
        r.write_table("anatomy", pd.DataFrame(anatomy))
    r.finish()
    sweep.headline(sweep.summary_lines(lambda: headline(df)), progress_bar, EXPERIMENT)
    return r


def _record(model, mode, T, plan: PrefillPlan, chunk_log, anatomy: list, tag: dict, attention: str,
            rates: dict) -> dict:
    rec, rows = measure(model, mode, T, plan, chunk_log, attention, rates)
    anatomy += [{**tag, **row} for row in rows]
    return rec


def headline(df) -> list[str]:
    """tok/s per mode at the longest prompt, and each against resident; attention's rate and the bound."""
    ok = df[(df["status"] == "ok") & (df["experiment"] == EXPERIMENT)]
    T = int(ok["context_len"].max())
    at = ok[ok["context_len"] == T]
    def vs(r) -> str:
        v = r.get("vs_resident")
        return "" if r["mode"] == "resident" or v is None or v != v else f" ({v:.2f}x resident)"
    def name(r) -> str:
        ev = r.get("engine_variant")
        att = r.get("prefill_attention")
        return r["mode"] + (" sparse" if att == "sparse" else "") + (f" [{ev}]" if isinstance(ev, str) and ev else "")
    parts = [f"{name(r)} {r['tok_s']:,.0f}{vs(r)}" for r in at.to_dict("records")]
    lines = [f"prompt of {T} tokens: " + ", ".join(parts) + " tok/s"]
    if "attention_tflops" in at and at["attention_tflops"].notna().any():
        best = at.loc[at["tok_s"].idxmax()]
        peak = best.get("attention_of_gemm_peak")
        lines.append(f"fastest: attention {best['attention_tflops']:,.0f} TFLOPS"
                     + (f" ({peak:.0%} of the GEMM peak)" if peak == peak and peak is not None else "")
                     + (f", bound {best['bound_tok_s']:,.0f} tok/s" if best.get("bound_tok_s") == best.get("bound_tok_s")
                        and best.get("bound_tok_s") else "")
                     + f", anatomy closure {best['anatomy_closure']:.2f}")
    failed = df[df["status"] == "failed"]
    if len(failed):
        lines.append(f"{len(failed)} point(s) failed: " + ", ".join(f"{r['mode']} at {int(r['context_len'])}"
                                                              for r in failed.to_dict("records")))
    return lines
