"""Every kernel of one prefill chunk: what runs and how long, to say which kernels make a prefill anatomy's
phase slow (the anatomy says which phase; this says which kernels).

    python3 scripts/profile_prefill.py OUT_DIR [--prefix 8K] [--chunk 8K] [--tag NAME] [--weights-dtype w4a16]
        [--expert-banks 24] [--ngram-gib 4]

Builds the reference shape, fills a random cached prefix of `--prefix` tokens, warms up, then profiles the
prefill of the next `--chunk` tokens (torch.profiler, CUDA kernels): per kernel name its launches and total
µs, sorted, with the chunk's wall time, and the chunk's anatomy (its phases by CUDA events, a pass of its own). Writes OUT_DIR/profile_prefill_<tag>.json and .md. Needs CUDA.
"""
import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from labkit import envs  # noqa: E402
from labkit.engine import Engine, HybridModel, OffloadCache, get_strategy  # noqa: E402
from labkit.engine.model.prefill_marks import PrefillMarks  # noqa: E402
from labkit.params import parse_size  # noqa: E402
from labkit.shapes import ModelShape  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--prefix", default="8K")
    ap.add_argument("--chunk", default="8K")
    ap.add_argument("--tag", default="chunk")
    ap.add_argument("--weights-dtype", default="auto")
    ap.add_argument("--expert-banks", type=int, default=None)
    ap.add_argument("--ngram-gib", type=float, default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_prefill: needs a CUDA GPU")
    from torch.profiler import ProfilerActivity, profile
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    s, dev = ModelShape.from_name("qwen3.8-flash-next"), torch.device("cuda")
    P, C = parse_size(a.prefix), parse_size(a.chunk)
    model = HybridModel(s, dev, seed=0, weights_dtype=a.weights_dtype, expert_banks=a.expert_banks,
                        ngram_table_bytes=int(a.ngram_gib * 2**30) if a.ngram_gib else None)
    st = get_strategy("resident")
    cache = OffloadCache.allocate(model, st.medium, 1, P + C)
    cache.fill_random_([P], seed=0)
    e = Engine(model, cache, st, 2048, prefill_chunk=C)
    tokens = torch.randint(0, s.vocab, (P + C,), device=dev)
    with torch.inference_mode():
        for _ in range(2):                               # warm-up: kernels, workspaces, autotuning
            cache.pages.release(0)
            cache.pages.reserve(0, P + C)
            e.prefill(0, tokens, start=P)
        torch.cuda.synchronize()
        cache.pages.release(0)
        cache.pages.reserve(0, P + C)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            e.prefill(0, tokens, start=P)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
        cache.pages.release(0)
        cache.pages.reserve(0, P + C)
        marks = PrefillMarks(dev)
        e.prefill(0, tokens, start=P, marks=marks)
        phases = {k[:-3]: v for k, v in marks.chunks()[0].items() if k.endswith("_ms")}
    per = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        d = getattr(ev, "device_time_total", None)
        per[ev.name][0] += 1
        per[ev.name][1] += ev.cuda_time_total if d is None else d
    kernels = sorted(({"name": n[:160], "launches": c, "us": t} for n, (c, t) in per.items()), key=lambda r: -r["us"])
    total = sum(k["us"] for k in kernels)
    res = {"gpu": torch.cuda.get_device_name(), "prefix": P, "chunk": C, "wall_ms": wall, "kernel_ms": total / 1e3,
           "launches": sum(k["launches"] for k in kernels), "switches": envs.in_force(), "holding": model.holding(),
           "phases_ms": phases, "kernels": kernels}
    (out / f"profile_prefill_{a.tag}.json").write_text(json.dumps(res, indent=1))
    lines = [f"# One prefill chunk: {C:,} tokens over {P:,} cached ({res['gpu']})", "",
             f"wall {wall:.1f} ms; kernels {total / 1e3:.1f} ms in {res['launches']:,} launches; {model.holding()}", "",
             "phases (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items() if v), "",
             "| kernel | launches | ms | share |", "|---|---|---|---|"]
    lines += [f"| `{k['name'][:90]}` | {k['launches']} | {k['us'] / 1e3:.2f} | {k['us'] / total:.1%} |" for k in kernels[:40]]
    (out / f"profile_prefill_{a.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:30]))


if __name__ == "__main__":
    main()
