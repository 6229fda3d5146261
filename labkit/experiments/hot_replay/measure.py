"""Hot-cache hit rates on recorded selections, without a GPU: a trace's selections, scaled to the
engine's context and budget the way the decode sweep replays them (`load_selection_trace(stable=True)`),
go through the hot cache's own bookkeeping (`HotIndex.plan`, the code a GPU step runs) on the CPU, one
request, every QSA layer of the reference shape. What comes out is what a GPU run would count (the
GPU test `test_device_counters_equal_a_cpu_replay` checks that equality), not a model of it.

    df = replay_sweep(["labkit/data/smollm2-135m-prose-indexer-b2048.npz"], context_lens=[1 << 20],
                      budget=2048, capacity_x=[0.5, 1, 1.5, 2], policies=["lru", "lfu", "lrfu"])

One row per (trace, context, capacity, policy): the trace's recording density (`ratio` = trace budget
/ trace context, e.g. 1/32), hit rate and link bytes per step in steady state (steps after the first,
whose cache starts cold), those bytes against `zero_copy`'s (every selected row, every step), and the
step-to-step overlap of the replayed selections next to the trace's own (the stable mapping keeps it).

    labkit run hot_replay --out DIR [-p traces=TRACE.npz,...] [-p context_lens=128K,1M] [-p budget=2048]
writes DIR/hot_replay.parquet, summary.md, manifest.json and report.html (`labkit.experiments.hot_replay.figures`).
"""
from __future__ import annotations

import time
import math
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ...engine.transfer.hot_cache import COUNTERS, POLICIES, HotIndex
from ...engine.model.trace_replay import read_trace, load_selection_trace, scale_row
from ...quality.traces import load_trace, locality
from ...shapes import PRESETS
from ... import __version__
from ...results import git_sha
from ...params import BadInput
from . import DATA, HotReplayPlan


def trace_path(name: str) -> Path:
    """A trace as a plan names it: a path from here, else one relative to the repository (the shipped traces are
    recorded as `labkit/data/...`, so a plan reads the same from any working directory)."""
    path = Path(name)
    return path if path.is_file() or path.is_absolute() else DATA.parent.parent / path


def check(p: dict) -> HotReplayPlan:
    """Check what crosses parameters and the traces named (one BadInput line before anything is read); "auto"
    traces: every one shipped in labkit/data. Returns the plan."""
    traces = p["traces"]
    if traces == "auto":
        traces = sorted(str(t.relative_to(DATA.parent.parent)) for t in DATA.glob("*.npz"))
    plan = HotReplayPlan.from_params({**p, "traces": traces})
    missing = [t for t in plan.traces if not trace_path(t).is_file()]
    if missing or not plan.traces:
        raise BadInput(f"trace {missing[0] if missing else '(none)'} does not exist")
    if not plan.policies:
        raise BadInput(f"policies: none given; choose from {', '.join(POLICIES)}")
    if any(c < plan.budget for c in plan.context_lens) or not plan.context_lens:
        raise BadInput(f"budget must be > 0 and no larger than every context, got {plan.budget}")
    if not plan.capacity_x:
        raise BadInput(f"capacity_x must be > 0, got {list(plan.capacity_x)}")
    return plan


def replay(sel: torch.Tensor, capacity: int, policy: str, row_bytes: int, n_rows: int) -> pd.DataFrame:
    """sel [steps, layers, k] positions of one request -> per-step counters summed over layers."""
    steps, layers, k = sel.shape
    idx = HotIndex(layers, 1, capacity, n_rows, policy)
    out = []
    for s in range(steps):
        for layer in range(layers):
            idx.plan(layer, sel[s, layer], row_bytes)
        out.append(dict(zip(COUNTERS, idx.step.sum(0).tolist()), step=s))
    return pd.DataFrame(out)


def overlap_prev(sel: np.ndarray) -> float:
    """Mean |S_t ∩ S_t-1| / |S_t| over steps >= 1 and layers (sel [steps, layers, k], rows unique)."""
    vals = [np.intersect1d(sel[s, li], sel[s - 1, li]).size / sel.shape[2]
            for s in range(1, sel.shape[0]) for li in range(sel.shape[1])]
    return float(np.mean(vals)) if vals else float("nan")


def trace_share(path, n_layers: int, context_len: int, budget: int) -> float:
    """Share of the stably replayed rows that come from the trace (its positions, widened into runs),
    the rest being the recent fill `scale_row` adds when a sparse trace's mapped set falls short of the
    budget (sink/recent picks are not widened). The fill is the same rows every step, so it hits once warm:
    a hit rate far above `trace_share` is partly the fill's."""
    pos, ctx, meta = read_trace(path)
    sink, recent = int(meta.get("sink_window", 16)), int(meta.get("recent_window", 64))
    rep = max(1, budget // pos.shape[2])
    n = [scale_row(pos[s, (i * pos.shape[1]) // n_layers], int(ctx.max()), context_len, budget, sink, recent, rep,
                   fill=False).size for s in range(pos.shape[0]) for i in range(n_layers)]
    return float(np.mean(n)) / budget


def ratio_label(budget: int, context: int) -> str:
    """Recording density to the nearest power of two: 2048 of 8001 -> "1/4", 16 of 8001 -> "1/512"."""
    return f"1/{2 ** round(math.log2(context / budget))}"


def replay_sweep(traces, context_lens, budget: int = 2048, capacity_x=(0.5, 1.0, 1.5, 2.0, 3.0),
                 policies=POLICIES, shape: str = "qwen3.8-flash-next", log=print, on_rows=None,
                 bar=None) -> pd.DataFrame:
    """One row per (trace, context, capacity, policy). `on_rows(df)`: called with every row so far after each
    (trace, context) set, so a caller can keep them on disk as they come (an interrupted sweep keeps what it
    measured); `bar` (a `sweep.bar`) advances per trace and context."""
    s = PRESETS[shape]
    rows = []
    for path in traces:
        tr = load_trace(trace_path(path))
        t_budget, t_ctx = tr.budget, int(tr.context_len[0])
        valid = tr.positions[tr.positions >= 0]
        src_overlap = float(locality(tr)["overlap_prev"].mean())
        for ctx in context_lens:
            t0 = time.perf_counter()
            if bar is not None:
                bar.set_postfix_str(f"{Path(path).name} @ {ctx}")
            sel = load_selection_trace(path, s.attn_layers, ctx, budget, tr.steps, stable=True)
            ov = overlap_prev(sel.numpy())
            share = trace_share(path, s.attn_layers, ctx, budget)
            for cx in capacity_x:
                cap = max(1, int(round(cx * budget)))
                for pol in policies:
                    df = replay(sel, cap, pol, s.row_bytes, ctx)
                    st = df[df["step"] >= 1]
                    hits, misses = st["hits"].sum(), st["misses"].sum()
                    zc = budget * s.attn_layers * s.row_bytes
                    rows.append({
                        "trace": Path(path).name, "corpus": tr.meta.get("corpus"), "trace_budget": t_budget,
                        "trace_context": t_ctx, "ratio": ratio_label(t_budget, t_ctx), "ratio_value": t_budget / t_ctx,
                        "context_len": ctx, "budget": budget, "capacity": cap, "capacity_x": cx, "policy": pol,
                        "steps": tr.steps, "hit_rate": hits / max(1, hits + misses),
                        "misses_per_step": misses / len(st), "h2d_bytes_per_step": st["h2d_bytes"].mean(),
                        "zero_copy_bytes_per_step": zc, "bytes_vs_zero_copy": st["h2d_bytes"].mean() / zc,
                        "first_step_hit_rate": df.loc[0, "hits"] / (budget * s.attn_layers),
                        "overlap_replayed": ov, "overlap_trace": src_overlap, "trace_share": share,
                        "selected_of_trace": int(valid.size)})
            if on_rows:
                on_rows(pd.DataFrame(rows))
            if log:
                log(f"{Path(path).name} @ {ctx}: {len(capacity_x) * len(policies)} replays in {time.perf_counter() - t0:.1f}s")
            if bar is not None:
                bar.update()
    return pd.DataFrame(rows)


def headline(df: pd.DataFrame) -> list[str]:
    """At the largest context: the best policy's hit rate and link bytes against zero_copy per capacity."""
    ctx = int(df["context_len"].max())
    at = df[df["context_len"] == ctx].groupby(["capacity_x", "policy"], as_index=False)[
        ["hit_rate", "bytes_vs_zero_copy"]].mean()        # over the traces
    best = at.loc[at.groupby("capacity_x")["hit_rate"].idxmax()]
    return [f"at {ctx:,} tokens, mean over {df['trace'].nunique()} trace(s), best policy per hot-cache capacity:",
            "  " + ", ".join(f"{r.capacity_x:g}x budget: {r.policy} hit {r.hit_rate:.2f}, bytes {r.bytes_vs_zero_copy:.2f}x zero_copy"
                             for r in best.itertuples())]


def summary_markdown(df: pd.DataFrame, args: dict) -> str:
    """Hit rate and bytes against zero_copy per (trace density, context, capacity, policy), as text."""
    lines = [f"# hot_cache replay of recorded selections (CPU, `HotIndex`)", "",
             f"labkit {__version__}, git {git_sha()}, args: `{args}`", "",
             "Steady state (steps after the first). bytes/zc: link bytes per step against zero_copy's. trace share: "
             "replayed rows that come from the trace (the rest: the recent fill of a sparse trace, hits once warm).", "",
             "| trace | density | context | capacity (x budget) | policy | hit rate | bytes/zc | overlap trace | overlap replayed | trace share |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in df.sort_values(["ratio_value", "trace", "context_len", "capacity_x", "policy"]).itertuples():
        lines.append(f"| {r.trace} | {r.ratio} | {r.context_len:,} | {r.capacity_x:g} | {r.policy} | {r.hit_rate:.3f} "
                     f"| {r.bytes_vs_zero_copy:.3f} | {r.overlap_trace:.3f} | {r.overlap_replayed:.3f} | {r.trace_share:.3f} |")
    return "\n".join(lines) + "\n"
