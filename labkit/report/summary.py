"""Headline figures and the issue's targets, computed as ratios within one run."""
from __future__ import annotations

import pandas as pd

from ..targets import SEED_000, TARGETS


def ok_rows(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"] if "status" in df else df


def decode_table(m: pd.DataFrame) -> pd.DataFrame:
    """The seed-000 table: one row per (strategy, concurrency, context) on the context axis."""
    d = ok_rows(m[m["experiment"] == "decode"])
    if "axis" in d:
        d = d[d["axis"] == "context"]
    cols = ["strategy", "concurrency", "context_len", "budget", "tok_s", "step_ms_median", "step_ms_min", "step_ms_max",
            "h2d_bytes_per_step", "nvml_rx_bytes_per_step", "device_kv_bytes", "device_index_bytes", "host_kv_bytes",
            "graph_mode"]
    return d[[c for c in cols if c in d]].sort_values(["strategy", "concurrency", "context_len"]).reset_index(drop=True)


def link_gbps(m: pd.DataFrame) -> float | None:
    """Contiguous pinned H2D bandwidth measured in this run (largest copy)."""
    p = ok_rows(m[(m["experiment"] == "probe") & (m["strategy"] == "contiguous")])
    if "direction" in p:
        p = p[p["direction"] == "h2d"]
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
    """Every target of `labkit.targets.TARGETS` this run can answer: value, threshold, met (None: not
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
    add("zero_copy_over_resident", z / r if z and r else None, f"{z:.1f} / {r:.1f} tok/s at {big // 1024}K" if z and r else "")
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
        rows.append({"target": f"prefill tok/s at {int(r['context_len']) // 1024}K ({r['strategy']})",
                     "value": float(r["tok_s"]), "threshold": None, "met": None, "detail": "measured here",
                     "source": "seed 000 (3x RTX 3090, not this machine): " + SEED_000["prefill tok/s at 248K tokens"]})
    return pd.DataFrame(rows)


def cost_model_errors(m: pd.DataFrame) -> pd.DataFrame | None:
    """The cost model's error on this run's own points, when the run has anatomies and a known GPU."""
    from ..costmodel import gpu_for_name, validate
    from ..shapes import ModelShape
    d = decode_table(m)
    if d.empty or "anat_weights_ms" not in m or "gpu_name" not in m or "shape" not in m:
        return None
    src = gpu_for_name(str(m["gpu_name"].dropna().iloc[0]) if m["gpu_name"].notna().any() else "")
    if src is None:
        return None
    return validate(m, ModelShape.from_name(str(m["shape"].dropna().iloc[0])), src)
