"""Selection traces: which positions a layer-shared policy selects at every real decode step.

`record_trace` prefills a long prompt densely, then decodes greedily `steps` tokens with the policy
under test, and after every step stores, for every attention layer, the positions the layer attended.

Trace file (`.npz`, written with `np.savez_compressed`; `save_trace` / `load_trace`), schema v1:

| array         | dtype            | shape                   | meaning |
|---------------|------------------|-------------------------|---------|
| `positions`   | int16 (int32 if a context exceeds 32767) | [steps, layers, budget] | selected key positions of each decode step and layer, ascending, padded with -1 at the end when fewer than `budget` were visible |
| `context_len` | int32            | [steps]                 | keys visible at that step (the query's own position is `context_len - 1`; the step's token is included) |
| `tokens`      | int32            | [steps]                 | the token fed at that step (step 0: the first generated token) |
| `layers`      | int32            | [layers]                | model layer index of each trace layer |
| `meta`        | str (JSON)       | []                      | `schema` (1), `model`, `policy`, `budget`, `prompt_len`, `sink_window`, `recent_window`, `corpus`, `document`, `created`, `labkit` |

Positions are absolute token positions in the sequence (0 = the first prompt token).
`labkit.engine.trace_replay.load_selection_trace` maps a trace onto an engine's layers, context and
budget.

Locality (`locality`): per step and layer, the overlap with the previous step's set
(|S_t ∩ S_{t-1}| / |S_t|), the share of positions not selected in any earlier step, and the
shares in the sink window (position < sink_window), the recent window (position >=
context_len - recent_window) and the middle; `reuse_distance` histograms, for every selected position
of steps >= 1, the number of steps since the same layer last selected it (`new` if never before).
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from labkit.quality.evaluate import forward
from labkit.quality.sparse import SHARED_POLICIES, instrument, n_layers

SCHEMA_VERSION = 1


@dataclass
class Trace:
    positions: np.ndarray  # [steps, layers, budget], -1 padded
    context_len: np.ndarray  # [steps]
    tokens: np.ndarray  # [steps]
    layers: np.ndarray  # [layers]
    meta: dict = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return int(self.positions.shape[0])

    @property
    def budget(self) -> int:
        return int(self.positions.shape[2])


def save_trace(trace: Trace, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pos = trace.positions
    pos = pos.astype(np.int16 if int(trace.context_len.max()) <= np.iinfo(np.int16).max else np.int32)
    np.savez_compressed(path, positions=pos, context_len=trace.context_len.astype(np.int32),
                        tokens=trace.tokens.astype(np.int32), layers=trace.layers.astype(np.int32),
                        meta=np.array(json.dumps(dict(trace.meta, schema=SCHEMA_VERSION))))
    return path


def load_trace(path) -> Trace:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"selection trace {path} does not exist")
    with np.load(path, allow_pickle=False) as z:
        missing = {"positions", "context_len", "tokens", "layers", "meta"} - set(z.files)
        if missing:
            raise ValueError(f"{path} is not a labkit selection trace (missing {', '.join(sorted(missing))})")
        t = Trace(positions=z["positions"].astype(np.int64), context_len=z["context_len"].astype(np.int64),
                  tokens=z["tokens"], layers=z["layers"], meta=json.loads(str(z["meta"])))
    if t.positions.ndim != 3 or t.positions.shape[0] != t.context_len.shape[0]:
        raise ValueError(f"{path}: positions must be [steps, layers, budget] with one context_len per step")
    return t


@torch.no_grad()
def record_traces(model, prompt: torch.Tensor, policies, budgets, steps: int = 32, controller=None,
                  meta: dict | None = None, log=print) -> dict[tuple[str, int], Trace]:
    """Greedy-decode `steps` tokens after a dense prefill of `prompt` (1-D ids), once per
    (policy, budget); the prefill is shared. Returns {(policy, budget): Trace}."""
    for p in policies:
        if p not in SHARED_POLICIES:
            raise ValueError(f"traces need a layer-shared policy ({', '.join(SHARED_POLICIES)}), got {p!r}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    ctl = instrument(model, controller)
    dev = next(model.parameters()).device
    ids = prompt.view(1, -1).to(dev)
    ctl.layers = {}
    logits, cache0 = forward(model, ids)
    first = logits[0, -1].argmax()
    L = n_layers(model)
    traces = {}
    for policy in policies:
        for budget in budgets:
            cache = copy.deepcopy(cache0)
            tok = first.view(1, 1)
            pos = np.full((steps, L, budget), -1, dtype=np.int64)
            ctx = np.zeros(steps, dtype=np.int64)
            toks = np.zeros(steps, dtype=np.int64)
            ctl.set_all(policy, budget, L)
            ctl.record_selection = True
            try:
                for s in range(steps):
                    ctl.last_selection = {}
                    logits, cache = forward(model, tok, cache)
                    toks[s] = int(tok)
                    ctx[s] = ids.shape[1] + s + 1
                    for li in range(L):
                        sel = torch.nonzero(ctl.last_selection[li][0]).flatten().cpu().numpy()
                        pos[s, li, : sel.size] = sel[:budget]
                    tok = logits[0, -1].argmax().view(1, 1)
            finally:
                ctl.record_selection = False
                ctl.set_all(None, None, L)
            traces[(policy, budget)] = Trace(
                positions=pos, context_len=ctx, tokens=toks, layers=np.arange(L),
                meta=dict(meta or {}, policy=policy, budget=int(budget), prompt_len=int(ids.shape[1]),
                          sink_window=ctl.sink_window, recent_window=ctl.recent_window,
                          created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")))
            if log:
                log(f"trace {policy}@{budget}: {steps} steps x {L} layers, context {ctx[0]}..{ctx[-1]}")
            del cache
    return traces


def _sets(trace: Trace, s: int, layer: int) -> np.ndarray:
    row = trace.positions[s, layer]
    return row[row >= 0]


def locality(trace: Trace, sink_window: int | None = None, recent_window: int | None = None) -> pd.DataFrame:
    """One row per (step, layer): overlap with the previous step, new share, sink/recent/middle shares."""
    sink = int(trace.meta.get("sink_window", 16) if sink_window is None else sink_window)
    recent = int(trace.meta.get("recent_window", 64) if recent_window is None else recent_window)
    rows = []
    for li in range(trace.positions.shape[1]):
        seen = set()
        prev = None
        for s in range(trace.steps):
            cur = _sets(trace, s, li)
            n = max(cur.size, 1)
            ctx = int(trace.context_len[s])
            in_sink = int((cur < sink).sum())
            in_recent = int((cur >= ctx - recent).sum())
            new = sum(1 for p in cur.tolist() if p not in seen) if s > 0 else np.nan
            rows.append({
                "step": s, "layer": int(trace.layers[li]), "context_len": ctx, "selected": int(cur.size),
                "overlap_prev": (np.intersect1d(cur, prev, assume_unique=True).size / n) if prev is not None else np.nan,
                "new_share": new / n if s > 0 else np.nan,
                "sink_share": in_sink / n, "recent_share": in_recent / n,
                "middle_share": (cur.size - in_sink - in_recent) / n,
            })
            seen.update(cur.tolist())
            prev = cur
    return pd.DataFrame(rows)


REUSE_BUCKETS = ("1", "2", "3-4", "5-8", "9-16", ">16", "new")


def _bucket(d: int | None) -> str:
    if d is None:
        return "new"
    for hi, name in ((1, "1"), (2, "2"), (4, "3-4"), (8, "5-8"), (16, "9-16")):
        if d <= hi:
            return name
    return ">16"


def reuse_distance(trace: Trace) -> pd.DataFrame:
    """Share of selected positions (steps >= 1, all layers) per reuse-distance bucket."""
    counts = dict.fromkeys(REUSE_BUCKETS, 0)
    for li in range(trace.positions.shape[1]):
        last: dict[int, int] = {}
        for s in range(trace.steps):
            for p in _sets(trace, s, li).tolist():
                if s > 0:
                    counts[_bucket(s - last[p] if p in last else None)] += 1
                last[p] = s
    total = max(sum(counts.values()), 1)
    return pd.DataFrame({"reuse_distance": list(counts), "count": list(counts.values()),
                         "share": [c / total for c in counts.values()]})


def locality_summary(traces: dict) -> pd.DataFrame:
    """One row per (policy, budget): means over steps and layers, plus the share reused at distance 1."""
    rows = []
    for (policy, budget), tr in traces.items():
        loc = locality(tr)
        rd = reuse_distance(tr).set_index("reuse_distance")["share"]
        rows.append({"policy": policy, "budget": budget, "steps": tr.steps,
                     "context_len": int(tr.context_len[-1]),
                     "overlap_prev_mean": float(loc["overlap_prev"].mean()),
                     "new_share_mean": float(loc["new_share"].mean()),
                     "sink_share": float(loc["sink_share"].mean()),
                     "recent_share": float(loc["recent_share"].mean()),
                     "middle_share": float(loc["middle_share"].mean()),
                     "reuse_d1_share": float(rd["1"]), "reuse_new_share": float(rd["new"])})
    return pd.DataFrame(rows)
