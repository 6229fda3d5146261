"""`labkit serve`: labkit's own engine behind an OpenAI-compatible streaming `/v1/completions`.

    labkit serve --shape tiny --resident-slots 4 --offload-slots 4 --policy threshold:2048 --port 8000

The same load generator that drives vLLM (`labkit.serving.loadgen`) drives this server. The engine has
random seeded weights and no tokenizer: a prompt is a list of token ids (what the load generator sends)
or a string, read as its UTF-8 bytes (ids 0-255); each generated token is streamed as the text
`" <id>"`. Decoding is greedy whatever `temperature` says; there is no EOS (`ignore_eos` is implied).

One thread runs the scheduler (`labkit.engine.drive.scheduler.Scheduler`): requests reach it through a queue,
tokens come back through the event loop (`call_soon_threadsafe`). A request the engine cannot take
(prompt + max_tokens longer than the cache, ids outside the vocabulary) gets HTTP 400 with one line; a
request that fails mid-run ends its stream with an `error` event and the server goes on.
A client that disconnects (mid-stream, or while a non-streamed answer is being generated) aborts its
request: it leaves the queue, or a running one stops after its next token and frees its slot; its record
says `aborted`. A body cut off mid-upload is dropped without a traceback.
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

    def submit(self, req) -> None:
        self.sched.validate(req)            # raises BadInput in the caller: one line, HTTP 400
        req.arrival = self.sched.now()
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


def _prompt_ids(prompt) -> list[int]:
    if isinstance(prompt, str):
        return list(prompt.encode("utf-8"))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        if len(prompt) != 1:
            raise BadInput("one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise BadInput("prompt must be a string or a list of token ids")


def create_app(loop: EngineLoop, model_name: str = "labkit"):
    from fastapi import FastAPI, Request as HTTPRequest
    from starlette.requests import ClientDisconnect
    from ..engine.drive.scheduler import Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="labkit engine")
    sched = loop.sched

    def error(status: int, msg: str):
        return JSONResponse({"error": {"message": msg, "type": "BadRequestError", "code": status}}, status_code=status)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "labkit"}]}

    @app.get("/stats")
    async def stats():
        return {"records": [r.record() for r in list(sched.finished)], "rounds": list(sched.rounds),
                "errors": list(loop.errors), "graphs": sched.graphs, "graph_error": sched.graph_error}

    @app.get("/timeline")
    async def timeline():
        return {"timelines": list(sched.timelines)}

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        try:
            body = await http.json()
        except ClientDisconnect:            # the body was cut off: nobody is listening for an answer
            return error(400, "the client disconnected before sending the whole body")
        except ValueError as ex:
            return error(400, f"body is not JSON: {ex}")
        try:
            if not isinstance(body, dict):
                raise BadInput("body must be a JSON object")
            ids = _prompt_ids(body.get("prompt"))
            max_tokens = body.get("max_tokens", 16)
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
                raise BadInput("max_tokens must be an integer")
            stream = body.get("stream", False)
            if not isinstance(stream, bool):
                raise BadInput("stream must be true or false")
            opts = body.get("stream_options")
            if opts is not None and not isinstance(opts, dict):
                raise BadInput("stream_options must be an object")
            usage_on = (opts or {}).get("include_usage", False)
            if not isinstance(usage_on, bool):
                raise BadInput("stream_options.include_usage must be true or false")
        except BadInput as ex:
            return error(400, str(ex))
        aio = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        rid = f"cmpl-{uuid.uuid4().hex[:16]}"
        req = Request(ids, max_tokens, id=rid,
                      on_token=lambda r, tok, t: aio.call_soon_threadsafe(events.put_nowait, ("tok", tok, r.remaining == 0)),
                      on_done=lambda r: aio.call_soon_threadsafe(events.put_nowait, ("done", None, False)))
        try:
            loop.submit(req)
        except BadInput as ex:
            return error(400, str(ex))
        created = int(time.time())

        def chunk(choices, usage=None) -> str:
            msg = {"id": rid, "object": "text_completion", "created": created, "model": model_name, "choices": choices}
            if usage is not None:
                msg["usage"] = usage
            return f"data: {json.dumps(msg)}\n\n"

        def usage():
            n = len(req.tokens)
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        if stream:
            async def gen():
                finished = False
                try:
                    while True:
                        kind, tok, last = await events.get()
                        if kind == "tok":
                            yield chunk([{"index": 0, "text": f" {tok}", "logprobs": None,
                                          "finish_reason": "length" if last else None}])
                            continue
                        finished = True
                        if req.status == "failed":
                            yield f"data: {json.dumps({'error': {'message': req.error, 'type': 'InternalServerError', 'code': 500}})}\n\n"
                        elif usage_on:
                            yield chunk([], usage())
                        yield "data: [DONE]\n\n"
                        return
                finally:
                    if not finished:        # the client went away (the generator was closed or cancelled)
                        loop.abort(req)
            return StreamingResponse(gen(), media_type="text/event-stream")

        while True:
            try:
                kind, _, _ = await asyncio.wait_for(events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    loop.abort(req)
                    return error(499, "client disconnected")
                continue
            if kind == "done":
                break
        if req.status == "failed":
            return error(500, req.error or "failed")
        text = "".join(f" {t}" for t in req.tokens)
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                             "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
                             "usage": usage()})

    return app


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
    parse_policy(args.policy, Costs(0, 0, 0))
    loop = build(args).start()
    app = create_app(loop, args.model_name)
    print(f"labkit serve: lanes {', '.join(f'{n}={l.cache.n_slots} slots' for n, l in loop.sched.lanes.items())}, "
          f"policy {args.policy}, switching {args.switching}, http://{args.host}:{args.port}/v1/completions", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        loop.stop()
    return 0
