"""Where a client's TTFT goes beyond `labkit serve`'s own: each request's time cut at the points the server can
stamp, so the offset between what a client reads and what the server records is measured, not guessed.

    .venv/bin/python -m labkit.serving.ttftsplit

runs `labkit serve` in this process (tiny shape on the CPU, two resident and two offload slots, SmolLM2's
tokenizer, as tests/test_vllm_serving.py builds it) and vLLM's own client against it (`vllm bench serve`, from
the vLLM venv, 12 requests of 64 random tokens, 16 out, at concurrency 1 and 4, completions and chat), pairs
each request (its `x-request-id`) with the server's stamps and prints the medians and ranges of:

- `client->socket`: from the client's start (`vllm bench serve`'s `start_times`, taken before it builds the
  request) to the server's first read of the request's bytes (uvicorn's `data_received`): the client building
  and sending the request, and the server's event loop getting round to the socket;
- `socket->app`: uvicorn parsing the HTTP request until it calls the app;
- `app->clock`: the app's routing until the handler starts the server's clock (`send_time` in /stats);
- `server`: the server's TTFT (`ttft_s` in /stats), from that clock to the engine's first token;
- `token->written`: the event loop taking the token, formatting the first chunk and writing it to the socket;
- `written->client`: the client reading that chunk until it stamps its TTFT.

They add up to the client's TTFT. Client and server read one clock: `time.perf_counter` is the system-wide
CLOCK_MONOTONIC on Linux in both processes. What it found is in docs/serving-api.md ("What a client's TTFT
adds").
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
from uvicorn.protocols.http.h11_impl import H11Protocol

from .benchclient import bench_command
from .engine_server import build, create_app, serve_in_thread
from .tokentext import TokenText, tokenizer_dir

SEGMENTS = ("client->socket", "socket->app", "app->clock", "server", "token->written", "written->client")
REPO = Path(__file__).resolve().parents[2]


class Stamps:
    """The server's stamps, per connection until the app takes the request, then per request id."""

    def __init__(self):
        self.rx: dict = {}              # connection -> perf_counter of the first bytes read since its last request
        self.by_id: dict = {}           # x-request-id -> {"rx", "app", "written"}
        self.lock = threading.Lock()

    def protocol(self):
        """uvicorn's h11 protocol, stamping the first bytes of each request read from a connection."""
        stamps = self

        class Stamped(H11Protocol):
            def data_received(self, data: bytes) -> None:
                if self.cycle is None or self.cycle.response_complete:     # a new request's first bytes
                    with stamps.lock:
                        stamps.rx.setdefault(self.client, time.perf_counter())
                super().data_received(data)
        return Stamped

    def wrap(self, app):
        """The ASGI app, stamping when it is called and when the first non-empty body chunk has been written."""
        async def stamped(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            t = {"app": time.perf_counter()}
            with self.lock:
                t["rx"] = self.rx.pop(tuple(scope["client"]) if scope.get("client") else None, t["app"])
            rid = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")

            async def send_stamped(msg):
                await send(msg)
                if msg["type"] == "http.response.body" and msg.get("body") and "written" not in t:
                    t["written"] = time.perf_counter()
            if rid:
                self.by_id[rid] = t
            await app(scope, receive, send_stamped)
        return stamped


def split(starts: list[float], ttfts: list[float], ids: list[str], records: dict, stamps: Stamps,
          offset: float) -> list[dict]:
    """Each request's segments in ms: the client's start and TTFT (perf_counter, s), its id, the server's
    /stats records by request id without the `cmpl-` / `chatcmpl-` prefix, and `offset` that turns the
    scheduler's clock into perf_counter."""
    rows = []
    for st, ttft, rid in zip(starts, ttfts, ids):
        t, rec = stamps.by_id.get(rid), records.get(rid)
        if t is None or rec is None or "written" not in t or not ttft:
            continue
        clock, token = rec["send_time"] + offset, rec["send_time"] + rec["ttft_s"] + offset
        cuts = [st, t["rx"], t["app"], clock, token, t["written"], st + ttft]
        rows.append({name: (b - a) * 1e3 for name, a, b in zip(SEGMENTS, cuts, cuts[1:])} |
                    {"client": ttft * 1e3})
    return rows


def summary(rows: list[dict]) -> str:
    """One line: client and server TTFT (means, their ratio), then each segment's median [min-max] in ms."""
    client, server = statistics.mean(r["client"] for r in rows), statistics.mean(r["server"] for r in rows)
    parts = [f"client {client:.1f} ms / server {server:.1f} ms = {client / server:.3f}x"]
    for k in SEGMENTS:
        if k != "server":
            v = [r[k] for r in rows]
            parts.append(f"{k} {statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]")
    return "; ".join(parts)


def serve(stamps: Stamps):
    """`labkit serve --device cpu --capacity 1024 --budget 16 --page-size 16 --prefill-chunk 64
    --resident-slots 2 --offload-slots 2 --policy threshold:512 --model-name tiny` in this process, stamped;
    returns (url, the engine loop, the uvicorn server)."""
    args = SimpleNamespace(device="cpu", shape="tiny", resident_slots=2, offload_slots=2, capacity=1024, budget=16,
                           strategy="zero_copy", seed=0, page_size=16, prefill_chunk=64, compile=False, graphs=False,
                           policy="threshold:512", overflow="on", switching="on", timeline_every=0, keep_records=1000)
    loop = build(args).start()
    vocab = next(iter(loop.sched.lanes.values())).engine.model.shape.vocab
    app = stamps.wrap(create_app(loop, "tiny", TokenText("smollm2-135m", vocab)))
    url, srv, _ = serve_in_thread(app, http=stamps.protocol())
    return url, loop, srv


def bench(url: str, chat: bool, concurrency: int, prefix: str, out: Path, n: int = 12) -> dict:
    """`vllm bench serve` (its completions or chat backend) against `url`, every request named `prefix<i>`;
    its detailed result (start times and TTFTs per request)."""
    name = f"{prefix}.json"
    cmd = bench_command(url, "tiny", 64, 16, n, concurrency, out, name, chat=chat,
                        tokenizer=str(tokenizer_dir("smollm2-135m")))
    cmd += ["--save-detailed", "--request-id-prefix", prefix]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                   stdin=subprocess.DEVNULL, timeout=600)
    return json.loads((out / name).read_text())


def main() -> None:
    stamps = Stamps()
    url, loop, srv = serve(stamps)
    sched = loop.sched
    offset = sched.clock() - sched.now()            # the scheduler's clock -> perf_counter
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for concurrency in (1, 4):
                for chat in (False, True):
                    prefix = f"split-{'chat' if chat else 'cmpl'}-c{concurrency}-"
                    got = bench(url, chat, concurrency, prefix, Path(tmp))
                    recs = httpx.get(url + "/stats", timeout=30).json()["records"]
                    by_id = {r["request_id"].split("-", 1)[1]: r for r in recs}
                    ids = [f"{prefix}{i}" for i in range(len(got["ttfts"]))]
                    rows = split(got["start_times"], got["ttfts"], ids, by_id, stamps, offset)
                    print(f"{'chat' if chat else 'completions'} c={concurrency} n={len(rows)}: {summary(rows)}",
                          flush=True)
    finally:
        srv.should_exit = True
        loop.stop()


if __name__ == "__main__":
    main()
