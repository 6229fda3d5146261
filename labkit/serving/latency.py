"""Serving metrics from per-request records, with vLLM's definitions (`vllm bench serve`):

- TTFT: send -> first streamed token;  E2EL: send -> last streamed token (not the `[DONE]` after it);
- TPOT per request: (E2EL - TTFT) / (output tokens - 1), requests with one output token count 0 for goodput
  and are left out of the TPOT statistics; a request handed over to a decode instance (`prefilled`, its first
  token made by the prefill instance) has no TTFT (None), and its TPOT runs from its decode's start
  (`decode_start_s`) instead;
- ITL: every gap between consecutive streamed chunks, pooled over requests (AIPerf calls TPOT "ITL": here
  ITL is vLLM's, the per-gap one);
- goodput: completed requests per second meeting every SLO given (TTFT and TPOT in ms);
- duration: first send -> last end; throughputs per second of duration.
Statistics of each: mean, median, std, p50/p90/p99, min, max, in milliseconds.
"""
from __future__ import annotations

import numpy as np

from labkit import lazy

pd = lazy.module("pandas")     # needed by goodput_grid alone: a lazy name keeps its import there

PCTS = (50, 90, 99)


def per_request(rec: dict) -> dict:
    """TTFT, TPOT, E2EL (s) and ITLs of one successful record."""
    tt = rec.get("token_times")
    tt = [] if tt is None else list(tt)        # a list, or a numpy array when read back from parquet
    ttft, e2el, n = rec.get("ttft_s"), rec.get("e2el_s"), int(rec.get("output_len") or 0)
    # a request handed over to a decode instance has no TTFT there: its TPOT runs from its decode's start
    start = ttft if ttft is not None else rec.get("decode_start_s") if rec.get("prefilled") else None
    tpot = (e2el - start) / (n - 1) if n > 1 and start is not None else None
    itl = np.diff(tt).tolist() if len(tt) > 1 else []
    return {"ttft_s": ttft, "tpot_s": tpot, "e2el_s": e2el, "itl_s": itl}


def _stats(name: str, values_s) -> dict:
    v = np.asarray([x for x in values_s if x is not None], dtype=float) * 1e3
    out = {}
    if v.size == 0:
        for k in ("mean", "median", "std", "min", "max", *(f"p{p}" for p in PCTS)):
            out[f"{name}_ms_{k}"] = None
        return out
    out.update({f"{name}_ms_mean": float(v.mean()), f"{name}_ms_median": float(np.median(v)),
                f"{name}_ms_std": float(v.std()), f"{name}_ms_min": float(v.min()), f"{name}_ms_max": float(v.max())})
    for p in PCTS:
        out[f"{name}_ms_p{p}"] = float(np.percentile(v, p))
    return out


def summarize(records: list[dict], slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
              slo_e2el_ms: float | None = None) -> dict:
    ok = [r for r in records if r.get("status") == "ok"]
    per = [per_request(r) for r in ok]
    out = {"requests": len(records), "completed": len(ok), "failed": len(records) - len(ok)}
    if records:
        t0 = min(r["send_time"] for r in records)
        t1 = max(r["end_time"] for r in records)
        dur = max(t1 - t0, 1e-9)
    else:
        dur = None
    out["duration_s"] = dur
    in_tok = sum(int(r.get("prompt_tokens") or r.get("input_len") or 0) for r in ok)
    out_tok = sum(int(r.get("output_len") or 0) for r in ok)
    out.update(total_input_tokens=in_tok, total_output_tokens=out_tok)
    out["request_throughput"] = len(ok) / dur if dur else None
    out["output_throughput"] = out_tok / dur if dur else None
    out["total_token_throughput"] = (in_tok + out_tok) / dur if dur else None
    out.update(_stats("ttft", [p["ttft_s"] for p in per]))
    out.update(_stats("tpot", [p["tpot_s"] for p in per]))
    out.update(_stats("itl", [x for p in per for x in p["itl_s"]]))
    out.update(_stats("e2el", [p["e2el_s"] for p in per]))
    slos = {"ttft_s": slo_ttft_ms, "tpot_s": slo_tpot_ms, "e2el_s": slo_e2el_ms}
    if any(v is not None and v > 0 for v in slos.values()) and dur:
        good = sum(all(v is None or v <= 0 or (p[k] or 0.0) * 1e3 <= v for k, v in slos.items()) for p in per)
        out["good_requests"] = good
        out["goodput"] = good / dur
    else:
        out["good_requests"] = out["goodput"] = None
    return out


def goodput_grid(records: list[dict], ttft_slos_ms: list[float], tpot_slos_ms: list[float]) -> "pd.DataFrame":
    """Goodput (requests/s meeting both SLOs) over a grid of TTFT x TPOT SLOs, for choosing an SLO after the fact."""
    rows = []
    for a in ttft_slos_ms:
        for b in tpot_slos_ms:
            s = summarize(records, a, b)
            rows.append({"slo_ttft_ms": a, "slo_tpot_ms": b, "good_requests": s["good_requests"], "goodput": s["goodput"]})
    return pd.DataFrame(rows)
