"""The peer's 4x RTX 3090 data: the shipped file agrees with the per-request values it keeps (each figure
recomputed here with its own formula, not labkit.peer's), rebuilding it from the peer's folder layout gives
the same points, and compare() scores predictions against it."""
import fnmatch
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from labkit import peer
from labkit.params import BadInput

ROOT = Path(__file__).resolve().parents[1]
FILE = ROOT / "labkit" / peer.PEER_FILE
ROUND = 0.5e-4 + 1e-9        # values are kept to 4 decimals


@pytest.fixture(scope="module")
def doc():
    return json.loads(FILE.read_text())


@pytest.fixture(scope="module")
def frame():
    return peer.load()


# ---- the file -----------------------------------------------------------------------------------------------------
def test_file_is_small_shipped_and_names_its_source(doc):
    assert FILE.stat().st_size < 50 * 1024
    patterns = __import__("tomllib").loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["labkit"]
    assert any(fnmatch.fnmatch(peer.PEER_FILE, p) for p in patterns), "the peer file is not package data"
    assert doc["repository"] == "alesha-pro/qwen38-flash-next-4x3090"
    assert len(doc["commit"]) == 40 and int(doc["commit"], 16)
    assert doc["licence"]["spdx"] == "Apache-2.0"
    s = doc["setup"]
    assert (s["gpus"], s["tp"], s["ep"], s["weight_bits"], s["power_limit_w"], s["kv_dtype"]) == (4, 4, 4, 4, 220, "fp8_e4m3")
    for p in doc["points"]:                   # every point names a file whose records are kept
        assert p["from"] in doc["requests"] or p["from"] in doc["batches"], p["from"]


def _window(b: dict) -> list[float]:
    """The last-admitted request's gaps up to the first other request's end (plus half a median gap)."""
    last = b["last_admitted"]
    assert b["ttft_s"][last] == max(b["ttft_s"])
    ends = [e for i, e in enumerate(b["e2e_s"]) if i != last]
    end = min(ends) if ends else math.inf
    gaps = b["last_admitted_itl_ms"]
    arrivals = b["ttft_s"][last] + np.cumsum(gaps) / 1e3
    return [g for g, t in zip(gaps, arrivals) if t <= end + np.median(gaps) / 2e3]


def _recompute(doc: dict, p: dict) -> list[float]:
    """A point's values from the raw records the file keeps, each formula written out here."""
    if p["from"] in doc["requests"]:
        rs = doc["requests"][p["from"]]
        return {"decode_tok_s": [(r["completion_tokens"] - 1) / (r["e2e_s"] - r["ttft_s"]) for r in rs],
                "tpot_ms": [r["tpot_ms"] for r in rs],
                "ttft_ms": [1e3 * r["ttft_s"] for r in rs],
                "prefill_tok_s": [r["prompt_tokens"] / r["ttft_s"] for r in rs]}[p["metric"]]
    bs, c = doc["batches"][p["from"]], p["concurrency"]
    if p["metric"] == "aggregate_tok_s":
        return [sum(b["completion_tokens"]) / b["wall_s"] for b in bs]
    if p["metric"] == "ttft_ms":
        return [1e3 * t for b in bs for t in b["ttft_s"]]
    steps = [float(np.mean(_window(b)[1:])) for b in bs if "last_admitted_itl_ms" in b]    # first gap left out
    return steps if p["metric"] == "tpot_ms" else [c * 1e3 / s for s in steps]


def test_every_point_is_recomputed_from_its_raw_values(doc):
    for p in doc["points"]:
        again = _recompute(doc, p)
        assert len(again) == p["n"] == len(p["values"]), (p["run"], p["metric"], p["context_len"])
        assert np.allclose(again, p["values"], rtol=0, atol=ROUND), (p["run"], p["metric"], p["context_len"], again)
        assert p["median"] == pytest.approx(statistics.median(p["values"]), abs=1e-12)
        assert (p["min"], p["max"]) == (min(p["values"]), max(p["values"]))


def test_window_exists_exactly_when_all_requests_decode_at_once(doc):
    """A batch keeps the last-admitted request's gaps (and gives a step time) iff its last prefill ended
    before any other request finished; the window never reaches past that end."""
    for rel, bs in doc["batches"].items():
        for b in bs:
            last = b["ttft_s"].index(max(b["ttft_s"]))
            others = [e for i, e in enumerate(b["e2e_s"]) if i != last]
            overlap = not others or max(b["ttft_s"]) < min(others)
            assert ("last_admitted_itl_ms" in b) == overlap, (rel, b["repeat"])
            if overlap:
                w = _window(b)
                assert 0 < len(w) <= len(b["last_admitted_itl_ms"])
                if others:
                    assert len(w) < len(b["last_admitted_itl_ms"]), "the tail after the first finish is cut"


def test_frame_rows_are_the_file_points(doc, frame):
    assert list(frame.columns) == peer.FRAME_COLUMNS
    assert len(frame) == len(doc["points"])
    for (_, row), p in zip(frame.iterrows(), doc["points"]):
        assert (row["metric"], row["context_len"], row["concurrency"], row["run"]) == \
            (p["metric"], p["context_len"], p["concurrency"], p["run"])
        assert row["median"] == statistics.median(p["values"]) and row["n"] == len(p["values"])
    assert set(frame["metric"]) <= set(peer.METRICS)
    assert not frame[frame["primary"]].duplicated(peer.KEY).any(), "two primary points for one key"
    assert set(frame.loc[frame["kv_dtype"] == "bf16", "run"]) == {"b6-kv"}
    assert (frame["gpus"] == 4).all() and (frame["power_limit_w"] == 220).all()
    assert frame["source"].iloc[0] == f"{doc['repository']}@{doc['commit'][:7]}"


def test_published_figures_and_their_formulas(doc, frame):
    """The peer's README figures come back from the kept raw values: decode and prefill as medians, the
    aggregate only as three repeats' tokens over one repeat's median wall time."""
    pub = doc["published"]
    prim = frame[frame["primary"]].set_index(peer.KEY)
    for ctx, v in pub["decode_tok_s_c1"].items():
        assert round(prim.loc[("decode_tok_s", int(ctx), 1), "median"], 1) == v
    for ctx, v in pub["prefill_tok_s"].items():
        rs = doc["requests"][f"b4-prefill/ttft-{ctx}.jsonl"]
        assert round(rs[0]["prompt_tokens"] / statistics.median(r["ttft_s"] for r in rs)) == v
    for ctx, by_c in pub["aggregate_tok_s"].items():
        for c, v in by_c.items():
            bs = doc["batches"][f"b3-concur/concur-{ctx}-c{c}.jsonl"]
            tokens = sum(sum(b["completion_tokens"]) for b in bs)
            assert round(tokens / statistics.median(b["wall_s"] for b in bs), 1) == v
            # the same tokens per batch throughout: the file's per-batch median is a third of it
            assert 3 * prim.loc[("aggregate_tok_s", int(ctx), int(c)), "median"] == pytest.approx(v, abs=0.05)


# ---- rebuilding from the peer's layout ------------------------------------------------------------------------------
def _peer_folder(doc: dict, root: Path) -> Path:
    """The peer's raw folder as its repository lays it out, written back from the records the file keeps
    (the kept fields only: answers and most gaps are not shipped, and the derivation does not need them)."""
    raw = root / "benchmarks" / "2026-08-28" / "raw"
    for rel, rs in doc["requests"].items():
        (raw / rel).parent.mkdir(parents=True, exist_ok=True)
        ctx = 131072 if rel.startswith("b6") else int(rel.split("-")[-1].split(".")[0])    # measured-131k
        lines = [json.dumps({**r, "depth_target": ctx}) for r in rs]
        (raw / rel).write_text("\n".join(lines) + "\n")
    for rel, bs in doc["batches"].items():
        (raw / rel).parent.mkdir(parents=True, exist_ok=True)
        lines = []
        for b in bs:
            reqs = [{k: b[k][i] for k in peer.BATCH_FIELDS} for i in range(len(b["nonce"]))]
            if "last_admitted_itl_ms" in b:
                reqs[b["last_admitted"]]["itl_ms_all"] = b["last_admitted_itl_ms"]
            lines.append(json.dumps({"repeat": b["repeat"], "wall_s": b["wall_s"], "requests": reqs}))
        (raw / rel).write_text("\n".join(lines) + "\n")
    return raw


def test_rebuild_from_the_peer_folder_gives_the_shipped_points(doc, tmp_path):
    raw = _peer_folder(doc, tmp_path)
    copy = tmp_path / "peer.json"
    copy.write_text(FILE.read_text())
    p = subprocess.run([sys.executable, "-m", "labkit", "peer", "rebuild", str(raw), "--file", str(copy)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    again = json.loads(copy.read_text())
    assert again["points"] == doc["points"]
    assert again["batches"] == doc["batches"]
    assert {k: again[k] for k in ("repository", "commit", "licence", "setup", "published")} == \
        {k: doc[k] for k in ("repository", "commit", "licence", "setup", "published")}


def test_rebuild_refuses_a_folder_that_is_not_the_peers(tmp_path):
    (tmp_path / "b5-decode").mkdir()
    copy = tmp_path / "peer.json"
    copy.write_text(FILE.read_text())
    p = subprocess.run([sys.executable, "-m", "labkit", "peer", "rebuild", str(tmp_path), "--file", str(copy)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert "b3-concur" in p.stderr and "b5-decode" not in p.stderr.split("(no ")[1]
    assert copy.read_text() == FILE.read_text(), "a refused rebuild wrote the file"


def test_show_prints_the_primary_points():
    p = subprocess.run([sys.executable, "-m", "labkit", "peer"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert lines[0].split()[:4] == ["metric", "context_len", "prompt_tokens", "concurrency"]
    assert len(lines) == 1 + int(peer.load()["primary"].sum())


# ---- compare -----------------------------------------------------------------------------------------------------
def _predicted(frame: pd.DataFrame, factors) -> pd.DataFrame:
    prim = frame[frame["primary"]].reset_index(drop=True)
    f = np.resize(np.asarray(factors, dtype=float), len(prim))
    return pd.DataFrame({"context_len": prim["context_len"], "concurrency": prim["concurrency"],
                         "metric": prim["metric"], "predicted": prim["median"] * f, "factor": f})


def test_compare_errors_are_the_factors(frame):
    pred = _predicted(frame, [0.5, 0.9, 1.0, 1.07, 1.3, 2.0])
    out = peer.compare(pred, frame)
    assert len(out) == len(pred) and out["median"].notna().all()
    assert np.allclose(out["error"], out["factor"] - 1, rtol=0, atol=1e-12)
    assert list(out["within"]) == [abs(f - 1) <= 0.15 for f in out["factor"]]
    assert list(peer.compare(pred, frame, tolerance=0.35)["within"]) == [abs(f - 1) <= 0.35 for f in out["factor"]]


def test_compare_tolerance_boundary_both_sides(frame):
    factors = [1.15, 0.85, 1.1501, 0.8499]
    out = peer.compare(_predicted(frame, factors), frame)
    for f in factors:
        rows = out[out["factor"] == f]
        assert rows["within"].all() if abs(f - 1) <= 0.15 + 1e-12 else not rows["within"].any(), f


def test_compare_spread_unmatched_rows_and_named_runs(frame):
    prim = frame[frame["primary"]]
    spread = prim[prim["n"] > 1].iloc[0]
    pred = pd.DataFrame({"context_len": [spread["context_len"]] * 4 + [12345],
                         "concurrency": [spread["concurrency"]] * 4 + [1],
                         "metric": [spread["metric"]] * 4 + ["decode_tok_s"],
                         "predicted": [spread["min"], spread["max"], spread["min"] * 0.999, spread["max"] * 1.001, 60.0]})
    out = peer.compare(pred, frame)
    assert list(out["within_spread"][:4]) == [True, True, False, False]
    assert pd.isna(out.loc[4, "median"]) and pd.isna(out.loc[4, "within"]) and pd.isna(out.loc[4, "error"])
    # the KV A/B: with run and kv_dtype named, the non-primary bf16 arm is matched
    bf16 = frame[(frame["run"] == "b6-kv") & (frame["kv_dtype"] == "bf16") & (frame["metric"] == "tpot_ms")].iloc[0]
    named = pd.DataFrame({"run": ["b6-kv"], "kv_dtype": ["bf16"], "context_len": [bf16["context_len"]],
                          "concurrency": [1], "metric": ["tpot_ms"], "predicted": [bf16["median"] * 1.1]})
    got = peer.compare(named, frame)
    assert got.loc[0, "median"] == bf16["median"] and got.loc[0, "error"] == pytest.approx(0.1)


def test_compare_refuses_bad_input_in_one_line(frame):
    ok = _predicted(frame, [1.0]).head(2)
    with pytest.raises(BadInput, match="lacks column"):
        peer.compare(ok.drop(columns="predicted"), frame)
    with pytest.raises(BadInput, match="unknown metric"):
        peer.compare(ok.assign(metric="tok_s"), frame)
    with pytest.raises(BadInput, match="positive fraction"):
        peer.compare(ok, frame, tolerance=0)
    # without the primary marks a key measured by two runs is ambiguous; a key measured once is not
    every = frame.drop(columns="primary")
    twice = pd.DataFrame({"context_len": [4096], "concurrency": [1], "metric": ["tpot_ms"], "predicted": [15.0]})
    with pytest.raises(BadInput, match="2 points for tpot_ms at 4096"):
        peer.compare(twice, every)
    once = twice.assign(metric="prefill_tok_s", predicted=1800.0)
    assert peer.compare(once, every).loc[0, "run"] == "b4-prefill"
