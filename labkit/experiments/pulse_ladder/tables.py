"""PulseInfer's ladder's generated table in docs/pulseinfer.md (`labkit docs`): each rung against the first on
the same test windows, and what each rung moved. It reads the committed run folder it is given: docs/runs.toml
names it, labkit/docs binds the block to its function and run."""
from __future__ import annotations

import pandas as pd

from ...report.summary import md_table as _md
from ...report.units import ratio_cell, window_range
from ...results import REPO, load_run


def pulse_ladder_table(run: str) -> str:
    """PulseInfer's ladder (the run `run`; "": none yet): per rung, throughput and p99 TPOT as ratios to the first rung
    on the same test window (median, min, max, 95% bootstrap interval over the windows), and what each rung moved
    (bytes per copy, copies per step, the most requests running at once: medians over the test windows)."""
    if not run:
        return "No ladder run is named in docs/runs.toml yet."
    lr = load_run(REPO / run)
    mf, prm, m = lr.manifest, lr.manifest["parameters"], lr.metrics
    s = lr.table("window_summary").set_index("arm")
    test = m[(m["window_role"] == "test") & m["rung"].notna()]
    rows = []
    for arm, r in s.iterrows():
        mine = test[test["rung"] == arm]
        kib = mine["bytes_per_copy"].median() / 1024
        rows.append({"rung": f"`{arm}`", "setting": r["policy"], "windows": int(r["throughput_ratio_n"]),
                     "tok/s ratio median": ratio_cell(r["throughput_ratio"]),
                     "min–max": f"{ratio_cell(r['throughput_ratio_min'])}–{ratio_cell(r['throughput_ratio_max'])}",
                     "95% interval": f"[{ratio_cell(r['throughput_ratio_lo'])}, {ratio_cell(r['throughput_ratio_hi'])}]",
                     "p99 TPOT ratio median": ratio_cell(r["tpot_p99_ratio"]),
                     "p99 95% interval": f"[{ratio_cell(r['tpot_p99_ratio_lo'])}, {ratio_cell(r['tpot_p99_ratio_hi'])}]",
                     "KiB per copy": "-" if pd.isna(kib) else f"{kib:.1f}",
                     "copies per step": "-" if pd.isna(mine["copies_per_step"].median()) else f"{mine['copies_per_step'].median():,.0f}",
                     "most running": f"{mine['max_running'].median():.0f}"})
    ratios = lr.table("window_ratios")
    vs = ratios[(ratios["role"] == "test") & (ratios["arm"] == "adaptive")]["throughput_vs_no_offload"]
    lead = (f"Run `{mf['run_id']}` ({mf.get('gpu_name') or 'CPU'}; {len(mf.get('resumed_from') or [])} earlier pieces "
            f"resumed): {prm['windows']} windows of {prm['window_size']} Mooncake requests (inputs × "
            f"{float(prm['length_scale']):g}, ≤ {prm['max_output']} output tokens), windows {window_range(mf['calibration'])} "
            f"calibrate, {window_range(mf['test'])} test; device KV cap {prm['device_kv_tokens']:,} tokens. Ratios to "
            f"`per_head` on the same window, rungs in an order turned per window.")
    tail = (f"Full PulseInfer (`adaptive`) / `no_offload` under the same cap, per test window: median "
            f"{vs.median():.2f}×, {vs.min():.2f}–{vs.max():.2f}.")
    return lead + "\n\n" + _md(pd.DataFrame(rows)) + "\n\n" + tail
