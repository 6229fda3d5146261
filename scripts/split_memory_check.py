"""The 3-way layer split planned for 24 GiB cards, checked against the allocator: each third of the reference
shape's layers built alone on this GPU under a 24 GiB cap, a decode batch at 1M context run (graph-captured
steps), its allocator peak against `memory_plan.plan_split`'s total for that card.

    python3 scripts/split_memory_check.py OUT_DIR [--cap-gib 24] [--weights w4a16]

Per card and point (c = 1 and 4 with zero_copy; c = 4 with hot_cache): the plan by part, the allocator's peak
(`torch.cuda.max_memory_allocated`) after the model, the cache and three decode steps, and their ratio; a
point the plan says cannot fit is reported so and not built. Writes OUT_DIR/split_memory.json.
"""
import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from labkit.engine import Engine, HybridModel, OffloadCache, get_strategy  # noqa: E402
from labkit.engine.drive.runner import DecodeRunner  # noqa: E402
from labkit.engine.memory_plan import GIB, plan_split  # noqa: E402
from labkit.shapes import PRESETS  # noqa: E402


def check(shape, card, plan, context, conc, strategy, weights, cap_gib) -> dict:
    dev = torch.device("cuda")
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    row = {"card": card, "layers": f"{plan.layers[0]}-{plan.layers[1] - 1}", "concurrency": conc,
           "strategy": strategy, "context_len": context, "weights_dtype": weights, "cap_gib": cap_gib,
           "planned_bytes": plan.total, **{f"plan_{k}": v for k, v in plan.parts.items()},
           "host_kv_bytes": plan.host_kv, "fits_plan": plan.fits(cap_gib)}
    if not plan.fits(cap_gib):
        row["status"] = "does not fit (plan)"
        return row
    t = time.time()
    try:
        model = HybridModel(shape, dev, seed=0, weights_dtype=weights, stage=plan.layers, ngram_table_bytes=1 << 30)
        row["model_bytes"] = torch.cuda.memory_allocated(dev)
        st = get_strategy(strategy)
        cache = OffloadCache.allocate(model, st.medium, conc, context + 64)
        cache.lens[:conc] = context
        e = Engine(model, cache, st, budget=2048)
        r = DecodeRunner(e, conc, max_steps=64)
        r.prepare(warmup=1)
        for _ in range(3):
            r.step()
        torch.cuda.synchronize()
        row.update(status="ok", peak_bytes=torch.cuda.max_memory_allocated(dev), graph_mode=r.graph_mode,
                   seconds=time.time() - t)
        row["peak_over_plan"] = row["peak_bytes"] / plan.total
        del r, e, cache, model
    except torch.cuda.OutOfMemoryError as ex:
        row.update(status="out of memory", error=str(ex).splitlines()[0][:300],
                   peak_bytes=torch.cuda.max_memory_allocated(dev))
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument("--weights", default="w4a16")
    ap.add_argument("--context", type=int, default=1 << 20)
    a = ap.parse_args()
    shape = PRESETS["qwen3.8-flash-next"]
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gib * GIB / total))
    rows = []
    for conc, strategy in ((1, "zero_copy"), (4, "zero_copy"), (4, "hot_cache")):
        plans = plan_split(shape, 3, a.context, conc, a.weights, strategy=strategy, max_steps=64)
        for p in plans:
            if strategy == "hot_cache" and p.card:
                continue                    # one card: the hot cache adds the same slots on each
            r = check(shape, p.card, p, a.context, conc, strategy, a.weights, a.cap_gib)
            rows.append(r)
            print(f"card {r['card']} c={conc} {strategy:9s} plan {r['planned_bytes'] / GIB:6.2f} GiB  "
                  f"peak {r.get('peak_bytes', 0) / GIB:6.2f} GiB  {r['status']}  "
                  f"{r.get('peak_over_plan', float('nan')):.3f}", flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "split_memory.json").write_text(json.dumps({"device": torch.cuda.get_device_name(0),
                                                               "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
