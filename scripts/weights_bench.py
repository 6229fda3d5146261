"""The weight stream of one decode step of the reference shape, in bf16 and W4A16, against the HBM read rate
measured in the same process.

    python3 scripts/weights_bench.py OUT_DIR [--shape qwen3.8-flash-next]
    TRITON_INTERPRET=1 python3 scripts/weights_bench.py OUT_DIR --shape tiny-moe --dry-run     # on CPU

What a step reads at one request (`ModelShape.step_weight_bytes`): every dense product once (the QSA and
DeltaNet projections, the shared experts, the router, the head, the hyper-connections) and 10 routed experts a
layer. Timed here as CUDA graphs of those products back to back, M = 1 (and the routed experts at c = 4: the
distinct experts four tokens chose), each weight a distinct copy (nothing stays in L2 between reads), median
over replays; GB/s = bytes read / time:
- `dense`: the quantised dense products (every product but the router, gates, hyper-connections and head)
  through the lab's bf16 GEMV (bf16) or the grouped kernel's one-group form (W4A16);
- `experts`: 48 layers of routed experts, 10 distinct a layer at c = 1 (as many as routing gives at c = 4),
  through the grouped kernel;
- `hbm_read`: a sum over 8 GiB (bytes read / time);
- `launch_floor_us`: a kernel of no work in a graph of 192 of them (what each launch of a step costs at least).
Dense products and experts are timed at one request and four; W4A16 under each of `VARIANTS` (the kernel as the
engine runs it, the earlier dequantising kernel, other tiles and K splits), every variant over the same weights.
The goal for W4A16: the stream at >= 75% of the measured read rate for one request.

Writes OUT_DIR/weights_bench.json.
"""
import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from labkit.engine.model.experts import plan, route  # noqa: E402
from labkit.engine.model.gemv import matmul  # noqa: E402
from labkit.engine.model import grouped_gemv as G  # noqa: E402
from labkit.engine.model.grouped_gemv import grouped_gemv, qmatmul  # noqa: E402
from labkit.engine.model.layers import make_weight  # noqa: E402
from labkit.engine.model.quant import QuantWeight  # noqa: E402
from labkit.shapes import PRESETS  # noqa: E402

DENSE = ("qsa.w_in", "qsa.w_o", "dn.w_in", "dn.w_o", "moe.shared_gu", "moe.shared_d")


def timed_graph(fn, dev, replays: int = 20) -> list[float]:
    """ms of each replay of fn captured as one CUDA graph (eager on CPU)."""
    if dev.type != "cuda":
        import time
        out = []
        for _ in range(2):
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
        return out
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


def hbm_read_gbps(dev) -> float:
    if dev.type != "cuda":
        return float("nan")
    x = torch.empty(8 << 30, dtype=torch.uint8, device=dev).view(torch.float32)
    x.fill_(1.0)
    ts = timed_graph(lambda: x.sum(), dev)
    del x
    return (8 << 30) / (statistics.median(ts) / 1e3) / 1e9


def launch_floor_us(dev, launches: int = 192) -> float:
    """µs a kernel of (almost) no work takes in a CUDA graph of `launches` of them back to back: the floor under
    every small product of a step (a W4A16 product at decode reads a few MB, a few µs of HBM)."""
    if dev.type != "cuda":
        return float("nan")
    t = torch.zeros(1, device=dev)

    def run():
        for _ in range(launches):
            t.add_(1)
    return statistics.median(timed_graph(run, dev)) * 1e3 / launches


def nbytes(w) -> int:
    return w.nbytes if isinstance(w, QuantWeight) else w.numel() * w.element_size()


def dense_products(s, weights: str, dev, rows: int = 1):
    """Every dense product a step makes at `rows` requests, each its own weight copy: (the graph's function,
    bytes it reads)."""
    gen = torch.Generator(device=dev).manual_seed(0)
    mats = s.weight_matrices(routed="per_token")
    todo = []
    for name in DENSE:
        if name not in mats:
            continue
        K, N, count = mats[name]
        for _ in range(count):
            todo.append((make_weight(gen, K, N, torch.bfloat16, dev, weights_dtype=weights), name.endswith("_gu")))
    xs = {K: torch.randn(rows, K, device=dev).bfloat16() for K in {mats[n][0] for n in DENSE if n in mats}}

    def run():
        for w, glu in todo:
            K = w.K if isinstance(w, QuantWeight) else w.shape[0]
            if glu and isinstance(w, QuantWeight):
                qmatmul(xs[K], w, glu=True)
            else:
                matmul(xs[K], w)
    return run, sum(nbytes(w) for w, _ in todo)


def expert_layers(s, weights: str, dev, concurrency: int, experts: int):
    """`s.layers` layers of `experts` routed experts each; a step's routing drawn once (as the router gives)."""
    gen = torch.Generator(device=dev).manual_seed(1)
    layers = []
    for _ in range(s.layers):
        if weights == "w4a16":
            gu = QuantWeight.random(gen, s.hidden, 2 * s.expert_intermediate, experts=experts, device=dev)
            d = QuantWeight.random(gen, s.expert_intermediate, s.hidden, experts=experts, device=dev)
        else:
            gu = torch.randn(experts, 2 * s.expert_intermediate, s.hidden, generator=gen, device=dev).bfloat16()
            d = torch.randn(experts, s.hidden, s.expert_intermediate, generator=gen, device=dev).bfloat16()
        idx, _ = route(torch.randn(concurrency, experts, generator=gen, device=dev), s.experts_per_tok)
        groups, _ = plan(idx)
        layers.append((gu, d, groups))
    x = torch.randn(concurrency, s.hidden, device=dev).bfloat16()
    distinct = sum(int(g.n_groups) for _, _, g in layers) / len(layers)
    per_expert = (nbytes(layers[0][0]) + nbytes(layers[0][1])) / experts

    def run():
        for gu, d, groups in layers:
            a = grouped_gemv(x, gu, groups, glu=True)
            grouped_gemv(a, d, groups, gather=False)
    return run, distinct * per_expert * len(layers), distinct


# The W4A16 kernels' variants, each timed over the same weights: `default` as the engine runs; `dequant` the
# earlier kernel (each tile dequantised to bf16 in registers, one program an output block, no K split); the rest
# the row kernel at other tiles and splits.
VARIANTS = {
    "default": {},
    "dequant": {"W4_ROWS_KERNEL": False},
    "no-split": {"W4_PROGRAMS_PER_SM": 0},
    "split-2sm": {"W4_PROGRAMS_PER_SM": 2},
    "split-8sm": {"W4_PROGRAMS_PER_SM": 8},
    "bn32-gt2": {"W4_TILES": {1: (32, 2), 4: (32, 1)}},
    "bn16-gt4": {"W4_TILES": {1: (16, 4), 4: (16, 2)}},
    "bn128-gt1-w8": {"W4_TILES": {1: (128, 1), 4: (64, 1)}, "W4_WARPS": 8},
    "bn64-gt2-w8": {"W4_TILES": {1: (64, 2), 4: (32, 2)}, "W4_WARPS": 8},
    "bn32-gt2-w8": {"W4_WARPS": 8},
}


@contextlib.contextmanager
def knobs(**values):
    """The grouped kernel's module settings set for the block (a new graph captures the launches they give)."""
    saved = {k: getattr(G, k) for k in values}
    for k, v in values.items():
        setattr(G, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(G, k, v)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="qwen3.8-flash-next")
    ap.add_argument("--experts", type=int, default=64, help="experts held a layer (the bytes a step reads are the "
                    "distinct ones routed to: 64 hold as many as 512 would at c <= 4)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="the W4A16 variants timed (comma-separated)")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    dev = torch.device("cpu" if a.dry_run else "cuda")
    s = PRESETS[a.shape]
    out = {"shape": s.name, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "hbm_read_gbps": hbm_read_gbps(dev), "launch_floor_us": launch_floor_us(dev), "rows": []}
    for weights in ("bf16", "w4a16"):
        parts = [("dense", 1, *dense_products(s, weights, dev)), ("dense", 4, *dense_products(s, weights, dev, 4))]
        for c in (1, 4):
            run, b, distinct = expert_layers(s, weights, dev, c, min(a.experts, s.experts))
            parts.append(("experts", c, run, b, distinct))
        for variant in (a.variants.split(",") if weights == "w4a16" else ["default"]):
            with knobs(**VARIANTS.get(variant, {})):
                for part, c, run, b, *distinct in parts:
                    ts = timed_graph(run, dev)
                    out["rows"].append({"part": part, "weights": weights, "concurrency": c, "variant": variant,
                                        "bytes": b, **({"distinct_per_layer": distinct[0]} if distinct else {}),
                                        "ms_median": statistics.median(ts), "ms_min": min(ts), "ms_max": max(ts)})
        del parts
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    for r in out["rows"]:
        r["gbps"] = r["bytes"] / (r["ms_median"] / 1e3) / 1e9
        r["of_hbm_read"] = r["gbps"] / out["hbm_read_gbps"]
        print(f"{r['part']:8s} {r['weights']:6s} {r['variant']:12s} c={r['concurrency']} {r['bytes'] / 1e9:7.3f} GB "
              f"{r['ms_median']:7.3f} ms  {r['gbps']:7.0f} GB/s  {r['of_hbm_read']:.0%} of read")
    print(f"hbm read {out['hbm_read_gbps']:.0f} GB/s, a launch in a graph {out['launch_floor_us']:.2f} µs")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "weights_bench.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
