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
- `hc`: 16 hyper-connection mixes back to back (bf16 mixing weights, 13 MB a mix of the published shape), the
  two-launch mix against the torch.compile'd pieces it replaced (`--no-hc` leaves them out);
- `hbm_read`: a sum over 8 GiB (bytes read / time);
- `launch_floor_us`: a kernel of no work in a graph of 192 of them (what each launch of a step costs at least).
Dense products and experts are timed at one request and four; W4A16 under each of `VARIANTS` (the kernels as the
engine chooses them, each of its two decode kernels for every product, with and without PDL, the earliest
dequantising kernel), every variant over the same weights, and through two existing W4A16 implementations on the
same codes (`REFERENCES`: torch's int4pack, gemlite; `--references ''` leaves them out). `--per-matrix` times each
dense matrix kind alone. Every variant's and library's products are checked against the definition first
(`checks`). The goal for W4A16: the stream at >= 70% of the measured read rate.

Writes OUT_DIR/weights_bench.json (after every section: a run stopped at its limit keeps what it measured).
"""
import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from labkit.engine.model.routing import plan, route  # noqa: E402
from labkit.engine.model.gemv import matmul  # noqa: E402
from labkit.engine.model import grouped_gemv as G  # noqa: E402
from labkit.engine.model import w4_decode as D  # noqa: E402
from labkit.engine.model.grouped_gemv import (Groups, dense_reference, grouped_gemv,  # noqa: E402
                                               grouped_gemv_reference, qmatmul)
from labkit.engine.model.layers import make_weight  # noqa: E402
from labkit.engine.model.quant import QuantWeight  # noqa: E402
from labkit.shapes import PRESETS, W4_GROUP  # noqa: E402

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


def dense_weights(s, weights: str, dev):
    """Each dense matrix a step reads, every copy its own weight (nothing stays in L2 between reads), drawn in
    order from one seeded generator (so every kernel's bench draws the same values): (name, K, weight, copy)."""
    gen = torch.Generator(device=dev).manual_seed(0)
    mats = s.weight_matrices(routed="per_token")
    for name in DENSE:
        if name in mats:
            K, N, count = mats[name]
            for i in range(count):
                yield name, K, make_weight(gen, K, N, torch.bfloat16, dev, weights_dtype=weights), i


def dense_products(s, weights: str, dev, rows: int = 1):
    """Every dense product a step makes at `rows` requests, each its own weight copy: (the graph's function,
    bytes it reads)."""
    todo = [(w, name.endswith("_gu")) for name, _, w, _ in dense_weights(s, weights, dev)]
    Ks = {w.K if isinstance(w, QuantWeight) else w.shape[0] for w, _ in todo}
    xs = {K: torch.randn(rows, K, device=dev).bfloat16() for K in Ks}

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


# The W4A16 kernels' variants, each timed over the same weights: `default` as the engine runs (one row and the
# routed experts through the FMA kernel `_w4_rows_kernel` with PDL, dense products of 2-16 rows through the
# tensor-core kernel `w4_decode`); `rows` and `dot` each kernel for every product; `dequant` the earliest kernel;
# the rest one thing changed (no PDL, shift-and-mask unpacking, the rows as the tensor-core product's M side, wider
# tiles, the K split by waves, the row kernel's x as 32-bit pairs and loaded a tile ahead, narrower programs more of
# them a multiprocessor, a dense product's fixed plan taken as known, the K loop under Triton's pipeliner). Keys
# name a module's setting, `module.NAME`.
# x a tile ahead with the plan read: what `xahead` and its combinations measured before both became the default
# (each variant names what it sets, so a committed bench's variant keeps its meaning as the defaults move)
_AHEAD_READ = {"grouped_gemv.W4_X_AHEAD": True, "w4_decode.W4_ONE": False}
VARIANTS = {
    "default": {},
    "rows": {"grouped_gemv.W4_KERNEL": "rows"},
    "rows-no-pdl": {"grouped_gemv.W4_KERNEL": "rows", "grouped_gemv.W4_ROWS_PDL": False},
    "dot": {"grouped_gemv.W4_KERNEL": "dot"},
    "dot-swapped": {"grouped_gemv.W4_KERNEL": "dot", "w4_decode.W4_SWAP": True},
    "dot-no-pdl": {"grouped_gemv.W4_KERNEL": "dot", "w4_decode.W4_PDL": False},
    "dot-no-lop3": {"grouped_gemv.W4_KERNEL": "dot", "w4_decode.W4_ASM": False},
    "dot-bn128": {"grouped_gemv.W4_KERNEL": "dot", "w4_decode.W4_BN": 128},
    "dequant": {"grouped_gemv.W4_KERNEL": "dequant"},
    "waves": {"grouped_gemv.W4_SPLIT_WAVES": True},
    "xpairs": {"grouped_gemv.W4_X_PAIRS": True, "grouped_gemv.W4_X_AHEAD": False},
    "xahead": _AHEAD_READ,
    "xahead-waves": {**_AHEAD_READ, "grouped_gemv.W4_SPLIT_WAVES": True},
    "xahead-regs": {**_AHEAD_READ, "grouped_gemv.W4_MAXNREG": {False: 96, True: 128},
                    "grouped_gemv.W4_PROGRAMS_PER_SM": 5},
    "xahead-regs-waves": {**_AHEAD_READ, "grouped_gemv.W4_MAXNREG": {False: 96, True: 128},
                          "grouped_gemv.W4_PROGRAMS_PER_SM": 5, "grouped_gemv.W4_SPLIT_WAVES": True},
    "one": {"w4_decode.W4_ONE": True, "grouped_gemv.W4_X_AHEAD": False},
    "xahead-one": {"grouped_gemv.W4_X_AHEAD": True, "w4_decode.W4_ONE": True},
    "xahead-pipe3": {**_AHEAD_READ, "grouped_gemv.W4_PIPE": 3},
    "xahead-pipe4": {**_AHEAD_READ, "grouped_gemv.W4_PIPE": 4},
    "xahead-bn16g4": {**_AHEAD_READ, "grouped_gemv.W4_TILES": {1: (16, 4), 4: (64, 1)}},
    "xahead-bn32g2": {**_AHEAD_READ, "grouped_gemv.W4_TILES": {1: (32, 2), 4: (64, 1)}},
    "xahead-bn32": {**_AHEAD_READ, "grouped_gemv.W4_TILES": {1: (32, 1), 4: (64, 1)},
                    "grouped_gemv.W4_WARPS": 2, "grouped_gemv.W4_PROGRAMS_PER_SM": 8},
    "xahead-bn32-waves": {**_AHEAD_READ, "grouped_gemv.W4_TILES": {1: (32, 1), 4: (64, 1)},
                          "grouped_gemv.W4_WARPS": 2, "grouped_gemv.W4_PROGRAMS_PER_SM": 8,
                          "grouped_gemv.W4_SPLIT_WAVES": True},
}
MODULES = {"grouped_gemv": G, "w4_decode": D}


def hc_mixes(s, dev, rows: int, fused: bool, count: int = 16):
    """`count` hyper-connection mixes back to back (each its own weights: 16 x 13 MB of the published shape, past
    L2), each taking the last one's output as its sub-block's: the two-launch mix (`hc_mix`) or the torch.compile'd
    pieces it replaced (`hybrid.hc_in`, `hc_out`). Returns (run, weight bytes read)."""
    from labkit.engine.model import hc_mix as X
    from labkit.engine.model import hybrid
    from labkit.engine.model.layers import HyperConnection
    g = torch.Generator(device=dev).manual_seed(7)
    hcs = [HyperConnection(s, g, torch.bfloat16, dev) for _ in range(count)]
    H = s.hidden
    h0 = torch.randn(rows, s.hc_count * H, generator=g, device=dev).bfloat16()
    y0 = torch.randn(rows, H, generator=g, device=dev).bfloat16()
    inj0 = torch.randn(rows, s.hc_count, generator=g, device=dev).bfloat16()
    if fused:
        def run():
            h, d = h0, X.Pending(inj0, y0)
            for hc in hcs:
                h, y, _, inj = X.hc_mix(hc, h, d)
                d = X.Pending(inj, y)
    else:
        hc_in, hc_out = (torch.compile(f, dynamic=False) if dev.type == "cuda" else f
                         for f in (hybrid.hc_in, hybrid.hc_out))

        def run():
            x = hc_out(h0, inj0, y0)
            for hc in hcs:
                h, y, _, inj = hc_in(hc, *x)
                x = hc_out(h, inj, y)
    return run, sum(nbytes(hc.w_down) + nbytes(hc.w_up) + nbytes(hc.norm_w) for hc in hcs) / count


@contextlib.contextmanager
def knobs(**values):
    """Module settings (`module.NAME`) set for the block (a new graph captures the launches they give)."""
    saved = {}
    for key, v in values.items():
        mod, name = key.split(".")
        saved[key] = getattr(MODULES[mod], name)
        setattr(MODULES[mod], name, v)
    try:
        yield
    finally:
        for key, v in saved.items():
            mod, name = key.split(".")
            setattr(MODULES[mod], name, v)


# ------------------------------------------------------------------ two existing W4A16 implementations beside
# The same codes, scales and zeros in each library's own layout, each product one launch of that library (a
# SwiGLU's gate and up one product, silu(gate) * up a torch op after it), the routed experts one product an
# expert (neither library has a grouped launch), checked against the lab's definition before it is timed.
class Int4Pack:
    """PyTorch's int4 weight-only kernel (`aten._weight_int4pack_mm`, tinygemm): its packing takes two codes a
    byte with the even K value in the high nibble (ours: the low), and a float zero per group: a value is
    (q - 8) * scale + zero, so zero = (8 - z) * scale."""
    name = "torch-int4pack"

    def __init__(self, w: QuantWeight, e: int = 0):
        q = w.q[e]
        self.packed = torch.ops.aten._convert_weight_to_int4pack((q >> 4) | ((q & 0xF) << 4), 8)
        s = w.scales[e].float()
        zf = (8 - w.zeros[e].float()) * s
        self.sz = torch.stack([s, zf], dim=2).transpose(0, 1).contiguous().to(torch.bfloat16)   # [K/128, N, 2]

    def __call__(self, x):
        return torch.ops.aten._weight_int4pack_mm(x, self.packed, W4_GROUP, self.sz)


class GemLite:
    """gemlite's A16W4 layer (HQQ's convention (W_q - zeros) * scales, the codes given unpacked)."""
    name = "gemlite"

    def __init__(self, w: QuantWeight, e: int = 0):
        from gemlite import DType, GemLiteLinear       # optional: carried to the device host as a wheel
        q = w.q[e]
        codes = torch.stack([q & 0xF, q >> 4], dim=-1).reshape(w.N, w.K)            # [N, K], low nibble first
        self.layer = GemLiteLinear(4, group_size=W4_GROUP, in_features=w.K, out_features=w.N,
                                   input_dtype=DType.BF16, output_dtype=DType.BF16)
        self.layer.pack(codes, w.scales[e], w.zeros[e].to(torch.bfloat16), None)

    def __call__(self, x):
        return self.layer(x)


REFERENCES = {"torch-int4pack": Int4Pack, "gemlite": GemLite}


def _glu(y):
    g, u = y.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(y.dtype)


def reference_parts(s, dev, ref_cls, experts: int, check: list):
    """The bench's parts through one library: (part, c, run, bytes[, distinct]) as `main` times them, over
    weights drawn as the lab's (the same seeds); a first product of each kind checked against the definition
    (relative error into `check`)."""
    todo = []
    for name, K, w, copy in dense_weights(s, "w4a16", dev):
        todo.append((ref_cls(w), name.endswith("_gu"), K, nbytes(w)))
        if copy == 0:
            x = torch.randn(4, K, device=dev).bfloat16()
            check.append({"kernel": ref_cls.name, "matrix": name,
                          "rel_err": rel_err(todo[-1][0](x), dense_reference(x, w))})
    parts = []
    for rows in (1, 4):
        xs = {K: torch.randn(rows, K, device=dev).bfloat16() for _, _, K, _ in todo}

        def run(xs=xs):
            for f, glu, K, _ in todo:
                y = f(xs[K])
                if glu:
                    _glu(y)
        parts.append(("dense", rows, run, sum(b for *_, b in todo)))
    for c in (1, 4):
        gen = torch.Generator(device=dev).manual_seed(1)
        layers = []
        for _ in range(s.layers):
            gu = QuantWeight.random(gen, s.hidden, 2 * s.expert_intermediate, experts=experts, device=dev)
            d = QuantWeight.random(gen, s.expert_intermediate, s.hidden, experts=experts, device=dev)
            idx, _ = route(torch.randn(c, experts, generator=gen, device=dev), s.experts_per_tok)
            chosen = {}
            for t, row in enumerate(idx.tolist()):
                for e in row:
                    chosen.setdefault(e, []).append(t)
            layers.append([(ref_cls(gu, e), ref_cls(d, e), torch.tensor(toks, device=dev))
                           for e, toks in sorted(chosen.items())])
        x = torch.randn(c, s.hidden, device=dev).bfloat16()
        per_expert = (nbytes(gu) + nbytes(d)) / experts
        distinct = sum(len(lay) for lay in layers) / len(layers)

        def run(layers=layers, x=x):
            for lay in layers:
                for fgu, fd, toks in lay:
                    fd(_glu(fgu(x.index_select(0, toks))))
        parts.append(("experts", c, run, distinct * per_expert * len(layers), distinct))
    return parts


def rel_err(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def per_matrix(s, dev, kernels: list[str]) -> list[dict]:
    """Each dense matrix kind alone, its `count` copies back to back at one row: the time a product of that size
    takes, where the whole-step rows mix the sizes. `kernels`: `default`, `rows` or a reference's name."""
    out = []
    mats = s.weight_matrices(routed="per_token")
    for name in DENSE:
        if name not in mats:
            continue
        K, N, count = mats[name]
        gen = torch.Generator(device=dev).manual_seed(2)
        ws = [make_weight(gen, K, N, torch.bfloat16, dev, weights_dtype="w4a16") for _ in range(count)]
        x = torch.randn(1, K, device=dev).bfloat16()
        glu = name.endswith("_gu")
        for kernel in kernels:
            try:
                if kernel in REFERENCES:
                    fs = [REFERENCES[kernel](w) for w in ws]

                    def run(fs=fs):
                        for f in fs:
                            y = f(x)
                            if glu:
                                _glu(y)
                else:
                    def run():
                        for w in ws:
                            qmatmul(x, w, glu=glu)
                with knobs(**VARIANTS[kernel]) if kernel in VARIANTS else contextlib.nullcontext():
                    ts = timed_graph(run, dev)
            except Exception as ex:              # a library that does not take this shape: recorded, the rest go on
                out.append({"matrix": name, "kernel": kernel, "error": f"{type(ex).__name__}: {ex}"[:300]})
                continue
            b = sum(nbytes(w) for w in ws)
            out.append({"matrix": name, "K": K, "N": N, "count": count, "kernel": kernel, "bytes": b,
                        "us_per_product": statistics.median(ts) * 1e3 / count, "ms_median": statistics.median(ts),
                        "ms_min": min(ts), "ms_max": max(ts)})
        del ws
    return out


def check_variant(s, dev, variant: str) -> list[dict]:
    """The variant's W4A16 products against their definition, fresh inputs: a dense product (plain and gate/up) at
    one and four rows, a step's routed experts at one and four requests."""
    gen = torch.Generator(device=dev).manual_seed(3)
    out = []
    with knobs(**VARIANTS.get(variant, {})):
        for glu in (False, True):
            N = 2 * s.expert_intermediate if glu else s.hidden
            w = QuantWeight.random(gen, s.hidden, N, device=dev)
            for rows in (1, 4):
                x = torch.randn(rows, s.hidden, generator=gen, device=dev).bfloat16()
                got = qmatmul(x, w, glu=glu)
                want = grouped_gemv_reference(x, w, Groups.one(rows, dev), glu=glu)
                out.append({"kernel": variant, "matrix": "dense-gu" if glu else "dense", "rows": rows,
                            "rel_err": rel_err(got, want)})
        w = QuantWeight.random(gen, s.hidden, 2 * s.expert_intermediate, experts=32, device=dev)
        for c in (1, 4):
            idx, _ = route(torch.randn(c, 32, generator=gen, device=dev), min(s.experts_per_tok, 8))
            groups, _ = plan(idx)
            x = torch.randn(c, s.hidden, generator=gen, device=dev).bfloat16()
            out.append({"kernel": variant, "matrix": "experts-gu", "rows": c,
                        "rel_err": rel_err(grouped_gemv(x, w, groups, glu=True),
                                           grouped_gemv_reference(x, w, groups, glu=True))})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="qwen3.8-flash-next")
    ap.add_argument("--experts", type=int, default=64, help="experts held a layer (the bytes a step reads are the "
                    "distinct ones routed to: 64 hold as many as 512 would at c <= 4)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="the W4A16 variants timed (comma-separated)")
    ap.add_argument("--references", default=",".join(REFERENCES),
                    help="existing W4A16 libraries timed beside the lab's kernel (comma-separated; '' for none)")
    ap.add_argument("--per-matrix", default="default,rows," + ",".join(REFERENCES),
                    help="kernels timed on each dense matrix kind alone (comma-separated; '' for none)")
    ap.add_argument("--weights", default="bf16,w4a16", help="the storages timed (comma-separated)")
    ap.add_argument("--hc", action=argparse.BooleanOptionalAction, default=True,
                    help="time the hyper-connections' mixes (the two-launch mix and the compiled pieces)")
    ap.add_argument("--abba", action="store_true", help="time the W4A16 variants forward, then again in reverse "
                    "(A B B A: no variant always last); each row then holds both passes' times and their medians")
    ap.add_argument("--dry-run", action="store_true")
    a = ap.parse_args()
    dev = torch.device("cpu" if a.dry_run else "cuda")
    s = PRESETS[a.shape]
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = {"shape": s.name, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "hbm_read_gbps": hbm_read_gbps(dev), "launch_floor_us": launch_floor_us(dev), "rows": [], "checks": [],
           "per_matrix": []}

    def save():                   # after every section: a run stopped at its limit keeps what it measured
        for r in out["rows"]:
            r["gbps"] = r["bytes"] / (r["ms_median"] / 1e3) / 1e9
            r["of_hbm_read"] = r["gbps"] / out["hbm_read_gbps"]
        for r in out["per_matrix"]:
            if "bytes" in r:
                r["of_hbm_read"] = r["bytes"] / (r["ms_median"] / 1e3) / 1e9 / out["hbm_read_gbps"]
        (out_dir / "weights_bench.json").write_text(json.dumps(out, indent=1))

    samples: dict = {}            # with --abba: each (part, c, variant)'s times over both passes

    def timed(part, weights, c, variant, kernel, run, b, distinct):
        ts = timed_graph(run, dev)
        key = (part, weights, c, variant, kernel)
        passes = samples.setdefault(key, [])
        passes.append(ts)
        out["rows"] = [r for r in out["rows"] if (r["part"], r["weights"], r["concurrency"], r["variant"],
                                                   r["kernel"]) != key]           # a second pass replaces the first
        every = [t for p in passes for t in p]
        out["rows"].append({"part": part, "weights": weights, "concurrency": c, "variant": variant, "kernel": kernel,
                            "bytes": b, **({"distinct_per_layer": distinct[0]} if distinct else {}),
                            "ms_median": statistics.median(every), "ms_min": min(every), "ms_max": max(every),
                            **({"ms_median_by_pass": [statistics.median(p) for p in passes]} if len(passes) > 1
                               else {})})
        r = out["rows"][-1]
        print(f"{part:8s} {weights:6s} {variant:15s} c={c} {b / 1e9:7.3f} GB {r['ms_median']:7.3f} ms "
              f"{b / r['ms_median'] / 1e6 / out['hbm_read_gbps']:5.0%} of read", flush=True)

    variants = [v for v in a.variants.split(",") if v]
    if dev.type == "cuda":
        for v in variants:
            out["checks"] += check_variant(s, dev, v)
        save()
    for weights in [w for w in a.weights.split(",") if w]:
        parts = [("dense", 1, *dense_products(s, weights, dev)), ("dense", 4, *dense_products(s, weights, dev, 4))]
        for c in (1, 4):
            run, b, distinct = expert_layers(s, weights, dev, c, min(a.experts, s.experts))
            parts.append(("experts", c, run, b, distinct))
        order = variants if weights == "w4a16" else ["default"]
        # --abba: the variants again in reverse, so none is always timed last (a part's row: both passes' times)
        for variant in order + (order[::-1] if a.abba else []):
            with knobs(**VARIANTS.get(variant, {})):
                for part, c, run, b, *distinct in parts:
                    timed(part, weights, c, variant, "lab", run, b, distinct)
            save()
        del parts
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    for ref in [r for r in a.references.split(",") if r] if dev.type == "cuda" else []:
        try:
            parts = reference_parts(s, dev, REFERENCES[ref], min(a.experts, s.experts), out["checks"])
            for part, c, run, b, *distinct in parts:
                timed(part, "w4a16", c, ref, ref, run, b, distinct)
        except Exception as ex:                  # a library missing or refusing: recorded, the bench goes on
            out.setdefault("errors", []).append({"kernel": ref, "error": f"{type(ex).__name__}: {ex}"[:400]})
            print(f"{ref}: {type(ex).__name__}: {ex}"[:400], flush=True)
        parts = None
        save()
        torch.cuda.empty_cache()
    if a.hc and s.hc_count > 1:
        for c in (1, 4):
            for fused in (True, False):
                run, b = hc_mixes(s, dev, c, fused)
                count = 16
                timed("hc", "bf16", c, "two-launch" if fused else "compiled", "lab", run, b * count, None)
                r = out["rows"][-1]
                r["us_per_mix"], r["mixes"] = r["ms_median"] * 1e3 / count, count
        save()
    if dev.type == "cuda" and a.per_matrix:
        out["per_matrix"] = per_matrix(s, dev, [k for k in a.per_matrix.split(",") if k])
        for r in out["per_matrix"]:
            if "error" in r:
                print(f"{r['matrix']:14s} {r['kernel']:15s} {r['error']}")
            else:
                print(f"{r['matrix']:14s} {r['kernel']:15s} {r['us_per_product']:7.2f} us a product "
                      f"({r['bytes'] / r['count'] / 1e6:6.2f} MB: {r['bytes'] / r['ms_median'] / 1e6 / out['hbm_read_gbps']:4.0%} of read)")
    save()
    for c in out["checks"]:
        print(f"check {c['kernel']:15s} {c['matrix']:12s} rows={c.get('rows', '-')} rel err {c['rel_err']:.2e}")
    print(f"hbm read {out['hbm_read_gbps']:.0f} GB/s, a launch in a graph {out['launch_floor_us']:.2f} µs")


if __name__ == "__main__":
    main()
