"""Headline figures and the issue's targets, computed as ratios within one run."""
from __future__ import annotations

import math

import pandas as pd


def _ok(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["status"] == "ok"] if "status" in df else df


def decode_table(m: pd.DataFrame) -> pd.DataFrame:
    """The seed-000 table: one row per (strategy, concurrency, context) on the context axis."""
    d = _ok(m[m["experiment"] == "decode"])
    if "axis" in d:
        d = d[d["axis"] == "context"]
    cols = ["strategy", "concurrency", "context_len", "budget", "tok_s", "step_ms_median", "step_ms_min", "step_ms_max",
            "h2d_bytes_per_step", "nvml_rx_bytes_per_step", "device_kv_bytes", "device_index_bytes", "host_kv_bytes",
            "graph_mode"]
    return d[[c for c in cols if c in d]].sort_values(["strategy", "concurrency", "context_len"]).reset_index(drop=True)


def link_gbps(m: pd.DataFrame) -> float | None:
    """Contiguous pinned H2D bandwidth measured in this run (largest copy)."""
    p = _ok(m[(m["experiment"] == "probe") & (m["strategy"] == "contiguous")])
    if "direction" in p:
        p = p[p["direction"] == "h2d"]
    if p.empty:
        return None
    return float(p.sort_values("bytes")["gbps"].iloc[-1])


def gather_gbps(m: pd.DataFrame, strategy: str = "zero_copy") -> float | None:
    p = _ok(m[(m["experiment"] == "probe") & (m["strategy"] == strategy)])
    return None if p.empty else float(p["gbps"].max())


def _point(d, strategy, conc, ctx, col="tok_s"):
    r = d[(d["strategy"] == strategy) & (d["concurrency"] == conc) & (d["context_len"] == ctx)]
    return None if r.empty else float(r[col].iloc[0])


def targets(m: pd.DataFrame) -> pd.DataFrame:
    """Each target of the foundation issue: measured value, threshold, met or not (None: not measured)."""
    d = decode_table(m)
    rows = []

    def add(name, value, threshold, higher=True, detail=""):
        met = None if value is None or (isinstance(value, float) and math.isnan(value)) else (
            value >= threshold if higher else value <= threshold)
        rows.append({"target": name, "value": value, "threshold": threshold, "met": met, "detail": detail})

    link, zc = link_gbps(m), gather_gbps(m)
    add("zero_copy gather GB/s / contiguous pinned H2D GB/s", zc / link if zc and link else None, 0.90,
        detail=f"{zc:.1f} / {link:.1f} GB/s" if zc and link else "")
    zcd = d[(d["strategy"] == "zero_copy") & (d["concurrency"] == d["concurrency"].min())] if not d.empty else d
    if not zcd.empty:
        c1 = int(zcd["concurrency"].iloc[0])
        big, ref = int(zcd["context_len"].max()), 64 << 10
        s_big, s_ref = _point(d, "zero_copy", c1, big, "step_ms_median"), _point(d, "zero_copy", c1, ref, "step_ms_median")
        add(f"zero_copy step at {big // 1024}K / step at 64K", s_big / s_ref if s_big and s_ref else None, 1.15, higher=False,
            detail=f"{s_big:.2f} / {s_ref:.2f} ms" if s_big and s_ref else "")
        res = d[(d["strategy"] == "resident") & (d["concurrency"] == c1)]
        if not res.empty:
            ctx = int(res["context_len"].max())
            z, r = _point(d, "zero_copy", c1, ctx), _point(d, "resident", c1, ctx)
            add(f"zero_copy tok/s / resident tok/s at {ctx // 1024}K", z / r if z and r else None, 0.75,
                detail=f"{z:.1f} / {r:.1f} tok/s" if z and r else "")
        cmax = int(d["concurrency"].max())
        if cmax > c1:
            z1, zc4 = _point(d, "zero_copy", c1, big), _point(d, "zero_copy", cmax, big)
            add(f"zero_copy aggregate tok/s at concurrency {cmax} / concurrency {c1} ({big // 1024}K)",
                zc4 / z1 if z1 and zc4 else None, 2.5, detail=f"{zc4:.1f} / {z1:.1f} tok/s" if z1 and zc4 else "")
    dd = d.dropna(subset=["nvml_rx_bytes_per_step"]) if "nvml_rx_bytes_per_step" in d else d.iloc[0:0]
    dd = dd[dd["h2d_bytes_per_step"] > 0]
    if not dd.empty:
        ratio = dd["nvml_rx_bytes_per_step"] / dd["h2d_bytes_per_step"]
        worst = float((ratio - 1).abs().max())
        add("max |NVML PCIe RX / engine-counted H2D - 1| over offloaded points", worst, 0.15, higher=False,
            detail=f"ratio {ratio.min():.3f}..{ratio.max():.3f} over {len(dd)} points")
    pf = _ok(m[m["experiment"] == "prefill"])
    for _, r in pf.iterrows():
        rows.append({"target": f"prefill tok/s at {int(r['context_len']) // 1024}K ({r['strategy']})",
                     "value": float(r["tok_s"]), "threshold": None, "met": None, "detail": "seed 000: 3,701 tok/s on 3x RTX 3090"})
    return pd.DataFrame(rows)
