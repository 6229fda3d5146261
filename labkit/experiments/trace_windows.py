"""PulseInfer's calibration protocol: its trace replay over disjoint windows of the trace, thresholds chosen on
calibration windows (shared by the `pulse` and `pulse_ladder` experiments and the docs' tables of their runs).

One window of the trace says little about a placement policy: on the first 32 requests switching gave
1.37-1.56x the throughput of "offload every long request, no switching", on another window far less, and
the thresholds had been read off the window they were reported on. Here:

- the trace's first `windows x window_size` requests are cut into `windows` disjoint windows of consecutive
  requests (window w holds requests w*size .. (w+1)*size - 1; its arrivals count from its own first request);
- the first `calibration_windows` windows calibrate: on each, the reference policy, every static threshold
  candidate (`threshold:N`) and every point of the adaptive grid (`adaptive:MIN:HIDE`, see `engine.drive.policies.parse_fitted`);
- `choose` picks, from the calibration windows' rows alone, the candidate with the best median throughput
  ratio to the reference among those whose median p99 TPOT ratio is at most `p99_limit` (none acceptable:
  the lowest median p99 ratio), once among the thresholds and once over the adaptive grid;
- every other window is a test window: the reference, the chosen threshold and the fitted adaptive policy
  (plus any fixed policies, replayed as given on every window).

Ratios are within a window (a policy's figure over the reference's on the same requests, in the same
process); over the test windows each arm gets `labkit.stats.spread` (median, min, max) and a bootstrap
interval of the median over windows. Nothing here imports torch: the replay is handed in (`replay_windows`).
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd

from ..params import BadInput
from ..stats import bootstrap, spread
from ..engine.drive.policies import fitted_name

REFERENCE, STATIC, ADAPTIVE = "reference", "threshold (fitted)", "adaptive (fitted)"
RULE = ("on the calibration windows only: the candidate with the best median throughput ratio to the reference "
        "among those whose median p99 TPOT ratio is at most p99_limit; none acceptable: the lowest median p99 ratio")


@dataclass(frozen=True)
class Protocol:
    """What the windows' protocol plans with: the policy every ratio is to (`reference`), the policies replayed as
    given on every window (`policies`), the candidates fitted on the calibration windows (static `thresholds`, the
    adaptive grid `adaptive_min_tokens` x `adaptive_hide`), the p99 bound of an acceptable one and the deadline
    (`deadline_s`, 0: none). A pulse plan carries these as its own fields (`of`); the ladder derives its own
    (`pulse_ladder.measure.ladder_protocol`)."""
    reference: str
    policies: tuple[str, ...] = ()
    thresholds: tuple[int, ...] = ()
    adaptive_min_tokens: tuple[int, ...] = ()
    adaptive_hide: tuple[float, ...] = ()
    p99_limit: float = 1.0
    deadline_s: float = 0.0

    def __post_init__(self):
        for name in ("policies", "thresholds", "adaptive_min_tokens", "adaptive_hide"):     # frozen: lists as tuples
            object.__setattr__(self, name, tuple(getattr(self, name)))

    @classmethod
    def of(cls, plan: Any, **changes) -> "Protocol":
        """The protocol of a plan that has these fields (pulse's), with `changes`."""
        names = ("reference", "policies", "thresholds", "adaptive_min_tokens", "adaptive_hide", "p99_limit",
                 "deadline_s")
        return cls(**{**{n: getattr(plan, n) for n in names}, **changes})


def window_bounds(n_trace: int, windows: int, size: int, calibration: int) -> list[dict]:
    """The windows as [{window, first, last, role}] (requests first..last inclusive), or one BadInput line."""
    if windows < 1 or size < 1:
        raise BadInput(f"windows and window_size must be >= 1, got {windows} and {size}")
    if windows * size > n_trace:
        raise BadInput(f"windows x window_size = {windows} x {size} = {windows * size} requests, but the trace "
                       f"holds {n_trace}: fewer or smaller windows")
    if not 0 <= calibration < windows:
        raise BadInput(f"calibration_windows must be >= 0 and below windows ({windows}) so that a test window "
                       f"is left, got {calibration}")
    return [{"window": w, "first": w * size, "last": (w + 1) * size - 1,
             "role": "calibration" if w < calibration else "test"} for w in range(windows)]


def candidates(protocol: Protocol) -> dict[str, list[str]]:
    """The policies each fitted arm chooses among (on the calibration windows)."""
    return {STATIC: [f"threshold:{int(t)}" for t in protocol.thresholds],
            ADAPTIVE: [fitted_name(m, h) for m in protocol.adaptive_min_tokens for h in protocol.adaptive_hide]}


def planned(protocol: Protocol, role: str, chosen: dict[str, str | None]) -> list[str]:
    """The policies replayed on a window of `role`, reference first, each once."""
    pols = [protocol.reference]
    if role == "calibration":
        for c in candidates(protocol).values():
            pols += c
    else:
        pols += [c for c in (chosen.get(STATIC), chosen.get(ADAPTIVE)) if c]
    pols += list(protocol.policies)
    return list(dict.fromkeys(pols))


def _ratios_of(rows: pd.DataFrame, reference: str) -> pd.DataFrame:
    """Per (window, policy): throughput, p99 and mean TPOT over the reference's of the same window (NaN where
    the reference or the policy did not finish ok; the mean's NaN too where rows lack it)."""
    ok = rows[rows["status"] == "ok"]
    if "tpot_ms_mean" not in ok:
        ok = ok.assign(tpot_ms_mean=float("nan"))
    ref = ok[ok["policy"] == reference].drop_duplicates("window", keep="last").set_index("window")
    out = ok.drop_duplicates(["window", "policy"], keep="last")[["window", "policy", "output_throughput", "tpot_ms_p99",
                                                                "tpot_ms_mean"]].copy()
    out["ref_throughput"] = out["window"].map(ref["output_throughput"])
    out["ref_tpot_ms_p99"] = out["window"].map(ref["tpot_ms_p99"])
    out["throughput_ratio"] = out["output_throughput"] / out["ref_throughput"]
    out["tpot_p99_ratio"] = out["tpot_ms_p99"] / out["ref_tpot_ms_p99"]
    out["tpot_mean_ratio"] = out["tpot_ms_mean"] / out["window"].map(ref["tpot_ms_mean"])
    return out


def choose(rows: pd.DataFrame, protocol: Protocol,
           calibration: list[int]) -> tuple[dict[str, str | None], pd.DataFrame]:
    """The chosen threshold and adaptive constants, from the rows of the `calibration` windows only (rows of
    other windows are dropped first, whatever they say), and the table of every candidate's calibration
    figures. A candidate needs an ok row on every calibration window whose reference finished ok."""
    cal = rows[rows["window"].isin(calibration)]
    r = _ratios_of(cal, protocol.reference)
    usable = sorted(r.loc[(r["policy"] == protocol.reference) & r["throughput_ratio"].notna(), "window"].unique())
    chosen: dict[str, str | None] = {}
    table = []
    for arm, pols in candidates(protocol).items():
        cands = []
        for pol in pols:
            g = r[(r["policy"] == pol) & r["window"].isin(usable)].dropna(subset=["throughput_ratio", "tpot_p99_ratio"])
            row = {"arm": arm, "policy": pol, "windows": len(g), "eligible": bool(usable) and len(g) == len(usable)}
            if len(g):
                t, q = spread(g["throughput_ratio"]), spread(g["tpot_p99_ratio"])
                row.update(throughput_ratio=t.median, throughput_ratio_min=t.min, throughput_ratio_max=t.max,
                           tpot_p99_ratio=q.median, tpot_p99_ratio_min=q.min, tpot_p99_ratio_max=q.max)
            row["acceptable"] = row["eligible"] and row.get("tpot_p99_ratio", math.inf) <= protocol.p99_limit
            table.append(row)
            if row["eligible"]:
                cands.append(row)
        ok = [c for c in cands if c["acceptable"]]
        if ok:      # best throughput; ties: the lower p99, then the order given
            best = max(ok, key=lambda c: (c["throughput_ratio"], -c["tpot_p99_ratio"]))
        elif cands:
            best = min(cands, key=lambda c: (c["tpot_p99_ratio"], -c["throughput_ratio"]))
        else:
            best = None
        chosen[arm] = best["policy"] if best else None
        for row in table:
            if row["arm"] == arm:
                row["chosen"] = best is not None and row["policy"] == best["policy"]
    sel = pd.DataFrame(table)
    sel.insert(0, "calibration_windows", ",".join(str(w) for w in usable))
    return chosen, sel


def window_ratios(rows: pd.DataFrame, protocol: Protocol, chosen: dict[str, str | None],
                  roles: dict[int, str]) -> pd.DataFrame:
    """One row per (window, arm): the arm's policy on that window and its ratios to the reference. Arms: the
    reference, the fitted threshold and adaptive policy (on calibration windows: the chosen candidate's
    replay there), and each fixed policy by its name."""
    r = _ratios_of(rows, protocol.reference)
    arms = {REFERENCE: protocol.reference, **{a: c for a, c in chosen.items() if c},
            **{x: x for x in protocol.policies}}
    out = []
    for arm, pol in arms.items():
        g = r[r["policy"] == pol].assign(arm=arm)
        out.append(g)
    t = pd.concat(out, ignore_index=True) if out else r.iloc[:0]
    t["role"] = t["window"].map(roles)
    cols = ["window", "role", "arm", "policy", "output_throughput", "ref_throughput", "throughput_ratio",
            "tpot_ms_p99", "ref_tpot_ms_p99", "tpot_p99_ratio", "tpot_ms_mean", "tpot_mean_ratio"]
    return t[cols].sort_values(["window", "arm"], kind="stable").reset_index(drop=True)


def summarize(ratios: pd.DataFrame) -> pd.DataFrame:
    """Per arm over the test windows: median, min, max of each ratio (throughput, p99 and mean TPOT;
    `stats.spread`) and a 95% bootstrap interval of the median over windows (`stats.bootstrap`)."""

    rows = []
    test = ratios[ratios["role"] == "test"]
    for arm, g in test.groupby("arm", sort=False):
        row = {"arm": arm, "policy": ",".join(dict.fromkeys(g["policy"])), "test_windows": ",".join(str(int(w)) for w in g["window"])}
        for col in ("throughput_ratio", "tpot_p99_ratio", "tpot_mean_ratio"):
            if col not in g:
                continue
            v = g[col].dropna()
            if v.empty:
                continue
            s = spread(v)
            row.update({col: s.median, f"{col}_min": s.min, f"{col}_max": s.max, f"{col}_n": s.n})
            ci = bootstrap(v, np.median)
            row.update({f"{col}_lo": ci.lo, f"{col}_hi": ci.hi})
        rows.append(row)
    return pd.DataFrame(rows)


def single_window(metrics: pd.DataFrame) -> pd.DataFrame:
    """A one-window replay's rows as ratios to its `noswitch` reference (the form `window_ratios` gives)."""
    m = metrics[metrics["status"] == "ok"].assign(window=0)
    ref = m.loc[m["policy"].str.startswith("noswitch"), "policy"].iloc[0]
    r = _ratios_of(m, ref)
    return r.assign(arm=r["policy"].where(r["policy"] != ref, REFERENCE))


def complete_windows(rows: pd.DataFrame, protocol: Protocol, bounds: list[dict]) -> tuple[set[int], dict]:
    """Which windows of an earlier (cut short) run hold an ok row for every policy planned for them, and the
    choice its calibration windows make: those windows need not be replayed again."""
    cal = [b["window"] for b in bounds if b["role"] == "calibration"]
    ok = rows[rows["status"] == "ok"] if len(rows) else rows
    have = {w: set(g["policy"]) for w, g in ok.groupby("window")} if len(ok) else {}
    done_cal = {w for w in cal if set(planned(protocol, "calibration", {})) <= have.get(w, set())}
    chosen = choose(rows, protocol, cal)[0] if cal and done_cal == set(cal) else {}
    done = set(done_cal)
    if not cal or chosen:
        done |= {b["window"] for b in bounds
                 if b["role"] == "test" and set(planned(protocol, "test", chosen)) <= have.get(b["window"], set())}
    return done, chosen


def replay_windows(protocol: Protocol, bounds: list[dict], replay: Callable[[int, str], dict],
                   record: Callable[[dict], None], earlier: pd.DataFrame | None = None, clock=time.monotonic,
                   t0: float | None = None) -> dict:
    """Replay the calibration windows, choose, then replay the test windows. `replay(window, policy)` returns
    a metrics row (status, output_throughput, tpot_ms_p99, ...); every row goes to `record` as it comes.
    `earlier`: rows of a run cut short with the same parameters; its complete windows are kept, not replayed.
    `protocol.deadline_s` > 0: a window is started only when, by the replays so far, it ends by then (the first
    window of a call always starts). A window's policies run one after the other, their order turned by
    the window's index, so that what the first replay of a process pays (it was the reference every time
    in the one-window runs) does not fall on one policy. Returns {chosen, selection, complete (windows with
    every planned policy ok), stopped (why windows were left, or None), order (this call's (window, policy)
    replays), kept, rows}."""
    t0 = clock() if t0 is None else t0
    earlier = earlier if earlier is not None and len(earlier) else pd.DataFrame(columns=["window", "policy", "status"])
    kept, _ = complete_windows(earlier, protocol, bounds)
    rows = []
    for _, r in earlier[earlier["window"].isin(kept)].iterrows():
        rows.append(r.to_dict())
        record(rows[-1])
    last: dict[str, float] = {}          # the last replay time per policy, this call
    order, stopped, started = [], None, False

    def fits(pols) -> bool:
        if not protocol.deadline_s or not started:
            return True
        longest = max(last.values(), default=0.0)
        return clock() - t0 + sum(last.get(x, longest) for x in pols) <= protocol.deadline_s

    def window(b: dict, pols: list[str]) -> bool:
        nonlocal started, stopped
        if b["window"] in kept:
            return True
        if not fits(pols):
            stopped = f"deadline_s {protocol.deadline_s:g} reached before window {b['window']}"
            return False
        started = True
        k = b["window"] % len(pols)          # the order turns with the window: no policy is always first
        for pol in pols[k:] + pols[:k]:
            t = clock()
            row = {**replay(b["window"], pol), "window": b["window"], "window_role": b["role"], "policy": pol}
            last[pol] = clock() - t
            rows.append(row)
            order.append((b["window"], pol))
            record(row)
        return True

    cal = [b for b in bounds if b["role"] == "calibration"]
    for b in cal:
        if not window(b, planned(protocol, "calibration", {})):
            break
    frame = pd.DataFrame(rows)
    cal_ids = [b["window"] for b in cal]
    if stopped is None:
        chosen, sel = choose(frame, protocol, cal_ids) if cal else ({}, pd.DataFrame())
        for b in (b for b in bounds if b["role"] == "test"):
            if not window(b, planned(protocol, "test", chosen)):
                break
    else:
        chosen, sel = {}, pd.DataFrame()
    frame = pd.DataFrame(rows) if rows else earlier.iloc[:0]
    done, _ = complete_windows(frame, protocol, bounds)
    return {"chosen": chosen, "selection": sel, "complete": sorted(done), "stopped": stopped, "order": order,
            "kept": sorted(kept), "rows": frame}


# what makes a one-window replay of the past comparable to a window of this replay: the same requests
# (window 0 of the same size) served the same way
SAME_SERVING = ("shape", "length_scale", "max_output", "capacity", "budget", "strategy", "select_block",
                "dma_units_per_call", "graphs", "resident_slots", "offload_slots", "rate", "transport")


def is_first_window_of(params: dict, p: dict, ignore: tuple = ()) -> bool:
    """Whether a run's `params` replayed the trace's first requests as one window covering this replay's
    first windows whole (window 0 alone, or windows 0..n-1 as one when its window held n times as many
    requests), served as `p` serves (but for the settings in `ignore`): a one-window figure to set beside
    the windows."""
    one = params.get("n_requests", params.get("window_size") if int(params.get("windows", 1)) == 1 else None)
    if one is None or int(one) < 1 or int(one) % int(p["window_size"]):
        return False
    dflt = {"select_block": 1, "dma_units_per_call": 0, "graphs": False, "rate": 1.0}

    def same(k):
        a, b = params.get(k, dflt.get(k)), p.get(k, dflt.get(k))
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
            return math.isclose(float(a), float(b))
        return str(a).lower() == str(b).lower()
    return all(same(k) for k in SAME_SERVING if k not in ignore)


def first_window_runs(paths, p: dict, ignore: tuple = ()) -> list:
    """The run folders among `paths` that replayed this replay's first windows as one (`is_first_window_of`)."""
    out = []
    for d in paths:
        mf = Path(d) / "manifest.json"
        if not mf.is_file():
            continue
        m = json.loads(mf.read_text())
        if m.get("experiment") == "pulse" and m.get("status") == "ok" and is_first_window_of(m.get("parameters", {}), p, ignore):
            out.append(Path(d))
    return out
