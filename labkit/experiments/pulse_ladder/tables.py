"""PulseInfer's ladder's generated table in docs/pulseinfer.md (`labkit docs`): each rung against the first on
the same test windows, and what each rung moved. It reads the committed run folder it is given: docs/runs.toml
names it, labkit/docs binds the block to its function and run."""
from __future__ import annotations

import pandas as pd

from ...report.summary import md_table as _md
from ...report.units import ratio_cell, window_range
from ...results import REPO, load_run


def pulse_ladder_table(run: str | list) -> str:
    """PulseInfer's ladder (the run `run`; "": none yet; a list: the same plan run in several processes, a table
    each): per rung, throughput and p99 TPOT as ratios to the first rung on the same test window (median, min,
    max, 95% bootstrap interval over the windows), and what each rung moved (bytes per copy, copies per step, the
    most requests running at once: medians over the test windows)."""
    if not isinstance(run, str):
        return "\n\n".join(f"Process {i + 1} of {len(run)}:\n\n{pulse_ladder_table(r)}" for i, r in enumerate(run)) \
            if run else pulse_ladder_table("")
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
                     **({"mean TPOT ratio median": ratio_cell(r["tpot_mean_ratio"]),
                         "mean 95% interval": f"[{ratio_cell(r['tpot_mean_ratio_lo'])}, "
                                              f"{ratio_cell(r['tpot_mean_ratio_hi'])}]"}
                        if "tpot_mean_ratio" in r and pd.notna(r["tpot_mean_ratio"]) else {}),
                     "KiB per copy": "-" if pd.isna(kib) else f"{kib:.1f}",
                     "copies per step": "-" if pd.isna(mine["copies_per_step"].median()) else f"{mine['copies_per_step'].median():,.0f}",
                     "most running": f"{mine['max_running'].median():.0f}"})
    ratios = lr.table("window_ratios")
    best = mf.get("strongest_rung") or "adaptive"         # runs before the calibration-only choice: adaptive
    vs = ratios[(ratios["role"] == "test") & (ratios["arm"] == best)]["throughput_vs_no_offload"]
    lead = (f"Run `{mf['run_id']}` ({mf.get('gpu_name') or 'CPU'}; {len(mf.get('resumed_from') or [])} earlier pieces "
            f"resumed): {prm['windows']} windows of {prm['window_size']} Mooncake requests (inputs × "
            f"{float(prm['length_scale']):g}, {_outputs(prm)}), windows {window_range(mf['calibration'])} "
            f"calibrate, {window_range(mf['test'])} test; {_cap(mf, prm)}. {_mode(mf)}Ratios to "
            f"`per_head` on the same window, rungs in an order turned per window.")
    name = "Full PulseInfer (`adaptive`)" if best == "adaptive" else f"The strongest rung on the calibration windows (`{best}`)"
    tail = (f"{name} / `no_offload` under the same cap, per test window: median "
            f"{vs.median():.2f}×, {vs.min():.2f}–{vs.max():.2f}.{_held(test)}")
    return lead + "\n\n" + _md(pd.DataFrame(rows)) + "\n\n" + tail


def _outputs(prm: dict) -> str:
    if int(prm["max_output"]) == 0:
        return f"the trace's output lengths × {float(prm.get('output_scale', 1.0)):g}"
    return f"≤ {prm['max_output']} output tokens"


def _cap(mf: dict, prm: dict) -> str:
    """The device KV cap: one for the run, or the pressure rule's one per window (its range and share)."""
    caps = mf.get("device_kv_caps")
    if prm["device_kv_tokens"] != "auto" or not caps:
        return f"device KV cap {int(prm['device_kv_tokens']):,} tokens"
    c = pd.DataFrame(caps)
    return (f"device KV cap per window by the pressure rule, {c['device_kv_cap_tokens'].min():,}–"
            f"{c['device_kv_cap_tokens'].max():,} tokens ({c['device_kv_share'].min():.0%}–"
            f"{c['device_kv_share'].max():.0%} of the window's KV; at most a third of the requests fit it together in "
            f"{int(c['third_held'].sum())} of {len(c)} windows)")


def _mode(mf: dict) -> str:
    if not mf.get("disaggregated"):
        return ""
    return ("Decode instance: every request arrives with its KV prefilled elsewhere (placed in its lane's pool, the "
            "hand-over outside the timed decode), no prefill in the timed window, no TTFT. ")


def _held(test: pd.DataFrame) -> str:
    """How hard the cap pressed on no_offload: the most of a window's requests it ran at once, the most waiting."""
    no = test[test["rung"] == "no_offload"]
    if no.empty or "max_waiting" not in no or not no["max_waiting"].notna().any():
        return ""           # runs before the pressure rule recorded no waiting
    return (f" `no_offload` ran at most {no['max_running'].max():.0f} of {no['n_requests'].max():.0f} requests a "
            f"window at once, {no['max_waiting'].max():.0f} waiting at the most.")
