"""Plotly figures for serving runs (notebooks/serve_sweep.ipynb): latency against concurrency and input
length, throughput, labkit vs vLLM's client, /metrics over time beside NVML, a per-request waterfall,
the host-tier (connector) experiment and trace goodput. Every figure says its timings' label (CPU/GPU)."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))


def _ok(m: pd.DataFrame, client: str = "labkit") -> pd.DataFrame:
    return m[(m["status"] == "ok") & (m["client"] == client)]


def _agg(df: pd.DataFrame, keys: list[str], col: str) -> pd.DataFrame:
    """Median over rounds with min and max (each round's value is itself a median over requests)."""
    g = df.groupby(keys)[col]
    return pd.DataFrame({"med": g.median(), "lo": g.min(), "hi": g.max()}).reset_index()


def latency_grid(m: pd.DataFrame, label: str) -> go.Figure:
    """TTFT / TPOT / ITL / E2EL (median, p90 and p99 dashed) against concurrency, one line per input length."""
    d = _ok(m)
    fig = make_subplots(rows=1, cols=4, subplot_titles=[f"{t} (ms)" for _, t in METRICS], horizontal_spacing=0.06)
    for i, (key, title) in enumerate(METRICS, 1):
        for j, (n, g) in enumerate(d.groupby("input_len")):
            a = _agg(g, ["concurrency"], f"{key}_ms_median")
            color = f"hsl({(j * 97) % 360},60%,45%)"
            fig.add_scatter(x=a["concurrency"], y=a["med"], mode="lines+markers", name=f"input {n}", legendgroup=str(n),
                            showlegend=i == 1, line=dict(color=color),
                            error_y=dict(type="data", symmetric=False, array=a["hi"] - a["med"], arrayminus=a["med"] - a["lo"]),
                            row=1, col=i)
            p99 = _agg(g, ["concurrency"], f"{key}_ms_p99")
            fig.add_scatter(x=p99["concurrency"], y=p99["med"], mode="lines", line=dict(color=color, dash="dot"),
                            name=f"input {n} p99", legendgroup=str(n), showlegend=False, row=1, col=i)
        fig.update_xaxes(title_text="concurrency", type="log", dtick=0.30103, row=1, col=i)
    fig.update_layout(title=f"Latency vs concurrency (median over rounds, bars min-max; dotted p99) - {label}",
                      height=380)
    return fig


def latency_vs_input(m: pd.DataFrame, label: str) -> go.Figure:
    d = _ok(m)
    fig = make_subplots(rows=1, cols=2, subplot_titles=["TTFT median (ms)", "TPOT median (ms)"])
    for c, g in d.groupby("concurrency"):
        for col, key in ((1, "ttft"), (2, "tpot")):
            a = _agg(g, ["input_len"], f"{key}_ms_median")
            fig.add_scatter(x=a["input_len"], y=a["med"], mode="lines+markers", name=f"c={c}", legendgroup=str(c),
                            showlegend=col == 1,
                            error_y=dict(type="data", symmetric=False, array=a["hi"] - a["med"], arrayminus=a["med"] - a["lo"]),
                            row=1, col=col)
    fig.update_xaxes(title_text="input tokens")
    fig.update_layout(title=f"Latency vs input length - {label}", height=360)
    return fig


def throughput(m: pd.DataFrame, label: str) -> go.Figure:
    d = _ok(m)
    fig = make_subplots(rows=1, cols=2, subplot_titles=["output tokens/s", "requests/s"])
    for n, g in d.groupby("input_len"):
        for col, key in ((1, "output_throughput"), (2, "request_throughput")):
            a = _agg(g, ["concurrency"], key)
            fig.add_scatter(x=a["concurrency"], y=a["med"], mode="lines+markers", name=f"input {n}", legendgroup=str(n),
                            showlegend=col == 1, row=1, col=col)
    fig.update_xaxes(title_text="concurrency")
    fig.update_layout(title=f"Throughput - {label}", height=340)
    return fig


def crosscheck_table(m: pd.DataFrame) -> pd.DataFrame:
    """labkit's vs vLLM's client per point: medians over rounds of the per-round median TTFT and TPOT."""
    ok = m[m["status"] == "ok"]
    if "vllm" not in set(ok["client"]):
        return pd.DataFrame()
    g = ok.groupby(["input_len", "concurrency", "client"])[["ttft_ms_median", "tpot_ms_median"]].median().unstack("client")
    out = pd.DataFrame({"ttft_labkit_ms": g[("ttft_ms_median", "labkit")], "ttft_vllm_ms": g[("ttft_ms_median", "vllm")],
                        "tpot_labkit_ms": g[("tpot_ms_median", "labkit")], "tpot_vllm_ms": g[("tpot_ms_median", "vllm")]})
    out["ttft_ratio"] = out["ttft_labkit_ms"] / out["ttft_vllm_ms"]
    out["tpot_ratio"] = out["tpot_labkit_ms"] / out["tpot_vllm_ms"]
    out["rounds"] = ok[ok["client"] == "labkit"].groupby(["input_len", "concurrency"]).size()
    return out.reset_index()


def crosscheck(t: pd.DataFrame, label: str) -> go.Figure:
    fig = make_subplots(rows=1, cols=2, subplot_titles=["median TTFT (ms)", "median TPOT (ms)"])
    x = [f"{a}/{b}" for a, b in zip(t["input_len"], t["concurrency"])]
    for col, key in ((1, "ttft"), (2, "tpot")):
        fig.add_bar(x=x, y=t[f"{key}_labkit_ms"], name="labkit client", legendgroup="l", showlegend=col == 1,
                    marker_color="#1f77b4", row=1, col=col)
        fig.add_bar(x=x, y=t[f"{key}_vllm_ms"], name="vllm bench serve", legendgroup="v", showlegend=col == 1,
                    marker_color="#ff7f0e", row=1, col=col)
    fig.update_xaxes(title_text="input tokens / concurrency")
    fig.update_layout(title=f"Same server, same load: labkit's client vs vLLM's - {label}", barmode="group", height=360)
    return fig


def server_timeline(tel: pd.DataFrame, label: str) -> go.Figure:
    """KV cache usage, running/waiting requests and (where present) connector bytes and NVML PCIe, one time axis."""
    v = tel[tel.get("source", pd.Series(dtype=str)) == "vllm"].copy() if "source" in tel else pd.DataFrame()
    nv = tel[tel["source"] == "nvml"].copy() if "source" in tel else pd.DataFrame()
    rows = 3 + (1 if not nv.empty else 0)
    titles = ["KV cache usage (%)", "requests running / waiting", "connector MB saved / loaded (cumulative)"]
    if not nv.empty:
        titles.append("GPU PCIe RX GB/s (NVML)")
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, subplot_titles=titles, vertical_spacing=0.06)
    if v.empty:
        return fig
    t0 = min(v["timestamp"].min(), nv["timestamp"].min() if not nv.empty else v["timestamp"].min())
    v["t"] = v["timestamp"] - t0
    for strat, g in v.groupby("strategy") if "strategy" in v else [("", v)]:
        if "kv_cache_usage_perc" in g:
            fig.add_scatter(x=g["t"], y=100 * g["kv_cache_usage_perc"], name=f"KV usage {strat}", row=1, col=1)
        for k in ("num_requests_running", "num_requests_waiting"):
            if k in g:
                fig.add_scatter(x=g["t"], y=g[k], name=f"{k.split('_')[-1]} {strat}", line_shape="hv", row=2, col=1)
        for k in ("connector_bytes_saved", "connector_bytes_loaded"):
            if k in g and g[k].notna().any():
                fig.add_scatter(x=g["t"], y=g[k] / 1e6, name=f"{k.split('_')[-1]} {strat}", row=3, col=1)
    if not nv.empty:
        nv["t"] = nv["timestamp"] - t0
        for gpu, g in nv.groupby("gpu"):
            fig.add_scatter(x=g["t"], y=g["pcie_rx_gbps"], name=f"GPU{gpu} RX", row=4, col=1)
    fig.update_xaxes(title_text="seconds since the first sample", row=rows, col=1)
    fig.update_layout(title=f"Server /metrics over time - {label}", height=220 * rows)
    return fig


def waterfall(req: pd.DataFrame, point_id: str, label: str) -> go.Figure:
    """One bar per request: queued/prefill (send -> first token) and decode (first token -> end), token ticks."""
    d = req[req["point_id"] == point_id].sort_values("send_time")
    t0 = d["send_time"].min()
    fig = go.Figure()
    y = [f"#{i}" for i in d["index"]]
    fig.add_bar(y=y, x=d["first_token_time"].fillna(d["end_time"]) - d["send_time"], base=d["send_time"] - t0,
                orientation="h", name="send -> first token (TTFT)", marker_color="#d62728")
    fig.add_bar(y=y, x=d["end_time"] - d["first_token_time"].fillna(d["end_time"]), base=d["first_token_time"].fillna(d["end_time"]) - t0,
                orientation="h", name="first token -> last (decode)", marker_color="#2ca02c")
    xs, ys = [], []
    for yy, (_, r) in zip(y, d.iterrows()):
        for tt in list(r["token_times"])[1:]:
            xs.append(r["send_time"] - t0 + tt)
            ys.append(yy)
    fig.add_scatter(x=xs, y=ys, mode="markers", marker=dict(symbol="line-ns-open", size=8, color="black"), name="tokens")
    fig.update_layout(title=f"Per-request waterfall, {point_id} - {label}", barmode="overlay", xaxis_title="seconds",
                      height=max(300, 26 * len(d) + 120), yaxis=dict(autorange="reversed"))
    return fig


def host_hit(m: pd.DataFrame, label: str) -> go.Figure:
    """Repeat workload: TTFT of first sends vs repeats, with and without the host tier."""
    d = m[(m["status"] == "ok") & m["send"].notna()]
    fig = make_subplots(rows=1, cols=2, subplot_titles=["TTFT median (ms)", "MB per request (connector)"])
    for (strat, send), g in d.groupby(["strategy", "send"]):
        a = _agg(g, ["input_len"], "ttft_ms_median")
        fig.add_scatter(x=a["input_len"], y=a["med"], mode="lines+markers", name=f"{strat}, {send}",
                        error_y=dict(type="data", symmetric=False, array=a["hi"] - a["med"], arrayminus=a["med"] - a["lo"]),
                        row=1, col=1)
    for k in ("bytes_saved_per_request", "bytes_loaded_per_request"):
        if k in d:
            g = d[d[k].notna() & (d["offload_gib"] > 0)]
            for send, gg in g.groupby("send"):
                fig.add_bar(x=gg["input_len"].astype(str), y=gg[k] / 1e6, name=f"{k.split('_')[1]} ({send})", row=1, col=2)
    fig.update_xaxes(title_text="prompt tokens")
    fig.update_layout(title=f"Host KV tier: a repeated prompt after its device blocks were evicted - {label}", height=380)
    return fig


def trace_goodput(m: pd.DataFrame, label: str) -> go.Figure:
    d = _ok(m)
    fig = make_subplots(rows=1, cols=2, subplot_titles=["requests/s", "TTFT / TPOT median (ms)"])
    fig.add_scatter(x=d["trace_rate"], y=d["request_throughput"], mode="lines+markers", name="throughput", row=1, col=1)
    if d["goodput"].notna().any():
        fig.add_scatter(x=d["trace_rate"], y=d["goodput"], mode="lines+markers", name="goodput (SLO met)", row=1, col=1)
    fig.add_scatter(x=d["trace_rate"], y=d["ttft_ms_median"], mode="lines+markers", name="TTFT", row=1, col=2)
    fig.add_scatter(x=d["trace_rate"], y=d["tpot_ms_median"], mode="lines+markers", name="TPOT", row=1, col=2)
    fig.update_xaxes(title_text="trace rate multiplier")
    fig.update_layout(title=f"Trace replay - {label}", height=340)
    return fig
