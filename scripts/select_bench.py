"""Top-k selection of one QSA layer at decode: the lab's radix select (the default: block 2048, one block a
histogram program; and each tiles count forced) against torch.topk + sort, batch 1..16 and context
64K..1M, budget 2048, graph-replayed.

    python3 scripts/select_bench.py OUT_DIR [--blocks] [--cpu-dry-run]

Each point: a CUDA graph of 10 selections over distinct score rows (past L2 at 1M), median of 15
replays / 10. Columns: `select (default)` is what `select_topk` runs, `auto tiles` the tiles `hist_tiles`
would choose there (histogram programs a pass = cdiv(L / 2048, tiles) * batch); `tiles T` the same select
with T forced (T = 1: one block a program, the default). `--blocks` adds the earlier sweep of
larger blocks (at tiles 1, as measured before). Every point also checks the default select's positions
against `select_topk_reference` exactly. Writes OUT_DIR/select_bench.json and .md. Needs a CUDA GPU;
`--cpu-dry-run` runs the same code paths on small CPU shapes under TRITON_INTERPRET=1 (wall-clock
timings of the interpreter, meaningless as speeds) to check the script.
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

DRY = "--cpu-dry-run" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"      # before triton is imported

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from labkit.engine.model.select import (hist_tiles, select_topk_reference, select_topk_torch,  # noqa: E402
                                        select_topk_triton)

BLOCK = 2048                                   # select_topk_triton's default
BLOCKS = (4096, 8192, 16384, 32768)            # --blocks, at tiles 1
TILES = (1, 2, 4, 8, 16)
if DRY:
    K, CONTEXTS, BATCHES, COPIES, DEV = 64, (1 << 12, 1 << 14), (1, 4), 2, "cpu"
else:
    K, CONTEXTS, BATCHES, COPIES, DEV = 2048, (1 << 16, 1 << 18, 1 << 20), (1, 4, 16), 10, "cuda"


def graph_ms(fn, copies):
    if DRY:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3 / copies
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ts = []
    for _ in range(15):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts) / copies


def main():
    out = Path(next(a for a in sys.argv[1:] if not a.startswith("--")))
    out.mkdir(parents=True, exist_ok=True)
    blocks = BLOCKS if "--blocks" in sys.argv else ()
    device = "CPU (TRITON_INTERPRET=1 dry run)" if DRY else torch.cuda.get_device_name()
    rows = []
    for L in CONTEXTS:
        for B in BATCHES:
            copies = COPIES
            scores = [torch.randn(B, L, device=DEV) for _ in range(copies)]
            nblk = -(-L // min(BLOCK, 1 << (L - 1).bit_length()))
            auto = hist_tiles(B, nblk)
            tiles = [t for t in TILES if t <= nblk]
            r = {"B": B, "L": L, "blocks_a_row": nblk, "auto_tiles": auto,
                 "auto_hist_programs": -(-nblk // auto) * B}
            r["topk_sort_ms"] = graph_ms(lambda: [select_topk_torch(s, K) for s in scores], copies)
            r["select_default_ms"] = graph_ms(lambda: [select_topk_triton(s, K) for s in scores], copies)
            for t in tiles:
                r[f"tiles_{t}_ms"] = graph_ms(lambda: [select_topk_triton(s, K, tiles=t) for s in scores], copies)
            for blk in blocks:
                r[f"block_{blk}_ms"] = graph_ms(lambda: [select_topk_triton(s, K, block=blk, tiles=1) for s in scores],
                                                copies)
            pos, valid = select_topk_triton(scores[0], K)
            rpos, rvalid = select_topk_reference(scores[0], K)
            r["same_as_reference"] = bool(torch.equal(pos, rpos) and torch.equal(valid, rvalid))
            ref = torch.topk(scores[0], K, dim=-1).values.sort(-1).values
            r["same_values_as_topk"] = bool(torch.equal(ref, scores[0].gather(1, pos).sort(-1).values))
            same_tiles = []
            for t in tiles:
                tpos, tvalid = select_topk_triton(scores[0], K, tiles=t)
                same_tiles.append(bool(torch.equal(tpos, rpos) and torch.equal(tvalid, rvalid)))
            r["all_tiles_same_as_reference"] = all(same_tiles)
            rows.append(r)
            print(f"B={B:2d} L={L:8d}: topk {r['topk_sort_ms']:.4f} ms, default {r['select_default_ms']:.4f} "
                  f"(auto tiles {auto}, {r['auto_hist_programs']} hist programs), " +
                  ", ".join(f"t{t}:{r[f'tiles_{t}_ms']:.4f}" for t in tiles) +
                  "".join(f", b{b}:{r[f'block_{b}_ms']:.4f}" for b in blocks) +
                  f", exact {r['same_as_reference']}/{r['all_tiles_same_as_reference']}", flush=True)
            del scores
    (out / "select_bench.json").write_text(json.dumps({"device": device, "k": K, "block": BLOCK, "rows": rows},
                                                      indent=1))
    lines = [f"# Top-{K} selection per QSA layer ({device}), ms per selection", "",
             f"Block {BLOCK}; `auto tiles`: the histogram's blocks a program that `hist_tiles` would "
             "choose (hist programs: a pass, all rows); `tiles T`: T forced (1: one block a program, the default).", "",
             "| batch | context | torch.topk + sort | select (default) | auto tiles | hist programs | " +
             " | ".join(f"tiles {t}" for t in TILES) + "".join(f" | block {b} (tiles 1)" for b in blocks) +
             " | select / topk | exact |",
             "|---|---|---|---|---|---|" + "---|" * (len(TILES) + len(blocks)) + "---|---|"]
    for r in rows:
        cell = lambda key: f"{r[key]:.4f}" if key in r else "-"  # noqa: E731
        lines.append(f"| {r['B']} | {r['L']} | {r['topk_sort_ms']:.4f} | {r['select_default_ms']:.4f} | "
                     f"{r['auto_tiles']} | {r['auto_hist_programs']} | " +
                     " | ".join(cell(f"tiles_{t}_ms") for t in TILES) +
                     "".join(f" | {cell(f'block_{b}_ms')}" for b in blocks) +
                     f" | {r['select_default_ms'] / r['topk_sort_ms']:.2f} | "
                     f"{'yes' if r['same_as_reference'] and r['all_tiles_same_as_reference'] else 'NO'} |")
    (out / "select_bench.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
