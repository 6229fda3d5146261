"""vLLM's own client (`vllm bench serve`) against the same server and load, for a cross-check of labkit's.

It runs from the vLLM venv through the launcher, with the random dataset at the same fixed lengths,
`--ignore-eos` (so both clients get the same output lengths), the same concurrency, and writes vLLM's JSON
result, which is kept in the run folder (`bench/<point>.json`).
"""
from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

from labkit.atomic import open_append, write_text
from labkit.serving.lifecycle import launcher_cmd
from labkit.serving.lifecycle import log_tail

KEYS = ("median_ttft_ms", "mean_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "mean_tpot_ms", "p99_tpot_ms",
        "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "completed", "duration", "request_throughput",
        "output_throughput", "total_input_tokens", "total_output_tokens")


def bench_command(base_url: str, model: str, input_len: int, output_len: int, num_prompts: int, concurrency: int,
                  result_dir: Path, result_name: str, request_rate: float = math.inf, seed: int = 0,
                  burstiness: float = 1.0, chat: bool = False, tokenizer: str | None = None) -> list[str]:
    """`chat`: its chat backend (`openai-chat`, /v1/chat/completions) instead of completions; `tokenizer`: a
    tokenizer folder where the model name is not one (a server that names its model otherwise)."""
    backend, endpoint = ("openai-chat", "/v1/chat/completions") if chat else ("vllm", "/v1/completions")
    args = ["bench", "serve", "--backend", backend, "--base-url", base_url, "--endpoint", endpoint,
            "--model", model, "--tokenizer", tokenizer or model, "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--random-range-ratio", "0",
            "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--temperature", "0",       # greedy, as labkit's own client asks
            "--seed", str(seed), "--save-result", "--result-dir", str(result_dir), "--result-filename", result_name,
            "--disable-tqdm"]
    if math.isfinite(request_rate):    # the same seed gives the same arrivals as labkit's (workload.poisson_arrivals)
        args += ["--request-rate", str(request_rate), "--burstiness", str(burstiness)]
    return launcher_cmd(*args)


def run_bench(base_url: str, model: str, input_len: int, output_len: int, num_prompts: int, concurrency: int,
              result_dir: Path, result_name: str, env: dict, log_path: Path, timeout_s: float = 1800,
              request_rate: float = math.inf, seed: int = 0, chat: bool = False, tokenizer: str | None = None) -> dict:
    """Run `vllm bench serve`; returns its result JSON (selected keys + the path); raises RuntimeError on failure."""
    result_dir.mkdir(parents=True, exist_ok=True)
    cmd = bench_command(base_url, model, input_len, output_len, num_prompts, concurrency, result_dir, result_name,
                        request_rate, seed, chat=chat, tokenizer=tokenizer)
    with open_append(log_path, "ab") as log:
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                              timeout=timeout_s, start_new_session=True)
    path = result_dir / result_name
    if proc.returncode != 0 or not path.is_file():
        raise RuntimeError(f"vllm bench serve exited {proc.returncode}: {log_tail(log_path, 3)}")
    data = json.loads(path.read_text())
    # the per-request arrays make the file large; the summary is what the report needs
    slim = {k: v for k, v in data.items() if not isinstance(v, list)}
    write_text(path, json.dumps(slim, indent=1))
    return {**{k: data.get(k) for k in KEYS}, "result_path": str(path)}
