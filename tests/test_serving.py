"""labkit.serving without a vLLM server: profiles, workloads, metric definitions, /metrics parsing, the load
generator's error path, bad input. The tests that start real `vllm serve` processes are in test_vllm_*.py."""
import json
import math
import os
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest

from labkit.params import BadInput
from labkit.serving import latency, workload
from labkit.serving.profiles import available, load_profile

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- profiles
def test_shipped_profiles_load_and_fill():
    assert {"smollm2-cpu", "qwen3-next-3x3090", "single-gpu"} <= set(available())
    q = load_profile("qwen3-next-3x3090")
    args = q.serve_args("/m", 8192, 4, offload_gib=32)
    assert args[0] == "/m"
    assert args[args.index("--pipeline-parallel-size") + 1] == "3"
    assert args[args.index("--max-model-len") + 1] == "8192"
    assert args[-4:] == ["--kv-offloading-backend", "native", "--kv-offloading-size", "32"]
    assert not any("{" in a for a in args)
    s = load_profile("smollm2-cpu")
    plain = s.serve_args("/m", 2304, 2)
    assert "--kv-transfer-config" not in plain and "--enforce-eager" in plain
    with_host = s.serve_args("/m", 2304, 2, offload_gib=1.5, connector_extra={"stats_dir": "/x"})
    cfg = __import__("json").loads(with_host[with_host.index("--kv-transfer-config") + 1])
    assert cfg["kv_connector"] == "LabkitHostConnector" and cfg["kv_connector_module_path"] == "labkit.serving.vllm_connector"
    assert cfg["kv_connector_extra_config"] == {"host_gib": 1.5, "stats_dir": "/x"}
    env = s.server_env()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_profile_errors_are_one_line(tmp_path):
    with pytest.raises(BadInput, match="unknown profile 'nope'"):
        load_profile("nope")
    bad = tmp_path / "bad.toml"
    bad.write_text('model = "/m"\nargs = ["--port", "1"]\n')
    with pytest.raises(BadInput, match="sets --host/--port itself"):
        load_profile(str(bad))
    bad.write_text('model = "/m"\nargs = ["--x", "{nonsense}"]\n')
    with pytest.raises(BadInput, match="unknown placeholder"):
        load_profile(str(bad)).serve_args("/m", 1, 1)
    bad.write_text('model = "/m"\ncolour = "red"\n')
    with pytest.raises(BadInput, match="unknown key"):
        load_profile(str(bad))


# --------------------------------------------------------------------------------------------- workloads
def test_synthetic_lengths_exact_and_ranged():
    reqs = workload.synthetic(5, 300, 7, vocab_size=1000, seed=1)
    assert [r.input_len for r in reqs] == [300] * 5 and [r.output_len for r in reqs] == [7] * 5
    assert all(workload.FIRST_ID <= t < 1000 for r in reqs for t in r.prompt)
    assert reqs[0].prompt != reqs[1].prompt and all(r.arrival_s is None for r in reqs)
    ranged = workload.synthetic(200, 100, 10, vocab_size=1000, input_range=0.5, output_range=0.2, seed=2)
    ins = [r.input_len for r in ranged]
    assert 50 <= min(ins) and max(ins) <= 150 and len(set(ins)) > 20
    assert workload.synthetic(3, 8, 2, 1000, seed=5)[0].prompt == workload.synthetic(3, 8, 2, 1000, seed=5)[0].prompt


def test_poisson_arrivals_rate():
    t = workload.poisson_arrivals(4000, rate=5.0, seed=0)
    assert t[0] > 0 and all(b >= a for a, b in zip(t, t[1:]))
    assert workload.poisson_arrivals(3, math.inf) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("n,rate,burstiness", [(6, 0.1, 1.0), (200, 5.0, 1.0), (40, 2.0, 0.25), (40, 2.0, 4.0)])
def test_last_arrival_lands_at_n_over_rate(n, rate, burstiness):
    """vLLM rescales the arrivals so the last lands at N / rate: every seed offers the nominal load (6 prompts at
    0.1 req/s end at 60 s, never at 19.6 s)."""
    for seed in range(20):
        t = workload.poisson_arrivals(n, rate, seed=seed, burstiness=burstiness)
        assert len(t) == n and t[-1] == pytest.approx(n / rate, rel=1e-12)


VLLM_PY = Path(os.environ.get("LABKIT_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
# vLLM's own generator (vllm/benchmarks/serve.py `get_request`) after `vllm bench serve`'s np.random.seed(seed),
# with its clock frozen and its sleeps recorded instead of slept: the recorded sleeps are its arrival offsets.
_VLLM_ARRIVALS = """
import asyncio, json, sys, types
import numpy as np
import vllm.benchmarks.serve as S
slept = []
async def sleep(s):
    slept.append(s)
S.time = types.SimpleNamespace(time=lambda: 1000.0)
S.asyncio = types.SimpleNamespace(sleep=sleep)
async def main(n, rate, burst):
    return [r async for r in S.get_request(list(range(n)), rate, burst)]
out = []
for n, rate, burst, seed in json.loads(sys.argv[1]):
    slept.clear()
    np.random.seed(seed)
    asyncio.run(main(n, rate, burst))
    out.append(list(slept))
print(json.dumps(out))
"""


@pytest.mark.skipif(not VLLM_PY.is_file(), reason="needs .venv-vllm (make vllm-venv): vLLM's own generator")
def test_arrivals_equal_vllm_bench_serve_for_the_same_seed():
    cases = [(6, 0.1, 1.0, 0), (50, 3.0, 1.0, 12345), (30, 2.0, 0.5, 7)]
    out = subprocess.run([str(VLLM_PY), "-c", _VLLM_ARRIVALS, json.dumps(cases)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for (n, rate, burst, seed), theirs in zip(cases, json.loads(out.stdout.strip().splitlines()[-1])):
        ours = workload.poisson_arrivals(n, rate, seed=seed, burstiness=burst)
        assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-9), (n, rate, burst, seed)


def test_cross_check_command_is_greedy_with_the_same_arrivals():
    from labkit.serving.benchclient import bench_command
    cmd = bench_command("http://127.0.0.1:1", "m", 8, 4, 6, 2, Path("/tmp"), "x.json", request_rate=0.5, seed=3)
    assert cmd[cmd.index("--temperature") + 1] == "0"
    assert cmd[cmd.index("--seed") + 1] == "3" and cmd[cmd.index("--burstiness") + 1] == "1.0"


def test_repeated_sends_each_prompt_twice_after_all_firsts():
    reqs = workload.repeated(3, 64, 4, vocab_size=500)
    assert [r.meta["send"] for r in reqs] == ["first"] * 3 + ["repeat"] * 3
    assert [r.prompt for r in reqs[:3]] == [r.prompt for r in reqs[3:]]


def test_trace_replay_caps_scales_and_shares_prefixes(tmp_path):
    tr = tmp_path / "t.jsonl"
    tr.write_text('{"timestamp": 1000, "input_length": 1500, "output_length": 900, "hash_ids": [1, 2, 3]}\n'
                  '{"timestamp": 3000, "input_length": 700, "output_length": 5, "hash_ids": [1, 4]}\n'
                  '{"timestamp": 5000, "input_length": 9000, "output_length": 10, "hash_ids": [7]}\n')
    reqs = workload.trace_replay(tr, 10, rate_multiplier=2.0, max_context=1024, vocab_size=5000, max_output=64)
    assert [r.arrival_s for r in reqs] == [0.0, 1.0, 2.0]          # ms -> s, twice as fast
    assert reqs[0].output_len == 64 and reqs[0].input_len == 1024 - 64
    assert reqs[1].input_len == 700 and reqs[1].output_len == 5
    assert reqs[2].input_len == 1024 - 10
    assert reqs[0].prompt[:512] == reqs[1].prompt[:512]             # hash id 1 shared
    assert reqs[0].prompt[512:700] != reqs[1].prompt[512:700]
    real = REPO.parent / "shared" / "data" / "traces" / "conversation_trace.jsonl"
    if real.is_file():
        r = workload.trace_replay(real, 5, 1.0, 2048, 49152, 32)
        assert len(r) == 5 and all(x.input_len + x.output_len <= 2048 for x in r)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1}\n')
    with pytest.raises(BadInput, match="bad.jsonl:1"):
        workload.load_trace(bad)


# ---------------------------------------------------------------------------------- metric definitions
def _rec(send, ttft, gaps, n=None, status="ok"):
    times = [ttft] + list(ttft + np.cumsum(gaps))
    return {"status": status, "send_time": send, "end_time": send + times[-1], "ttft_s": ttft, "e2el_s": times[-1],
            "token_times": times, "output_len": n if n is not None else len(times), "input_len": 10}


def test_summary_uses_vllm_definitions():
    a = _rec(0.0, 0.5, [0.1, 0.1, 0.2])        # 4 tokens: TPOT = (0.9 - 0.5) / 3
    b = _rec(0.2, 1.0, [0.3])                  # 2 tokens: TPOT = 0.3
    c = _rec(0.4, 2.0, [], n=1)                # 1 token: no TPOT
    d = {**_rec(0.5, 0.1, [0.1]), "status": "failed"}
    s = latency.summarize([a, b, c, d], slo_ttft_ms=900, slo_tpot_ms=200)
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["ttft_ms_median"] == pytest.approx(1000.0)
    assert s["tpot_ms_mean"] == pytest.approx(((0.4 / 3) + 0.3) / 2 * 1e3)       # c left out
    assert s["itl_ms_median"] == pytest.approx(150.0)                           # pooled gaps .1 .1 .2 .3
    assert s["itl_ms_max"] == pytest.approx(300.0)
    assert s["e2el_ms_max"] == pytest.approx(2000.0)
    assert s["duration_s"] == pytest.approx(2.4)                                # first send -> last end
    assert s["good_requests"] == 1 and s["goodput"] == pytest.approx(1 / 2.4)   # only a meets both SLOs
    assert s["output_throughput"] == pytest.approx(7 / 2.4)


# ------------------------------------------------------------------------------------- /metrics parsing
def test_parse_real_vllm_metrics_page():
    from labkit.serving.servermetrics import parse_metrics
    text = (Path(__file__).parent / "data" / "vllm-0.32-cpu-metrics.txt").read_text()  # captured from vllm-cpu 0.32
    m = parse_metrics(text)
    for k in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting", "prefix_cache_queries",
              "prefix_cache_hits", "prompt_tokens", "generation_tokens"):
        assert k in m, k
    assert m["prefix_cache_queries"] == 272.0 and m["num_requests_running"] == 1.0
    assert 0 <= m["kv_cache_usage_perc"] <= 1
    page = 'vllm:prompt_tokens_cached_by_source_total{engine="0",source="host"} 128.0\n' \
           'vllm:prompt_tokens_cached_by_source_total{engine="0",source="device"} 256.0\n'
    m = parse_metrics("# TYPE vllm:prompt_tokens_cached_by_source counter\n" + page)
    assert m["prompt_tokens_cached_host"] == 128.0 and m["prompt_tokens_cached_device"] == 256.0


# ------------------------------------------------------------------------------------------ load errors
def test_loadgen_records_errors_and_goes_on():
    from labkit.serving import loadgen
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]               # nothing listens there once closed
    recs = loadgen.run_load(f"http://127.0.0.1:{port}", "m", workload.synthetic(3, 4, 2, 1000), concurrency=2)
    assert len(recs) == 3 and all(r["status"] == "failed" and "Connect" in r["error"] for r in recs)
    assert latency.summarize(recs)["failed"] == 3


# -------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("given,msg", [
    ({"backend": "sglang"}, "backend must be one of vllm; got 'sglang'"),
    ({"profile": "nope"}, "unknown profile"),
    ({"model": "/no/such/checkpoint"}, "does not exist"),
    ({"workload": "chat"}, "workload must be one of synthetic, repeat, trace"),
    ({"concurrency": "0"}, "concurrency must be > 0"),
    ({"offload": "-1"}, "offload must be >= 0"),
    ({"workload": "trace", "trace": "/no/trace.jsonl"}, "does not exist"),
    ({"profile": "single-gpu", "model": str(REPO)}, "holds no config.json"),
    ({"colour": "red"}, "unknown parameter"),
    ({"input_lens": "4096", "context_len": 1024}, "shorter than the longest input"),
])
def test_bad_input_one_line_before_anything(given, msg):
    from labkit.experiments.serve_sweep import plan
    with pytest.raises(BadInput) as e:
        plan(given, check_args=False)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_port_in_use_is_bad_input():
    from labkit.experiments.serve_sweep import plan
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(BadInput, match="in use"):
            plan({"port": s.getsockname()[1]}, check_args=False)


@pytest.mark.parametrize("config", ["{}", '{"vocab_size": null}', "[1, 2]", "not json"])
def test_config_without_vocab_is_bad_input_before_a_folder(tmp_path, config):
    from labkit.experiments.serve_sweep import plan
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(config)
    with pytest.raises(BadInput, match="config.json") as e:
        plan({"model": str(tmp_path / "m"), "out_dir": str(tmp_path / "run")}, check_args=False)
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


def test_trace_workload_reads_the_shipped_trace():
    from labkit.experiments.serve_sweep import plan
    p = plan({"workload": "trace"}, check_args=False)
    trace = Path(p.trace).resolve()
    assert trace.is_file() and trace.is_relative_to(REPO / "labkit" / "data"), trace
    assert len(workload.load_trace(trace)) >= p.trace_requests


def test_port_held_only_by_time_wait_is_free():
    """A server (vLLM's uvicorn, which binds with SO_REUSEADDR) that closed its connections first leaves them in
    TIME_WAIT on its port; its successor binds with SO_REUSEADDR too, so the port is free for it."""
    from labkit.serving.lifecycle import port_in_use
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as uvicorn (asyncio's create_server) binds
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.close()                  # the server side closes first: its end goes to TIME_WAIT
    cli.recv(1)
    cli.close()
    srv.close()
    states = subprocess.run(["ss", "-tan", f"sport = :{port}"], capture_output=True, text=True).stdout
    assert "TIME-WAIT" in states, states
    assert not port_in_use(port)


def test_launcher_answers_the_vllm_version_lookup_only(monkeypatch):
    """The dist-name shim: with only `vllm-cpu` installed, version('vllm') is vllm-cpu's + '+cpu'; other names
    untouched. (Emulated here by pretending the lookup of 'vllm' fails, as it does with vllm-cpu.)"""
    import importlib
    import importlib.metadata as md
    real = md.version

    def fake(name):
        if name == "vllm":
            raise md.PackageNotFoundError(name)
        if name == "vllm-cpu":
            return "0.32.0"
        return real(name)

    monkeypatch.setattr(md, "version", fake)
    import labkit.serving.launcher as L
    L = importlib.reload(L)
    try:
        assert md.version("vllm") == "0.32.0+cpu"
        assert md.version("pytest") == real("pytest")
        assert L.distribution() == "vllm-cpu"
    finally:
        monkeypatch.setattr(md, "version", real)
        importlib.reload(L)


def test_server_death_seen_through_its_teardown(tmp_path):
    """A failed request's server counts as dead if its process exits within the grace (a killed server's
    socket closes before the process is gone: reading `alive()` at once raced with that in CI); a live
    one is not. Real child processes stand in for `vllm serve` (any process has the same lifecycle)."""
    import subprocess
    import sys
    import time
    from labkit.serving.lifecycle import VllmServer
    srv = VllmServer([], None, tmp_path / "log")
    srv.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    assert srv.alive()                          # still tearing down when the request failed
    t = time.time()
    assert srv.died(grace_s=10)
    assert time.time() - t < 5 and not srv.alive()
    srv.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not srv.died(grace_s=0.3)        # a live server is not reported dead
    finally:
        srv.proc.kill()
        srv.proc.wait()
