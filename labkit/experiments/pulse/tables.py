"""PulseInfer's trace replay's generated table in docs/pulseinfer.md (`labkit docs`): each policy against the
reference over held-out trace windows, then every one-window replay. It reads the committed run folders it is
given: docs/runs.toml names them, labkit/docs binds the block to its function and runs."""
from __future__ import annotations

import pandas as pd

from ...report.summary import md_table as _md
from ...report.units import ratio_cell, window_range
from ...results import REPO, load_run
from ..trace_windows import REFERENCE, first_window_runs, single_window


def pulse_trace_table(runs: list[str], windows: str = "") -> str:
    """The trace replayed over disjoint windows (the run `windows`, when one is committed): per
    policy, median, min and max over the test windows of its throughput and p99 TPOT as ratios to the
    reference on the same window, thresholds chosen on the calibration windows; the one-window replays of
    the trace's first requests with the same serving (window 0, or the first windows as one) as a row
    each. Then every one-window replay, per policy, throughput as a ratio to "noswitch" of the same run
    (same requests, same strategy)."""
    cols = {"policy": "policy", "completed": "requests done", "output_throughput": "output tok/s",
            "ttft_ms_p99": "p99 TTFT ms", "tpot_ms_p50": "p50 TPOT ms", "tpot_ms_p90": "p90 TPOT ms",
            "tpot_ms_p99": "p99 TPOT ms", "share_offloaded": "share offloaded", "switched_rounds": "switched rounds",
            "stalls": "stalls"}
    parts = []
    for run in runs:
        lr = load_run(REPO / run)
        m, prm = lr.metrics, lr.manifest["parameters"]
        t = m[list(cols)].rename(columns=cols)
        base = float(m.loc[m.policy.str.startswith("noswitch"), "output_throughput"].iloc[0])
        t.insert(3, "vs noswitch", (m["output_throughput"] / base).map(lambda v: f"{v:.2f}"))
        sb, per = prm.get("select_block", 1), prm.get("dma_units_per_call", 0)
        lane = f"{m.strategy.iloc[0]}" + (f", blocks of {sb}" if sb > 1 else "") + (f", calls of {per}" if per else "")
        t.insert(0, "run", run.split("-")[1])
        t.insert(1, "offload lane", lane)
        t.insert(2, "steps", "graphs" if prm.get("graphs") in (True, "true", "True") else "eager")
        t.insert(3, "requests × inputs / outputs", f"{int(m.n_requests.iloc[0])} × {float(prm.get('length_scale') or 1):g} "
                 f"/ ≤ {prm.get('max_output')}")
        parts.append(t)
    t = pd.concat(parts, ignore_index=True)
    for c in ("output tok/s", "p99 TTFT ms", "p50 TPOT ms", "p90 TPOT ms", "p99 TPOT ms", "share offloaded"):
        t[c] = t[c].map(lambda v: f"{v:.2f}" if abs(v) < 10 else f"{v:.0f}")
    single = _md(t)
    if not windows:
        return single
    lr = load_run(REPO / windows)
    mf, prm = lr.manifest, lr.manifest["parameters"]
    s, ref = lr.table("window_summary"), prm["reference"]
    rows = []
    for _, r in s[s["arm"] != REFERENCE].iterrows():
        rows.append({"policy": r["arm"], "setting": r["policy"], "windows": f"test {window_range(mf['test'])} ({int(r['throughput_ratio_n'])})",
                     "tok/s ratio median": ratio_cell(r["throughput_ratio"]), "min": ratio_cell(r["throughput_ratio_min"]),
                     "max": ratio_cell(r["throughput_ratio_max"]),
                     "95% interval of the median": f"[{ratio_cell(r['throughput_ratio_lo'])}, {ratio_cell(r['throughput_ratio_hi'])}]",
                     "p99 TPOT ratio median": ratio_cell(r["tpot_p99_ratio"]), "p99 min": ratio_cell(r["tpot_p99_ratio_min"]),
                     "p99 max": ratio_cell(r["tpot_p99_ratio_max"]),
                     "p99 95% interval": f"[{ratio_cell(r['tpot_p99_ratio_lo'])}, {ratio_cell(r['tpot_p99_ratio_hi'])}]"})
    for d in first_window_runs([REPO / x for x in runs], prm, ignore=("dma_units_per_call",)):
        one = load_run(d)
        per = one.manifest["parameters"].get("dma_units_per_call", 0)
        covers = int(one.metrics["n_requests"].iloc[0]) // int(prm["window_size"])
        where = "0 alone (1)" if covers == 1 else f"0–{covers - 1} as one (1)"
        for _, r in single_window(one.metrics).query("arm != @REFERENCE").iterrows():
            v, q = ratio_cell(r["throughput_ratio"]), ratio_cell(r["tpot_p99_ratio"])
            rows.append({"policy": f"{r['policy']} (run {d.name.split('-')[1]}, DMA {f'in calls of {per}' if per else 'in one call'})",
                         "setting": "read off its window", "windows": where, "tok/s ratio median": v, "min": v,
                         "max": v, "95% interval of the median": "-", "p99 TPOT ratio median": q, "p99 min": q,
                         "p99 max": q, "p99 95% interval": "-"})
    chosen = ", ".join(c for c in (mf.get("chosen") or {}).values() if c) or "none"
    lead = (f"Run `{mf['run_id']}` ({mf.get('gpu_name') or 'CPU'}): {prm['windows']} disjoint windows of {prm['window_size']} "
            f"trace requests (inputs × {float(prm['length_scale']):g}, ≤ {prm['max_output']} output tokens); windows "
            f"{window_range(mf['calibration'])} calibrate (chosen there: {chosen}), windows {window_range(mf['test'])} are test windows. "
            f"Ratios to `{ref}` on the same window (its policies in an order turned per window, after untimed warm-up "
            f"replays); median, min and max over the test windows (`labkit.stats.spread`), 95% bootstrap interval of "
            f"the median over windows.")
    return (lead + "\n\n" + _md(pd.DataFrame(rows)) + "\n\nEvery one-window replay (thresholds read off the window "
            "they are reported on):\n\n" + single)
