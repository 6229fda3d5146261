"""`labkit serve` over real HTTP on 127.0.0.1: the load generator that drives vLLM (serving/loadgen.py)
drives labkit's engine; streamed tokens equal each request's tokens run alone in-process."""
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from labkit.engine.drive.scheduler import Request, Scheduler, Threshold, make_lanes
from labkit.serving.engine_server import EngineLoop, create_app
from labkit.serving.latency import summarize
from labkit.serving.loadgen import run_load
from labkit.serving.tokentext import piece
from labkit.serving.workload import RequestSpec
from labkit.shapes import PRESETS

TINY = PRESETS["tiny"]
CFG = dict(capacity=256, budget=16, page_size=16, prefill_chunk=32)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(url, timeout=120):
    t = time.time()
    while time.time() - t < timeout:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


@pytest.fixture(scope="module")
def server():
    import uvicorn
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    loop = EngineLoop(Scheduler(make_lanes(TINY, "cpu", 2, 2, **CFG), Threshold(80), timeline_every=1)).start()
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(loop, "tiny"), host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{port}"
    _wait_health(url)
    yield url, loop
    srv.should_exit = True
    th.join(timeout=10)
    loop.stop()
    torch.set_num_threads(n)


def _specs():
    g = torch.Generator().manual_seed(3)
    lens = [(40, 5), (100, 4), (30, 6), (90, 3), (60, 4), (120, 2)]
    return [RequestSpec(i, torch.randint(0, TINY.vocab, (n,), generator=g).tolist(), m) for i, (n, m) in enumerate(lens)]


def test_loadgen_streams_from_labkit_server(server):
    url, loop = server
    specs = _specs()
    recs = run_load(url, "tiny", specs, concurrency=4)
    assert [r["status"] for r in recs] == ["ok"] * len(specs), [r["error"] for r in recs]
    s = summarize(recs, slo_tpot_ms=1e6)
    assert s["completed"] == len(specs) and s["ttft_ms_p50"] > 0 and s["tpot_ms_p50"] > 0
    for rec, spec in zip(recs, specs):
        assert rec["output_len"] == spec.output_len == len(rec["token_times"])
        alone = Scheduler(make_lanes(TINY, "cpu", 2, 2, **CFG), Threshold(80)).run([Request(spec.prompt, spec.output_len)])[0]
        assert rec["text"] == "".join(piece(t) for t in alone.tokens)
    st = httpx.get(url + "/stats").json()
    assert len(st["records"]) >= len(specs) and {r["lane"] for r in st["records"]} == {"resident", "offload"}
    assert httpx.get(url + "/timeline").json()["timelines"]


def test_bad_requests_get_400_and_the_server_goes_on(server):
    url, _ = server
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": list(range(300)), "max_tokens": 4})
    assert r.status_code == 400 and "exceed" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [1.5], "max_tokens": 4})
    assert r.status_code == 400
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200
    body = r.json()
    assert body["usage"]["completion_tokens"] == 3 and len(body["choices"][0]["text"].split()) == 3
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny"


def test_labkit_serve_cli(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "serve", "--device", "cpu", "--port", str(port),
                             "--capacity", "256", "--budget", "16", "--page-size", "16", "--prefill-chunk", "64",
                             "--resident-slots", "1", "--offload-slots", "1", "--policy", "threshold:50"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_health(url)
        specs = _specs()[:2]
        recs = run_load(url, "labkit", specs, concurrency=2)
        assert [r["status"] for r in recs] == ["ok", "ok"]
        assert [r["output_len"] for r in recs] == [s.output_len for s in specs]
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert "lanes resident=1 slots, offload=1 slots" in out
    bad = subprocess.run([sys.executable, "-m", "labkit", "serve", "--host", "0.0.0.0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "loopback" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("body,msg", [
    ({"prompt": [1, 2, 3], "max_tokens": 2, "stream": True, "stream_options": 5}, "stream_options"),
    ({"prompt": [1, 2, 3], "max_tokens": True}, "max_tokens"),
    ({"prompt": [1, 2, 3], "max_tokens": 2, "stream": "yes"}, "stream"),
    ({"prompt": [1, 2, 3], "max_tokens": 2, "stream": True, "stream_options": {"include_usage": 3}}, "include_usage"),
])
def test_wrong_types_get_400_not_500(server, body, msg):
    url, _ = server
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400 and msg in r.json()["error"]["message"]


def _stats_for(url, rid, timeout=30):
    t = time.time()
    while time.time() - t < timeout:
        got = [r for r in httpx.get(url + "/stats").json()["records"] if r["request_id"] == rid]
        if got:
            return got[0]
        time.sleep(0.2)
    raise AssertionError(f"request {rid} never finished")


def test_client_disconnect_mid_stream_aborts_the_request(server):
    """A client that reads two chunks and hangs up: the request stops (not run to its 200 tokens), is recorded
    as aborted, and its slot serves the next request."""
    url, _ = server
    body = {"model": "tiny", "prompt": list(range(1, 41)), "max_tokens": 200, "stream": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", url + "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            first = next(ln for ln in lines if ln.startswith("data:"))
            rid = json.loads(first[5:])["id"]
            next(ln for ln in lines if ln.startswith("data:"))
    rec = _stats_for(url, rid)
    assert rec["status"] == "failed" and "aborted" in rec["error"] and rec["output_len"] < 200, rec
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_half_sent_body_logs_no_traceback(tmp_path):
    """A body cut off mid-upload (Content-Length larger than what arrives, then the socket closes)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "serve", "--device", "cpu", "--port", str(port),
                             "--capacity", "64", "--budget", "16", "--page-size", "16", "--prefill-chunk", "64",
                             "--resident-slots", "1", "--offload-slots", "0", "--policy", "resident"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_health(url)
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 500\r\n\r\n{\"prompt\": [1, 2")
            time.sleep(0.5)
        time.sleep(1.0)
        assert httpx.get(url + "/health", timeout=5).status_code == 200
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert "Traceback" not in out, out[-3000:]
