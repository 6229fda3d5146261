"""Headline figures and the targets (labkit.report.targets), computed as ratios within one run; what a run is
(its header, and on a CPU what it can and cannot say); the run's table as a reader wants it."""
from __future__ import annotations

import pandas as pd

from ..sweep import BUSY_SPREAD, machine_busy     # the one busy rule (slowest / fastest step above BUSY_SPREAD)
from .units import tokens_label as _tok
from .targets import PUBLISHED, SPARSE_OFFLOAD, TARGETS
from ..costmodel import gpu_for_name, validate
from ..shapes import metrics_shape


def is_cpu(m: pd.DataFrame) -> bool:
    """No GPU named on any row (the metrics name the device `cpu` there): a CPU run."""
    if "gpu_name" not in m:
        return True
    names = m["gpu_name"].dropna().astype(str).str.strip().str.lower()
    return names.isin(["", "cpu", "none", "nan"]).all()


def ok_rows(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"] if "status" in df else df


def decode_table(m: pd.DataFrame) -> pd.DataFrame:
    """The main table: one row per (strategy, concurrency, context) on the context axis."""
    d = ok_rows(m[m["experiment"] == "decode"])
    if "axis" in d:
        d = d[d["axis"] == "context"]
    cols = ["strategy", "concurrency", "context_len", "budget", "tok_s", "step_ms_median", "step_ms_min", "step_ms_max",
            "h2d_bytes_per_step", "nvml_rx_bytes_per_step", "device_kv_bytes", "device_index_bytes", "host_kv_bytes",
            "graph_mode"]
    return d[[c for c in cols if c in d]].sort_values(["strategy", "concurrency", "context_len"]).reset_index(drop=True)


def link_gbps(m: pd.DataFrame) -> float | None:
    """Contiguous pinned H2D bandwidth measured in this run (largest copy); None on a CPU, which has no host
    link (its "copy" is a memcpy within RAM, and a bound drawn from it would be no link's)."""
    p = ok_rows(m[(m["experiment"] == "probe") & (m["strategy"] == "contiguous")])
    if "direction" in p:
        p = p[p["direction"] == "h2d"]
    if "device" in p:
        p = p[~p["device"].astype(str).str.startswith("cpu")]
    if p.empty:
        return None
    return float(p.sort_values("bytes")["gbps"].iloc[-1])


def gather_gbps(m: pd.DataFrame, strategy: str = "zero_copy") -> float | None:
    p = ok_rows(m[(m["experiment"] == "probe") & (m["strategy"] == strategy)])
    return None if p.empty else float(p["gbps"].max())


def _point(d, strategy, conc, ctx, col="tok_s"):
    r = d[(d["strategy"] == strategy) & (d["concurrency"] == conc) & (d["context_len"] == ctx)]
    return None if r.empty else float(r[col].iloc[0])


def probe_ms(m: pd.DataFrame, strategy: str, **where) -> float | None:
    p = ok_rows(m[(m["experiment"] == "probe") & (m["strategy"] == strategy)])
    for k, v in where.items():
        if k not in p:
            return None
        p = p[p[k] == v]
    return None if p.empty else float(p["step_ms_median"].iloc[0])


def targets(m: pd.DataFrame) -> pd.DataFrame:
    """Every target of `labkit.report.targets.TARGETS` this run can answer: value, threshold, met (None: not
    measured here), and how the value was formed."""
    d = decode_table(m)
    rows = []

    def add(key, value, detail=""):
        t = TARGETS[key]
        rows.append({"target": t.what, "value": value, "threshold": t.threshold,
                     "met": t.met(value), "detail": detail, "source": t.source})

    link, zc = link_gbps(m), gather_gbps(m)
    add("gather_over_link", zc / link if zc and link else None, f"{zc:.1f} / {link:.1f} GB/s" if zc and link else "")
    if d.empty:
        return pd.DataFrame(rows)
    c1, cmax = int(d["concurrency"].min()), int(d["concurrency"].max())
    big, ref = int(d["context_len"].max()), 64 << 10

    def ratio(key, strategy, a_ctx, b_ctx, col="step_ms_median", a_c=c1, b_c=c1, unit="ms"):
        a, b = _point(d, strategy, a_c, a_ctx, col), _point(d, strategy, b_c, b_ctx, col)
        add(key, a / b if a and b else None, f"{a:.2f} / {b:.2f} {unit}" if a and b else "")

    ratio("zero_copy_1m_over_64k", "zero_copy", big, ref)
    z, r = _point(d, "zero_copy", c1, big), _point(d, "resident", c1, big)
    add("zero_copy_over_resident", z / r if z and r else None, f"{z:.1f} / {r:.1f} tok/s at {_tok(big)}" if z and r else "")
    if cmax > c1:
        ratio("concurrency_scaling", "zero_copy", big, big, col="tok_s", a_c=cmax, unit="tok/s")
    dd = d.dropna(subset=["nvml_rx_bytes_per_step"]) if "nvml_rx_bytes_per_step" in d else d.iloc[0:0]
    dd = dd[dd["h2d_bytes_per_step"] > 0]
    if not dd.empty:
        nv = dd["nvml_rx_bytes_per_step"] / dd["h2d_bytes_per_step"]
        add("nvml_vs_engine", float((nv - 1).abs().max()), f"ratio {nv.min():.3f}..{nv.max():.3f} over {len(dd)} points")
    full = ok_rows(m[m["experiment"] == "decode"])
    full = full[full["axis"] == "context"] if "axis" in full else full
    hbm = gather_gbps(m, "hbm_read")
    res = full[(full["strategy"] == "resident") & (full["concurrency"] == c1) & (full["context_len"] == ref)]
    if hbm and not res.empty and "step_weight_bytes" in res:
        bound = float(res["step_weight_bytes"].iloc[0]) / (hbm * 1e6)
        step = float(res["step_ms_median"].iloc[0])
        add("resident_roofline", step / bound, f"{step:.2f} ms / {bound:.2f} ms ({hbm:.0f} GB/s read)")
    ratio("resident_1m_over_64k", "resident", big, ref)
    sel = probe_ms(m, "score_select", context_len=1 << 20, concurrency=1)
    add("selection_1m_ms", sel, "probe: index_score + radix select, one layer" if sel else "")
    if "anat_closure" in full and full["anat_closure"].notna().any():
        cl = full["anat_closure"].dropna()
        add("anatomy_closure", float((cl - 1).abs().max()), f"{cl.min():.3f}..{cl.max():.3f} over {len(cl)} points")
    err = cost_model_errors(m)
    if err is not None and not err.empty:
        add("cost_model_error", float(err["error"].abs().max()), f"median {err['error'].abs().median():.1%} over {len(err)} points")
    pf = ok_rows(m[m["experiment"] == "prefill"])
    for _, r in pf.iterrows():
        rows.append({"target": f"prefill tok/s at {_tok(r['context_len'])} ({r['strategy']})",
                     "value": float(r["tok_s"]), "threshold": None, "met": None, "detail": "measured here",
                     "source": f"{SPARSE_OFFLOAD}, not this machine: {PUBLISHED['prefill tok/s at 248K tokens']} "
                               "tok/s at 248K"})
    return pd.DataFrame(rows)


def cost_model_errors(m: pd.DataFrame) -> pd.DataFrame | None:
    """The cost model's error on this run's own points, when the run has anatomies and a known GPU."""
    d = decode_table(m)
    if d.empty or "anat_weights_ms" not in m or "gpu_name" not in m or "shape" not in m:
        return None
    src = gpu_for_name(str(m["gpu_name"].dropna().iloc[0]) if m["gpu_name"].notna().any() else "")
    if src is None:
        return None
    return validate(m, metrics_shape(m), src)


# --- what a run is, said in its report -------------------------------------------------------------------


def is_cpu_run(mf: dict) -> bool:
    return not mf.get("gpu_name")


def _load_line(mf: dict) -> str:
    """Load averages at the start and end against the core count, and the busiest other processes."""
    b, a = mf.get("machine_load_before") or {}, mf.get("machine_load_after") or {}
    if not b and not a:
        return ""
    def la(x):
        return f"{x['load_avg'][0]:.1f}" if x.get("load_avg") else "?"
    procs: dict = {}
    for p in (b.get("busy_processes") or []) + (a.get("busy_processes") or []):    # one entry per process
        if p.get("pid") not in procs or p["cpu_percent"] > procs[p.get("pid")]["cpu_percent"]:
            procs[p.get("pid")] = p
    top = ", ".join(f"{p['name']} (pid {p.get('pid')}) {p['cpu_percent']:.0f}% of a core"
                    for p in sorted(procs.values(), key=lambda p: -p["cpu_percent"])[:3])
    return (f"**Load** 1-min load average {la(b)} at the start, {la(a)} at the end, on {mf.get('cpu_count')} cores"
            + f" · busiest other processes: {top or 'none above 1% of a core'}")


def link_text(mf: dict) -> str:
    """The run's host link in words: `PCIe gen 5 x16`, or why there is none to name (never `gen None xNone`)."""
    if is_cpu_run(mf):
        return "no PCIe link"
    if mf.get("pcie_gen") and mf.get("pcie_width"):
        return f"PCIe gen {mf['pcie_gen']:g} x{mf['pcie_width']:g}" if isinstance(mf["pcie_gen"], (int, float)) \
            else f"PCIe gen {mf['pcie_gen']} x{mf['pcie_width']}"
    return "PCIe link not read (no NVML)"


def run_header(mf: dict) -> str:
    """The report's header (markdown): the run, the machine as it was (a CPU run says it has no GPU and no
    PCIe link instead of printing None), the sweep, the machine's load."""
    p = mf.get("parameters", {})
    lines = [f"**Run** `{mf['run_id']}` · {mf.get('created')} · git `{mf.get('git_sha')}` · status **{mf.get('status')}**"]
    ram = f", {mf['host_mem_total_bytes'] / 2**30:.1f} GiB RAM" if mf.get("host_mem_total_bytes") else ""
    if is_cpu_run(mf):
        cpu = mf.get("cpu_model") or "CPU"
        lines.append(f"**Machine** CPU run: {cpu}, {mf.get('cpu_count')} cores{ram} · no GPU, no PCIe link · "
                     f"torch {mf.get('torch')} · host `{mf.get('host')}`")
        tel = "none (NVML reads GPUs; a CPU run has none)"
    else:
        link = f"PCIe gen {mf['pcie_gen']} x{mf['pcie_width']}" if mf.get("pcie_gen") else "PCIe link not read (no NVML)"
        lines.append(f"**Machine** {mf['gpu_name']} · {link} · driver {mf.get('driver') or '?'} · CUDA {mf.get('cuda')} · "
                     f"torch {mf.get('torch')} · host `{mf.get('host')}` ({mf.get('cpu_count')} cores{ram})")
        tel = mf.get("telemetry")
    budgets = ", ".join(_tok(b) for b in p.get("budgets", [])) if isinstance(p.get("budgets"), list) else p.get("budgets")
    concs = ", ".join(str(c) for c in p.get("concurrency", [])) if isinstance(p.get("concurrency"), list) else p.get("concurrency")
    lines.append(f"**Shape** {p.get('shape')} · budgets {budgets} · concurrency {concs} · {p.get('repeats')} x "
                 f"{p.get('steps')} timed steps per point · telemetry: {tel}")
    load = _load_line(mf)
    if load:
        lines.append(load)
    return "  \n".join(lines)


def what_this_run_is(mf: dict) -> str:
    """For a CPU run: what it is (a check that the pipeline runs; this CPU's timings) and what a GPU run
    adds. Empty for a GPU run."""
    if not is_cpu_run(mf):
        return ""
    return ("**What this run is.** A CPU run: a check that the pipeline runs end to end on this machine — every "
            "strategy decodes, moved bytes are counted, the notebook and this report are drawn. Its timings are this "
            "CPU's (eager code on shared cores) and are not comparable with GPU figures; none are shown beside them.  \n"
            "**What a GPU run adds:** step times from CUDA graphs, the PCIe link and its bound on every speed plot, "
            "NVML's PCIe byte counters beside the engine's count, GPU telemetry, a step anatomy that closes within 5% "
            "and feeds `labkit predict`, and the 64K–1M contexts the targets are set at (`make sweep` on a GPU box).")


def busy_points(m: pd.DataFrame, spread: float = BUSY_SPREAD) -> pd.DataFrame:
    """Points of the main table whose slowest step took more than `spread` times their fastest."""
    d = decode_table(m)
    if d.empty or "step_ms_min" not in d:
        return d.iloc[0:0]
    r = d["step_ms_max"] / d["step_ms_min"]
    return d.assign(spread=r)[r > spread]


def run_busy(m: pd.DataFrame, mf: dict) -> str:
    """Why this run's machine was busy (the sweep core's rule over its timed points), or "" when nothing says so."""
    t = ok_rows(m[~m["experiment"].isin(("probe", "link_probe"))]) if "experiment" in m else m.iloc[0:0]
    if "step_ms_min" in t and "step_ms_max" in t:
        t = t[(t["step_ms_min"] > 0) & t["step_ms_max"].notna()]
        spreads = list(t["step_ms_max"] / t["step_ms_min"])
    else:
        spreads = []
    return machine_busy(mf, spreads)


def busy_note(m: pd.DataFrame, mf: dict) -> str:
    """A warning (markdown) when points' spread says the machine was busy while they ran; empty otherwise."""
    b, d = busy_points(m), decode_table(m)
    if b.empty:
        return ""
    w = b.sort_values("spread").iloc[-1]
    load = mf.get("machine_load_before") or {}
    la = load.get("load_avg")
    busy = f" The 1-min load average was {la[0]:.1f} on {mf.get('cpu_count')} cores at the start." if la else ""
    return (f"⚠ **Busy machine:** {len(b)} of {len(d)} points have a slowest step more than {BUSY_SPREAD:g}× their "
            f"fastest (worst: {w['strategy']} at {_tok(w['context_len'])}, concurrency {int(w['concurrency'])}: "
            f"{w['step_ms_min']:,.0f}–{w['step_ms_max']:,.0f} ms).{busy} A spread this wide says other work shared the "
            "machine while they ran: their medians may say more about it than about the strategies. They are marked "
            "`busy` in the table.")


def targets_view(m: pd.DataFrame, mf: dict) -> tuple[pd.DataFrame, str]:
    """The targets as a report shows them: only what this run measured, the verdict in words (met / not
    met / not measured), values formatted; and one line naming what this run could not measure. A CPU run
    shows no published GPU figures (its source column is dropped)."""
    t = targets(m)
    if t.empty:
        return t, "No target can be computed from this run."
    measured = t["value"].notna()
    missing = t.loc[~measured, "target"].tolist()
    t = t[measured].copy()
    higher = {x.what: x.higher_is_better for x in TARGETS.values()}

    def num(v):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:,.0f}"
    t["value"] = t["value"].map(num)
    t["goal"] = [("" if thr is None or thr != thr else f"{'≥' if higher.get(w, True) else '≤'}\u00a0{thr:g}")
                 for w, thr in zip(t["target"], t["threshold"])]
    t["result"] = t["met"].map(lambda v: "met" if v is True else "not met" if v is False else "not judged")
    if is_cpu_run(mf):         # the thresholds are GPU figures: a CPU's ratio is shown, never judged against them
        t["result"] = "not judged (CPU run)"
    cols = ["target", "value", "goal", "result", "detail"] + ([] if is_cpu_run(mf) else ["source"])
    t = t[cols].rename(columns={"detail": "how"}).reset_index(drop=True)
    note = ""
    if missing:
        note = (f"Not measured in this run ({len(missing)}; its contexts, concurrencies or probes do not reach them): "
                + "; ".join(missing) + ".")
    if is_cpu_run(mf):
        note = (note + " " if note else "") + ("The thresholds are set for GPU runs: on this CPU a row shows the "
                                               "ratio can be computed, and met / not met says nothing about a GPU.")
    return t, note


def table_view(m: pd.DataFrame) -> pd.DataFrame:
    """The main table as a reader wants it: counts as integers, bytes in MiB/GiB, the step-time spread,
    columns without any value dropped, a `busy` mark on points the machine's load spoiled."""
    tab = decode_table(m).copy()
    for c in ("concurrency", "context_len", "budget"):
        if c in tab:
            tab[c] = tab[c].astype("Int64")
    for c in ("h2d_bytes_per_step", "nvml_rx_bytes_per_step"):
        if c in tab:
            tab[c.replace("bytes", "MiB")] = tab.pop(c) / 2**20
    held = [c for c in ("device_kv_bytes", "device_index_bytes", "host_kv_bytes") if c in tab]
    unit, scale = ("GiB", 2**30) if held and tab[held].max().max() >= 2**30 else ("MiB", 2**20)   # tiny shapes: MiB
    for c in held:
        tab[c.replace("bytes", unit)] = tab.pop(c) / scale
    if "step_ms_min" in tab:
        spread = tab["step_ms_max"] / tab["step_ms_min"]
        at = list(tab.columns).index("step_ms_max") + 1       # beside the times it is read from
        tab.insert(at, "max/min", spread)
        tab.insert(at + 1, "busy", (spread > BUSY_SPREAD).map({True: "busy", False: ""}))
    return tab.dropna(axis=1, how="all")


# A table's box: as wide as the page and at most most of a screen tall, scrolling both ways inside, its header row
# held at the top. A wide table in a box as tall as itself (the decode table: 16 columns, 1,700 px, 40+ rows) put its
# sideways scrollbar a screen or more below where a reader meets it, so at 1280 px its last columns read as cut off.
SCROLL_BOX = "overflow:auto;max-width:100%;max-height:75vh"
STICKY_HEAD = [{"selector": "thead th", "props": "position:sticky;top:0;z-index:1;background:#fff"}]


def scroll_table(df: pd.DataFrame, digits: int = 3) -> str:
    """A table for a report (HTML): no index, integers as integers, floats to `digits` places, inside a box that
    scrolls when the table is wider than the page or taller than most of a screen, its scrollbars and header row
    in view while the table is (nothing clipped out of reach)."""
    if df.empty:
        return "<p><em>(no rows)</em></p>"
    floats = [c for c in df.columns if pd.api.types.is_float_dtype(df[c])]
    sty = df.style.hide(axis="index").format("{:,." + str(digits) + "f}", subset=floats, na_rep="—").format(
        na_rep="—", subset=[c for c in df.columns if c not in floats]).set_table_styles(STICKY_HEAD)
    return f'<div class="lk-scroll" style="{SCROLL_BOX}">{sty.to_html()}</div>'


def md_table(df: pd.DataFrame) -> str:
    """A frame as a markdown table (no tabulate needed): every generated docs table is drawn by this."""
    cols = list(df.columns)
    lines = ["| " + " | ".join(str(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(x).replace("|", "\\|") for x in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)
