"""Top-k selection of one QSA layer at decode: the lab's radix select at each block size (and the default) against torch.topk + sort, batch 1..16 and context 64K..1M, budget 2048, graph-replayed.

    python3 scripts/select_bench.py OUT_DIR

Each point: a CUDA graph of 10 selections over distinct score rows (past L2 at 1M), median of 15
replays / 10. Writes OUT_DIR/select_bench.json and .md. Needs a CUDA GPU.
"""
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from labkit.engine.model.select import select_topk_torch, select_topk_triton  # noqa: E402

BLOCKS = (512, 1024, 2048, 4096, 8192)
K = 2048


def graph_ms(fn, copies):
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
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for L in (1 << 16, 1 << 18, 1 << 20):
        for B in (1, 4, 16):
            copies = 10
            scores = [torch.randn(B, L, device="cuda") for _ in range(copies)]
            r = {"B": B, "L": L}
            r["topk_sort_ms"] = graph_ms(lambda: [select_topk_torch(s, K) for s in scores], copies)
            for blk in BLOCKS:
                r[f"select_{blk}_ms"] = graph_ms(lambda: [select_topk_triton(s, K, block=blk) for s in scores], copies)
            r["select_auto_ms"] = graph_ms(lambda: [select_topk_triton(s, K) for s in scores], copies)  # the default
            pos, _ = select_topk_triton(scores[0], K)
            ref = torch.topk(scores[0], K, dim=-1).values.sort(-1).values
            got = scores[0].gather(1, pos).sort(-1).values
            r["same_values_as_topk"] = bool(torch.equal(ref, got))
            rows.append(r)
            print(f"B={B:2d} L={L:8d}: topk {r['topk_sort_ms']:.4f} ms, default "
                  f"{r['select_auto_ms']:.4f}, " + ", ".join(f"{b}:{r[f'select_{b}_ms']:.4f}" for b in BLOCKS), flush=True)
            del scores
    (out / "select_bench.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "k": K, "rows": rows},
                                                      indent=1))
    lines = [f"# Top-{K} selection per QSA layer ({torch.cuda.get_device_name()}), ms per selection", "",
             "| batch | context | torch.topk + sort | select (default block) | " +
             " | ".join(f"block {b}" for b in BLOCKS) + " | select / topk |", "|---|---|---|---|" + "---|" * len(BLOCKS) + "---|"]
    for r in rows:
        lines.append(f"| {r['B']} | {r['L']} | {r['topk_sort_ms']:.4f} | {r['select_auto_ms']:.4f} | " +
                     " | ".join(f"{r[f'select_{b}_ms']:.4f}" for b in BLOCKS) +
                     f" | {r['select_auto_ms'] / r['topk_sort_ms']:.2f} |")
    (out / "select_bench.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
