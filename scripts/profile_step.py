"""Where a decode step's time goes, kernel by kernel: the torch profiler over graph replays (and one
eager step) of the reference shape, beside the step time and its anatomy. A development tool; the
sweep's per-point anatomy is the measured record.

    python3 scripts/profile_step.py [--strategy resident] [--context 65536] [--batch 1] [--out DIR]
"""
import argparse
import collections
import json
import os

import torch
from torch.profiler import ProfilerActivity, profile

from labkit.engine import Engine, HybridModel, OffloadCache, get_strategy
from labkit.shapes import PRESETS
from labkit.stats import spread
from labkit.engine.drive.runner import DecodeRunner


def kernel_table(prof, top=45):
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.name][0] += 1
            agg[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    rows = sorted(agg.items(), key=lambda kv: -kv[1][1])
    return [(n[:110], c, t / 1e3) for n, (c, t) in rows[:top]], sum(v[1] for v in agg.values()) / 1e3, sum(v[0] for v in agg.values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="resident")
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    shape = PRESETS["qwen3.8-flash-next"]
    model = HybridModel(shape, "cuda", seed=0)
    st = get_strategy(a.strategy)
    cache = OffloadCache.allocate(model, st.medium, a.batch, a.context + 512)
    cache.fill_random_([a.context] * a.batch, seed=1)
    r = DecodeRunner(Engine(model, cache, st, 2048), a.batch, max_steps=400)
    r.prepare()
    ts = []
    for _ in range(40):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); r.step(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    t = spread(ts)
    anat = r.anatomy(repeats=5)
    wb = model.step_weight_bytes()
    print(f"{a.strategy} ctx={a.context} B={a.batch}: step {t.median:.3f} ms ({t.min:.3f}-{t.max:.3f}), "
          f"weights {wb/1e9:.2f} GB -> {wb/t.median/1e6:.0f} GB/s; anatomy closure {anat['marked_step_ms']/t.median:.3f}")
    print("anatomy ms:", {k: round(v, 3) for k, v in anat.items()})
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            r.step()
        torch.cuda.synchronize()
    rows, total, n = kernel_table(prof)
    print(f"graph replays: {n / a.steps:.0f} kernels/step, {total / a.steps:.3f} ms kernel time/step")
    for name, c, ms in rows:
        print(f"{ms / a.steps:8.3f} ms {c // a.steps:5d}x  {name}")
    with open(os.path.join(a.out, f"profile_{a.strategy}_{a.context}_{a.batch}.json"), "w") as f:
        json.dump({"step": t.__dict__, "anatomy": anat, "kernels": rows, "kernels_per_step": n / a.steps}, f, indent=1)


if __name__ == "__main__":
    main()
