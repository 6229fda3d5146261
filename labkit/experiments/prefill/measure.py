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

Writes a run folder: manifest.json, metrics.parquet + metrics.csv (one row per mode and length,
`vs_resident` the ratio of tok/s to resident's in the same run), chunks.csv (each chunk's enqueue time,
appended as it goes). Bad parameters: one line,
exit 2, before anything is allocated.
"""
from __future__ import annotations

import sys
import time

import torch

from ...engine import Engine, HybridModel, OffloadCache, get_strategy
from ...engine.model.prefill_buffers import rotating_buffer_bytes
from ...results import Run
from ...shapes import ModelShape
from ...params import BadInput, check_positive, gib, one_line, resolve_device

EXPERIMENT = "prefill"
MODES = {"resident": ("resident", "sync"), "sync": ("zero_copy", "sync"), "rotating": ("zero_copy", "rotating")}

AUTO = {"cuda": {"shape": "qwen3.8-flash-next", "context_lens": [248 << 10]},
        "cpu": {"shape": "tiny", "context_lens": [512]}}


def check(p: dict) -> dict:
    """Validate resolved parameters and decide the "auto" ones; BadInput (one line) before anything is
    allocated. Returns the parameters a plan records."""
    p = dict(p)
    dev = resolve_device(p["device"])
    auto = AUTO[dev.type]
    for k in ("shape", "context_lens"):
        if p[k] == "auto":
            p[k] = auto[k]
    p["device"] = str(dev)
    try:
        shape = ModelShape.from_name(p["shape"])
    except ValueError as ex:
        raise BadInput(str(ex)) from None
    bad = [m for m in p["modes"] if m not in MODES]
    if bad or not p["modes"]:
        raise BadInput(f"unknown prefill mode {bad[0] if bad else '(none)'}: choose from {', '.join(MODES)}")
    check_positive("context_lens", p["context_lens"] or [0])
    if p["chunk"] == 0:
        p["chunk"] = 8192 if dev.type == "cuda" else 64
    check_positive("chunk", [p["chunk"]])
    if p["tail_tokens"] < 0 or any(p["tail_tokens"] >= n for n in p["context_lens"]):
        raise BadInput(f"tail_tokens={p['tail_tokens']} must be >= 0 and below every context length")
    check_cap(p["mem_cap_gib"], shape, dev)
    return p


def check_cap(cap_gib: float, shape: ModelShape, dev: torch.device) -> None:
    """A cap must be > 0 (or 0: none), hold the weights, and not exceed the device."""
    if cap_gib == 0:
        return
    if cap_gib < 0:
        raise BadInput(f"mem_cap_gib must be > 0 (or 0 for no cap), got {cap_gib}")
    cap = cap_gib * 2**30
    if cap <= shape.weight_bytes():
        raise BadInput(f"mem_cap_gib={cap_gib:g} is below the {gib(shape.weight_bytes())} the weights of "
                       f"{shape.name} need")
    if dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
        if cap > total:
            raise BadInput(f"mem_cap_gib={cap_gib:g} exceeds the device's {gib(total)}")


def apply_cap(cap_gib: float, dev: torch.device) -> None:
    """Make the caching allocator refuse what would not fit a card of `cap_gib` (CUDA; a no-op on CPU)."""
    if cap_gib and dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()   # it wants an index
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(float(min(1.0, cap_gib * 2**30 / total)), index)


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure(model, mode: str, T: int, p: dict, chunk_log=None) -> dict:
    """One prefill of T tokens (or its last `tail_tokens`) in `mode`; a record."""
    dev, shape = model.device, model.shape
    strategy, pmode = MODES[mode]
    st = get_strategy(strategy)
    tail = p["tail_tokens"]
    start = T - tail if tail else 0
    gen = torch.Generator().manual_seed(p["seed"])
    tokens = torch.randint(0, shape.vocab, (T,), generator=gen).to(dev)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    cache = OffloadCache.allocate(model, st.medium, 1, T)
    if start:
        cache.fill_random_([start], seed=p["seed"])
    e = Engine(model, cache, st, 2048, prefill_chunk=p["chunk"], prefill_mode=pmode)
    warm = p["warmup_tokens"] or 2 * p["chunk"]
    with torch.inference_mode():   # warm-up: kernels, workspaces (a slot of its own would need a second pool)
        e.prefill(0, tokens[:min(warm, T)])
        _sync(dev)
        cache.pages.release(0)
        if start:
            cache.pages.reserve(0, T)
        t0 = time.perf_counter()
        chunks = e.prefill_chunks(0, tokens, start=start)
        while True:
            try:
                a, b = next(chunks)
            except StopIteration as done:
                logits = done.value
                break
            if chunk_log is not None:      # host time at the chunk's enqueue (the GPU runs behind by <= a chunk)
                chunk_log(mode, T, b, time.perf_counter() - t0)
        _sync(dev)
        dt = time.perf_counter() - t0
    n = T - start
    on_dev = st.medium == "device"
    kv = T * shape.kv_bytes_per_token()
    rec = {"experiment": EXPERIMENT, "status": "ok", "error": None, "strategy": strategy, "prefill_mode": pmode,
           "mode": mode, "context_len": T, "tail_tokens": tail, "computed_tokens": n, "prefill_chunk": p["chunk"],
           "budget": 0, "concurrency": 1, "repeats": 1, "steps": 1,
           "step_ms_median": dt * 1e3, "step_ms_min": dt * 1e3, "step_ms_max": dt * 1e3, "tok_s": n / dt,
           "device_kv_bytes": kv if on_dev else 0, "host_kv_bytes": 0 if on_dev else kv,
           "prefill_buffer_bytes": rotating_buffer_bytes(T, shape.row_bytes, shape.attn_layers) if pmode == "rotating"
           else (T * shape.row_bytes),
           "device_index_bytes": cache.index.nbytes, "weight_bytes": model.weight_bytes(),
           "mem_cap_bytes": int(p["mem_cap_gib"] * 2**30) or None,
           "device_mem_peak_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
           "logits_finite": bool(torch.isfinite(logits.float()).all())}
    del e, cache
    return rec


def run(p: dict, progress=print) -> Run:
    """Every (length, mode) of checked parameters into a run folder."""
    shape, dev = ModelShape.from_name(p["shape"]), torch.device(p["device"])
    apply_cap(p["mem_cap_gib"], dev)
    r = Run.create(p["out_dir"] or None, EXPERIMENT, dict(p))
    base = {"device": p["device"], "gpu_name": r.manifest.get("gpu_name") or "cpu", "shape": shape.name}
    model = HybridModel(shape, dev, seed=p["seed"])
    r.update_manifest(weight_bytes=model.weight_bytes(), shape_info=shape.summary())
    chunks_csv = r.path / "chunks.csv"
    chunks_csv.write_text("mode,context_len,chunk_end,t_s\n")

    def chunk_log(mode, T, end, t):     # appended as it goes: a run cut short still says how far it got
        with chunks_csv.open("a") as fh:
            fh.write(f"{mode},{T},{end},{t:.3f}\n")

    for T in p["context_lens"]:
        for mode in p["modes"]:
            try:
                rec = measure(model, mode, T, p, chunk_log)
            except Exception as ex:      # a mode that does not fit the cap is a row, the run goes on
                rec = {"experiment": EXPERIMENT, "status": "failed", "error": one_line(ex), "mode": mode,
                       "strategy": MODES[mode][0], "prefill_mode": MODES[mode][1], "context_len": T,
                       "tail_tokens": p["tail_tokens"], "mem_cap_bytes": int(p["mem_cap_gib"] * 2**30) or None}
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            r.add({**base, **rec})
            progress(f"prefill {mode} T={T}: {rec['status']} " + (f"{rec['tok_s']:.0f} tok/s" if rec["status"] == "ok" else rec["error"]))
    df = r.metrics()
    ok = df[df["status"] == "ok"]
    for T in p["context_lens"]:
        res = ok[(ok["context_len"] == T) & (ok["mode"] == "resident")]
        if len(res):
            sel = (df["context_len"] == T) & (df["status"] == "ok")
            df.loc[sel, "vs_resident"] = df.loc[sel, "tok_s"] / float(res["tok_s"].iloc[0])
    r.records = df.to_dict("records")
    r.write_table("metrics", df)
    df.to_csv(r.path / "metrics.csv", index=False)
    r.finish()
    return r
