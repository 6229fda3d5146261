"""A prefill chunk's routed experts at the published widths: each tile setting of the grouped GEMMs (`moe_gemm.py`),
the products against the GEMM rate of the same process, and a whole layer's experts against the row-at-a-time
kernel they replace.

    python3 scripts/moe_gemm_bench.py OUT_DIR [--tokens 8192] [--quick]

For each product (gate|up with SiLU over 2,560 -> 2 x 640, down 640 -> 2,560) and tile setting: median, min and
max of 10 launches (CUDA events, after 3 warm-ups), TFLOP/s of the pairs' FLOPs (2 x T x k x K x N', padding not
counted) and their share of the bf16 rate of an 8192^3 cuBLAS GEMM measured first. Routing: each token's 10 of 512
experts uniform at random (the router's random weights choose about so). W4A16 and bf16 weights (the same kernel
without dequantisation: what dequantising in the loads costs). Then one layer's experts end to end (alignment,
both products, the weighted sum with the shared expert) with the fastest tiles, beside the decode step's grouped
kernel on the same chunk (`moe_gemm=off`, one launch: it is slow). Writes OUT_DIR/moe_gemm_bench.json and .md.
"""
import argparse
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from labkit.engine.model import moe_gemm  # noqa: E402
from labkit.engine.model.routing import plan  # noqa: E402
from labkit.engine.model.grouped_gemv import grouped  # noqa: E402
from labkit.engine.model.quant import QuantWeight  # noqa: E402
from labkit.shapes import ModelShape  # noqa: E402
from labkit.sweep import event_ms  # noqa: E402

T_ = moe_gemm.Tiles
SETTINGS = [T_(64, 64, 64, 4, 3), T_(64, 128, 64, 4, 3), T_(64, 64, 64, 4, 4), T_(64, 64, 64, 8, 3),
            T_(64, 64, 32, 4, 4), T_(64, 128, 64, 4, 4), T_(128, 64, 64, 4, 3), T_(128, 128, 64, 8, 3)]
FIELDS = ("bm", "bn", "bk", "warps", "stages")
QUICK = [T_(64, 64, 64, 4, 3), T_(64, 128, 64, 4, 3), T_(128, 64, 64, 4, 3), T_(128, 128, 64, 8, 3)]


def timed(fn, repeats: int = 10, warmup: int = 3) -> dict:
    """Median, min and max ms of `repeats` calls, each alone on the device (`sweep.event_ms`'s isolated mode)."""
    ms = event_ms(fn, repeats, torch.device("cuda"), warmup=warmup)
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "repeats": repeats}


def gemm_tflops() -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    return 2 * 8192 ** 3 / (timed(lambda: a @ a)["median"] * 1e9)


def weights(s: ModelShape, quant: bool, g):
    H, I, E = s.hidden, s.expert_intermediate, s.experts
    if quant:
        return QuantWeight.random(g, H, 2 * I, experts=E, device="cuda"), QuantWeight.random(g, I, H, experts=E,
                                                                                          device="cuda")
    return (torch.randn(E, 2 * I, H, device="cuda", generator=g, dtype=torch.bfloat16) / H ** 0.5,
            torch.randn(E, H, I, device="cuda", generator=g, dtype=torch.bfloat16) / I ** 0.5)


def sweep_products(s, T, experts, gu, d, quant, settings, peak) -> list[dict]:
    H, I, k = s.hidden, s.expert_intermediate, s.experts_per_tok
    y = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    rows = []
    for tiles in settings:
        blocks = moe_gemm.align(experts, s.experts, tiles.bm)
        try:
            act = moe_gemm.moe_gemm(y, gu, blocks, glu=True, tiles=tiles)
            for prod, fn, flops in (("glu", lambda: moe_gemm.moe_gemm(y, gu, blocks, glu=True, tiles=tiles),
                                     2 * T * k * H * 2 * I),
                                    ("down", lambda: moe_gemm.moe_gemm(act, d, blocks, scatter=True, tiles=tiles),
                                     2 * T * k * I * H)):
                t = timed(fn)
                rows.append({"product": prod, "weights": "w4a16" if quant else "bf16", **asdict(tiles), **t,
                             "tflops": flops / (t["median"] * 1e9), "of_gemm": flops / (t["median"] * 1e9) / peak})
        except Exception as exc:          # a setting that does not compile or fit is a row, the sweep goes on
            rows.append({"product": "both", "weights": "w4a16" if quant else "bf16", **asdict(tiles),
                         "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"})
        print(rows[-1], flush=True)
    return rows


def layer_rows(s, T, experts, gu, d, best: dict) -> list[dict]:
    """One layer's routed experts end to end with the fastest tiles, and the decode kernel on the same chunk."""
    H, k = s.hidden, s.experts_per_tok
    y = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    p = torch.softmax(torch.randn(T, k, device="cuda"), -1)
    shared, gate = torch.randn(T, H, device="cuda", dtype=torch.bfloat16), torch.randn(T, 1, device="cuda",
                                                                                        dtype=torch.bfloat16)
    moe_gemm.TILES.update(best)
    out = [{"path": "moe_gemm (align, gate|up, down, combine)",
            **timed(lambda: moe_gemm.routed_experts(y, gu, d, experts, p, s.experts, shared, gate))}]

    def rowwise():
        groups, back = plan(experts)
        act = grouped(y, gu, groups, glu=True)
        return grouped(act, d, groups, gather=False)[back]
    out.append({"path": "decode kernel, a row at a time (moe_gemm=off)", **timed(rowwise, repeats=1, warmup=1)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("moe_gemm_bench: needs a CUDA GPU")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    s, T = ModelShape.from_name("qwen3.8-flash-next"), a.tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    experts = torch.argsort(torch.rand(T, s.experts, device="cuda", generator=g), dim=1)[:, :s.experts_per_tok]
    peak = gemm_tflops()
    settings = QUICK if a.quick else SETTINGS
    rows, layers = [], []
    for quant in (True, False):
        gu, d = weights(s, quant, g)
        rows += sweep_products(s, T, experts, gu, d, quant, settings if quant else QUICK, peak)
        if quant:
            ok = [r for r in rows if "error" not in r]
            best = {p: moe_gemm.Tiles(**{f: min((r for r in ok if r["product"] == p), key=lambda r: r["median"])[f]
                                         for f in FIELDS}) for p in ("glu", "down")}
            if best["glu"].bm != best["down"].bm:      # the two products share the blocks: the down's best at glu's bm
                best["down"] = moe_gemm.Tiles(**{f: min((r for r in ok if r["product"] == "down"
                                                         and r["bm"] == best["glu"].bm), key=lambda r: r["median"])[f]
                                                 for f in FIELDS})
            layers = layer_rows(s, T, experts, gu, d, best)
        del gu, d
        torch.cuda.empty_cache()
    res = {"gpu": torch.cuda.get_device_name(), "tokens": T, "gemm_tflops": peak,
           "best": {p: asdict(t) for p, t in best.items()}, "products": rows, "layer": layers}
    (out / "moe_gemm_bench.json").write_text(json.dumps(res, indent=1))
    lines = [f"# A prefill chunk's routed experts: {T:,} tokens x {s.experts_per_tok} of {s.experts} experts "
             f"({res['gpu']}; cuBLAS bf16 {peak:.0f} TFLOP/s)", "",
             "| product | weights | bm | bn | bk | warps | stages | ms (min-max) | TFLOP/s | of GEMM |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tiles = f"{r['bm']} | {r['bn']} | {r['bk']} | {r['warps']} | {r['stages']}"
        if "error" in r:
            lines.append(f"| {r['product']} | {r['weights']} | {tiles} | {r['error']} | | |")
        else:
            lines.append(f"| {r['product']} | {r['weights']} | {tiles} | {r['median']:.3f} ({r['min']:.3f}-"
                         f"{r['max']:.3f}) | {r['tflops']:.0f} | {r['of_gemm']:.0%} |")
    lines += ["", "| one layer's experts | ms (min-max) |", "|---|---|"]
    lines += [f"| {r['path']} | {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}) |" for r in layers]
    (out / "moe_gemm_bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
