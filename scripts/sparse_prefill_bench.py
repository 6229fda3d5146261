"""One QSA layer's sparse prefill of a chunk on the GPU: the score + select (`prefill_select`) and the
sparse attention over the selected rows (`sparse_prefill_attention`), against dense causal attention over the
whole prefix, at the reference shape (T = 8,192 queries, 16 query / 2 KV heads of 256, index 4 heads x 64,
k = 2,048) and prefix S = 64K, 248K, 1M (the chunk is the prefix's last T positions).

    PYTHONPATH=$PWD python3 scripts/sparse_prefill_bench.py [OUT_DIR]

Each figure: CUDA events, 1 warm-up then the median of 3 calls (the exact select: 1 call; a call at 1M
is tens of ms: enough to time). First the collect pass's tiles and key ranges swept at 248K (the select, and its
bound, collect and pick timed apart by CUDA events around each); the fastest is used after. Per prefix: the
sampled select (the default) and its phases, how many keys sat above the bound (mean, max, against the list's cap)
and how many queries took the exact passes, the exact select, the attention, dense attention up to 248K.
Rates: index scoring as 2 x Hi x Di FLOP per visible (query, key) pair, counted once (the sampled select
scores its sample of every st-th key twice, the exact select every key five times), and the selected rows' bytes
(K and V, each row read once per query for all heads of its KV head) per second of attention. Writes
OUT_DIR/sparse_prefill_bench.json when given. About 2 minutes on an H200.
"""
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from labkit.engine.model import sparse_prefill as P  # noqa: E402
from labkit.engine.model.attention import dense_prefill_attention, fast_sdpa, split_rows  # noqa: E402
from labkit.engine.model.kv import quantize_index_keys  # noqa: E402
from labkit.sweep import event_ms  # noqa: E402

T, K, HQ, NKV, D, HI, DI = 8192, 2048, 16, 2, 256, 4, 64
PREFIXES = (1 << 16, 248 * 1024, 1 << 20)
SWEEP_AT = 248 * 1024            # the tile sweep's prefix: long enough that the collect pass dominates
DENSE_UP_TO = 248 * 1024          # dense attention at 1M is ~0.4 s a call: left out to keep the run short


def ms(fn, reps=3):
    """Median GPU ms of `reps` calls after one warm call (the sweep core's isolated event timer)."""
    return statistics.median(event_ms(fn, reps, torch.device("cuda"), warmup=1, mode="isolated"))


def inputs(S, g):
    y = torch.randn(T, HI * DI + HI, generator=g, device="cuda").bfloat16()          # strided, as projected
    iq, iw = y[:, :HI * DI].view(T, HI, DI), y[:, HI * DI:]
    keys, scales = quantize_index_keys(torch.randn(S, DI, generator=g, device="cuda"))
    return iq, iw, keys, scales, torch.arange(S - T, S, device="cuda")


TILES = (   # the collect pass: queries a program x keys a tile x warps, key ranges a query block, its switches
    dict(bt_sampled=64, bs_sampled=64, warps_sampled=4, splits=1),
    dict(bt_sampled=64, bs_sampled=64, warps_sampled=4, splits=2),
    dict(bt_sampled=64, bs_sampled=64, warps_sampled=4, splits=4),
    dict(bt_sampled=64, bs_sampled=32, warps_sampled=4, splits=2),
    dict(bt_sampled=64, bs_sampled=32, warps_sampled=4, splits=4),
    dict(bt_sampled=128, bs_sampled=64, warps_sampled=8, splits=2),
)


def phases(sel_in, tile, reps=3):
    """Median ms of the sampled select's phases (bound, collect, pick) over `reps` calls after a warm one."""
    got = []
    for _ in range(reps + 1):
        stats = {"events": []}
        P.prefill_select_triton(*sel_in, K, stats=stats, **tile)
        torch.cuda.synchronize()
        ev = stats["events"]
        got.append([ev[i].elapsed_time(ev[i + 1]) for i in range(len(ev) - 1)])
    return {name: statistics.median(g[i] for g in got[1:]) for i, name in enumerate(("bound_ms", "collect_ms",
                                                                                      "pick_ms"))}


def sweep_tiles(sel_in, prefix):
    """The sampled select's collect tiles at one prefix; the best is used after."""
    best, sweep = None, []
    # (each tile compiles the collect kernel: a few seconds on a fresh Triton cache)
    for tile in TILES:
        try:
            t = ms(lambda: P.prefill_select_triton(*sel_in, K, **tile))
            ph = phases(sel_in, tile)
        except Exception as e:                                  # a tile that does not compile: say so, go on
            print(f"  select tile {tile}: failed: {str(e).splitlines()[0][:200]}", flush=True)
            continue
        sweep.append({**tile, "prefix": prefix, "select_ms": t, **ph})
        print(f"  select tile {tile} at {prefix}: {t:.2f} ms (bound {ph['bound_ms']:.2f}, collect "
              f"{ph['collect_ms']:.2f}, pick {ph['pick_ms']:.2f})", flush=True)
        if best is None or t < best[0]:
            best = (t, tile)
    return best[1], sweep


def select_figures(sel_in, S, tile):
    """The sampled select (default) with its phases, and the exact select."""
    r = {"S": S, "tile": tile, "stride": P.sample_stride(S), "cap": P.sampled_cap(K, P.sample_stride(S)),
         "select_ms": ms(lambda: P.prefill_select_triton(*sel_in, K, **tile)), **phases(sel_in, tile),
         "select_exact_ms": ms(lambda: P.prefill_select_triton(*sel_in, K, method="exact"), reps=1)}
    stats = {}
    P.prefill_select_triton(*sel_in, K, stats=stats, **tile)
    above = stats["above"].float()
    r.update(fallback_queries=int(stats["fallback"].sum()), above_mean=float(above.mean()), above_max=float(above.max()))
    return r


def main():
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    g = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    print(f"{torch.cuda.get_device_name()}: T={T} k={K} Hq={HQ} n_kv={NKV} D={D} Hi={HI} Di={DI}", flush=True)
    sel_in = inputs(SWEEP_AT, g)
    tile, sweep = sweep_tiles(sel_in, SWEEP_AT)
    del sel_in
    for S in PREFIXES:
        sel_in = inputs(S, g)
        kv = torch.randn(S, 2 * NKV * D, generator=g, device="cuda").bfloat16()
        k, v = split_rows(kv, NKV, D)
        q = torch.randn(T, HQ, D, generator=g, device="cuda").bfloat16()
        r = select_figures(sel_in, S, tile)
        idx, valid = P.prefill_select_triton(*sel_in, K, **tile)
        att_ms = ms(lambda: P.sparse_prefill_attention(q, k, v, idx, valid))
        dense_ms = None
        if S <= DENSE_UP_TO:
            with fast_sdpa(q.device):
                dense_ms = ms(lambda: dense_prefill_attention(q, k, v))
        pairs = T * (S - T) + T * (T + 1) // 2                       # visible (query, key) pairs
        score_flop = 2 * HI * DI * pairs
        row_bytes = T * K * NKV * 2 * D * 2                          # K and V of each selected row, per KV head
        sel_ms = r["select_ms"]
        r.update(attention_ms=att_ms, sparse_ms=sel_ms + att_ms, dense_ms=dense_ms,
                 score_tflops_once=score_flop / sel_ms / 1e9, rows_gbps=row_bytes / att_ms / 1e6)
        rows_out.append(r)
        dense = "-" if dense_ms is None else f"{dense_ms:.1f}"
        print(f"S={S:8d}: select {sel_ms:.2f} ms ({r['score_tflops_once']:.0f} TFLOP/s of scoring counted once; "
              f"bound {r['bound_ms']:.2f} ms, collect {r['collect_ms']:.2f}, pick {r['pick_ms']:.2f}, stride {r['stride']}, above the bound {r['above_mean']:.0f} mean "
              f"{r['above_max']:.0f} max of cap {r['cap']}; {r['fallback_queries']} of {T} queries took the exact "
              f"passes), exact select {r['select_exact_ms']:.2f} ms, attention {att_ms:.2f} ms ({r['rows_gbps']:.0f} GB/s of "
              f"selected rows), sparse {sel_ms + att_ms:.2f} ms vs dense {dense} ms", flush=True)
        del sel_in, kv, k, v, q, idx, valid
        torch.cuda.empty_cache()
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "sparse_prefill_bench.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "T": T, "k": K, "sweep": sweep, "rows": rows_out}, indent=1))


if __name__ == "__main__":
    main()
