"""Imported (external) points beside the lab's own: matched on model, context and concurrency, drawn into the
decode, prefill and serving figures and tabled, always labelled external with their source.

    ext = external_points("results")                      # every imported row under the results folder
    models = lab_models(run_dir)                          # the run's model names, as its exported rows say them
    decode_figure(metrics, ext, models).show()            # labkit's decode figure + the external decode rates
    matched_table(run_dir, ext)                           # exact matches side by side, with the ratio

Matching: the model by name (case, dashes and dots ignored; the checkpoint's name counts too), the concurrency
exactly, the context within 10% (a chat template adds a few tokens to a prompt). `models=` names another model
on purpose, e.g. the published checkpoint beside the engine's shape of it. What is compared is what both sides
define the same way (`archive`: the kinds of rate): the decode figure takes the external one-stream decode rate
times the concurrency (the batch's decode tokens per second, first token excluded), the prefill figure prompt
tokens per second, the serving figures TTFT, TPOT and output tokens per second of the same kind.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go

from ..experiments.decode.figures import tok_s_vs_context
from ..report.summary import decode_table
from ..outdir import results_root_problem
from ..params import BadInput
from ..results import load_run, read_manifest
from ..experiments.serve_sweep import figures as F
from .archive import rows_of_run
from .importer import EXPERIMENT, RATES

CONTEXT_TOLERANCE = 0.10
STYLE = {"mode": "markers+lines", "line": {"dash": "dot", "color": "grey"},
         "marker": {"symbol": "diamond-open", "size": 9, "color": "grey"}}


def norm(name) -> str:
    return re.sub(r"[^a-z0-9]", "", str(name or "").lower())


IMPORTED = re.compile(r"external-[a-z0-9-]{1,40}-[0-9a-f]{8}")      # the folder names `labkit import` makes
NUMERIC = ("context_len", "concurrency", "tp", "power_limit_w") + RATES + ("tpot_p50_ms",)


def imported_folders(root: str | Path) -> list[Path]:
    """The folders `labkit import` made directly under the results folder `root`: named as it names them, real
    folders (not links) of this user's alone. Nothing else, and nothing outside `root`, is read as external rows;
    a root that is not this user's alone (`/tmp`, a folder of another's) has none."""
    root = Path(root)
    if not root.is_dir() or results_root_problem(root):
        return []
    out = []
    for e in sorted(os.scandir(root), key=lambda e: e.name):
        if IMPORTED.fullmatch(e.name) and e.is_dir(follow_symlinks=False):
            st = e.stat(follow_symlinks=False)
            if st.st_uid == os.geteuid() and not st.st_mode & 0o022:
                out.append(Path(e.path))
    return out


def external_points(root: str | Path) -> pd.DataFrame:
    """Every imported row under `root` (`imported_folders`, each with a manifest of experiment `external`). A
    folder that cannot be read is passed over; the rate columns are numbers (anything else is missing), so one
    odd file never stops a figure."""
    frames = []
    for d in imported_folders(root):
        try:
            if read_manifest(d).get("experiment") == EXPERIMENT:
                frames.append(_numeric(load_run(d).metrics))
        except (BadInput, OSError, ValueError):
            continue
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _numeric(m: pd.DataFrame) -> pd.DataFrame:
    for c in NUMERIC:
        if c in m:
            m[c] = pd.to_numeric(m[c], errors="coerce")
    return m


def lab_models(run_dir: str | Path) -> set[str]:
    """The names a run's model goes by in its exported rows (model and checkpoint)."""
    rows, _ = rows_of_run(run_dir)
    return {norm(r.get(k)) for r in rows for k in ("model", "checkpoint_ref") if r.get(k)}


def matching(ext: pd.DataFrame, models, concurrency=None) -> pd.DataFrame:
    """External rows of these models (and this concurrency)."""
    if ext is None or ext.empty:
        return pd.DataFrame()
    names = {norm(m) for m in ([models] if isinstance(models, str) else models)}
    keys = ext["shape"].map(norm)
    if "checkpoint_ref" in ext:
        keys = keys.where(keys.isin(names), ext["checkpoint_ref"].map(norm))
    out = ext[keys.isin(names)]
    if concurrency is not None:
        out = out[out["concurrency"] == concurrency]
    return out


def _label(g: pd.DataFrame) -> str:
    r = g.iloc[0]
    what = " ".join(str(r[k]) for k in ("engine", "quant") if k in g and isinstance(r.get(k), str))
    tp = f" tp{int(r['tp'])}" if "tp" in g and pd.notna(r.get("tp")) else ""
    return f"external: {r['source']} · {r['shape']} {what}{tp}"


def _groups(pts: pd.DataFrame):
    keys = [k for k in ("source", "shape", "engine", "quant", "tp", "power_limit_w", "kv_cache_dtype") if k in pts]
    return pts.groupby(keys, dropna=False, sort=True) if keys else [((), pts)]


def add_points(fig: go.Figure, pts: pd.DataFrame, y: str, x: str = "context_len", row: int | None = None,
               col: int | None = None, scale=None, first: bool = True) -> int:
    """One dotted grey trace per external configuration; returns how many points were drawn."""
    n = 0
    for _, g in _groups(pts.dropna(subset=[y])):
        g = g.sort_values(x)
        vals = g[y] * (scale(g) if scale else 1)
        hover = [f"{rid}<br>{kind}" for rid, kind in zip(g.get("external_run_id", g["run_id"]),
                                                           g.get("output_tps_kind", pd.Series([""] * len(g))))]
        trace = go.Scatter(x=g[x], y=vals, name=_label(g), legendgroup=_label(g), showlegend=first, text=hover,
                           hovertemplate="%{x}: %{y:.4g}<br>%{text}<extra>external</extra>", **STYLE)
        if row is None:
            fig.add_trace(trace)
        else:
            fig.add_trace(trace, row=row, col=col)
        n += len(g)
    return n


def decode_figure(m: pd.DataFrame, ext: pd.DataFrame, models) -> go.Figure:
    """labkit's decode figure (tok/s vs context, a facet per concurrency) with the matching external decode rates:
    one stream's decode tok/s x the concurrency (first token excluded, as the engine's steady steps)."""
    fig = tok_s_vs_context(m)
    d = decode_table(m)
    concs = sorted(int(c) for c in d["concurrency"].unique()) if not d.empty else []
    for j, c in enumerate(concs, start=1):
        pts = matching(ext, models, c)
        if "decode_tok_s" in pts:
            add_points(fig, pts, "decode_tok_s", row=1, col=j, scale=lambda g: g["concurrency"], first=j == 1)
    return _titled(fig, ext, models)


def prefill_figure(m: pd.DataFrame, ext: pd.DataFrame, models) -> go.Figure:
    """Prefill tok/s vs prompt length: the lab's prefill points per strategy and mode, external prefill rates beside."""
    fig = go.Figure()
    p = m[(m["experiment"] == "prefill") & (m["status"] == "ok")] if "experiment" in m else m.iloc[0:0]
    for key, g in p.groupby(["strategy"] + (["mode"] if "mode" in p else []), dropna=False):
        g = g.sort_values("context_len")
        fig.add_trace(go.Scatter(x=g["context_len"], y=g["tok_s"], mode="lines+markers", name=" ".join(map(str, key))))
    pts = matching(ext, models, 1)
    if "prefill_tok_s" in pts:
        add_points(fig, pts, "prefill_tok_s")
    fig.update_xaxes(type="log", title="prompt tokens")
    fig.update_yaxes(title="prefill tok/s")
    fig.update_layout(title="Prefill speed vs prompt length")
    return _titled(fig, ext, models)


def serving_figures(m: pd.DataFrame, ext: pd.DataFrame, models, label: str) -> list[go.Figure]:
    """The serving run's latency-vs-input and throughput figures, with the matching external TTFT, TPOT (or ITL
    where a row has no TPOT) and output tok/s of the same kind (wall-clock, first token included)."""
    d = m[(m["status"] == "ok") & (m["client"] == "labkit")] if "client" in m else m
    lat, thr = F.latency_vs_input(m, label), F.throughput(m, label)
    for c in sorted(int(x) for x in d["concurrency"].dropna().unique()):
        pts = matching(ext, models, c)
        if pts.empty:
            continue
        pts = pts.assign(input_len=pts["context_len"],
                         tpot=pts["tpot_p50_ms"].fillna(pts["itl_p50_ms"]) if "itl_p50_ms" in pts else pts.get("tpot_p50_ms"))
        if "ttft_p50_ms" in pts:
            add_points(lat, pts, "ttft_p50_ms", x="input_len", row=1, col=1)
        if pts["tpot"] is not None:
            add_points(lat, pts, "tpot", x="input_len", row=1, col=2, first=False)
    pts = matching(ext, models)
    if not pts.empty and "output_tps_kind" in pts:
        pts = pts[pts["output_tps_kind"].isin(["single_stream_wall", "aggregate_output"])]
        add_points(thr, pts, "output_tok_s", x="concurrency", row=1, col=1)
    return [_titled(lat, ext, models), _titled(thr, ext, models)]


def _titled(fig: go.Figure, ext: pd.DataFrame, models) -> go.Figure:
    n = len(matching(ext, models)) if ext is not None and not ext.empty else 0
    if n:
        fig.update_layout(title=f"{fig.layout.title.text or ''} · beside {n} external rows (grey, dotted)")
    return fig


def matched_table(run_dir: str | Path, ext: pd.DataFrame, models=None) -> pd.DataFrame:
    """The run's exported rows next to every external row of the same model, concurrency and context (within 10%):
    the rate both define the same way side by side, and lab / external."""
    rows, _ = rows_of_run(run_dir)
    lab = pd.DataFrame(rows)
    names = models or {norm(r.get(k)) for r in rows for k in ("model", "checkpoint_ref") if r.get(k)}
    out = []
    for _, r in lab.iterrows():
        pts = matching(ext, names, r["concurrency"])
        depth = r["prompt_tokens"]
        if pts.empty or not depth:
            continue
        pts = pts[(pts["context_len"] - depth).abs() <= CONTEXT_TOLERANCE * depth]
        for _, e in pts.iterrows():
            for col in ("decode_tok_s", "prefill_tok_s", "ttft_p50_ms", "tpot_p50_ms", "output_tok_s"):
                if col == "output_tok_s" and e.get("output_tps_kind") != r["output_tps_kind"]:
                    continue           # rates of different kinds are not compared
                a, b = r.get(col), e.get(col)
                if pd.notna(a) and pd.notna(b) and b:
                    out.append({"field": col, "model": r["model"], "prompt_tokens": depth, "concurrency": r["concurrency"],
                                "lab": a, "lab_point": r["run_id"], "external": b, "source": e["source"],
                                "external_row": e.get("external_run_id"), "lab_over_external": a / b})
    return pd.DataFrame(out)
