"""How fast a W4A16 decode product's weight can be read at all, with no arithmetic: each program loads its tiles
of 32-bit words and only XORs them, over the same launch the row kernel makes (output blocks x K splits), so the
time is the access pattern's and the occupancy's alone. Two layouts of the same bytes: `rows` (the engine's: a
weight row's K/8 words contiguous, a tile BN rows x W words at the row stride) and `tiled` (each tile's BN x W
words one contiguous block, the blocks of a row block in K order: what a kernel reading 16 B a thread sees).

    python3 scripts/w4_stream_probe.py OUT_DIR          # on a GPU; about 15 s on an H100 (the two matrices, 160 points)
    TRITON_INTERPRET=1 python3 scripts/w4_stream_probe.py OUT_DIR --dry-run   # the script on CPU

Times each point in a CUDA graph over copies of the weight that L2 cannot hold (median of replays) beside a
contiguous read of the same process (torch's sum), and writes OUT_DIR/w4_stream_probe.json.
"""
import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from weights_bench import hbm_read_gbps, timed_graph  # noqa: E402
from labkit.engine.model import arch  # noqa: E402

# (K, N) of the published shape's largest dense products at decode, W4A16: the QSA input and output projections
SHAPES = {"qsa.w_in": (2560, 13696), "qsa.w_o": (6144, 2560)}
L2_SAFE_BYTES = 160 << 20          # copies of a weight until a pass reads this much (H100's L2 is 50 MB)


@triton.jit
def _stream(w_ptr, out_ptr, N, KW, tiles, BN: tl.constexpr, W: tl.constexpr, TILED: tl.constexpr,
            STAGES: tl.constexpr):
    """Program (j, sp): rows [j BN, (j + 1) BN), word tiles [sp tiles, (sp + 1) tiles) of W words each, XORed."""
    j = tl.program_id(0)
    t0 = tl.program_id(1) * tiles
    t1 = tl.minimum(t0 + tiles, KW // W)
    r = tl.arange(0, BN)
    c = tl.arange(0, W)
    acc = tl.zeros([BN, W], dtype=tl.int32)
    for t in tl.range(t0, t1, num_stages=STAGES):
        if TILED:
            off = (j.to(tl.int64) * (KW // W) + t) * (BN * W) + r[:, None] * W + c[None, :]
        else:
            off = (j * BN + r[:, None]).to(tl.int64) * KW + t * W + c[None, :]
        acc ^= tl.load(w_ptr + off)
    tl.store(out_ptr + (j * tl.num_programs(1) + tl.program_id(1)), tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0))


def points(quick: bool = False):
    """(layout, BN, W, programs a multiprocessor the split aims at (0: no split), pipeline stages). quick: the
    engine's tile and the longest row run, no split or the engine's four programs a multiprocessor."""
    tiles = ((64, 16), (16, 64)) if quick else ((64, 16), (32, 32), (16, 64), (128, 16), (64, 32))
    for layout, (bn, w), per_sm, stages in itertools.product(
            ("rows", "tiled"), tiles, (0, 4) if quick else (0, 2, 4, 8), (1, 3)):
        yield layout, bn, w, per_sm, stages


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--dry-run", action="store_true", help="CPU, the Triton interpreter, two small points")
    ap.add_argument("--quick", action="store_true", help="16 points a matrix, not 80")
    a = ap.parse_args()
    if not a.dry_run and not torch.cuda.is_available():
        sys.exit("w4_stream_probe: needs a CUDA GPU (or --dry-run under TRITON_INTERPRET=1)")
    dev = torch.device("cpu" if a.dry_run else "cuda")
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sms = arch.multiprocessors(dev) if dev.type == "cuda" else 4
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "hbm_read_gbps": hbm_read_gbps(dev), "multiprocessors": sms, "points": []}
    shapes = {"tiny": (256, 128)} if a.dry_run else SHAPES
    for name, (K, N) in shapes.items():
        KW = K // 8
        nbytes = N * K // 2
        copies = 1 if a.dry_run else max(1, -(-L2_SAFE_BYTES // nbytes))
        ws = [torch.randint(-2**31, 2**31 - 1, (N * KW,), dtype=torch.int32, device=dev) for _ in range(copies)]
        pts = list(points())[:2] if a.dry_run else list(points(a.quick))
        for layout, bn, w, per_sm, stages in pts:
            blocks, ktiles = N // bn, KW // w
            split = 1 if per_sm == 0 else max(1, min(ktiles, -(-per_sm * sms // blocks)))
            tiles = -(-ktiles // split)
            split = -(-ktiles // tiles)
            o = torch.empty(blocks * split, dtype=torch.int32, device=dev)

            def run():
                for wt in ws:
                    _stream[(blocks, split)](wt, o, N, KW, tiles, BN=bn, W=w, TILED=layout == "tiled",
                                             STAGES=stages, num_warps=4)
            try:
                ts = timed_graph(run, dev)
            except Exception as ex:         # a point that does not compile or launch: recorded, the rest go on
                res["points"].append({"matrix": name, "layout": layout, "BN": bn, "W": w, "per_sm": per_sm,
                                      "stages": stages, "error": f"{type(ex).__name__}: {ex}"[:300]})
                continue
            us = statistics.median(ts) * 1e3 / copies
            gbps = nbytes / (us / 1e6) / 1e9
            res["points"].append({"matrix": name, "K": K, "N": N, "layout": layout, "BN": bn, "W": w,
                                  "per_sm": per_sm, "stages": stages, "programs": blocks * split,
                                  "tiles_a_program": tiles, "us": us, "us_min": min(ts) * 1e3 / copies,
                                  "us_max": max(ts) * 1e3 / copies, "gbps": gbps,
                                  "of_read": gbps / res["hbm_read_gbps"]})
            p = res["points"][-1]
            print(f"{name:9s} {layout:5s} BN={bn:3d} W={w:2d} per_sm={per_sm} stages={stages} programs="
                  f"{p['programs']:5d} {us:6.2f} us {p['of_read']:5.0%} of read", flush=True)
        (out_dir / "w4_stream_probe.json").write_text(json.dumps(res, indent=1))
        del ws


if __name__ == "__main__":
    main()
