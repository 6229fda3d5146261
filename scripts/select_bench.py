"""Top-k selection of one QSA layer at decode: the lab's radix select (its plain passes, with the run-maxima bound, and the default) against torch.topk + sort, batch 1..16 and context 64K..1M, budget 2048, graph-replayed.

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
from labkit.engine.model.select import bound_run, select_topk_torch, select_topk_triton  # noqa: E402

K = 2048
# score rows: independent normals, and normals rising with position (the best at the end, as recency makes
# them; the run-maxima bound is looser there)
DISTS = {"normal": lambda B, L: torch.randn(B, L, device="cuda"),
         "rising": lambda B, L: torch.randn(B, L, device="cuda") + torch.linspace(0, 6, L, device="cuda")}


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
    points = [(L, B, "normal") for L in (1 << 16, 1 << 18, 1 << 20) for B in (1, 4, 16)]
    points += [(1 << 20, 4, "rising"), (1 << 20, 16, "rising")]
    for L, B, dist in points:
        copies = 10
        scores = [DISTS[dist](B, L) for _ in range(copies)]
        r = {"B": B, "L": L, "scores": dist, "bound_default": bound_run(B, L, K) > 0}
        r["topk_sort_ms"] = graph_ms(lambda: [select_topk_torch(s, K) for s in scores], copies)
        r["select_plain_ms"] = graph_ms(lambda: [select_topk_triton(s, K, bound=False) for s in scores], copies)
        r["select_bound_ms"] = (graph_ms(lambda: [select_topk_triton(s, K, bound=True) for s in scores], copies)
                                if bound_run(B, L, K, force=True) else None)
        r["select_auto_ms"] = graph_ms(lambda: [select_topk_triton(s, K) for s in scores], copies)  # the default
        pos, _ = select_topk_triton(scores[0], K)
        ref = torch.topk(scores[0], K, dim=-1).values.sort(-1).values
        got = scores[0].gather(1, pos).sort(-1).values
        r["same_values_as_topk"] = bool(torch.equal(ref, got))
        rows.append(r)
        bnd = "-" if r["select_bound_ms"] is None else f"{r['select_bound_ms']:.4f}"
        print(f"B={B:2d} L={L:8d} {dist}: topk {r['topk_sort_ms']:.4f} ms, plain {r['select_plain_ms']:.4f}, "
              f"bound {bnd}, default {r['select_auto_ms']:.4f}", flush=True)
        del scores
    (out / "select_bench.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "k": K, "rows": rows},
                                                      indent=1))
    lines = [f"# Top-{K} selection per QSA layer ({torch.cuda.get_device_name()}), ms per selection", "",
             "| batch | context | scores | torch.topk + sort | radix passes | with the run-maxima bound | default "
             "| default / topk |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bnd = "–" if r["select_bound_ms"] is None else f"{r['select_bound_ms']:.4f}"
        lines.append(f"| {r['B']} | {r['L']} | {r['scores']} | {r['topk_sort_ms']:.4f} | {r['select_plain_ms']:.4f} | "
                     f"{bnd} | {r['select_auto_ms']:.4f} ({'bound' if r['bound_default'] else 'passes'}) | "
                     f"{r['select_auto_ms'] / r['topk_sort_ms']:.2f} |")
    (out / "select_bench.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
