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


class PhaseRanges:
    """Marks that open a profiler range at each of the anatomy's phase lines ("phase:<mark>"), so each kernel is
    attributed to the phase whose range launched it (`by_phase`)."""

    def __init__(self):
        self.rf = None

    def mark(self, phase: str, new_block: bool = False) -> None:
        self.close()
        self.rf = torch.profiler.record_function("phase:" + phase)
        self.rf.__enter__()

    def close(self) -> None:
        if self.rf is not None:
            self.rf.__exit__(None, None, None)
            self.rf = None

    def begin_chunk(self, start: int, end: int) -> None:
        self.mark("other")

    def end_chunk(self) -> None:
        self.close()


def by_phase(prof) -> dict:
    """{phase: {kernel: µs}}: each CUDA kernel under the phase range that holds the CPU event that launched it."""
    out = defaultdict(lambda: defaultdict(float))
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CPU or not ev.kernels:
            continue
        p = ev
        while p is not None and not p.name.startswith("phase:"):
            p = p.cpu_parent
        ph = p.name[len("phase:"):] if p is not None else "unmarked"
        for k in ev.kernels:
            out[ph][k.name[:160]] += k.duration
    return {ph: dict(ks) for ph, ks in out.items()}


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
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            e.prefill(0, tokens, start=P, marks=PhaseRanges())
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
        cache.pages.release(0)
        cache.pages.reserve(0, P + C)
        marks = PrefillMarks(dev)
        e.prefill(0, tokens, start=P, marks=marks)
        phases = {k[:-3]: v for k, v in marks.chunks()[0].items() if k.endswith("_ms")}
    per = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA or ev.name.startswith("phase:"):
            continue          # the phase ranges' own GPU annotations are not kernels
        d = getattr(ev, "device_time_total", None)
        per[ev.name][0] += 1
        per[ev.name][1] += ev.cuda_time_total if d is None else d
    try:
        phase_kernels = by_phase(prof)
    except Exception as exc:        # the attribution is a help; the kernel table stands without it
        phase_kernels = {"attribution failed": {f"{type(exc).__name__}: {exc}"[:160]: 0.0}}
    kernels = sorted(({"name": n[:160], "launches": c, "us": t} for n, (c, t) in per.items()), key=lambda r: -r["us"])
    total = sum(k["us"] for k in kernels)
    res = {"gpu": torch.cuda.get_device_name(), "prefix": P, "chunk": C, "wall_ms": wall, "kernel_ms": total / 1e3,
           "launches": sum(k["launches"] for k in kernels), "switches": envs.in_force(), "holding": model.holding(),
           "phases_ms": phases, "kernels": kernels,
           "phase_kernels": phase_kernels}
    (out / f"profile_prefill_{a.tag}.json").write_text(json.dumps(res, indent=1))
    lines = [f"# One prefill chunk: {C:,} tokens over {P:,} cached ({res['gpu']})", "",
             f"wall {wall:.1f} ms; kernels {total / 1e3:.1f} ms in {res['launches']:,} launches; {model.holding()}", "",
             "phases (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items() if v), "",
             "| kernel | launches | ms | share |", "|---|---|---|---|"]
    lines += [f"| `{k['name'][:90]}` | {k['launches']} | {k['us'] / 1e3:.2f} | {k['us'] / total:.1%} |" for k in kernels[:40]]
    for ph, ks in sorted(phase_kernels.items(), key=lambda kv: -sum(kv[1].values())):
        lines += ["", f"## {ph}: {sum(ks.values()) / 1e3:.1f} ms of kernels", "", "| kernel | ms |", "|---|---|"]
        lines += [f"| `{n[:90]}` | {us / 1e3:.2f} |" for n, us in sorted(ks.items(), key=lambda kv: -kv[1])[:10]]
    (out / f"profile_prefill_{a.tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:30]))


if __name__ == "__main__":
    main()
