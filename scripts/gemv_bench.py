"""The weights phase at decode batch sizes: cuBLAS against the GEMV kernel on every weight shape of the
reference model, beside the contiguous HBM read bandwidth measured in the same process.

    python3 scripts/gemv_bench.py OUT_DIR [--shape qwen3.8-flash-next] [--budget-s 120]
    python3 scripts/gemv_bench.py OUT_DIR --layout nk       # the GEMV on K-major weights ([N, K] transposed)
    python3 scripts/gemv_bench.py OUT_DIR --rows 1          # one row only (M in 1, 4, 16 by default)
    TRITON_INTERPRET=1 python3 scripts/gemv_bench.py OUT_DIR --dry-run --shape tiny     # the script on CPU

Per distinct weight shape [K, N] and M in 1, 4, 16 (`--rows`): `x @ w` (cuBLAS on the layers' [K, N] layout), the
same through `torch.matmul(x, wt.t())` on a [N, K] copy (the layout of a checkpoint's nn.Linear), the
GEMV with the engine's default config, and the best of a small sweep of GEMV configs. Each is timed as a
CUDA graph of products over distinct copies of the weight (>= 256 MB in all, so L2, 50 MB on an H200,
holds none of them between reads), median over replays; GB/s = weight bytes / time. Then every weight
matrix a decode step multiplies by, streamed back to back from one graph per M, each way (the bound the
step's weights phase can reach). The read bandwidth: a sum over 8 GiB (bytes read / time) and a 4 GiB
device-to-device copy (read + written bytes / time).

Writes OUT_DIR/gemv_bench.json and OUT_DIR/gemv_bench.md. Runs in about 2-3 minutes on an H200: the
sweep stops early when it nears --budget-s, and says so in the JSON.
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from labkit.engine.model import gemv as G  # noqa: E402
from labkit.shapes import PRESETS  # noqa: E402

MS = (1, 4, 16)     # the rows M measured by default (--rows)
KINDS = ("cublas", "cublas_nk", "gemv", "gemv_pdl", "gemv_best", "gemv_best_nopdl", "gemv_glu")
PER_MATRIX = ("cublas", "cublas_nk", "gemv", "gemv_pdl", "gemv_best", "gemv_best_nopdl", "gemv_glu")
LABELS = {"cublas": "cuBLAS [K,N]", "cublas_nk": "cuBLAS [N,K]", "gemv": "GEMV", "gemv_pdl": "GEMV pdl",
          "gemv_best": "GEMV best", "gemv_best_nopdl": "GEMV best nopdl", "gemv_glu": "GEMV gate/up fused"}
L2_SAFE_BYTES = 256 << 20
# --dry-run: the same code path on CPU under the Triton interpreter with a tiny shape, timed by the wall
# clock without graphs (numbers meaningless): the script's own check, run by the test suite. It multiplies by
# one copy of each weight, and its step chains by one matrix of each distinct shape (`step_copies`): every
# path runs, at a fraction of the interpreter's time.
DRY = "--dry-run" in sys.argv
DEV = "cpu" if DRY else "cuda"
# the config sweep launches with programmatic dependent launch where the GPU has it (sm90+): the
# weights of the next product stream while the one before finishes
PDL = not DRY and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
KM = False          # --layout nk: the GEMV reads K-major weights


def weight_shapes(s) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """[K, N] of each distinct weight a decode step multiplies by, and how many of each a step reads."""
    wm = s.weight_matrices()
    return {n: (K, N) for n, (K, N, _) in wm.items()}, {n: cnt for n, (_, _, cnt) in wm.items()}


def step_copies(count: int) -> int:
    """How many of a matrix the step chains multiply by: all of them, one in a dry run."""
    return 1 if DRY else count


def graph_ms(fn, replays: int = 15) -> float:
    """Median ms of one replay of a graph that runs fn() once (fn warmed up outside the capture)."""
    if DRY:     # one call, no warm-up: the interpreter compiles nothing, and a dry run's time means nothing
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    del g
    return statistics.median(ts)


def read_bandwidth() -> dict:
    """Contiguous HBM read: bytes read by a sum over 8 GiB; and a 4 GiB copy (read + write bytes)."""
    big = torch.ones((2 << 30) if not DRY else (1 << 20), dtype=torch.float32, device=DEV)   # 8 GiB
    acc = torch.empty((), dtype=torch.float32, device=DEV)
    t_sum = graph_ms(lambda: torch.sum(big, dim=0, out=acc), replays=10)
    src = big[: 1 << 30]
    dst = torch.empty_like(src)
    t_copy = graph_ms(lambda: dst.copy_(src), replays=10)
    out = {"sum_bytes": big.numel() * 4, "sum_ms": t_sum, "read_GBps": big.numel() * 4 / t_sum / 1e6,
           "copy_bytes_moved": 2 * src.numel() * 4, "copy_ms": t_copy,
           "copy_GBps_read_plus_write": 2 * src.numel() * 4 / t_copy / 1e6}
    del big, dst, src
    if not DRY:
        torch.cuda.empty_cache()
    return out


def sweep_configs(M: int, k_major: bool = False):
    """GEMV configs tried per shape: column tile, K rows a load, warps, software-pipeline stages, programs
    per SM (the K split). Row-major: tiles of 16-64 KB of weight, loaded whole into registers (stages 1) or
    through a two-stage shared-memory pipeline; 36 configs, 18 kernels to compile per path and column
    alignment. K-major: 8-32 KB tiles of 16-128 columns of 256-1024 contiguous bytes, one to three stages;
    one row through the FMA path (products summed once after the loop) or the tensor-core dot."""
    if not k_major:
        for bn, bk, warps in ((128, 128, 4), (128, 256, 8), (256, 128, 8), (64, 256, 4), (128, 64, 4), (256, 64, 4)):
            for stages in (1, 2):
                for per_sm in (4, 2, 8):        # the likeliest first: a sweep cut short by the budget keeps it
                    yield bn, bk, M > 1, warps, stages, per_sm
        return
    tiles = ((16, 512, 4), (32, 256, 4), (64, 128, 4), (32, 512, 8), (64, 256, 8), (128, 128, 8))
    for use_dot in ((False, True) if M == 1 else (True,)):
        for bn, bk, warps in tiles:
            if use_dot and bn < 16:
                continue
            for stages in (2, 1, 3):
                for per_sm in (2, 4, 1):
                    yield bn, bk, use_dot, warps, stages, per_sm


def make_config(M, N, K, bn, bk, use_dot, warps, stages, per_sm, sms, pdl=False, k_major=False) -> G.Config:
    return G.Config(bn, bk, G.split_for(N, K, bn, bk, per_sm, sms), use_dot, warps, stages, pdl,
                    acc2d=k_major and not use_dot)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--shape", default="qwen3.8-flash-next")
    ap.add_argument("--budget-s", type=float, default=120.0,
                    help="wall-clock budget (s) for the bench; the config sweep gets 70%% of it")
    ap.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, a tiny shape: checks the script")
    ap.add_argument("--layout", choices=("kn", "nk"), default="kn",
                    help="the GEMV's weights: kn row-major [K, N] (the layers' layout), nk K-major ([N, K] transposed)")
    ap.add_argument("--rows", default=",".join(map(str, MS)),
                    help=f"the activation rows M measured, comma-separated, 1 to {G.MAX_M} (default %(default)s)")
    a = ap.parse_args()
    if a.shape not in PRESETS:
        sys.exit(f"gemv_bench: unknown shape {a.shape!r} (known: {', '.join(PRESETS)})")
    try:
        m_rows = tuple(int(v) for v in a.rows.split(","))
    except ValueError:
        m_rows = ()
    if not m_rows or not all(1 <= m <= G.MAX_M for m in m_rows):
        sys.exit(f"gemv_bench: --rows takes row counts from 1 to {G.MAX_M}, got {a.rows!r}")
    if DRY and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("gemv_bench: --dry-run runs under TRITON_INTERPRET=1")
    if not DRY and not torch.cuda.is_available():
        sys.exit("gemv_bench: needs a CUDA GPU (or --dry-run under TRITON_INTERPRET=1)")
    global KM
    KM = a.layout == "nk"
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    dev = torch.device(DEV)
    sms = 132 if DRY else torch.cuda.get_device_properties(dev).multi_processor_count
    bw = read_bandwidth()
    read = bw["read_GBps"]
    print(f"HBM read {read:.0f} GB/s (sum over 8 GiB), copy {bw['copy_GBps_read_plus_write']:.0f} GB/s r+w", flush=True)
    shapes, counts = weight_shapes(PRESETS[a.shape])
    g = torch.Generator(device=DEV).manual_seed(0)
    rows, best_cfg = [], {}
    # the sweep's deadline for the j-th (shape, M) row: an even share, time left by fast rows carried on
    sweep_budget, n_rows, t_sweep = a.budget_s * 0.7, len(shapes) * len(m_rows), time.time()
    sweep_cut = False
    for name, (K, N) in shapes.items():
        nbytes = K * N * 2
        copies = max(1, -(-L2_SAFE_BYTES // nbytes)) if not DRY else 1
        ws = [(torch.randn(K, N, generator=g, device=DEV) / K ** 0.5).bfloat16() for _ in range(copies)]
        wts = [w.t().contiguous() for w in ws]
        gws = [w.t() for w in wts] if KM else ws              # the weights the GEMV reads
        for M in m_rows:
            xs = torch.randn(M, K, generator=g, device=DEV).bfloat16()
            outs = [torch.empty(M, N, device=DEV, dtype=torch.bfloat16) for _ in ws]

            def run_cublas():
                for w, o in zip(ws, outs):
                    torch.matmul(xs, w, out=o)

            def run_cublas_nk():
                for w, o in zip(wts, outs):
                    torch.matmul(xs, w.t(), out=o)

            def run_gemv(cfg):
                def f():
                    for w, o in zip(gws, outs):
                        G.gemv(xs, w, out=o, config=cfg)
                return f

            res = {"matrix": name, "K": K, "N": N, "M": M, "bytes": nbytes, "copies": copies}
            dcfg = G.default_config(M, N, K, sms, k_major=KM)
            for key, fn in (("cublas", run_cublas), ("cublas_nk", run_cublas_nk), ("gemv", run_gemv(dataclasses.replace(dcfg, pdl=False))),
                            ("gemv_pdl", run_gemv(dataclasses.replace(dcfg, pdl=True)))):
                try:
                    ms = graph_ms(fn) / copies
                except Exception as e:     # a variant this GPU or driver refuses: recorded, the bench goes on
                    res[key] = {"error": f"{type(e).__name__}: {e}"[:300]}
                    print(f"  {key} failed: {res[key]['error']}", flush=True)
                    continue
                res[key] = {"ms": ms, "GBps": nbytes / ms / 1e6, "of_read_bw": nbytes / ms / 1e6 / read}
            if name == "ffn.w_gu":   # the FFN's fused path: gate and up tiles side by side, silu(g) * u out
                glu_outs = [torch.empty(M, N // 2, device=DEV, dtype=torch.bfloat16) for _ in ws]

                def run_glu():
                    for w, o in zip(gws, glu_outs):
                        G.gemv(xs, w, out=o, glu=True)
                ms = graph_ms(run_glu) / copies
                res["gemv_glu"] = {"ms": ms, "GBps": nbytes / ms / 1e6, "of_read_bw": nbytes / ms / 1e6 / read}
            ref = xs.float() @ ws[0].float()
            res["gemv_max_abs_err"] = (G.gemv(xs, gws[0]).float() - ref).abs().max().item()
            res["cublas_max_abs_err"] = ((xs @ ws[0]).float() - ref).abs().max().item()
            res["gemv_config"] = dataclasses.asdict(dcfg)
            best = None
            cfgs = list(sweep_configs(M, KM))
            for bn, bk, use_dot, warps, stages, per_sm in cfgs[:: max(1, len(cfgs) // 3) if DRY else 1]:   # dry: three
                if not DRY and time.time() - t_sweep > sweep_budget * (len(rows) + 1) / n_rows:   # dry: every path
                    sweep_cut = True
                    break
                cfg = make_config(M, N, K, bn, bk, use_dot, warps, stages, per_sm, sms, pdl=PDL, k_major=KM)
                try:
                    ms = graph_ms(run_gemv(cfg), replays=7) / copies
                except Exception as e:   # a config the GPU cannot hold (shared memory): skip it, say which
                    print(f"  skip {cfg}: {type(e).__name__}", flush=True)
                    continue
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            if best is not None:
                ms = graph_ms(run_gemv(best[1])) / copies          # re-timed like the others
                res["gemv_best"] = {"ms": ms, "GBps": nbytes / ms / 1e6, "of_read_bw": nbytes / ms / 1e6 / read,
                                    "config": dataclasses.asdict(best[1])}
                best_cfg[(name, M)] = best[1]
                ms = graph_ms(run_gemv(dataclasses.replace(best[1], pdl=False))) / copies
                res["gemv_best_nopdl"] = {"ms": ms, "GBps": nbytes / ms / 1e6, "of_read_bw": nbytes / ms / 1e6 / read}
            rows.append(res)
            print(f"{name:9s} K={K:5d} N={N:6d} M={M:2d}: cuBLAS {res['cublas']['GBps']:6.0f} GB/s, "
                  f"[N,K] {res['cublas_nk']['GBps']:6.0f}, GEMV {res['gemv']['GBps']:6.0f}, "
                  f"best {res.get('gemv_best', {}).get('GBps', float('nan')):6.0f} GB/s "
                  f"({res['gemv']['of_read_bw']:.0%} of read, default)", flush=True)
        del ws, wts
        if not DRY:
            torch.cuda.empty_cache()

    # every matrix of a step, back to back in one graph per M
    order = [n for n in shapes for _ in range(counts[n])]
    total_bytes = sum(shapes[n][0] * shapes[n][1] * 2 for n in order)
    mats = {n: [(torch.randn(*shapes[n], generator=g, device=DEV) / shapes[n][0] ** 0.5).bfloat16()
                for _ in range(step_copies(counts[n]))] for n in shapes}
    mats_nk = {n: [w.t().contiguous() for w in ws] for n, ws in mats.items()}
    mats_gemv = {n: [w.t() for w in ws] for n, ws in mats_nk.items()} if KM else mats
    whole = []
    for M in m_rows:
        xs = {n: torch.randn(M, shapes[n][0], generator=g, device=DEV).bfloat16() for n in shapes}
        outs = {n: torch.empty(M, shapes[n][1], device=DEV, dtype=torch.bfloat16) for n in shapes}
        glu_out = torch.empty(M, shapes["ffn.w_gu"][1] // 2, device=DEV, dtype=torch.bfloat16)

        def chain(kind):
            def f():
                for n, ws in {"cublas": mats, "cublas_nk": mats_nk}.get(kind, mats_gemv).items():
                    for w in ws:
                        if kind == "cublas":
                            torch.matmul(xs[n], w, out=outs[n])
                        elif kind == "cublas_nk":
                            torch.matmul(xs[n], w.t(), out=outs[n])
                        elif kind == "gemv_glu" and n == "ffn.w_gu":
                            G.gemv(xs[n], w, out=glu_out, glu=True)
                        else:
                            cfg = best_cfg.get((n, M)) if kind.startswith("gemv_best") else None
                            if kind == "gemv":
                                cfg = dataclasses.replace(G.default_config(xs[n].shape[0], w.shape[1], w.shape[0], sms, k_major=KM), pdl=False)
                            elif kind == "gemv_pdl":
                                cfg = dataclasses.replace(G.default_config(xs[n].shape[0], w.shape[1], w.shape[0], sms, k_major=KM), pdl=True)
                            elif kind == "gemv_best_nopdl" and cfg is not None:
                                cfg = dataclasses.replace(cfg, pdl=False)
                            G.gemv(xs[n], w, out=outs[n], config=cfg)
            return f
        r = {"M": M, "matrices": len(order), "bytes": total_bytes}
        for kind in KINDS:
            try:
                ms = graph_ms(chain(kind), replays=10)
            except Exception as e:
                r[kind] = {"error": f"{type(e).__name__}: {e}"[:300], "ms": float("nan"), "of_read_bw": float("nan")}
                continue
            r[kind] = {"ms": ms, "GBps": total_bytes / ms / 1e6, "of_read_bw": total_bytes / ms / 1e6 / read}
        whole.append(r)
        print(f"all {len(order)} matrices ({total_bytes / 1e9:.2f} GB) M={M}: " +
              ", ".join(f"{k} {r[k]['ms']:.3f} ms ({r[k]['of_read_bw']:.0%})"
                        for k in KINDS), flush=True)

    result = {"device": "cpu (dry run)" if DRY else torch.cuda.get_device_name(dev), "dry_run": DRY, "sms": sms,
              "torch": torch.__version__,
              "triton": __import__("triton").__version__, "shape": a.shape, "gemv_layout": a.layout, "read_bandwidth": bw,
              "per_matrix": rows, "whole_step": whole, "sweep_cut_short": sweep_cut,
              "wall_s": time.time() - t0,
              "method": "CUDA graphs of products over distinct weight copies (>= 256 MB, past L2), median of "
                        "replays; GB/s = weight bytes / time; of_read_bw = that / the sum's read GB/s"}
    (out_dir / "gemv_bench.json").write_text(json.dumps(result, indent=1))
    (out_dir / "gemv_bench.md").write_text(markdown(result))
    print(f"wrote {out_dir}/gemv_bench.json and .md in {time.time() - t0:.0f} s")


def markdown(r) -> str:
    read = r["read_bandwidth"]["read_GBps"]
    lay = {"kn": "row-major [K, N]", "nk": "K-major ([N, K] seen transposed)"}[r.get("gemv_layout", "kn")]
    lines = [f"# Weight streaming at decode batch sizes ({r['device']}, {r['shape']})", "",
             f"The GEMV reads the weights {lay}.", "",
             f"Contiguous HBM read (a sum over 8 GiB): **{read:.0f} GB/s**; a 4 GiB device copy "
             f"{r['read_bandwidth']['copy_GBps_read_plus_write']:.0f} GB/s (read + write).", "",
             "GB/s per product and its share of the read bandwidth; `pdl`: launched with programmatic dependent "
             "launch (the first weight tile streams while the kernel before finishes); `best`: the best config of "
             "the sweep (itself with PDL where the GPU has it), `best nopdl` the same config without.", "",
             "| matrix | K | N | M | MB | " + " | ".join(LABELS[k] for k in PER_MATRIX) + " | best config |",
             "|---|---|---|---|---|" + "---|" * len(PER_MATRIX) + "---|"]

    def cell(d):
        if not d or "GBps" not in d:
            return "failed" if d else "-"
        return f"{d['GBps']:.0f} ({d['of_read_bw']:.0%})"
    for x in r["per_matrix"]:
        b = x.get("gemv_best")
        cfg = tuple(b["config"].values()) if b else "-"
        lines.append(f"| {x['matrix']} | {x['K']} | {x['N']} | {x['M']} | {x['bytes'] / 1e6:.1f} | " +
                     " | ".join(cell(x.get(k)) for k in PER_MATRIX) + f" | {cfg} |")
    lines += ["", "Every weight matrix of a decode step back to back in one CUDA graph (as the layers hold them: "
              "gate and up are one matrix), ms (share of the read bandwidth):", "",
              "| M | matrices | GB | " + " | ".join(LABELS[k] for k in KINDS) + " |",
              "|---|---|---|" + "---|" * len(KINDS)]
    for w in r["whole_step"]:
        c = lambda k: (f"{w[k]['ms']:.3f} ({w[k]['of_read_bw']:.0%})" if "error" not in w[k] else "failed")  # noqa: E731
        lines.append(f"| {w['M']} | {w['matrices']} | {w['bytes'] / 1e9:.2f} | " + " | ".join(c(k) for k in KINDS) + " |")
    if r["sweep_cut_short"]:
        lines += ["", "The config sweep stopped early for some shapes (time budget): 'best' is over the configs tried."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
