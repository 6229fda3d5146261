"""The run index `results/index.html`: every run, and trends of the headline figures on each machine.

`rebuild_index(root)` scans every run folder under `root` (nightly folders included), and writes one
self-contained page:
- a table of runs: date, the run (a link to its folder), experiment, status (whatever the manifest says),
  machine (GPU, PCIe link; a CPU by its model, cores and RAM), git sha, wall time, what the folder holds,
  a link to the run's report or the command that draws one;
- the nightly folders and each entry's status;
- per machine kind (the cluster kind a run ran on, else its GPU's kind, else cpu: `machine_kind`) and
  within it per machine (same GPU and link; CPU runs by CPU model, cores and RAM, never mixed with GPU runs), trend
  charts of the headline figures (`headlines`): decode tok/s at the largest context per strategy, the
  zero-copy gather GB/s, the contiguous pinned link GB/s, prefill tok/s;
- regressions: a figure whose value falls below the spread (min..max over the earlier runs' points, each
  point's own min..max included) of at least MIN_EARLIER earlier runs on that machine is flagged; one above it
  is an improvement; inside it is noise. A run whose machine was busy (`summary.run_busy`: a point's slowest
  step over 3x its fastest, other work on the cores) is neither judged nor counted in a spread: its timings
  measured the neighbours. With fewer earlier quiet runs the figure is a `baseline`, not a verdict: one earlier
  run gives a spread of zero width, which any noise leaves.

`labkit run`, `labkit report` and `labkit nightly` call it after every run or report.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go

from .gpus import capped, machine_cell, power_text
from .summary import ok_rows, link_gbps, run_busy
from .units import tokens_label as _ctx
from ..results import UNREADABLE, BadManifest, mtime_iso, effective_status, read_manifest, run_manifests
from ..costmodel import gpu_kind
from ..params import BadInput
from ..atomic import read_regular_at
from ..outdir import results_root_problem
from .html import Page, esc

INDEX_NAME = "index.html"
NIGHTLY_CAP = 16 << 20      # bytes of a nightly's record read at most
MIN_EARLIER = 3        # earlier quiet runs of a figure before a new value is judged against their spread


@dataclass(frozen=True)
class Headline:
    family: str        # "decode tok/s", "gather GB/s", "link GB/s", "prefill tok/s"
    key: str           # the figure within its family, e.g. "zero_copy @ 1M c=1 (qwen3.8-flash-next)"
    value: float
    lo: float          # the run's own spread (slowest repeat) ...
    hi: float          # ... and fastest




def _shape(r, default: str | None) -> str:
    """' (shape)' for a figure's key: the row's shape, else the run's, else nothing (never '(nan)')."""
    v = r.get("shape")
    v = v if isinstance(v, str) and v.strip() and v.lower() not in ("nan", "none") else default
    return f" ({v})" if v else ""


def headlines(m: pd.DataFrame, shape: str | None = None) -> list[Headline]:
    """The headline figures of one run's metrics (higher is better for all of them); `shape` names the
    run's shape where its rows do not (multi-GPU runs)."""
    out: list[Headline] = []
    if m is None or m.empty or "experiment" not in m:
        return out
    d = ok_rows(m[m["experiment"] == "decode"])
    if "axis" in d:
        d = d[d["axis"].isna() | (d["axis"] == "context")]
    d = d.dropna(subset=["tok_s"])
    if not d.empty:
        c1 = d["concurrency"].min()
        for s, g in d[d["concurrency"] == c1].groupby("strategy", sort=True):
            r = g.sort_values("context_len").iloc[-1]
            lo = c1 / (r["step_ms_max"] / 1e3) if pd.notna(r.get("step_ms_max")) and r["step_ms_max"] else r["tok_s"]
            hi = c1 / (r["step_ms_min"] / 1e3) if pd.notna(r.get("step_ms_min")) and r["step_ms_min"] else r["tok_s"]
            out.append(Headline("decode tok/s", f"{s} @ {_ctx(r['context_len'])} c={int(c1)}{_shape(r, shape)}",
                                float(r["tok_s"]), float(lo), float(hi)))
    p = ok_rows(m[m["experiment"] == "probe"])
    zc = p[p["strategy"] == "zero_copy"].dropna(subset=["gbps"]) if "gbps" in p else p.iloc[0:0]
    if not zc.empty:
        r = zc.sort_values("gbps").iloc[-1]
        out.append(Headline("gather GB/s", "zero_copy gather", float(r["gbps"]), *_gbps_spread(r)))
    link = link_gbps(m)
    if link:
        c = p[(p["strategy"] == "contiguous")]
        if "direction" in c:
            c = c[c["direction"] == "h2d"]
        r = c.sort_values("bytes").iloc[-1]
        out.append(Headline("link GB/s", "contiguous pinned H2D", float(link), *_gbps_spread(r)))
    pf = ok_rows(m[m["experiment"] == "prefill"]).dropna(subset=["tok_s"])
    for _, r in pf.iterrows():
        out.append(Headline("prefill tok/s", f"{r['strategy']}{_prefill_mode(r)} @ {_ctx(r['context_len'])}{_cap(r)}"
                            f"{_shape(r, shape)}", float(r["tok_s"]), float(r["tok_s"]), float(r["tok_s"])))
    return out


def _prefill_mode(r) -> str:
    """' sync' / ' rotating': one prefill run measures a strategy in several modes, each its own figure
    (comparing a run's rotating mode against its own sync mode would flag a false regression)."""
    for col in ("mode", "prefill_mode"):
        v = r.get(col)
        if isinstance(v, str) and v.strip() and v != r.get("strategy"):
            return f" {v}"
    return ""


def _cap(r) -> str:
    """' cap 24 GiB' where the run measured under a device-memory cap (another figure than uncapped)."""
    v = r.get("mem_cap_bytes")
    return f" cap {v / 2**30:g} GiB" if isinstance(v, (int, float)) and v == v and v > 0 else ""


def _gbps_spread(r) -> tuple[float, float]:
    b = r.get("bytes")
    if pd.notna(b) and pd.notna(r.get("step_ms_max")) and pd.notna(r.get("step_ms_min")) and r["step_ms_min"] > 0:
        return float(b / r["step_ms_max"] / 1e6), float(b / r["step_ms_min"] / 1e6)
    return float(r["gbps"]), float(r["gbps"])


# Host names that say nothing about the machine (every cloud VM or container may carry them).
_GENERIC_HOSTS = {"", "vm", "localhost", "ubuntu", "debian", "runner", "host", "box"}


def _meaningful_host(host: str | None) -> bool:
    h = (host or "").strip().lower()
    return not (h in _GENERIC_HOSTS or re.fullmatch(r"[0-9a-f]{12}", h))      # a container's id


def machine_label(mf: dict) -> str:
    """Runs are comparable only on the same GPU behind the same link; CPU runs only on the same CPU
    (model, cores, RAM; the host name too where it names a machine rather than every VM)."""
    if mf.get("gpu_name"):
        link = f"PCIe gen{mf['pcie_gen']} x{mf['pcie_width']}" if mf.get("pcie_gen") else "link unknown"
        # several GPUs, or a card held below its default power limit, is another machine (older runs: neither)
        devs = (mf.get("gpus") or {}).get("devices") or [] if isinstance(mf.get("gpus"), dict) else []
        many = f" x{len(devs)}" if len(devs) > 1 else ""
        cap = f" · {power_text(devs)}" if capped(mf) else ""
        return f"{mf['gpu_name']}{many}{cap} · {link}"
    parts = ["CPU", mf.get("cpu_model") or "model not recorded", f"{mf.get('cpu_count', '?')} cores"]
    if mf.get("host_mem_total_bytes"):
        parts.append(f"{mf['host_mem_total_bytes'] / 2**30:.0f} GiB")
    if _meaningful_host(mf.get("host")):
        parts.append(f"host {mf['host']}")
    return " · ".join(parts)


def machine_kind(mf: dict) -> str:
    """The kind a run's machine is grouped under: the cluster kind it ran on, else its GPU's kind, else cpu."""
    c, gpu = mf.get("cluster"), mf.get("gpu_name")       # a table's row holds NaN where a manifest had nothing
    if isinstance(c, dict) and c.get("kind"):
        return str(c["kind"])
    return gpu_kind(gpu) if isinstance(gpu, str) and gpu.strip() else "cpu"


# A few committed runs' notes begin with the numbered stage of work they came from, a word about how the lab was
# built rather than what it measured; the index shows the notes without it (the committed data stays as it is).
_ROUND = re.compile(r"\b[Rr]ound \d+(?:'s)? ")


def _note(text: str) -> str:
    text = str(text)
    opens = _ROUND.match(text) is not None
    text = _ROUND.sub("", text)
    return text[:1].upper() + text[1:] if opens else text


def _short(text: str, n: int = 110) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1].rstrip() + "…"


def contents(run_dir: Path, st: pd.Series) -> str:
    """What a run folder holds, in words: its points, or (no metrics table) the result files it has."""
    if len(st):
        ok, bad = int((st == "ok").sum()), int((st != "ok").sum())
        return f"{ok} point{'s' if ok != 1 else ''} ok" + (f", {bad} failed" if bad else "")
    files = [f for f in run_dir.iterdir() if f.is_file() and f.name != "manifest.json" and not f.name.startswith(".")
             and f.suffix in (".json", ".parquet", ".csv", ".jsonl")]
    if not files:
        return "no measurements"
    kinds = sorted({f.suffix[1:].upper() for f in files})
    return f"{len(files)} {'/'.join(kinds)} result file{'s' if len(files) != 1 else ''}, no metrics table"


def _busy(m: pd.DataFrame, mf: dict, run_dir: Path, problems: list[str]) -> str:
    """`run_busy`, or "" (with a problem line) for a table whose columns are not the types it reads: one run's
    strange table never stops the index of the runs beside it."""
    try:
        return run_busy(m, mf) if len(m) else ""
    except Exception as ex:
        problems.append(f"{run_dir}: metrics.parquet's step times unreadable ({type(ex).__name__}); not judged busy")
        return ""


def collect(root: str | Path) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """(runs, headline figures, problems) for every run folder under root."""
    root = Path(root)
    runs, heads, problems = [], [], []
    for mf_path in run_manifests(root):
        run_dir = mf_path.parent
        try:
            mf = read_manifest(mf_path)
        except (BadManifest, OSError) as ex:     # listed as unreadable, with why; the other runs go on
            why = str(ex).removeprefix(f"{mf_path}: ") if isinstance(ex, BadManifest) else type(ex).__name__
            runs.append({"created": mtime_iso(mf_path) or "", "run_id": run_dir.name, "experiment": "",
                         "status": UNREADABLE, "kind": "", "machine": "", "git_sha": "", "wall_s": None,
                         "points_ok": 0, "points_failed": 0, "holds": f"manifest.json unreadable: {why}", "note": "",
                         "folder": os.path.relpath(run_dir, root), "report": ""})
            continue
        mp = run_dir / "metrics.parquet"
        try:
            m = pd.read_parquet(mp) if mp.is_file() else pd.DataFrame()
        except Exception as ex:
            problems.append(f"{run_dir}: metrics.parquet unreadable ({type(ex).__name__})")
            m = pd.DataFrame()
        st = m["status"] if "status" in m else pd.Series(dtype=object)
        report = run_dir / "report.html"
        busy = _busy(m, mf, run_dir, problems)
        runs.append({"created": mf.get("created", ""), "run_id": mf.get("run_id", run_dir.name),
                     "experiment": mf.get("experiment", ""), "status": effective_status(mf, list(st)),
                     "kind": machine_kind(mf), "machine": " · ".join(x for x in (machine_label(mf), machine_cell(mf)) if x),
                     "git_sha": mf.get("git_sha", ""), "wall_s": mf.get("wall_s"), "busy": "busy" if busy else "",
                     "points_ok": int((st == "ok").sum()), "points_failed": int((st != "ok").sum()) if len(st) else 0,
                     "holds": contents(run_dir, st), "note": _short(_note(mf.get("note") or mf.get("command") or "")),
                     "folder": os.path.relpath(run_dir, root),
                     "report": os.path.relpath(report, root) if report.is_file() else ""})
        shape = (mf.get("parameters") or {}).get("shape")
        try:
            found = headlines(m, shape if isinstance(shape, str) and shape != "auto" else None)
        except Exception as ex:        # a table of unexpected columns or types: the run is listed, not charted
            problems.append(f"{run_dir}: metrics.parquet has no readable headline figures ({type(ex).__name__})")
            found = []
        for h in found:
            heads.append({"created": mf.get("created", ""), "run_id": mf.get("run_id", run_dir.name),
                          "kind": machine_kind(mf), "machine": machine_label(mf), "family": h.family, "key": h.key, "value": h.value,
                          "lo": h.lo, "hi": h.hi, "busy": busy})
    runs_df = pd.DataFrame(runs)
    if not runs_df.empty:
        runs_df = runs_df.sort_values("created", ascending=False).reset_index(drop=True)
    return runs_df, flag(pd.DataFrame(heads)), problems


def flag(heads: pd.DataFrame, min_earlier: int = MIN_EARLIER) -> pd.DataFrame:
    """Add `prev_lo, prev_hi, n_earlier, verdict` to each headline: against the spread of the earlier quiet runs of
    the same figure on the same machine (all headline figures are higher-is-better). Verdicts: `first`, `baseline`
    (fewer than `min_earlier` earlier quiet runs: no spread to judge against yet), `busy` (this run's machine was
    busy: not judged, not counted), `noise`, `regression`, `improvement`. A row's `busy` holds why (empty: quiet)."""
    if heads.empty:
        return heads.assign(prev_lo=[], prev_hi=[], n_earlier=[], verdict=[])
    if "busy" not in heads:
        heads = heads.assign(busy="")
    heads = heads.sort_values("created").reset_index(drop=True)
    prev_lo, prev_hi, n_earlier, verdict = [], [], [], []
    seen: dict[tuple, tuple[float, float, int]] = {}
    for _, r in heads.iterrows():
        k = (r["machine"], r["family"], r["key"])
        lo, hi, n = seen.get(k, (None, None, 0))
        prev_lo.append(lo), prev_hi.append(hi), n_earlier.append(n)
        if isinstance(r["busy"], str) and r["busy"]:
            verdict.append("busy")
            continue
        if n < min_earlier:
            verdict.append("first" if n == 0 else "baseline")
        else:
            verdict.append("regression" if r["value"] < lo else "improvement" if r["value"] > hi else "noise")
        seen[k] = (min(r["lo"], r["value"], *([lo] if n else [])), max(r["hi"], r["value"], *([hi] if n else [])), n + 1)
    return heads.assign(prev_lo=prev_lo, prev_hi=prev_hi, n_earlier=n_earlier, verdict=verdict)


def _when(created: pd.Series) -> pd.Series:
    return pd.to_datetime(created, utc=True, errors="coerce")


def trend_figure(h: pd.DataFrame, machine: str, family: str) -> go.Figure:
    """One line per figure over the runs' creation times. With a single run there is no trend yet: a time
    axis would zoom into fractions of a millisecond around it, so the point is placed at its date instead."""
    fig = go.Figure()
    single = h["run_id"].nunique() < 2
    for key, g in h.groupby("key", sort=True):
        g = g.sort_values("created")
        x = _when(g["created"])
        if single:
            x = x.dt.strftime("%Y-%m-%d %H:%M UTC")
        fig.add_trace(go.Scatter(x=x, y=g["value"], mode="lines+markers", name=key, text=g["run_id"],
                                 error_y={"type": "data", "symmetric": False, "array": (g["hi"] - g["value"]).clip(lower=0),
                                          "arrayminus": (g["value"] - g["lo"]).clip(lower=0), "thickness": 1},
                                 hovertemplate="%{text}<br>%{y:.4g}<extra>" + key + "</extra>"))
        busy = g[g["verdict"] == "busy"]
        if not busy.empty:       # measured on a busy machine: shown, hollow, never judged
            fig.add_trace(go.Scatter(x=_when(busy["created"]) if not single else x[g["verdict"] == "busy"], y=busy["value"],
                                     mode="markers", name=f"busy machine: {key}",
                                     marker={"symbol": "circle-open", "size": 14, "color": "grey"}, text=busy["busy"],
                                     hovertemplate="busy machine, not judged: %{text}<br>%{y:.4g}<extra></extra>"))
        bad = g[g["verdict"] == "regression"]
        if not bad.empty:
            fig.add_trace(go.Scatter(x=_when(bad["created"]), y=bad["value"], mode="markers",
                                     name=f"regression: {key}", marker={"symbol": "x", "size": 14, "color": "red"},
                                     text=bad["run_id"], hovertemplate="REGRESSION %{text}<br>%{y:.4g}<extra></extra>"))
    fig.update_layout(title=f"{family} — {machine}" + (" (one run so far: a trend needs two)" if single else ""),
                      template="plotly_white", height=380, xaxis_title="run created (UTC)", yaxis_title=family,
                      legend={"font": {"size": 10}})
    if single:
        fig.update_xaxes(type="category")
    fig.update_yaxes(rangemode="tozero")
    return fig


def _nightlies(root: Path) -> pd.DataFrame:
    rows = []
    for nj in sorted(root.glob("nightly-*/nightly.json"), reverse=True):
        try:
            n = json.loads(read_regular_at(None, nj, NIGHTLY_CAP))      # a regular file under the cap, no link
            entries = [e for e in n.get("entries", []) if isinstance(e, dict)]
        except Exception:            # not JSON, or not the record's shape: that night is not listed
            continue
        for e in entries:
            rows.append({"nightly": nj.parent.name, "entry": e.get("name"), "status": e.get("status"),
                         "wall_s": e.get("wall_s"), "error": e.get("error") or "",
                         "report": os.path.relpath(nj.parent / e["name"] / "report.html", root)
                         if isinstance(e.get("name"), str) and (nj.parent / e["name"] / "report.html").is_file()
                         else ""})
    return pd.DataFrame(rows)


def rebuild_index(results_root: str | Path = "results") -> Path:
    """Write `<results_root>/index.html` (a nightly folder's parent if given a nightly folder)."""
    root = Path(results_root)
    if root.name.startswith("nightly-") and (root.parent / root.name).is_dir():
        root = root.parent
    if not root.is_dir():
        raise BadInput(f"{root} is not a folder of runs")
    why = results_root_problem(root)       # a shared folder (/tmp) or another user's gets no index of ours
    if why:
        raise BadInput(f"no index written in {root}: it {why}")
    runs, heads, problems = collect(root)
    page = Page(f"labkit runs — {root.resolve().name}")
    page.text(f"{len(runs)} run(s) under {root}, trends grouped by machine kind. Figures are compared only between "
              "runs on the same machine; side by side, kinds are across machines, never a speedup "
              "(same GPU and PCIe link; CPU runs by CPU model, cores and RAM). A figure below the spread (min..max) of "
              f"at least {MIN_EARLIER} earlier quiet runs is a regression, above it an improvement, inside it noise; with "
              "fewer it is a baseline. A run whose machine was busy (a point's slowest step over 3x its fastest, or other "
              "work on the cores as it started or ended) is marked busy and neither judged nor counted.")
    latest = heads.sort_values("created").groupby(["machine", "family", "key"]).tail(1) if not heads.empty else heads
    regress = latest[latest["verdict"] == "regression"] if not latest.empty else latest
    every = heads[heads["verdict"] == "regression"] if not heads.empty else heads
    earlier = every[~every.index.isin(regress.index)] if not every.empty else every
    cols = ["machine", "run_id", "family", "key", "value", "prev_lo", "prev_hi", "n_earlier"]
    fmt = {"value": ".4g", "prev_lo": ".4g", "prev_hi": ".4g"}
    page.heading("Regressions (latest run of each figure)")
    if regress.empty:
        page.text("none standing" + (f"; {len(earlier)} earlier regression(s), each followed by a run back inside "
                                     "the spread (✖ in the trends, listed below)" if not earlier.empty else ""), cls="ok")
    else:
        t = regress[cols]
        page.table(t.reset_index(drop=True), classes={i: "regression" for i in range(len(t))}, fmt=fmt)
    if not earlier.empty:
        page.heading("Earlier regressions (✖ in the trends; a later run of the figure is not one)", level=3)
        t = earlier.sort_values("created")[cols].reset_index(drop=True)
        page.table(t, fmt=fmt)
    page.heading("Runs")
    if runs.empty:
        page.text("no runs yet")
    else:
        t = runs.copy()
        t["report_link"] = t["report"]
        # a run without a report says how to draw one (from its own tables; nothing is measured again)
        t["report"] = [("report" if r else f"labkit report {root.as_posix()}/{f}") for r, f in zip(t["report"], t["folder"])]
        t["folder_link"] = t["folder"].map(lambda f: f + "/")
        t["created"] = t["created"].str.replace("T", " ").str.slice(0, 19)
        t["wall_s"] = t["wall_s"].map(lambda w: f"{w:,.0f}" if isinstance(w, (int, float)) and w == w else "not recorded")
        # the manifest's note says what a folder without a metrics table is
        t["holds"] = [h + (f" — {n}" if n and "no metrics table" in h else "") for h, n in zip(t["holds"], t["note"])]
        page.table(t[["created", "run_id", "experiment", "status", "busy", "kind", "machine", "git_sha", "wall_s", "holds",
                      "report", "report_link", "folder_link"]], wrap=("holds", "machine"),
                   classes={i: "failed" for i, s in enumerate(t["status"]) if s not in ("ok",)},
                   links={"report": "report_link", "run_id": "folder_link"})
    nights = _nightlies(root)
    if not nights.empty:
        page.heading("Nightly runs")
        nights["report_link"] = nights["report"]
        nights["report"] = nights["report"].map(lambda r: "report" if r else "")
        page.table(nights, classes={i: "failed" for i, s in enumerate(nights["status"]) if s not in ("ok", "skipped")},
                   links={"report": "report_link"})
    if not heads.empty:
        # grouped by machine kind (the boxes of a cluster side by side), then by machine within a kind
        for (kind, machine), hm in heads.groupby(["kind", "machine"], sort=True):
            page.heading(f"Trends — {kind}: {machine}")
            for family in ["decode tok/s", "gather GB/s", "link GB/s", "prefill tok/s"]:
                hf = hm[hm["family"] == family]
                if not hf.empty:
                    page.figure(trend_figure(hf, machine, family))
        page.heading("Headline figures, every run")
        t = heads.sort_values(["machine", "family", "key", "created"])[
            ["machine", "created", "run_id", "family", "key", "value", "lo", "hi", "prev_lo", "prev_hi", "n_earlier", "verdict",
             "busy"]]
        page.table(t.reset_index(drop=True), classes={i: v for i, v in enumerate(t["verdict"]) if v in ("regression", "improvement", "noise")},
                   fmt={c: ".4g" for c in ("value", "lo", "hi", "prev_lo", "prev_hi")})
    if problems:
        page.heading("Folders skipped")
        page.raw("<ul>" + "".join(f"<li>{esc(p)}</li>" for p in problems) + "</ul>")
    return page.write(root / INDEX_NAME)
