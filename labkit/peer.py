"""A peer's published measurements of the reference model on 4x RTX 3090, and predictions checked against them.

`load()` reads `labkit/data/peer/qwen38-flash-next-4x3090-2026-08-28.json` into a tidy frame, one row per
measured point: source, model, gpu, gpus, tp, ep, weight_bits, kv_dtype, power_limit_w, run, metric,
context_len (the peer's target depth), prompt_tokens (the input it actually served), concurrency, median, min,
max, n, primary. `compare(predicted, peer)` matches predicted rows to those points.

Metrics (docs/peer-data.md gives the derivation in full):
- decode_tok_s: one request's (completion_tokens - 1) / (e2e_s - ttft_s), the peer's own `decode_tok_s`;
- tpot_ms: at c = 1 the peer's `tpot_ms` (mean gap between streamed chunks after the first); at c > 1 the
  same mean for the last-admitted request while all c requests were decoding (the decode step at batch c);
- decode_aggregate_tok_s: c x 1000 / that step time (tokens per second while all c decode together);
- aggregate_tok_s: a batch's generated tokens / its wall time (prefill of every request included);
- prefill_tok_s: prompt_tokens / ttft_s of a single request;
- ttft_ms: time to the first streamed token.

Several runs measure the same key (decode at 4K c = 1 in the decode and the concurrency runs, the KV A/B at
128K): `primary` marks the one point per (metric, context_len, concurrency) that a comparison uses by default.

The file is built from the peer's raw JSONL by `derive()` (`labkit peer rebuild RAW_DIR`); it keeps
the per-request values every point comes from, so each figure can be re-checked without the peer's files.
"""
from __future__ import annotations

import json
import os
import re
import statistics
import sys
from importlib import resources
from pathlib import Path

import pandas as pd

from .atomic import write_text_or_in_place
from .params import BadInput

PEER_FILE = "data/peer/qwen38-flash-next-4x3090-2026-08-28.json"
METRICS = ("decode_tok_s", "tpot_ms", "decode_aggregate_tok_s", "aggregate_tok_s", "prefill_tok_s", "ttft_ms")
KEY = ["metric", "context_len", "concurrency"]
FRAME_COLUMNS = ["source", "model", "gpu", "gpus", "tp", "ep", "weight_bits", "kv_dtype", "power_limit_w", "run",
                 "metric", "context_len", "prompt_tokens", "concurrency", "median", "min", "max", "n", "primary"]
TOLERANCE = 0.15
DECIMALS = 4            # derived values kept to 0.1 ms / 0.0001 tok/s: finer than any clock in the peer's records
# a predicted value exactly at the tolerance is inside it: the division that gives the error can land a few
# ulps above a factor like 1.15
_ULP_SLACK = 1e-9


# ---- the derivation: the peer's raw JSONL -> per-request values -> points -------------------------------------
def _median_min_max(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _point(run: str, metric: str, ctx: int, c: int, kv: str, primary: bool, source: str, values: list[float],
           prompt_tokens: int) -> dict:
    """`values` in the order of the source's requests (or batches, or requests batch by batch), rounded to
    what the peer's clocks resolve; the median, min and max are of the rounded values, so the file agrees
    with itself exactly."""
    values = [round(v, DECIMALS) for v in values]
    return {"run": run, "metric": metric, "context_len": ctx, "concurrency": c, "kv_dtype": kv,
            "prompt_tokens": prompt_tokens, "primary": primary, "from": source, "values": values,
            **_median_min_max(values)}


def _request_record(r: dict) -> dict:
    keep = ("nonce", "prompt_tokens", "completion_tokens", "finish_reason", "ttft_s", "e2e_s", "tpot_ms",
            "decode_tok_s")
    out = {k: r[k] for k in keep if k in r}
    if "itl_ms_all" in r:
        out["n_itl"] = len(r["itl_ms_all"])      # fewer than completion_tokens - 1: tokens that came bunched
    return out


def decode_tok_s(r: dict) -> float:
    """Tokens after the first over the time after the first, as the peer's own `decode_tok_s`."""
    return (r["completion_tokens"] - 1) / (r["e2e_s"] - r["ttft_s"])


def decode_window(batch: dict) -> list[float] | None:
    """The gaps (ms) of the last-admitted request while every request of the batch was decoding, or None when
    the batch never had all of them decoding at once (an earlier one finished before the last one's prefill).

    Requests of a batch advance in lockstep (one token each per engine step), so the last-admitted request's
    gaps from its first token until the first other request ends are the steps of the full batch. A gap
    belongs to the window when its token arrived no later than that end plus half a step (the end is rounded
    to a millisecond in the peer's record)."""
    reqs = batch["requests"]
    last = max(reqs, key=lambda r: r["ttft_s"])
    itl = batch.get("last_admitted_itl_ms") or last.get("itl_ms_all")
    if not itl:
        return None
    others = [r["e2e_s"] for r in reqs if r is not last]
    end = min(others) if others else float("inf")
    if last["ttft_s"] >= end:
        return None
    slack = statistics.median(itl) / 2e3
    t, window = last["ttft_s"], []
    for gap in itl:
        t += gap / 1e3
        if t > end + slack:
            break
        window.append(gap)
    return window or None


RAW_FOLDERS = ("b3-concur", "b4-prefill", "b5-decode", "b6-bf16", "b6-fp8")
BATCH_FIELDS = ("nonce", "prompt_tokens", "completion_tokens", "ttft_s", "e2e_s")
_FILE = re.compile(r"(?P<kind>full|ttft|concur)-(?P<ctx>\d+)(?:-c(?P<c>\d+))?\.jsonl$")


def _read_jsonl(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as ex:
        raise BadInput(f"{path}: not JSON lines ({ex})") from None


def derive(raw_dir: str | Path, kv_dtype: str = "fp8_e4m3") -> dict:
    """Per-request records, batches and points from the peer's `benchmarks/<date>/raw` folder."""
    raw = Path(raw_dir)
    absent = [d for d in RAW_FOLDERS if not (raw / d).is_dir()]
    if absent:
        raise BadInput(f"{raw}: not the peer's raw folder (no {', '.join(absent)} in it; give benchmarks/<date>/raw)")
    try:
        return _derive(raw, kv_dtype)
    except KeyError as ex:
        raise BadInput(f"{raw}: a record lacks the field {ex}") from None


def _derive(raw: Path, kv_dtype: str) -> dict:
    requests, batches, points = {}, {}, []

    def single(rel: str, run: str, ctx: int, kv: str, metrics: dict[str, bool]) -> None:
        rs = _read_jsonl(raw / rel)
        requests[rel] = [_request_record(r) for r in rs]
        prompt = int(statistics.median(r["prompt_tokens"] for r in rs))
        per = {"decode_tok_s": [decode_tok_s(r) for r in rs], "tpot_ms": [r["tpot_ms"] for r in rs],
               "ttft_ms": [r["ttft_s"] * 1e3 for r in rs],
               "prefill_tok_s": [r["prompt_tokens"] / r["ttft_s"] for r in rs]}
        for metric, primary in metrics.items():
            points.append(_point(run, metric, ctx, 1, kv, primary, rel, per[metric], prompt))

    for p in sorted((raw / "b5-decode").glob("full-*.jsonl"), key=lambda p: int(_FILE.search(p.name)["ctx"])):
        single(f"b5-decode/{p.name}", "b5-decode", int(_FILE.search(p.name)["ctx"]), kv_dtype,
               {"decode_tok_s": True, "tpot_ms": True})
    for p in sorted((raw / "b4-prefill").glob("*.jsonl"), key=lambda p: (p.name[0], int(_FILE.search(p.name)["ctx"]))):
        m = _FILE.search(p.name)
        if m["kind"] == "ttft":      # the prefill arm: 16 tokens generated, three requests
            single(f"b4-prefill/{p.name}", "b4-prefill", int(m["ctx"]), kv_dtype,
                   {"prefill_tok_s": True, "ttft_ms": True})
        else:                        # one request of up to 256 tokens: decode at depths the decode arm skipped
            single(f"b4-prefill/{p.name}", "b4-prefill-full", int(m["ctx"]), kv_dtype,
                   {"decode_tok_s": True, "tpot_ms": True})
    for arm, kv in (("b6-bf16", "bf16"), ("b6-fp8", "fp8_e4m3")):
        for p in sorted((raw / arm).glob("measured-*.jsonl")):
            ctx = int(_read_jsonl(p)[0]["depth_target"])
            single(f"{arm}/{p.name}", "b6-kv", ctx, kv, {"decode_tok_s": False, "tpot_ms": False, "ttft_ms": False})

    concur = [(p, _FILE.search(p.name)) for p in (raw / "b3-concur").glob("concur-*.jsonl")]
    for p, m in sorted(concur, key=lambda pm: (int(pm[1]["ctx"]), int(pm[1]["c"]))):
        rel, ctx, c = f"b3-concur/{p.name}", int(m["ctx"]), int(m["c"])
        kept, agg, step, ttft = [], [], [], []
        for b in _read_jsonl(p):
            reqs = b["requests"]
            last = max(range(len(reqs)), key=lambda i: reqs[i]["ttft_s"])
            window = decode_window(b)
            # columns, one entry per request in the peer's order: a batch of 8 stays one readable line
            kept.append({"repeat": b["repeat"], "wall_s": b["wall_s"],
                         **{k: [r[k] for r in reqs] for k in BATCH_FIELDS},
                         "last_admitted": last, **({"last_admitted_itl_ms": reqs[last]["itl_ms_all"]} if window else {})})
            agg.append(sum(r["completion_tokens"] for r in reqs) / b["wall_s"])
            ttft += [r["ttft_s"] * 1e3 for r in reqs]
            if window and len(window) > 1:
                # without the first gap, as the peer's tpot_ms: after a long prefill the first tokens reach the
                # client bunched (gaps of a fraction of a step)
                step.append(sum(window[1:]) / len(window[1:]))
        batches[rel] = kept
        prompt = int(statistics.median(t for b in kept for t in b["prompt_tokens"]))
        points.append(_point("b3-concur", "aggregate_tok_s", ctx, c, kv_dtype, True, rel, agg, prompt))
        if step:
            points.append(_point("b3-concur", "tpot_ms", ctx, c, kv_dtype, c > 1, rel, step, prompt))
            points.append(_point("b3-concur", "decode_aggregate_tok_s", ctx, c, kv_dtype, True, rel,
                                 [c * 1e3 / s for s in step], prompt))
        if c > 1:        # at c = 1 the prefill arm measures the same thing
            points.append(_point("b3-concur", "ttft_ms", ctx, c, kv_dtype, True, rel, ttft, prompt))
    return {"requests": requests, "batches": batches, "points": points}


def _dump(doc: dict) -> str:
    # one line per point, request and batch: small enough to ship, still readable in a diff
    def block(items, indent):
        return "[\n" + ",\n".join(" " * indent + json.dumps(x, separators=(",", ":")) for x in items) + "\n" + \
            " " * (indent - 1) + "]"
    head = {k: v for k, v in doc.items() if k not in ("points", "requests", "batches")}
    parts = [json.dumps(head, indent=1)[:-2]]
    parts.append(',\n "points": ' + block(doc["points"], 2))
    for name in ("requests", "batches"):
        inner = ",\n".join(f'  {json.dumps(k)}: ' + block(v, 3) for k, v in doc[name].items())
        parts.append(f',\n "{name}": {{\n{inner}\n }}')
    return "".join(parts) + "\n}\n"


def rebuild(raw_dir: str | Path, path: str | Path) -> Path:
    """Re-derive the points and raw values of the file at `path` from the peer's raw folder; its header
    (source, licence, setup, published figures) is kept as written."""
    path = Path(path)
    doc = json.loads(path.read_text())
    doc.update(derive(raw_dir, kv_dtype=doc["setup"]["kv_dtype"]))
    write_text_or_in_place(path, _dump(doc))
    return path


# ---- reading and comparing --------------------------------------------------------------------------------------
def read(path: str | Path | None = None) -> dict:
    """The peer file as written (header, points, per-request values)."""
    if path is None:
        return json.loads(resources.files("labkit").joinpath(PEER_FILE).read_text())
    return json.loads(Path(path).read_text())


def load(path: str | Path | None = None) -> pd.DataFrame:
    """The peer's points as a tidy frame (columns `FRAME_COLUMNS`), the shipped file unless `path` is given."""
    doc = read(path)
    s = doc["setup"]
    source = f"{doc['repository']}@{doc['commit'][:7]}"
    rows = [{"source": source, "model": doc["model"], "gpu": s["gpu"], "gpus": s["gpus"], "tp": s["tp"],
             "ep": s["ep"], "weight_bits": s["weight_bits"], "kv_dtype": p["kv_dtype"],
             "power_limit_w": s["power_limit_w"], **{k: p[k] for k in FRAME_COLUMNS[9:]}} for p in doc["points"]]
    return pd.DataFrame(rows, columns=FRAME_COLUMNS)


def compare(predicted: pd.DataFrame, peer: pd.DataFrame, tolerance: float = TOLERANCE) -> pd.DataFrame:
    """Each predicted row (context_len, concurrency, metric, predicted) beside the peer's point: its median,
    min, max and n, error = predicted / median - 1, `within` (|error| <= tolerance) and `within_spread`
    (the prediction lies inside the peer's min-max over requests). A row the peer did not measure keeps NaN
    and <NA>. Matching uses the peer's primary points unless the predicted frame names a `run`; a
    `kv_dtype` column in it is matched too."""
    need = {"context_len", "concurrency", "metric", "predicted"}
    missing = need - set(predicted.columns)
    if missing:
        raise BadInput(f"predicted frame lacks column(s) {', '.join(sorted(missing))} (needs {', '.join(sorted(need))})")
    if not tolerance > 0:
        raise BadInput(f"tolerance must be a positive fraction (0.15 = 15%), not {tolerance!r}")
    unknown = sorted(set(predicted["metric"]) - set(METRICS))
    if unknown:
        raise BadInput(f"unknown metric(s) {', '.join(map(str, unknown))}: the peer has {', '.join(METRICS)}")
    keys = KEY + [k for k in ("run", "kv_dtype") if k in predicted.columns]
    rows = peer if "run" in predicted.columns or "primary" not in peer.columns else peer[peer["primary"]]
    try:
        pred = predicted.astype({"context_len": "int64", "concurrency": "int64"})
    except (TypeError, ValueError):
        raise BadInput("predicted context_len and concurrency must be whole numbers (no blanks)") from None
    wanted = rows.merge(pred[keys].drop_duplicates(), on=keys)       # only the points asked for
    dup = wanted[wanted.duplicated(keys, keep=False)]
    if not dup.empty:
        first = dup.iloc[0]
        raise BadInput(f"the peer has {len(dup)} points for {first['metric']} at {first['context_len']} "
                       f"c={first['concurrency']}: give the predicted frame a run column (or keep the peer's primary)")
    cols = keys + [c for c in ("run", "kv_dtype", "prompt_tokens") if c not in keys] + ["median", "min", "max", "n"]
    out = pred.merge(wanted[cols], on=keys, how="left", validate="many_to_one")
    out["error"] = out["predicted"] / out["median"] - 1
    matched = out["median"].notna()
    out["within"] = pd.array([bool(abs(e) <= tolerance + _ULP_SLACK) if m else pd.NA
                              for e, m in zip(out["error"], matched)], dtype="boolean")
    out["within_spread"] = pd.array([bool(lo <= p <= hi) if m else pd.NA
                                     for p, lo, hi, m in zip(out["predicted"], out["min"], out["max"], matched)],
                                    dtype="boolean")
    return out


def headline(peer: pd.DataFrame | None = None) -> pd.DataFrame:
    """The primary points, one row per metric, context and concurrency: the table docs/peer-data.md shows."""
    peer = load() if peer is None else peer
    cols = ["metric", "context_len", "prompt_tokens", "concurrency", "median", "min", "max", "n", "run"]
    return peer[peer["primary"]][cols].sort_values(KEY).reset_index(drop=True)


def cmd(what: str = "show", raw_dir: str | None = None, file: str | None = None) -> int:
    """`labkit peer [show]`: the primary points; `labkit peer rebuild RAW_DIR [--file F]`: the shipped file
    re-derived from the peer's raw folder. BadInput (one line) for a folder or file that is not the peer's."""
    if what == "rebuild":
        target = Path(file) if file else Path(str(resources.files("labkit").joinpath(PEER_FILE)))
        if not target.is_file():
            raise BadInput(f"{target}: no peer file to rebuild (its header is kept, so it must exist)")
        print(rebuild(raw_dir, target))
        return 0
    try:
        with pd.option_context("display.width", 160, "display.max_rows", 200):
            print(headline().to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        sys.stdout.flush()      # inside the try: a closed pipe is caught below
    except BrokenPipeError:     # `show | head`: the reader took what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
