"""Every kernel of one graph-replayed decode step: what runs, how long, and how much of the step the GPU
sits between kernels. The anatomy says which phase is slow; this says which kernels make it so.

    python3 scripts/profile_step.py OUT_DIR [--shape qwen3.8-flash-next] [--ctx 65536] [--conc 1,4]
                                           [--strategy resident] [--budget 2048] [--tag NAME]
                                           [--weights-dtype w4a16] [--layers 8] [--expert-banks 0]

Per concurrency: the step's median over 50 graph replays (CUDA events), the runner's anatomy, and a
torch.profiler (CUPTI) trace of 10 replays -> per kernel name: launches per step, µs per step; the sum
of kernel time per step against the step (the rest is the GPU between kernels: launch latency and
ramp/tail of small grids). Kernels are grouped by what they do, from their names
(`labkit.docs.kernels`: the lab's kernels, cuBLAS, inductor's fused kernels, copies).
Writes OUT_DIR/profile_<tag>.json and .md. Needs a CUDA GPU.
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from labkit.engine import DecodeRunner, Engine, HybridModel, OffloadCache, get_strategy  # noqa: E402
from labkit.docs.kernels import group_of  # noqa: E402
from labkit.shapes import PRESETS  # noqa: E402

def step_ms(runner, n: int = 50) -> list[float]:
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        runner.step()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return ts


def profile(runner, steps: int = 10) -> dict:
    from torch.profiler import ProfilerActivity, profile as prof
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        for _ in range(steps):
            runner.step()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    spans = []
    for e in p.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name
        d = getattr(e, "device_time_total", None)
        d = e.cuda_time_total if d is None else d
        per[name][0] += 1
        per[name][1] += d
        spans.append((e.time_range.start, e.time_range.end))
    kernels = sorted(({"name": n[:160], "group": group_of(n), "per_step": c / steps, "us_per_step": t / steps}
                      for n, (c, t) in per.items()), key=lambda r: -r["us_per_step"])
    spans.sort()
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in spans:                       # union of kernel intervals: time the GPU ran something
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    groups = defaultdict(lambda: [0.0, 0.0])
    for k in kernels:
        groups[k["group"]][0] += k["per_step"]
        groups[k["group"]][1] += k["us_per_step"]
    return {"kernels": kernels, "kernels_per_step": sum(k["per_step"] for k in kernels),
            "kernel_us_per_step": sum(k["us_per_step"] for k in kernels), "busy_us_per_step": busy / steps,
            "groups": {g: {"per_step": c, "us_per_step": t} for g, (c, t) in groups.items()}}


def _label(pt: dict) -> str:
    """A point's variant: the DeltaNet mixer's and the hc mix's form, and any other switch it set."""
    rest = {k: v for k, v in pt.get("switches", {}).items() if k not in ("dn_fused", "hc_fused")}
    return ", ".join([f"DeltaNet mixer {pt['deltanet_mix']}", f"hc mix {pt['hc_mix']}",
                      *(f"{k} {'on' if v else 'off'}" for k, v in rest.items())])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--shape", default="qwen3.8-flash-next")
    ap.add_argument("--ctx", type=int, default=65536)
    ap.add_argument("--conc", default="1,4")
    ap.add_argument("--strategy", default="resident")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--tag", default="step")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a strategy setting by its sweep name (e.g. hot_defer=false); repeatable, recorded")
    ap.add_argument("--mix", default="fused", choices=("fused", "unfused", "both"),
                    help="the DeltaNet mixer as one kernel, as torch.compile's kernels, or both in this process "
                         "(an A/B within one process)")
    ap.add_argument("--hc", default="fused", choices=("fused", "unfused", "both"),
                    help="the hyper-connections' mix as two kernels (`hc_mix`), as torch.compile's pieces, or both in "
                         "this process (an A/B within one process)")
    ap.add_argument("--ab", default="", metavar="SWITCH",
                    help="an engine switch by its parameter name (e.g. moe_step, hc_pdl): on and off in this process, "
                         "A B B A (`labkit.envs`)")
    ap.add_argument("--weights-dtype", default="auto", help="the model's weights_dtype (auto, bf16, w4a16)")
    ap.add_argument("--expert-banks", type=int, default=0, help="expert banks held (0: as many as fit)")
    ap.add_argument("--layers", type=int, default=0,
                    help="the shape cut to its first N layers (a multiple of its QSA period): every layer's kernels "
                         "are the same, and a few build in seconds where 48 take minutes")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_step: needs a CUDA GPU")
    concs = [int(c) for c in a.conc.split(",")]
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    shape = PRESETS[a.shape]
    if a.layers:
        if a.layers % shape.attn_every:
            sys.exit(f"profile_step: --layers {a.layers} is no multiple of the shape's QSA period {shape.attn_every}")
        shape = dataclasses.replace(shape, name=f"{shape.name}[:{a.layers}]", layers=a.layers,
                                    ple_layers=tuple(i for i in shape.ple_layers if i < a.layers))
    model = HybridModel(shape, "cuda", weights_dtype=a.weights_dtype, expert_banks=a.expert_banks or None)
    from labkit.engine.transfer.base import STRATEGIES
    from labkit.params import Param, parse_value
    declared = {st.param: st for cls in STRATEGIES.values() for st in cls.SETTINGS}
    settings = {}
    for kv in a.set:
        name, _, value = kv.partition("=")
        if name not in declared:
            sys.exit(f"profile_step: --set {kv}: unknown strategy setting (choose from {', '.join(sorted(declared))})")
        st = declared[name]
        settings[name] = parse_value(Param(name, st.kind, st.default, st.help), value)
    strat = get_strategy(a.strategy, **settings)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": shape.name, "ctx": a.ctx,
           "holding": model.holding(),
           "strategy": a.strategy, "settings": settings, "budget": a.budget, "env": {k: v for k, v in os.environ.items()
                                                                if k.startswith("LABKIT_")},
           "weight_bytes": model.step_weight_bytes(), "points": []}
    from labkit import envs
    res["switches"] = envs.in_force()
    # both: A B B A, so that neither variant is always the one measured first or second in the process
    ab = {"fused": [True], "unfused": [False], "both": [True, False, False, True]}
    if sum(x == "both" for x in (a.mix, a.hc)) + bool(a.ab) > 1:
        sys.exit("profile_step: --mix both, --hc both, --ab: one A/B at a time")
    by_param = envs.BY_PARAM
    if a.ab and (a.ab not in by_param or by_param[a.ab].kind != "bool"):
        sys.exit(f"profile_step: --ab {a.ab}: not an on/off engine switch (choose from "
                 f"{', '.join(sorted(n for n, v in by_param.items() if v.kind == 'bool'))})")
    base = {"dn_fused": a.mix != "unfused", "hc_fused": a.hc != "unfused"}
    if a.mix == "both":
        variants = [dict(base, dn_fused=f) for f in ab["both"]]
    elif a.hc == "both":
        variants = [dict(base, hc_fused=h) for h in ab["both"]]
    elif a.ab:
        variants = [dict(base, **{a.ab: v}) for v in ab["both"]]
    else:
        variants = [base]
    points = [(c, v) for c in concs for v in variants]

    def runner_for(conc, variant):
        envs.apply(variant)                       # the switches (recorded below with the rest)
        cache = OffloadCache.allocate(model, strat.medium, conc, a.ctx + 256)
        cache.fill_random_([a.ctx] * conc, seed=0)
        cache.lens[:conc] = a.ctx
        r = DecodeRunner(Engine(model, cache, get_strategy(a.strategy, **settings), a.budget), conc, max_steps=256)
        r.prepare()
        return r, cache

    # every point's step timed before any profiling: once CUPTI has traced, graph replays in the same
    # process run slower (measured: +0.5 ms on a 4.3 ms step), so profiles come second
    for conc, variant in points:
        runner, cache = runner_for(conc, variant)
        ts = step_ms(runner)
        res["points"].append({"conc": conc, "deltanet_mix": "fused" if variant["dn_fused"] else "unfused",
                              "hc_mix": "fused" if variant["hc_fused"] else "unfused", "switches": dict(variant),
                              "step_ms_median": statistics.median(ts), "step_ms_min": min(ts), "step_ms_max": max(ts),
                              "graph_mode": runner.graph_mode, "anatomy_ms": runner.anatomy()})
        del runner, cache
        torch.cuda.empty_cache()
    for pt, (conc, variant) in zip(res["points"], points):
        runner, cache = runner_for(conc, variant)
        pt.update(profile(runner))
        print(f"c={conc} {_label(pt)}: step {pt['step_ms_median']:.3f} ms, {pt['kernels_per_step']:.0f} kernels, "
              f"kernel time {pt['kernel_us_per_step'] / 1e3:.3f} ms, busy {pt['busy_us_per_step'] / 1e3:.3f} ms",
              flush=True)
        for g, v in sorted(pt["groups"].items(), key=lambda kv: -kv[1]["us_per_step"]):
            print(f"   {g:24s} {v['per_step']:6.0f} kernels {v['us_per_step'] / 1e3:7.3f} ms", flush=True)
        del runner, cache
        torch.cuda.empty_cache()
    res["wall_s"] = time.time() - t0
    (out / f"profile_{a.tag}.json").write_text(json.dumps(res, indent=1))
    lines = [f"# Kernels of one decode step ({res['device']}, {shape.name} ({model.weights_dtype}), {a.strategy}, "
             f"{a.ctx} context, budget {a.budget}, {a.tag})", ""]
    for pt in res["points"]:
        lines += [f"## c = {pt['conc']}, {_label(pt)}: step {pt['step_ms_median']:.3f} ms (min {pt['step_ms_min']:.3f}, max "
                  f"{pt['step_ms_max']:.3f}), {pt['kernels_per_step']:.0f} kernels, kernel time "
                  f"{pt['kernel_us_per_step'] / 1e3:.3f} ms, GPU busy {pt['busy_us_per_step'] / 1e3:.3f} ms", "",
                  "anatomy (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in pt["anatomy_ms"].items()), "",
                  "| group | kernels / step | ms / step |", "|---|---|---|"]
        for g, v in sorted(pt["groups"].items(), key=lambda kv: -kv[1]["us_per_step"]):
            lines.append(f"| {g} | {v['per_step']:.0f} | {v['us_per_step'] / 1e3:.3f} |")
        lines += ["", "| kernel | group | per step | µs / step | µs each |", "|---|---|---|---|---|"]
        for k in pt["kernels"][:40]:
            lines.append(f"| `{k['name'][:90]}` | {k['group']} | {k['per_step']:.0f} | {k['us_per_step']:.1f} | "
                         f"{k['us_per_step'] / max(k['per_step'], 1e-9):.2f} |")
        lines.append("")
    (out / f"profile_{a.tag}.md").write_text("\n".join(lines))
    print(f"wrote {out}/profile_{a.tag}.md in {res['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
