"""`labkit compare RUN_A RUN_B [--out FILE]`: matching points of two runs side by side, with ratios.

Points match on what defines them (experiment, shape, strategy, context, budget, concurrency, axis, and
for probe rows the copy size, direction and launch configuration). For each match the page shows A's
and B's speed (decode/prefill tok/s, probe GB/s) and step time, the ratio B / A, and a verdict: a
difference whose step-time spreads (each point's step_ms_min..step_ms_max) overlap is **noise**, not a
change; otherwise B is **faster** or **slower**. Points measured once (no spread) say so.
CPU runs are never compared with GPU runs (DESIGN.md: CPU timings are labelled CPU, never compared).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ..costmodel import numeric_metrics
from ..params import BadInput
from .index import machine_label
from .summary import ok_rows
from ..results import LoadedRun
from .html import Page, esc

KEY = ["experiment", "shape", "strategy", "axis", "context_len", "budget", "concurrency", "selection",
       "direction", "bytes", "size_mib", "threads", "rows_per_prog", "num_warps"]


def _load(path: str | Path):
    p = Path(path)
    if not p.is_dir():
        raise BadInput(f"{p} is not a folder")
    try:
        return LoadedRun(p)
    except FileNotFoundError as ex:
        raise BadInput(str(ex)) from None
    except BadInput:                   # a manifest not matching the schema: its own line says why
        raise
    except ValueError as ex:
        raise BadInput(f"{p}/manifest.json is not valid JSON ({ex})") from None


def _speed(df: pd.DataFrame) -> pd.Series:
    """Higher-is-better figure per row: gbps for probe rows, tok/s otherwise."""
    g = df["gbps"] if "gbps" in df else pd.Series(np.nan, index=df.index)
    return g.where(df["experiment"] == "probe", df.get("tok_s", pd.Series(np.nan, index=df.index)))


def _keyed(m: pd.DataFrame, key: list[str]) -> pd.DataFrame:
    m = ok_rows(m).copy()
    for k in key:
        if k not in m:
            m[k] = None
        m[k] = m[k].astype("string").fillna("")
        # 8192 and 8192.0 are the same point
        m[k] = m[k].str.replace(r"\.0$", "", regex=True)
    m["speed"] = _speed(m)
    return m.dropna(subset=["speed"]).drop_duplicates(subset=key, keep="first")


def match(a: pd.DataFrame, b: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(matched points with ratio and verdict, points only in one run)."""
    key = [k for k in KEY if k in a.columns or k in b.columns]
    ka, kb = _keyed(a, key), _keyed(b, key)
    cols = key + ["speed", "step_ms_median", "step_ms_min", "step_ms_max", "repeats"]
    for df in (ka, kb):
        for c in cols:
            if c not in df:
                df[c] = np.nan
    j = ka[cols].merge(kb[cols], on=key, how="outer", suffixes=("_a", "_b"), indicator=True)
    only = j[j["_merge"] != "both"].copy()
    only["only_in"] = only["_merge"].map({"left_only": "A", "right_only": "B"})
    j = j[j["_merge"] == "both"].drop(columns="_merge").copy()
    j["ratio"] = j["speed_b"] / j["speed_a"]
    j["step_ratio"] = j["step_ms_median_b"] / j["step_ms_median_a"]
    j["verdict"] = [verdict(r) for _, r in j.iterrows()]
    keep = [k for k in key if (j[k] != "").any()]
    only_keep = [k for k in key if (only[k] != "").any()]
    return (j[keep + ["speed_a", "speed_b", "ratio", "step_ms_median_a", "step_ms_median_b", "step_ms_min_a", "step_ms_max_a",
                      "step_ms_min_b", "step_ms_max_b", "step_ratio", "verdict"]].reset_index(drop=True),
            only[["only_in"] + only_keep].reset_index(drop=True))


def verdict(r) -> str:
    lo_a, hi_a, lo_b, hi_b = r["step_ms_min_a"], r["step_ms_max_a"], r["step_ms_min_b"], r["step_ms_max_b"]
    if any(pd.isna(v) for v in (lo_a, hi_a, lo_b, hi_b)):
        return "no spread"
    if lo_a == hi_a and lo_b == hi_b:      # one measurement each (prefill): no run-to-run spread known
        return "no spread"
    if lo_b <= hi_a and lo_a <= hi_b:      # the two spreads overlap
        return "noise"
    return "faster" if r["ratio"] > 1 else "slower"


def _label(r, key_cols) -> str:
    parts = []
    for k in key_cols:
        v = r[k]
        if v in ("", None) or k in ("experiment", "shape", "selection", "axis"):
            continue
        parts.append(f"{k.replace('context_len', 'ctx').replace('concurrency', 'c')}={v}")
    return " ".join(parts)


def ratio_figure(j: pd.DataFrame, experiment: str) -> go.Figure:
    d = j[j["experiment"] == experiment].copy()
    key_cols = [c for c in KEY if c in d]
    d["label"] = [_label(r, key_cols) for _, r in d.iterrows()]
    colors = {"noise": "#999999", "faster": "#2ca02c", "slower": "#d62728", "no spread": "#1f77b4"}
    fig = go.Figure()
    for v, g in d.groupby("verdict", sort=True):
        # the ratio's range if each run sat at the other end of its spread
        hi = g["step_ms_max_a"] / g["step_ms_min_b"]
        lo = g["step_ms_min_a"] / g["step_ms_max_b"]
        fig.add_trace(go.Scatter(x=g["label"], y=g["ratio"], mode="markers", name=v, marker={"color": colors.get(v), "size": 9},
                                 error_y={"type": "data", "symmetric": False, "array": (hi - g["ratio"]).clip(lower=0),
                                          "arrayminus": (g["ratio"] - lo).clip(lower=0), "thickness": 1},
                                 hovertemplate="%{x}<br>B/A %{y:.3f}<extra>" + v + "</extra>"))
    fig.add_hline(y=1.0, line_dash="dash", line_color="black")
    unit = "GB/s" if experiment == "probe" else "tok/s"
    fig.update_layout(title=f"{experiment}: {unit} of B / A per matching point (bars: range from each point's step-time spread)",
                      template="plotly_white", height=440, yaxis_title=f"B / A ({unit})", xaxis_title="point",
                      xaxis={"type": "category", "tickangle": -45, "tickfont": {"size": 9}})
    return fig


def compare(run_a: str | Path, run_b: str | Path, out: str | Path | None = None) -> Path:
    """Write the comparison page; returns its path. Bad input raises BadInput before anything is written."""
    a, b = _load(run_a), _load(run_b)
    ma, mb = machine_label(a.manifest), machine_label(b.manifest)
    if bool(a.manifest.get("gpu_name")) != bool(b.manifest.get("gpu_name")):
        raise BadInput(f"one run is CPU ({ma if not a.manifest.get('gpu_name') else mb}), the other GPU: "
                       "CPU timings are never compared with GPU figures")
    # text where numbers belong (a hand-edited or foreign table): one line naming the run and column
    j, only = match(numeric_metrics(a.metrics, f"{a.path}/metrics.parquet"),
                    numeric_metrics(b.metrics, f"{b.path}/metrics.parquet"))
    if j.empty:
        raise BadInput(f"{a.path.name} and {b.path.name} have no matching points (different experiments or grids)")
    out = Path(out) if out else b.path.parent / f"compare-{a.path.name}-vs-{b.path.name}.html"
    if out.resolve().parent in (a.path.resolve(), b.path.resolve()) and out.name == "report.html":
        raise BadInput(f"--out {out} would overwrite a run's report")

    page = Page(f"labkit compare: {a.path.name} (A) vs {b.path.name} (B)")
    info = pd.DataFrame([{"": name, "run": r.manifest.get("run_id"), "created": r.manifest.get("created"),
                          "machine": m, "git sha": r.manifest.get("git_sha"), "experiment": r.manifest.get("experiment"),
                          "status": r.manifest.get("status"), "torch": r.manifest.get("torch")}
                         for name, r, m in (("A", a, ma), ("B", b, mb))])
    page.table(info)
    if ma != mb:
        page.raw(f'<p class="regression">Different machines ({esc(ma)} vs {esc(mb)}): ratios compare hardware as well as code.</p>')
    counts = j["verdict"].value_counts()
    page.text(f"{len(j)} matching points: " + ", ".join(f"{n} {v}" for v, n in counts.items()) +
              f"; {int((only['only_in'] == 'A').sum())} only in A, {int((only['only_in'] == 'B').sum())} only in B. "
              "Ratio = B / A of tok/s (probe: GB/s); > 1 means B is faster. A difference whose step-time spreads "
              "(min..max of the repeats) overlap is noise, not a change.")
    for exp in [e for e in ("decode", "prefill", "probe") if e in set(j["experiment"])] + \
               sorted(set(j["experiment"]) - {"decode", "prefill", "probe"}):
        page.heading(exp)
        page.figure(ratio_figure(j, exp))
        t = j[j["experiment"] == exp].drop(columns=["experiment"]).reset_index(drop=True)
        t = t[[c for c in t.columns if not (t[c].astype(str) == "").all()]]
        page.table(t, classes={i: {"faster": "improvement", "slower": "regression", "noise": "noise"}.get(v, "")
                               for i, v in enumerate(t["verdict"])},
                   fmt={c: ".4g" for c in t.columns if c.startswith(("speed", "step", "ratio"))})
    if not only.empty:
        page.heading("Points in one run only")
        page.table(only)
    return page.write(out)


def cmd_compare(a) -> int:
    print(compare(a.run_a, a.run_b, a.out).resolve())
    return 0
