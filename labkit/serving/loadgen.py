"""One load generator for any OpenAI-compatible server: streaming `/v1/completions` over httpx.

    records = run_load(base_url, model, requests, concurrency=4)      # list[dict], one per request

Each record: index, request_id (the server's), send_time / first_token_time / end_time (Unix seconds),
token_times (seconds after send, one per streamed chunk carrying text, as vLLM's client counts them),
input_len, output_len (the server's usage count when it sends one), status ok/failed, error, text.
A request that errors is recorded and the run goes on. Closed loop (`arrival_s` None): at most
`concurrency` requests in flight. Open loop: each request is sent at its arrival offset, still capped by
`concurrency` (0 = no cap).
"""
from __future__ import annotations

import asyncio
import json
import time
import threading

import httpx

from labkit.serving.workload import RequestSpec


def _payload(model: str, spec: RequestSpec, ignore_eos: bool) -> dict:
    return {"model": model, "prompt": spec.prompt, "max_tokens": spec.output_len, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}


async def _one(client: httpx.AsyncClient, url: str, model: str, spec: RequestSpec, ignore_eos: bool,
               clock0: tuple[float, float]) -> dict:
    wall0, perf0 = clock0
    rec = {"index": spec.index, "request_id": None, "input_len": spec.input_len, "output_len_requested": spec.output_len,
           "output_len": 0, "status": "failed", "error": None, "text": "", "token_times": [], **spec.meta}
    t_send = time.perf_counter()
    rec["send_time"] = wall0 + (t_send - perf0)
    ttft = None
    chunks = 0
    text = []
    try:
        async with client.stream("POST", url, json=_payload(model, spec, ignore_eos)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")[:300]
                raise RuntimeError(f"HTTP {resp.status_code}: {body.strip()}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                msg = json.loads(data)
                rec["request_id"] = rec["request_id"] or msg.get("id")
                if msg.get("choices"):
                    piece = msg["choices"][0].get("text") or ""
                    text.append(piece)
                    chunks += 1
                    if ttft is None:
                        ttft = now - t_send
                    rec["token_times"].append(now - t_send)
                if msg.get("usage"):
                    rec["output_len"] = int(msg["usage"].get("completion_tokens") or 0)
                    rec["prompt_tokens"] = int(msg["usage"].get("prompt_tokens") or 0)
        if ttft is None:
            raise RuntimeError("stream ended without a token")
        rec["output_len"] = rec["output_len"] or chunks
        rec["status"] = "ok"
    except Exception as ex:       # recorded; the run goes on
        rec["error"] = f"{type(ex).__name__}: {str(ex).strip().splitlines()[0] if str(ex).strip() else ''}"[:400]
    t_end = time.perf_counter()
    rec["text"] = "".join(text)
    rec["first_token_time"] = rec["send_time"] + ttft if ttft is not None else None
    rec["end_time"] = wall0 + (t_end - perf0)
    rec["ttft_s"] = ttft
    # vLLM's E2EL ends at the last chunk that carries a token (not the usage chunk or `[DONE]` after it)
    rec["e2el_s"] = rec["token_times"][-1] if rec["status"] == "ok" else t_end - t_send
    return rec


async def run_load_async(base_url: str, model: str, requests: list[RequestSpec], concurrency: int = 1,
                         ignore_eos: bool = True, timeout_s: float = 600.0, on_record=None) -> list[dict]:
    url = base_url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(concurrency) if concurrency and concurrency > 0 else None
    clock0 = (time.time(), time.perf_counter())
    limits = httpx.Limits(max_connections=max(len(requests), 1), max_keepalive_connections=max(len(requests), 1))

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits) as client:
        async def go(spec: RequestSpec) -> dict:
            if spec.arrival_s is not None:
                delay = spec.arrival_s - (time.perf_counter() - clock0[1])
                if delay > 0:
                    await asyncio.sleep(delay)
            if sem is None:
                rec = await _one(client, url, model, spec, ignore_eos, clock0)
            else:
                async with sem:
                    rec = await _one(client, url, model, spec, ignore_eos, clock0)
            if spec.arrival_s is not None:
                rec["arrival_time"] = clock0[0] + spec.arrival_s
            if on_record is not None:
                on_record(rec)
            return rec

        return list(await asyncio.gather(*(go(s) for s in requests)))


def run_load(base_url: str, model: str, requests: list[RequestSpec], concurrency: int = 1, ignore_eos: bool = True,
             timeout_s: float = 600.0, on_record=None) -> list[dict]:
    """Blocking wrapper. Inside a running event loop (Jupyter) the load runs on a thread of its own; Ctrl-C
    in the caller cancels the requests in flight at once (not after the whole point) and re-raises."""
    def coro():
        return run_load_async(base_url, model, requests, concurrency, ignore_eos, timeout_s, on_record)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro())
    loop = asyncio.new_event_loop()
    box: dict = {}

    def worker():
        asyncio.set_event_loop(loop)
        try:
            box["task"] = loop.create_task(coro())
            box["result"] = loop.run_until_complete(box["task"])
        except BaseException as ex:      # cancelled, or an error to re-raise in the caller
            box["error"] = ex
        finally:
            try:       # close httpx's stream generators here, not at garbage collection ("Task was destroyed")
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

    t = threading.Thread(target=worker, name="labkit-loadgen", daemon=True)
    t.start()
    try:
        while t.is_alive():
            t.join(0.2)
    except KeyboardInterrupt:
        if "task" in box and not loop.is_closed():
            loop.call_soon_threadsafe(box["task"].cancel)
        t.join(10)
        raise
    if "error" in box:
        raise box["error"]
    return box["result"]
