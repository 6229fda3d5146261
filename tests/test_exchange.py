"""Rows out and rows in (`labkit export`, `labkit import`, `labkit.exchange`): committed runs of the lab exported
as the public 4x RTX 3090 archive's rows (fields, kinds, the labkit command that replans the run, no local
path), in JSONL, SQLite and Markdown; the archive's own rows (a five-row sample copied from it, provenance in
tests/data/archive-4x3090-sample.md) imported as an external run the index lists; and imported points drawn and
tabled beside the lab's own, matched on model, context and concurrency."""
import json
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from labkit.exchange import archive, beside
from labkit.exchange.importer import import_file

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "tests" / "data" / "archive-4x3090-sample.jsonl"
DECODE = REPO / "results" / "20261129-101629-decode-h200"
PREFILL = REPO / "results" / "20261130-071914-prefill-248k-h200"
SERVE = REPO / "results" / "20261129-serve-smollm2-cpu"
SOURCE = "alesha-pro/4x3090-llm-benchmarks@7237614"


def _labkit(*args):
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True, text=True, cwd=REPO, timeout=300)


def _jsonl(*runs) -> list[dict]:
    r = _labkit("export", *map(str, runs), "--format", "jsonl")
    assert r.returncode == 0, r.stderr
    return [json.loads(x) for x in r.stdout.splitlines()]


def test_export_rows_carry_the_archive_fields_and_kinds():
    rows = _jsonl(DECODE, PREFILL, SERVE)
    m = {p: pd.read_parquet(p / "metrics.parquet") for p in (DECODE, PREFILL, SERVE)}
    n_decode = int(((m[DECODE]["experiment"] == "decode") & (m[DECODE]["status"] == "ok")
                    & (m[DECODE]["axis"].isna() | (m[DECODE]["axis"] == "context"))).sum())
    n_serve = int(((m[SERVE]["client"] == "labkit") & (m[SERVE]["status"] == "ok")).sum())
    n_decode_prefill = int(((m[DECODE]["experiment"] == "prefill") & (m[DECODE]["status"] == "ok")).sum())
    assert n_decode_prefill >= 1                                               # the decode run's prefill point
    assert len(rows) == n_decode + n_decode_prefill + 3 + n_serve
    assert len({r["run_id"] for r in rows}) == len(rows)                     # unique, as the archive's index wants
    home = str(Path.home())
    for r in rows:
        assert list(r) == archive.FIELD_NAMES
        assert r["output_tps_kind"] in archive.KINDS and r["schema_version"] == 2
        assert r["launch_cmd"].startswith("labkit run ")
        text = json.dumps(r)
        assert home not in text and str(REPO) not in text and "/root/" not in text, r["run_id"]
        assert isinstance(r["concurrency"], int) and isinstance(r["prompt_tokens"], int)
    dec = [r for r in rows if r["labkit_experiment"] == "decode" and r["concurrency"] == 1]
    assert all(r["output_tps_kind"] == "single_stream_decode" and r["decode_tok_s"] == pytest.approx(r["output_tok_s"], rel=1e-6)
               for r in dec)
    assert {r["output_tps_kind"] for r in rows if r["labkit_experiment"] == "decode" and r["concurrency"] > 1} == {"aggregate_output"}
    pre = [r for r in rows if r["labkit_experiment"] == "prefill" and DECODE.name not in r["source_path"]]
    assert sorted(r["prefill_tok_s"] for r in pre) == pytest.approx(sorted(m[PREFILL]["tok_s"]))
    assert all(r["output_tok_s"] is None and r["gen_tokens"] == 0 for r in pre)
    srv = [r for r in rows if r["labkit_experiment"] == "serve_sweep"]
    one = next(r for r in srv if r["concurrency"] == 1)
    src = m[SERVE][m[SERVE]["point_id"] == one["run_id"].rsplit("/", 1)[1]].iloc[0]
    assert one["output_tps_kind"] == "single_stream_wall" and one["output_tok_s"] == pytest.approx(src["output_throughput"])
    assert one["decode_tok_s"] == pytest.approx(1000 / src["tpot_ms_median"]) and one["engine"] == "vllm"
    assert one["model"] == "smollm2-135m" and one["knobs"]["server_argv"][1] == "${MODEL_ROOT}/smollm2-135m"
    assert all(r["timings"] == "CPU" and "not comparable with GPU rows" in r["notes"] for r in srv)


def test_launch_cmd_replans_the_run():
    """The command, parsed as the CLI parses it, gives back every parameter the run recorded."""
    from labkit.experiments import get
    from labkit.params import kv_pairs, resolve
    for run in (DECODE, PREFILL, SERVE):
        mf = json.loads((run / "manifest.json").read_text())
        cmd = archive.labkit_command(mf)
        words = shlex.split(cmd)
        assert words[:3] == ["labkit", "run", mf["experiment"]]
        pairs = [words[i + 1] for i, w in enumerate(words) if w == "-p"]
        spec = get(mf["experiment"]).spec
        got = resolve(spec, kv_pairs(pairs), mf["experiment"])
        for prm in spec:
            if prm.name in archive.PER_RUN or prm.name not in mf["parameters"] or prm.name.startswith("trace"):
                continue
            want = mf["parameters"][prm.name]
            assert archive._same(got[prm.name], want), (run.name, prm.name, got[prm.name], want)


def test_sqlite_adds_and_replaces_and_markdown_pastes(tmp_path):
    db = tmp_path / "rows.sqlite"
    for runs in ((SERVE,), (SERVE, PREFILL)):
        r = _labkit("export", *map(str, runs), "--format", "sqlite", "--out", str(db))
        assert r.returncode == 0, r.stderr
    con = sqlite3.connect(db)
    cols = {row[1]: row[2] for row in con.execute("PRAGMA table_info(runs)")}
    assert [c for c in cols] == archive.FIELD_NAMES
    assert cols["concurrency"] == "INTEGER" and cols["output_tok_s"] == "REAL" and cols["launch_cmd"] == "TEXT"
    n = con.execute("SELECT count(*) FROM runs").fetchone()[0]
    assert n == len(_jsonl(SERVE, PREFILL))                                 # the serve rows replaced, not doubled
    knobs = json.loads(con.execute("SELECT knobs FROM runs WHERE labkit_experiment='prefill' LIMIT 1").fetchone()[0])
    assert knobs["strategy"] in ("resident", "zero_copy")
    md = _labkit("export", str(SERVE), "--format", "markdown")
    lines = md.stdout.splitlines()
    assert lines[0].startswith("| model | quant | engine") and lines[1].startswith("|---")
    assert "```" in lines and any(ln.startswith("labkit run serve_sweep") for ln in lines) and "/root/" not in md.stdout
    bad = _labkit("export", str(SERVE), "--format", "sqlite")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--out" in bad.stderr


def test_import_the_archives_rows_as_an_external_run(tmp_path):
    root = tmp_path / "results"
    r = _labkit("import", str(SAMPLE), "--source", SOURCE, "--hardware", "4x NVIDIA GeForce RTX 3090", "--root", str(root))
    assert r.returncode == 0, r.stderr
    folder = Path(r.stdout.strip().split(": ", 1)[1])
    mf = json.loads((folder / "manifest.json").read_text())
    assert mf["experiment"] == "external" and mf["status"] == "ok" and mf["external"]["rows"] == 5
    assert mf["external"]["source"] == SOURCE and mf["host"] == "external"
    m = pd.read_parquet(folder / "metrics.parquet")
    depth = m[m["external_run_id"].str.contains("_d32768")].iloc[0]
    assert depth["context_len"] == 32792 and depth["context_limit"] == 131072 and depth["shape"] == "Qwen3.6-27B"
    assert depth["campaign"] == "depth-curves-2026-08-04" and depth["source"] == SOURCE
    kv = m[m["external_run_id"].str.startswith("kvsweep")].iloc[0]
    assert kv["context_len"] == 1024 and kv["output_tps_kind"] == "unknown"          # no prompt length: its depth
    assert "external-" in (root / "index.html").read_text() and (folder / "report.html").is_file()
    ls = _labkit("runs", "--root", str(root))
    assert folder.name in ls.stdout and "external" in ls.stdout
    again = _labkit("import", str(SAMPLE), "--source", SOURCE, "--root", str(root))
    assert again.returncode == 0 and "imported already" in again.stdout
    broken = tmp_path / "broken.jsonl"
    broken.write_text(SAMPLE.read_text().splitlines()[0] + "\n{not json\n")
    bad = _labkit("import", str(broken), "--root", str(root))
    assert bad.returncode == 2 and "broken.jsonl:2: not JSON" in bad.stderr and bad.stderr.count("\n") == 1


def test_a_run_exported_and_imported_matches_itself(tmp_path):
    """The lab's serve run, exported and imported back: every matched field is the same number (ratio 1), and the
    serving figures draw the imported points where the lab's are."""
    rows = tmp_path / "serve.jsonl"
    assert _labkit("export", str(SERVE), "--out", str(rows)).returncode == 0
    import_file(rows, tmp_path / "results", source="round trip")
    ext = beside.external_points(tmp_path / "results")
    t = beside.matched_table(SERVE, ext)
    assert not t.empty and set(t["field"]) >= {"decode_tok_s", "ttft_p50_ms", "output_tok_s"}
    same = t[t["lab_point"] == t["external_row"]]              # each point beside itself (the other round's too)
    assert same["lab_over_external"].tolist() == pytest.approx([1.0] * len(same))
    assert set(same["lab_point"]) == {r["run_id"] for r in map(json.loads, rows.read_text().splitlines())}
    m = pd.read_parquet(SERVE / "metrics.parquet")
    lat, thr = beside.serving_figures(m, ext, beside.lab_models(SERVE), "CPU")
    ext_traces = [tr for tr in lat.data if tr.name and tr.name.startswith("external: round trip")]
    assert ext_traces and "external rows" in lat.layout.title.text
    c1 = m[(m["client"] == "labkit") & (m["concurrency"] == 1) & (m["status"] == "ok")]
    ttft = next(tr for tr in ext_traces if tr.xaxis in (None, "x") and tr.yaxis in (None, "y"))
    assert sorted(ttft.y) == pytest.approx(sorted(c1["ttft_ms_median"]))   # c=1 rows: the lab's own TTFTs
    assert any(tr.name.startswith("external:") for tr in thr.data)


def test_decode_and_prefill_figures_draw_the_archive_beside(tmp_path):
    import_file(SAMPLE, tmp_path, source=SOURCE, hardware="4x NVIDIA GeForce RTX 3090")
    ext = beside.external_points(tmp_path)
    m = pd.read_parquet(DECODE / "metrics.parquet")
    fig = beside.decode_figure(m, ext, {"Qwen3.6-27B"})          # the published checkpoint beside the engine's shape
    tr = [t for t in fig.data if t.name and t.name.startswith("external:")]
    want = pd.read_json(SAMPLE, lines=True)
    want = want[(want["model"] == "Qwen3.6-27B") & (want["concurrency"] == 1)].dropna(subset=["decode_tok_s"])
    assert tr and sorted(v for t in tr for v in t.y) == pytest.approx(sorted(want["decode_tok_s"]))
    assert all(t.xaxis in (None, "x") for t in tr)                            # the concurrency-1 facet only
    assert "llama.cpp gguf-q4_k_m" in " ".join(t.name for t in tr) and SOURCE in tr[0].name
    assert not [t for t in beside.decode_figure(m, ext, beside.lab_models(DECODE)).data
                if t.name and t.name.startswith("external:")]                # no model match: nothing drawn
    pf = beside.prefill_figure(pd.read_parquet(PREFILL / "metrics.parquet"), ext, {"qwen3.6-27b"})
    pts = [v for t in pf.data if t.name.startswith("external:") for v in t.y]
    assert sorted(pts) == pytest.approx(sorted(want["prefill_tok_s"].dropna()))


def test_the_docs_page_lists_every_field_as_the_code_maps_it():
    page = (REPO / "docs" / "share-rows.md").read_text()
    for name, what in archive.FIELDS:
        assert f"| `{name}` | {what.replace('|', '/')} |" in page, name


def test_the_serve_report_draws_imported_rows_beside_the_run(tmp_path):
    """The serve notebook, re-rendered over a copy of a committed run with rows of the same model imported beside it:
    the report has the external section, its traces labelled with their source."""
    import shutil
    run = tmp_path / "serve"
    shutil.copytree(SERVE, run)
    rows = tmp_path / "rows.jsonl"
    assert _labkit("export", str(run), "--out", str(rows)).returncode == 0
    import_file(rows, tmp_path, source="another rig")
    r = _labkit("report", str(run), "--rerun")
    assert r.returncode == 0, r.stderr[-2000:]
    page = (run / "report.html").read_text()
    assert "Beside external rows" in page and "external: another rig" in page
