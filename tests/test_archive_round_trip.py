"""The archive's every field, and the round trip: `labkit export` fills each of the public archive's 57 fields a lab
run can know (quantization, weights, launch argv, parallelism, samples; on GPU rows the driver, clocks, power limit
and hottest reading NVML gave; the busy flag; a decode run's prefill points), `labkit import` takes JSONL and its
own SQLite, and export -> import -> export writes the same rows. A server measured as a target records its
version, the `kv_cache_dtype` it publishes and the launch command the user passes (against `labkit serve`, a real
server on 127.0.0.1; vLLM's `cache_config_info` parsed from its text, as labkit serve does not publish it)."""
import json
import shlex
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pandas as pd
import pytest

from labkit.exchange import archive
from labkit.serving.target import cache_config

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "tests" / "data" / "archive-4x3090-sample.jsonl"
GPU = REPO / "results" / "20261206-042517-reference-w4a16-h100"        # decode + prefill points, NVML telemetry
SERVE = REPO / "results" / "20261129-serve-smollm2-cpu"               # vLLM launched by labkit (CPU)
ENV = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _labkit(*args, timeout=300):
    import os
    return subprocess.run([sys.executable, "-m", "labkit", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout, env={**os.environ, **ENV})


def _rows(*runs) -> list[dict]:
    r = _labkit("export", *runs, "--format", "jsonl")
    assert r.returncode == 0, r.stderr
    return [json.loads(x) for x in r.stdout.splitlines()]


def test_a_row_has_every_field_of_the_archive_in_its_order():
    sample = [json.loads(x) for x in SAMPLE.read_text().splitlines()]
    theirs = list(sample[0])
    assert len(theirs) == 57 and all(list(r) == theirs for r in sample)
    ours = [f for f in archive.FIELD_NAMES if f in theirs]
    assert ours == theirs                                                # all 57, in the archive's order
    assert all(f.startswith("labkit_") or f in ("hardware", "timings") for f in archive.FIELD_NAMES if f not in theirs)


def test_gpu_rows_carry_what_nvml_and_the_manifest_recorded():
    rows = _rows(GPU)
    mf = json.loads((GPU / "manifest.json").read_text())
    m = pd.read_parquet(GPU / "metrics.parquet")
    dev = mf["gpus"]["devices"][0]
    pre = [r for r in rows if r["labkit_experiment"] == "prefill"]
    assert len(pre) == int(((m["experiment"] == "prefill") & (m["status"] == "ok")).sum()) == 2
    assert sorted(r["prefill_tok_s"] for r in pre) == pytest.approx(sorted(m.loc[m["experiment"] == "prefill", "tok_s"]))
    for r in rows:
        assert r["power_limit_w"] == dev["power_limit_w"] and r["labkit_driver"] == mf["driver"]
        assert 0 < r["max_temp_c"] <= dev["observed"]["temp_c"]["max"]
        assert r["labkit_sm_clock_mhz"] > 0 and r["labkit_mem_clock_mhz"] > 0
        assert (r["quant"], r["quant_method"], r["weight_bits"], r["activation_bits"]) == ("w4a16", "w4a16", 4, 16)
        assert r["group_size"] == 128 and r["symmetric"] is False and "zero" in r["quant_recipe"]
        assert r["quant_raw"] == "w4a16" and r["model_variant"].startswith(mf["parameters"]["shape"])
        assert (r["dp"], r["instances"], r["engine_raw"]) == (1, 1, "labkit")
        assert r["launch_argv"] == shlex.split(r["launch_cmd"]) and r["source_path"] == f"results/{GPU.name}"
        assert r["labkit_busy"] == "" and r["samples"]["repeats"] >= 1
    dec = [r for r in rows if r["labkit_experiment"] == "decode"]
    assert dec and all(r["avg_power_w"] and r["vram_peak_mib"] for r in dec)        # over each point's own window


def test_a_launched_servers_rows_carry_its_argv_and_checkpoint():
    rows = _rows(SERVE)
    mf = json.loads((SERVE / "manifest.json").read_text())
    argv = shlex.split(mf["servers"][0]["command"])
    for r in rows:
        assert r["launch_argv"][0] == "${ENGINE_ROOT}/python" and r["launch_argv"][1:4] == argv[1:4]
        assert len(r["launch_argv"]) == len(argv) and "${MODEL_ROOT}/smollm2-135m" in r["launch_argv"]
        assert r["weight_path"] == "${MODEL_ROOT}/smollm2-135m" and r["weight_format"] == "safetensors"
        assert (r["quant"], r["quant_raw"], r["quant_method"], r["activation_bits"]) == ("bf16", "bfloat16", "none", 16)
        assert (r["engine_raw"], r["dp"], r["instances"], r["model_variant"]) == ("vllm", 1, 1, "smollm2-135m")
        assert r["samples"]["completed"] >= 1 and r["labkit_driver"] is None and r["max_temp_c"] is None  # CPU run
    # what a lab row cannot know stays empty, and only that
    gpu = _rows(GPU)
    never = [f for f in archive.FIELD_NAMES if all(r[f] in (None, "") for r in rows + gpu)]
    assert set(never) <= {"quality", "curve", "spec_decode", "labkit_busy"}, never


def test_the_busy_flag_comes_from_the_runs_own_rule(tmp_path):
    run = tmp_path / "serve"
    shutil.copytree(SERVE, run)
    mf = json.loads((run / "manifest.json").read_text())
    mf["machine_load_before"] = {"load_avg": [9.0, 9.0, 9.0], "cpu_count": 2,
                                 "busy_processes": [{"name": "other", "pid": 1, "cpu_percent": 180.0}]}
    (run / "manifest.json").write_text(json.dumps(mf))
    rows = _rows(run)
    assert all("other processes used 1.8 of" in r["labkit_busy"] and "busy machine:" in r["notes"] for r in rows)
    assert "the point's slowest step took more than 3x" in archive.busy({}, {"step_ms_min": 1.0, "step_ms_max": 5.0})
    assert archive.busy({}, {"step_ms_min": 1.0, "step_ms_max": 2.0}) == ""


def test_export_import_export_gives_the_same_rows(tmp_path):
    """JSONL and SQLite both: the imported run, exported again, is byte for byte the first export."""
    first = tmp_path / "rows.jsonl"
    db = tmp_path / "rows.sqlite"
    assert _labkit("export", GPU, SERVE, "--out", first).returncode == 0
    assert _labkit("export", GPU, SERVE, "--format", "sqlite", "--out", db).returncode == 0
    root = tmp_path / "results"
    for f in (first, db):
        r = _labkit("import", f, "--root", root)
        assert r.returncode == 0, r.stderr
        folder = Path(r.stdout.strip().split(": ", 1)[1])
        again = _labkit("export", folder, "--format", "jsonl")
        assert again.returncode == 0, again.stderr
        assert again.stdout == first.read_text(), f.name
        db2 = tmp_path / f"again-{f.suffix[1:]}.sqlite"
        assert _labkit("export", folder, "--format", "sqlite", "--out", db2).returncode == 0
        con1, con2 = sqlite3.connect(db), sqlite3.connect(db2)
        assert con1.execute("SELECT * FROM runs").fetchall() == con2.execute("SELECT * FROM runs").fetchall()
    m = pd.read_parquet(folder / "metrics.parquet")
    assert len(m) == len(first.read_text().splitlines()) and (m["source"] == "rows").all()


def test_the_archives_own_sqlite_reads_as_its_jsonl(tmp_path):
    """The archive publishes the same rows in SQLite (a `runs` table, its column types): read back, each row is
    the JSONL's (flags as booleans, nested fields parsed)."""
    from labkit.exchange.export import to_sqlite
    from labkit.exchange.importer import read_rows
    sample = [json.loads(x) for x in SAMPLE.read_text().splitlines()]
    db = to_sqlite([{f: r.get(f) for f in archive.FIELD_NAMES} for r in sample], tmp_path / "archive.sqlite")
    got, skipped = read_rows(db)
    assert skipped == 0 and len(got) == len(sample)
    for g, want in zip(got, sample):
        assert {k: g[k] for k in want} == want


def test_a_bad_sqlite_file_is_one_line(tmp_path):
    other = tmp_path / "other.sqlite"
    con = sqlite3.connect(other)
    con.execute("CREATE TABLE results (x)")
    con.commit()
    con.close()
    broken = tmp_path / "broken.sqlite"
    broken.write_bytes(b"SQLite format 3\x00" + b"\xff" * 200)
    for f, words in ((other, "without a `runs` table (tables: results)"), (broken, "not a readable SQLite file")):
        r = _labkit("import", f, "--root", tmp_path / "results")
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and words in lines[0], r.stderr
    assert not list((tmp_path / "results").glob("external-*")) if (tmp_path / "results").exists() else True


def test_an_earlier_table_gains_the_new_columns(tmp_path):
    db = tmp_path / "old.sqlite"
    con = sqlite3.connect(db)
    con.execute('CREATE TABLE runs (run_id TEXT, model TEXT, output_tok_s REAL, launch_cmd TEXT)')
    con.execute("CREATE UNIQUE INDEX runs_run_id_uq ON runs(run_id)")
    con.commit()
    con.close()
    assert _labkit("export", SERVE, "--format", "sqlite", "--out", db).returncode == 0
    cols = [r[1] for r in sqlite3.connect(db).execute("PRAGMA table_info(runs)")]
    assert set(cols) == set(archive.FIELD_NAMES)


def test_a_targets_version_kv_dtype_and_launch_command_are_its_rows():
    text = ('# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="16",cache_dtype="fp8_e4m3"} 1.0\n'
            '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="q"} 0.0\n')
    assert cache_config(text) == {"block_size": "16", "cache_dtype": "fp8_e4m3"}
    assert cache_config("not prometheus {") is None and cache_config("# TYPE x gauge\nx 1\n") is None
    mf = {"run_id": "r", "served_model": "q", "target": {
        "url": "http://127.0.0.1:8000", "local": True, "engine": "vllm", "engine_version": None,
        "version": {"version": "0.11.0"}, "cache_config": {"cache_dtype": "fp8_e4m3"},
        "models": [{"id": "q", "root": "/data/models/Qwen3-8B-AWQ"}],
        "launch_cmd": "/opt/venvs/vllm/bin/vllm serve /data/models/Qwen3-8B-AWQ --kv-cache-dtype fp8 -tp 2"}}
    ident = archive._server_identity(mf)
    assert ident["engine_version"] == "0.11.0" and ident["kv_cache_dtype"] == "fp8_e4m3"
    assert ident["_argv"] == ["${ENGINE_ROOT}/vllm", "serve", "${MODEL_ROOT}/Qwen3-8B-AWQ", "--kv-cache-dtype", "fp8",
                              "-tp", "2"]
    assert (ident["quant"], ident["weight_bits"], ident["weight_path"]) == ("awq", 4, "${MODEL_ROOT}/Qwen3-8B-AWQ")
    mf |= {"experiment": "serve_sweep", "parameters": {"target": "http://127.0.0.1:8000",
                                                       "server_cmd": mf["target"]["launch_cmd"]}}
    cmd = archive.labkit_command(mf)
    assert "/data/" not in cmd and "/opt/" not in cmd
    key, value = shlex.split(cmd)[-1].split("=", 1)
    assert key == "server_cmd" and shlex.split(value) == ident["_argv"]


# ------------------------------------------------------------------------------------------- against labkit serve
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def labkit_server(tmp_path_factory):
    """`labkit serve` (the tiny shape) as a separate process, as a user runs it."""
    import os
    port = _free_port()
    log = tmp_path_factory.mktemp("lk") / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "serve", "--shape", "tiny", "--port", str(port),
                             "--capacity", "512", "--budget", "16", "--page-size", "16", "--prefill-chunk", "64",
                             "--tokenizer", "none"], cwd=REPO, env={**os.environ, **ENV}, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield url, port
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_target_run_records_what_the_server_publishes_and_the_users_command(labkit_server, tmp_path):
    url, port = labkit_server
    out = tmp_path / "run"
    cmd = f"labkit serve --shape tiny --port {port} --capacity 512"
    r = _labkit("run", "serve_sweep", "-p", f"target={url}", "-p", f"server_cmd={cmd}", "-p", "input_lens=32",
                "-p", "concurrency=1", "-p", "num_prompts=2", "-p", "output_len=4", "--out", out, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    mf = json.loads((out / "manifest.json").read_text())
    assert mf["target"]["launch_cmd"] == cmd
    assert mf["target"]["cache_config"] is None          # labkit serve does not publish vLLM's cache_config_info
    rows = _rows(out)
    assert rows and all(r["launch_argv"] == shlex.split(cmd) for r in rows)
    assert all(r["kv_cache_dtype"] is None for r in rows)           # not published: empty, never guessed
    assert all(r["engine"] == r["engine_raw"] == "labkit-serve" for r in rows)
    bad = _labkit("run", "serve_sweep", "-p", "server_cmd=vllm serve x", "--out", tmp_path / "never")
    assert bad.returncode == 2 and "server_cmd" in bad.stderr and not (tmp_path / "never").exists()
