"""`labkit serve`: labkit's own engine behind vLLM's OpenAI-compatible API, for the clients people already use.

    labkit serve --shape tiny --resident-slots 4 --offload-slots 4 --policy threshold:2048 --port 8000

`POST /v1/completions` and `/v1/chat/completions` (streamed or not) answer with vLLM's fields: an unknown
`model` gets 404; `max_tokens` (chat: `max_completion_tokens` first) is honoured, default 16 for
completions and what fits the request's cache slot for chat; stop conditions are vLLM's (`Sampling`);
`usage` includes `prompt_tokens_details.cached_tokens` (0: there is no prefix cache). `GET /metrics`
is Prometheus text under vLLM's metric names (`labkit.serving.promserve`). The same load generator that
drives vLLM (`labkit.serving.loadgen`) drives this server.

The engine's weights are random and seeded; decoding is greedy whatever `temperature` says and there is
no EOS. How text becomes tokens and tokens text (SmolLM2's tokenizer for prompts, one countable word per
generated token): `labkit.serving.tokentext`. A prompt may also be a list of token ids.

One thread runs the scheduler (`labkit.engine.drive.scheduler.Scheduler`): requests reach it through a queue,
tokens come back through the event loop (`call_soon_threadsafe`). A request the engine cannot take
(prompt + max_tokens longer than the cache, ids outside the vocabulary), a body that is not JSON or is
nested too deeply for the parser, or a field of the wrong type gets HTTP 400 with one line; a
request that fails mid-run ends its stream with an `error` event and the server goes on.
A client that disconnects (mid-stream, or while a non-streamed answer is being generated, whether tokens
are arriving or not) aborts its request: it leaves the queue, or a running one stops after its next token
and frees its slot; its record says `aborted`. A body cut off mid-upload is dropped without a traceback.
`GET /stats` returns the scheduler's per-request records and per-iteration rounds (lane sizes,
switches, stalls, bytes), `GET /timeline` the sampled switching timelines.
"""

import asyncio
import json
import queue
import threading
import time
import uuid

from ..params import BadInput
from .promserve import CONTENT_TYPE, ServeMetrics
from .tokentext import TokenText, piece


class EngineLoop:
    """The scheduler on its own thread; `submit` from any thread."""

    def __init__(self, sched, idle_wait_s: float = 0.02):
        self.sched, self.idle_wait_s = sched, idle_wait_s
        self.inbox: queue.Queue = queue.Queue()
        self.aborts: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="labkit-engine", daemon=True)
        self.errors: list[str] = []

    def start(self) -> "EngineLoop":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=10)

    def submit(self, req, arrival: float | None = None) -> None:
        """`arrival`: when the request reached the server (scheduler clock), default now."""
        self.sched.validate(req)            # raises BadInput in the caller: one line, HTTP 400
        req.arrival = self.sched.now() if arrival is None else arrival
        self.inbox.put(req)

    def abort(self, req) -> None:
        """From any thread: stop `req` (its client is gone); done on the engine's thread between steps."""
        self.aborts.put(req)

    def _abort_pending(self) -> None:
        while True:
            try:
                req = self.aborts.get_nowait()
            except queue.Empty:
                return
            if req.status in ("done", "failed", "aborted"):
                continue
            why = f"aborted: the client disconnected after {len(req.tokens)} of {req.max_tokens} tokens"
            sched = self.sched
            queued = [q for q in (sched.waiting, sched.future) if any(r is req for r in q)]
            if queued:                      # never started: just leave the queue
                for q in queued:
                    keep = [r for r in q if r is not req]
                    q.clear()
                    q.extend(keep)
                sched._fail(req, RuntimeError(why))
                req.status, req.error = "aborted", why
                continue
            # prefilling or decoding: end after the next token through the scheduler's own finish path (which
            # frees the slot and its pages), then mark it aborted
            req.max_tokens = len(req.tokens) + 1
            done = req.on_done

            def aborted(r, done=done, why=why):
                r.status, r.error = "aborted", why
                if done is not None:
                    done(r)
            req.on_done = aborted
            self.inbox.put(None)          # wake an idle loop

    def _take(self, block: bool) -> None:
        try:
            req = self.inbox.get(timeout=self.idle_wait_s) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if req is None:                 # a wake-up, not a request
                try:
                    req = self.inbox.get_nowait()
                except queue.Empty:
                    return
                continue
            try:
                self.sched.submit(req)
            except BadInput as ex:          # validated at the door; recorded, never fatal to the loop
                self.sched._fail(req, ex)
            try:
                req = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        while not self._stop.is_set():
            self._take(block=False)
            self._abort_pending()
            try:
                did = self.sched.step()
            except Exception as ex:         # noqa: BLE001 - the scheduler records request failures itself
                self.errors.append(f"{type(ex).__name__}: {ex}")
                did = False
            if not did:
                self._take(block=True)


def _int(body: dict, key: str, default):
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool):
        raise BadInput(f"{key} must be an integer")
    return v


def _bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadInput(f"{key} must be true or false")
    return v


def _prompt_ids(prompt, text: TokenText) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        if len(prompt) != 1:
            raise BadInput("one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return text.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise BadInput("prompt must be a string or a list of token ids")


def _messages(body: dict) -> list[dict]:
    """Chat messages as role + text content (content parts of type text are joined, as vLLM does)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadInput("messages must be a non-empty list")
    out = []
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadInput("each message must be an object with a role")
        c = m.get("content")
        if c is None:
            c = ""
        if isinstance(c, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c):
                raise BadInput("message content parts must be of type text (this server takes text only)")
            c = "\n".join(p["text"] for p in c)
        if not isinstance(c, str):
            raise BadInput("message content must be a string or a list of text parts")
        out.append({"role": m["role"], "content": c})
    return out


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadInput("stop must be a string or a list of strings")
    return [s for s in stop if s]


class Sampling:
    """What a request asks of generation, parsed and checked (BadInput: one line, HTTP 400).

    Greedy decoding whatever `temperature` / `top_p` say (the weights are random: sampling measures
    nothing more). Stop conditions as vLLM's: `max_tokens` (chat: `max_completion_tokens` first), `stop`
    strings (the text ends before the stop string unless `include_stop_str_in_output`), `stop_token_ids`
    (the engine's ids; the token counts, its text is dropped), none of them before `min_tokens`. There is
    no EOS token (`ignore_eos` is accepted and changes nothing)."""

    def __init__(self, body: dict, chat: bool, default_max: int):
        if chat:
            mt = _int(body, "max_completion_tokens", None)
            mt = _int(body, "max_tokens", default_max) if mt is None else mt
        else:
            mt = _int(body, "max_tokens", default_max)
        self.max_tokens = mt
        self.min_tokens = _int(body, "min_tokens", 0)
        if self.min_tokens < 0 or self.min_tokens > mt:
            raise BadInput(f"min_tokens must be in [0, max_tokens = {mt}], got {self.min_tokens}")
        if _int(body, "n", 1) != 1:
            raise BadInput("n must be 1 (one choice per request)")
        if _bool(body, "echo"):
            raise BadInput("echo is not supported")
        self.stop = _stops(body)
        ids = body.get("stop_token_ids") or []
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise BadInput("stop_token_ids must be a list of integers")
        self.stop_ids = set(ids)
        self.include_stop = _bool(body, "include_stop_str_in_output")
        _bool(body, "ignore_eos")
        self.stream = _bool(body, "stream")
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise BadInput("stream_options must be an object")
        self.usage_on = _bool(opts or {}, "include_usage")
        self.continuous_usage = _bool(opts or {}, "continuous_usage_stats")
        # vLLM holds back as many characters as a stop string could still be completed by
        self.holdback = max((len(s) for s in self.stop), default=1) - 1


class Generation:
    """One request from submission to its end: the stop conditions are checked on the scheduler's thread
    right after each token (so a stopped request frees its slot at once); every token goes to the event
    loop as (text delta, finish reason or None)."""

    def __init__(self, loop: "EngineLoop", ids: list[int], sp: Sampling, rid: str, metrics: ServeMetrics):
        from ..engine.drive.scheduler import Request
        self.sp, self.metrics, self.engine = sp, metrics, loop
        self.aio = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.text, self.sent = "", 0
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.ended = False
        self.req = Request(ids, sp.max_tokens, id=rid, on_token=self._on_token, on_done=self._on_done)

    # -- the scheduler's thread
    def _on_token(self, req, tok: int, t: float) -> None:
        self.metrics.token(req, t)
        if self.finish_reason is not None:          # a token after the request stopped (not expected): not shown
            return
        n, sp = len(req.tokens), self.sp
        before = len(self.text)
        self.text += piece(tok)
        if n >= sp.min_tokens:
            if tok in sp.stop_ids:
                self.text = self.text[:before]
                self.finish_reason, self.stop_reason = "stop", tok
            else:
                for s in sp.stop:
                    i = self.text.find(s, max(0, before - len(s) + 1))
                    if i >= 0:
                        self.text = self.text[:i + len(s) if sp.include_stop else i]
                        self.finish_reason, self.stop_reason = "stop", s
                        break
        if self.finish_reason is not None:
            req.max_tokens = n                      # ends now, through the scheduler's own finish path
        elif req.remaining == 0:
            self.finish_reason = "length"
        upto = len(self.text) if self.finish_reason else max(self.sent, len(self.text) - sp.holdback)
        delta, self.sent = self.text[self.sent:upto], upto
        self.aio.call_soon_threadsafe(self.events.put_nowait, (delta, self.finish_reason))

    def _on_done(self, req) -> None:
        reason = "abort" if req.status in ("failed", "aborted") else (self.finish_reason or "length")
        self.metrics.finished(req, reason, self.sp.max_tokens)
        self.aio.call_soon_threadsafe(self.events.put_nowait, None)

    # -- the event loop
    def start(self, arrival: float) -> None:
        self.engine.submit(self.req, arrival)       # BadInput: one line, HTTP 400

    def abort(self) -> None:
        if not self.ended:
            self.engine.abort(self.req)

    async def deltas(self):
        """(text, finish reason) per token; ends when the request has ended."""
        while True:
            ev = await self.events.get()
            if ev is None:
                self.ended = True
                return
            yield ev

    async def wait(self, http) -> bool:
        """Until the request ends; False (and the request aborted) if the client went away first. The
        disconnect is watched by its own task, so it is seen while tokens arrive as well as between them."""
        async def gone():
            while True:
                msg = await http.receive()
                if msg["type"] == "http.disconnect":
                    return
        watch = asyncio.ensure_future(gone())
        try:
            while True:
                get = asyncio.ensure_future(self.events.get())
                done, _ = await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    self.abort()
                    return False
                if get.result() is None:
                    self.ended = True
                    return True
        finally:
            watch.cancel()

    def usage(self) -> dict:
        n, p = len(self.req.tokens), len(self.req.prompt)
        return {"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n,
                "prompt_tokens_details": {"cached_tokens": 0}}


async def _json_body(http):
    """The body as JSON, or an error line: cut off, not JSON, or nested too deep for the parser."""
    from starlette.requests import ClientDisconnect
    try:
        raw = await http.body()
    except ClientDisconnect:                # the body was cut off: nobody is listening for an answer
        return None, "the client disconnected before sending the whole body"
    try:
        return json.loads(raw), None
    except RecursionError:
        return None, "body is nested too deeply"
    except ValueError as ex:
        return None, f"body is not JSON: {ex}"


def create_app(loop: EngineLoop, model_name: str = "labkit", text: TokenText | None = None):
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI(title="labkit engine")
    sched = loop.sched
    capacity = min(l.cache.capacity for l in sched.lanes.values())
    text = text or TokenText(None, next(iter(sched.lanes.values())).engine.model.shape.vocab)
    metrics = ServeMetrics(sched, model_name, capacity)
    started = int(time.time())

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                            "owned_by": "labkit", "root": model_name, "parent": None,
                                            "max_model_len": capacity}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.page(), media_type=CONTENT_TYPE)

    @app.get("/stats")
    async def stats():
        return {"records": [r.record() for r in list(sched.finished)], "rounds": list(sched.rounds),
                "errors": list(loop.errors), "graphs": sched.graphs, "graph_error": sched.graph_error}

    @app.get("/timeline")
    async def timeline():
        return {"timelines": list(sched.timelines)}

    async def serve(http: HTTPRequest, chat: bool):
        # the request's clock starts before its body is read and tokenized: a client's TTFT includes both
        arrival = sched.now()
        body, why = await _json_body(http)
        if why:
            return _error(400, why)
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object")
        asked = body.get("model")
        if asked is not None and asked != model_name:       # vLLM: 404 for a model it does not serve
            return _error(404, f"The model `{asked}` does not exist.", "NotFoundError", "model")
        try:
            ids = text.chat(_messages(body)) if chat else _prompt_ids(body.get("prompt"), text)
            sp = Sampling(body, chat, max(1, capacity - len(ids)) if chat else 16)
            gen = Generation(loop, ids, sp, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}", metrics)
            gen.start(arrival)
        except BadInput as ex:
            return _error(400, str(ex))
        reply = _Reply(gen, sp, chat, model_name)
        if sp.stream:
            return StreamingResponse(reply.events(), media_type="text/event-stream")
        if not await gen.wait(http):
            return _error(499, "client disconnected")
        if gen.req.status == "failed":
            return _error(500, gen.req.error or "failed", "InternalServerError")
        return JSONResponse(reply.whole())

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await serve(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await serve(http, chat=True)

    return app


def _error(status: int, msg: str, kind: str = "BadRequestError", param=None):
    """An error as vLLM's OpenAI server words it."""
    from fastapi.responses import JSONResponse
    return JSONResponse({"error": {"message": msg, "type": kind, "param": param, "code": status}}, status_code=status)


class _Reply:
    """A started generation's answer in vLLM's OpenAI shapes: server-sent chunks, or one whole response."""

    def __init__(self, gen: "Generation", sp: "Sampling", chat: bool, model_name: str):
        self.gen, self.sp, self.chat, self.model_name = gen, sp, chat, model_name
        self.rid, self.created = gen.req.id, int(time.time())

    def head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model_name}

    def choice(self, delta: str, finish, stream: bool) -> dict:
        c = {"index": 0}
        if self.chat:
            c["delta" if stream else "message"] = {"content": delta} if stream else \
                {"role": "assistant", "content": delta, "tool_calls": [], "reasoning_content": None}
        else:
            c["text"] = delta
        c.update(logprobs=None, finish_reason=finish, stop_reason=self.gen.stop_reason if finish else None)
        return c

    async def events(self):
        gen, sp = self.gen, self.sp
        obj = "chat.completion.chunk" if self.chat else "text_completion"

        def sse(msg: dict) -> str:
            return f"data: {json.dumps(msg)}\n\n"

        try:
            if self.chat:        # vLLM's first chat chunk: the role, no content yet
                yield sse({**self.head(obj), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                          "logprobs": None, "finish_reason": None}]})
            async for delta, finish in gen.deltas():
                msg = {**self.head(obj), "choices": [self.choice(delta, finish, True)]}
                if sp.usage_on and sp.continuous_usage:
                    msg["usage"] = gen.usage()
                yield sse(msg)
            if gen.req.status == "failed":
                yield sse({"error": {"message": gen.req.error, "type": "InternalServerError", "code": 500}})
            elif sp.usage_on:
                yield sse({**self.head(obj), "choices": [], "usage": gen.usage()})
            yield "data: [DONE]\n\n"
        finally:
            gen.abort()     # a no-op once ended; otherwise the client went away mid-stream

    def whole(self) -> dict:
        gen = self.gen
        return {**self.head("chat.completion" if self.chat else "text_completion"),
                "choices": [self.choice(gen.text, gen.finish_reason or "length", False)],
                "usage": gen.usage(), "prompt_logprobs": None, "kv_transfer_params": None}


def build(args) -> EngineLoop:
    from ..engine.drive.scheduler import Scheduler, calibrate, make_lanes, parse_policy
    device = args.device
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    lanes = make_lanes(args.shape, device, args.resident_slots, args.offload_slots, capacity=args.capacity,
                       budget=args.budget, strategy=args.strategy, seed=args.seed, page_size=args.page_size,
                       prefill_chunk=args.prefill_chunk, compile=args.compile)
    costs = calibrate(lanes, graphs=args.graphs) if args.policy == "adaptive" else None
    sched = Scheduler(lanes, parse_policy(args.policy, costs), switching=args.switching == "on",
                      timeline_every=args.timeline_every, graphs=args.graphs)
    return EngineLoop(sched)


def cmd_serve(args) -> int:
    import uvicorn
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        raise BadInput(f"labkit serve binds to the loopback interface only, not {args.host}")
    if args.switching not in ("on", "off"):
        raise BadInput("--switching must be on or off")
    from ..engine.drive.scheduler import Costs, parse_policy
    from ..shapes import ModelShape
    parse_policy(args.policy, Costs(0, 0, 0))
    tokenizer = getattr(args, "tokenizer", "auto")
    try:
        vocab = ModelShape.from_name(args.shape).vocab
    except ValueError as ex:
        raise BadInput(str(ex)) from ex
    if tokenizer == "auto":             # SmolLM2's where the lab's model package is installed, else none
        try:
            text = TokenText("smollm2-135m", vocab)
        except ValueError:
            text = TokenText(None, vocab)
    else:
        try:
            text = TokenText(None if tokenizer == "none" else tokenizer, vocab)
        except ValueError as ex:        # the tokenizer's package missing: one line
            raise BadInput(str(ex)) from ex
    loop = build(args).start()
    app = create_app(loop, args.model_name, text)
    print(f"labkit serve: shape {args.shape} with seeded random weights (seed {args.seed}), not a trained model: the "
          "engine's speed and protocol are real, its replies are random tokens; "
          f"lanes {', '.join(f'{n}={l.cache.n_slots} slots' for n, l in loop.sched.lanes.items())}, "
          f"policy {args.policy}, switching {args.switching}, {text.describe()}, "
          f"http://{args.host}:{args.port}/v1/completions and /v1/chat/completions, /metrics", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        loop.stop()
    return 0
