"""The GEMV's tensor-core path at 2-16 rows on K-major weights ([N, K] seen transposed, the layers' layout):
cuBLAS (`x @ w` on the [N, K] weight), the kernel as x @ w with the rows padded to 16 ("dot"), the kernel
swapped, out^T = w^T @ x^T ("swap", the weight tile on the MMA's wide side), and the best swapped tiles of a
small sweep per matrix at M = 4; then a step's matrices (the head left out) back to back from one CUDA graph
each way, beside the contiguous HBM read bandwidth of the same process.

    python3 scripts/gemv_rows_bench.py OUT_DIR [--rows 4,16] [--shape qwen3.8-flash-next]
    TRITON_INTERPRET=1 python3 scripts/gemv_rows_bench.py OUT_DIR --dry-run --shape tiny   # the script on CPU

Timing as scripts/gemv_bench.py (CUDA graphs over copies of each weight that L2 cannot hold, median of
replays). Writes OUT_DIR/bench_swap.json; prints a line per matrix and M. About 3 minutes on an H200.
"""
import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_bench import DEV, DRY, L2_SAFE_BYTES, graph_ms, read_bandwidth, step_copies, weight_shapes  # noqa: E402
from labkit.engine.model import gemv as G  # noqa: E402
from labkit.shapes import PRESETS  # noqa: E402

SWEEP_S = 150       # the tile sweep's wall-clock budget, shared evenly by the matrices


def sweep():
    """Swapped tiles tried at M = 4: columns x K rows a load, pipeline stages, programs an SM (0: no split)."""
    for bn in (64, 128, 32):
        for bk in (128, 64, 256):
            for stages in (3, 4):
                for per_sm in (0, 2):
                    yield bn, bk, stages, per_sm


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--rows", default="4,16")
    ap.add_argument("--shape", default="qwen3.8-flash-next")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, a tiny shape: checks the script")
    a = ap.parse_args()
    if a.shape not in PRESETS:
        sys.exit(f"gemv_rows_bench: unknown shape {a.shape!r} (known: {', '.join(PRESETS)})")
    try:
        ms_rows = [int(v) for v in a.rows.split(",")]
    except ValueError:
        ms_rows = []
    if not ms_rows or not all(2 <= m <= G.MAX_M for m in ms_rows):
        sys.exit(f"gemv_rows_bench: --rows takes row counts from 2 to {G.MAX_M}, got {a.rows!r}")
    if DRY and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("gemv_rows_bench: --dry-run runs under TRITON_INTERPRET=1")
    if not DRY and not torch.cuda.is_available():
        sys.exit("gemv_rows_bench: needs a CUDA GPU (or --dry-run under TRITON_INTERPRET=1)")
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sms = 132 if DRY else torch.cuda.get_device_properties(0).multi_processor_count
    bw = read_bandwidth()
    read = bw["read_GBps"]
    print(f"read {read:.0f} GB/s", flush=True)
    shapes, counts = weight_shapes(PRESETS[a.shape])
    names = [n for n in shapes if n != "lm_head"]
    g = torch.Generator(device=DEV).manual_seed(0)
    rows, best, t0 = [], {}, time.time()
    for name in names:
        K, N = shapes[name]
        nbytes = K * N * 2
        copies = 1 if DRY else max(1, -(-L2_SAFE_BYTES // nbytes))
        wts = [(torch.randn(N, K, generator=g, device=DEV) / K ** 0.5).bfloat16() for _ in range(copies)]
        gws = [w.t() for w in wts]                      # [K, N] K-major, what the kernel reads
        for M in ms_rows:
            xs = torch.randn(M, K, generator=g, device=DEV).bfloat16()
            outs = [torch.empty(M, N, device=DEV, dtype=torch.bfloat16) for _ in wts]

            def cublas():
                for w, o in zip(wts, outs):
                    torch.matmul(xs, w.t(), out=o)

            def kernel(cfg):
                def f():
                    for w, o in zip(gws, outs):
                        G.gemv(xs, w, out=o, config=cfg)
                return f

            res = {"matrix": name, "K": K, "N": N, "M": M}
            d = G.default_config(M, N, K, sms, k_major=True)
            for key, fn in (("cublas_nk", cublas), ("dot", kernel(dataclasses.replace(d, swap=False))),
                            ("swap", kernel(dataclasses.replace(d, swap=True)))):
                try:
                    res[key] = graph_ms(fn) / copies
                except Exception as e:       # a variant the GPU refuses: recorded, the bench goes on
                    res[key] = None
                    print(f"  {key} failed: {e!r}"[:200], flush=True)
            ref = xs.float() @ gws[0].float()
            res["swap_err"] = (G.gemv(xs, gws[0], config=dataclasses.replace(d, swap=True)).float() - ref).abs().max().item()
            found = None
            tiles = list(sweep()) if M == 4 else []
            for bn, bk, stages, per_sm in tiles[::12] if DRY else tiles:     # dry: three, one of each width
                if not DRY and time.time() - t0 > SWEEP_S * (len(rows) + 1) / (len(names) * len(ms_rows)):
                    break
                split = G.split_for(N, K, bn, bk, per_sm, sms, 2) if per_sm else 1
                cfg = G.Config(bn, bk, split, True, 4, stages, True, swap=True)
                try:
                    t = graph_ms(kernel(cfg), replays=7) / copies
                except Exception:            # a tile the GPU cannot hold (shared memory): skipped
                    continue
                if found is None or t < found[0]:
                    found = (t, cfg)
            if found:
                res["swap_best"] = graph_ms(kernel(found[1])) / copies
                res["best_cfg"] = dataclasses.asdict(found[1])
                best[(name, M)] = found[1]
            rows.append(res)
            gbs = {k: f"{nbytes / res[k] / 1e6:5.0f}" if res.get(k) else "  n/a" for k in ("cublas_nk", "dot", "swap", "swap_best")}
            print(f"{name:9s} M={M:2d} cuBLAS {gbs['cublas_nk']} dot {gbs['dot']} swap {gbs['swap']} "
                  f"best {gbs['swap_best']} GB/s  {res.get('best_cfg')}", flush=True)
        del wts, gws
        if not DRY:
            torch.cuda.empty_cache()

    # a step's matrices back to back, one graph per way
    mats = {n: [(torch.randn(shapes[n][1], shapes[n][0], generator=g, device=DEV) / 50).bfloat16()
                for _ in range(step_copies(counts[n]))] for n in names}
    total = sum(shapes[n][0] * shapes[n][1] * 2 * counts[n] for n in names)
    chain = {}
    for M in ms_rows:
        xs = {n: torch.randn(M, shapes[n][0], generator=g, device=DEV).bfloat16() for n in names}
        outs = {n: torch.empty(M, shapes[n][1], device=DEV, dtype=torch.bfloat16) for n in names}

        def run(kind):
            # each matrix's configuration, picked once outside the captured loop (None: the kernel's default)
            cfgs = {n: best.get((n, M)) if kind == "swap_best" else dataclasses.replace(
                G.default_config(M, shapes[n][1], shapes[n][0], sms, k_major=True), swap=kind == "swap") for n in names}

            def f():
                for n in names:
                    for w in mats[n]:
                        if kind == "cublas_nk":
                            torch.matmul(xs[n], w.t(), out=outs[n])
                        else:
                            G.gemv(xs[n], w.t(), out=outs[n], config=cfgs[n])
            return f

        for kind in ("cublas_nk", "dot", "swap", "swap_best"):
            t = chain[f"{kind}_M{M}"] = graph_ms(run(kind))
            print(f"chain M={M} {kind:10s} {t:.3f} ms {total / t / 1e6:.0f} GB/s {total / t / 1e6 / read:.0%}", flush=True)
    (out / "bench_swap.json").write_text(json.dumps({"read": bw, "rows": rows, "chain": chain, "chain_bytes": total,
                                                     "shape": a.shape, "dry_run": DRY}, indent=1))


if __name__ == "__main__":
    main()
