"""Replay a real model's selection trace in the engine (`selection=trace:PATH`).

A trace (`labkit.quality.traces`, npz schema v1) holds, per decode step and per attention layer of
the model it was recorded on, the positions that layer's policy selected, in that model's context
(`context_len[step]` keys) and budget. `load_selection_trace` turns it into index rows for an engine
with another number of sparse layers, another context length and another budget:

- **steps**: engine step `j` replays trace step `j mod trace_steps` (the trace cycles).
- **layers**: engine layer `i` of `n_layers` replays trace layer `floor(i * L_trace / n_layers)`
  (proportional: the first engine layers take the first model layers, and so on; with more engine
  layers than trace layers, neighbours repeat a trace layer).
- **positions**: the trace's sink window `[0, sink)` and recent window (the last `recent` keys) stay
  anchored at the start and at the end of the engine's context; the middle
  `[sink, C - recent)` of the trace context `C` maps linearly onto the engine's middle
  `[sink, context_len - recent)`: `p' = sink + floor((p - sink) * M' / M)`, `M`, `M'` the middle
  lengths. When `context_len < sink + recent + budget` the windows shrink in proportion.
- **budget**: mapped positions are de-duplicated (scaling down merges neighbours). Too many: keep the
  sink and recent ones, then an evenly spaced subset of the middle ones (`np.linspace`), so the
  spread is kept. Too few (or a trace budget below the engine's): fill with the most recent
  not-yet-selected positions, as an engine growing its recent window would.

Stable replay (`stable=True`, what the decode sweep uses): the default maps step `s` with that step's
own trace context `C_s`, and since `C_s` grows by one token per step, the same token lands on a
different engine position every step (at 8K -> 1M, middle positions drift by ~60 per step) and the
trace's reuse is lost, which a hot cache would measure as misses. The stable mapping uses one map for
all steps, that of the trace's final context (`max C_s`): a token keeps its engine position, and the
map is one-to-one when the engine context is longer than the trace's (sink: identity; middle: linear
expansion; recent: shift), so the *sets* of every step, and with them the step-to-step overlap and
every reuse distance, are the trace's exactly. Budget: a trace sparser than the engine's budget (say
256 of 8K replayed with budget 2048) would be filled with recent positions, a sliding window whose
easy reuse is not the trace's; the stable mapping instead widens each mapped middle position into a run
of `budget // trace_budget` consecutive positions (top-k selections at long context come in runs;
a run is kept or dropped whole, so overlap and reuse distance are again the trace's), then fills what
is left as before.

Result: `LongTensor[steps, n_layers, budget]`, every row sorted ascending, unique, within
`[0, context_len)`. Deterministic: same inputs, same tensor. Needs `budget <= context_len`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch


def read_trace(path):
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"selection trace {path} does not exist")
    with np.load(path, allow_pickle=False) as z:
        if "positions" not in z.files or "context_len" not in z.files:
            raise ValueError(f"{path} is not a labkit selection trace (needs positions and context_len)")
        pos = z["positions"].astype(np.int64)
        ctx = z["context_len"].astype(np.int64)
        meta = json.loads(str(z["meta"])) if "meta" in z.files else {}
    if pos.ndim != 3 or ctx.shape != (pos.shape[0],):
        raise ValueError(f"{path}: positions must be [steps, layers, budget] with one context_len per step")
    return pos, ctx, meta


def scale_row(row: np.ndarray, src_ctx: int, context_len: int, budget: int, sink: int, recent: int,
              rep: int = 1, fill: bool = True) -> np.ndarray:
    """Map one trace row (-1 padded) into an engine context; returns `budget` sorted unique positions.
    `rep` > 1 (stable replay of a sparser trace): each mapped middle position becomes a run of `rep`.
    `fill=False`: only the positions that come from the trace (no recent fill; possibly fewer than budget)."""
    row = row[(row >= 0) & (row < src_ctx)]
    # windows: anchored; shrink in proportion if the engine context is too small for them
    room = context_len - budget
    if sink + recent > max(room, 0):
        f = max(room, 0) / max(sink + recent, 1)
        sink, recent = int(sink * f), int(recent * f)
    src_mid = max(src_ctx - recent - sink, 1)
    dst_mid = max(context_len - recent - sink, 1)
    is_sink = row < sink
    is_recent = row >= src_ctx - recent
    mid = ~(is_sink | is_recent)
    out = np.empty_like(row)
    out[is_sink] = row[is_sink]
    out[is_recent] = context_len - (src_ctx - row[is_recent])
    out[mid] = sink + ((row[mid] - sink) * dst_mid) // src_mid
    out = np.clip(out, 0, context_len - 1)
    anchored = np.unique(out[is_sink | is_recent])
    middle = np.unique(out[mid])
    if rep > 1 and middle.size:
        middle = np.unique((middle[:, None] + np.arange(rep)[None, :]).ravel())
        middle = middle[middle < context_len - recent]
    middle = np.setdiff1d(middle, anchored, assume_unique=True)
    sel = np.union1d(anchored, middle)
    if sel.size > budget:
        keep = anchored[:budget]  # sink first (ascending), then recent
        need = budget - keep.size
        if need > 0 and middle.size:
            idx = np.unique(np.linspace(0, middle.size - 1, need).round().astype(np.int64))
            keep = np.union1d(keep, middle[idx])
        sel = keep
    if sel.size < budget and fill:  # fill from the end of the context backwards
        cand = np.arange(context_len - 1, -1, -1)
        cand = cand[~np.isin(cand, sel)][: budget - sel.size]
        sel = np.union1d(sel, cand)
    return np.sort(sel)[:budget]


def load_selection_trace(path, n_layers: int, context_len: int, budget: int, steps: int,
                         stable: bool = False) -> torch.LongTensor:
    """Selected positions `[steps, n_layers, budget]` for an engine, from a trace file (module docstring).
    `stable=True`: the reuse-preserving mapping (module docstring, "Stable replay")."""
    for name, v in (("n_layers", n_layers), ("context_len", context_len), ("budget", budget), ("steps", steps)):
        if int(v) < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if budget > context_len:
        raise ValueError(f"budget {budget} exceeds context_len {context_len}: cannot select unique positions")
    pos, ctx, meta = read_trace(path)
    sink = int(meta.get("sink_window", 16))
    recent = int(meta.get("recent_window", 64))
    t_steps, t_layers = pos.shape[0], pos.shape[1]
    out = np.empty((steps, n_layers, budget), dtype=np.int64)
    cache: dict[tuple[int, int], np.ndarray] = {}
    rep = max(1, budget // pos.shape[2]) if stable else 1
    for j in range(steps):
        s = j % t_steps
        for i in range(n_layers):
            li = (i * t_layers) // n_layers
            key = (s, li)
            if key not in cache:
                src = int(ctx.max()) if stable else int(ctx[s])
                cache[key] = scale_row(pos[s, li], src, context_len, budget, sink, recent, rep)
            out[j, i] = cache[key]
    return torch.from_numpy(out)
