"""`labkit serve`: labkit's own engine behind vLLM's OpenAI-compatible API, for the clients people already use.

    labkit serve --shape tiny --resident-slots 4 --offload-slots 4 --policy threshold:2048 --port 8000

`POST /v1/completions` and `/v1/chat/completions` (streamed or not) answer as vLLM 0.32's server does: what a
request asks and how it ends, logprobs included, in `labkit.serving.generation`; the fields of every answer
and chunk in `labkit.serving.replies`. An unknown `model` gets 404. `POST /tokenize`, `/detokenize` and `GET
/version` are vLLM's; `GET /metrics` is Prometheus text under vLLM's metric names (`labkit.serving.promserve`), its
`http_*` families measured by an ASGI middleware as vLLM's server measures them.
The same load generator that drives vLLM (`labkit.serving.loadgen`) drives this server.

The engine's weights are random and seeded; decoding is greedy whatever `temperature` says and there is
no EOS. How text becomes tokens and tokens text (SmolLM2's tokenizer for prompts, one countable word per
generated token): `labkit.serving.tokentext`. A prompt may also be a list of token ids.

One thread runs the scheduler (`labkit.engine.drive.scheduler.Scheduler`): requests reach it through a queue,
tokens come back through the event loop (`call_soon_threadsafe`). Bounded whoever sends: a body over
`--max-body-mib` is a 413 before it is parsed; every string of a request, whatever its field, is counted
against the context before anything is tokenized (`labkit.serving.fields`), and a prompt that cannot fit is
refused before it is tokenized; at most 4 stop strings of at most 1,024 characters; /tokenize and /detokenize
take no more tokens than the context; tokenizing runs on a worker thread. A request the engine cannot take
(prompt + max_tokens longer than the cache, ids outside the vocabulary), a body that is not JSON or is nested
too deeply for the parser, text that is not valid Unicode in any field, or a field of the wrong type gets HTTP
400 with one line; a request that fails mid-run ends its stream with an `error` event and the server goes
on. A client that disconnects (mid-stream, or while a non-streamed answer is being generated, whether tokens
are arriving or not) aborts its request: it leaves the queue, or a running one stops after its next token and
frees its slot; its record says `aborted`. A body cut off mid-upload is dropped without a traceback. `GET
/stats` returns the newest per-request records and per-iteration rounds (lane sizes, switches, stalls, bytes)
with totals over all (`RecordLog`), `GET /timeline` the newest sampled switching timelines. The command line,
its checks and how it stops: `labkit.serving.serve_cli`.
"""

import asyncio
import collections
import json
import queue
import threading
import time
import uuid

from ..params import BadInput
from .fields import check_text
from .generation import Generation, Sampling, bool_field, int_field, messages, prompt_ids
from .lifecycle import free_port
from .promserve import CONTENT_TYPE, HttpMetrics, ServeMetrics
from .replies import Reply
from .tokentext import TokenText
from .. import __version__, lazy
from ..engine.drive.scheduler import Scheduler, Threshold, calibrate, make_lanes, parse_policy

torch = lazy.module("torch")     # imported when device=auto is resolved, not when this module loads
httpx = lazy.module("httpx")       # serve_in_thread's wait for /health: tests and the client-TTFT split
uvicorn = lazy.module("uvicorn")


KEEP_RECORDS = 1000                   # finished requests (and decode rounds) /stats keeps, newest last
KEEP_TIMELINES = 64
MAX_BODY_MIB = 16                     # a request body above this is refused (HTTP 413) before it is parsed


class RecordLog:
    """The newest `keep` records of one kind (a ring), numbered from 1 in the order they came, and totals over
    every record ever added: a server that runs for days answers /stats with the same few hundred KB."""

    def __init__(self, keep: int, totals: dict):
        self.keep, self.totals, self.seen = keep, totals, 0
        self.ring: collections.deque = collections.deque(maxlen=keep)
        self.lock = threading.Lock()

    def add(self, rec: dict, counts: dict) -> None:
        with self.lock:
            self.seen += 1
            self.ring.append({"seq": self.seen, **rec})
            for k, v in counts.items():
                self.totals[k] = self.totals.get(k, 0) + v

    def view(self, since: int = 0) -> dict:
        with self.lock:
            return {"records": [r for r in self.ring if r["seq"] > since], "seen": self.seen,
                    "dropped": self.seen - len(self.ring), "totals": dict(self.totals)}


class EngineLoop:
    """The scheduler on its own thread; `submit` from any thread. Between steps it moves the scheduler's
    finished requests and decode rounds into bounded logs (`RecordLog`), so memory stays flat however long
    the server runs."""

    def __init__(self, sched, idle_wait_s: float = 0.02, keep: int | None = KEEP_RECORDS):
        """`keep`: requests and rounds kept for /stats (and KEEP_TIMELINES timelines); None keeps every one
        (a measurement that reads all of a bounded replay)."""
        if keep is not None and keep < 1:
            raise BadInput(f"keep must be >= 1 (records kept), got {keep}")
        self.sched, self.idle_wait_s = sched, idle_wait_s
        self.inbox: queue.Queue = queue.Queue()
        self.aborts: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="labkit-engine", daemon=True)
        self.errors: collections.deque = collections.deque(maxlen=100)
        self.requests = RecordLog(keep, {"ok": 0, "failed": 0, "aborted": 0, "prompt_tokens": 0,
                                         "output_tokens": 0})
        self.rounds = RecordLog(keep, {"rounds": 0, "switches": 0, "stalls": 0, "h2d_bytes": 0, "copies": 0})

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

    def _collect(self) -> None:
        """The scheduler's finished requests and rounds into the logs (this thread owns the scheduler)."""
        s = self.sched
        if s.finished:
            done, s.finished[:] = list(s.finished), []
            for r in done:
                kind = "ok" if r.status == "done" else ("aborted" if r.status == "aborted" else "failed")
                self.requests.add(r.record(), {kind: 1, "prompt_tokens": len(r.prompt), "output_tokens": len(r.tokens)})
        n = len(s.rounds)
        n -= n % s.timeline_every if s.timeline_every > 0 else 0     # keeps the timeline's sampling phase
        if n:
            gone, s.rounds[:n] = s.rounds[:n], []
            for rec in gone:
                self.rounds.add(rec, {"rounds": 1, "switches": rec["switches"], "stalls": rec["stalls"],
                                      "h2d_bytes": rec["h2d_bytes"], "copies": rec["copies"]})
        if self.requests.keep is not None and len(s.timelines) > KEEP_TIMELINES:
            s.timelines[:len(s.timelines) - KEEP_TIMELINES] = []

    def round_view(self) -> dict:
        """The newest rounds: those moved into the log, then the few the scheduler still holds (fewer than
        its timeline's sampling period; a list copy from another thread is one step for the interpreter)."""
        held = list(self.sched.rounds)
        v = self.rounds.view()
        tot = dict(v["totals"])
        for rec in held:
            for k in ("switches", "stalls", "h2d_bytes", "copies"):
                tot[k] += rec[k]
        tot["rounds"] += len(held)
        keep = self.rounds.keep or tot["rounds"]
        recent = [{k: r[k] for k in r if k != "seq"} for r in v["records"]] + held
        return {"rounds": recent[-keep:] if keep else [], "totals": tot, "dropped": max(0, tot["rounds"] - keep)}

    def _run(self) -> None:
        while not self._stop.is_set():
            self._take(block=False)
            self._abort_pending()
            try:
                did = self.sched.step()
            except Exception as ex:         # noqa: BLE001 - the scheduler records request failures itself
                self.errors.append(f"{type(ex).__name__}: {ex}")
                did = False
            self._collect()
            if not did:
                self._take(block=True)


class BodyTooLarge(Exception):
    pass


async def _json_body(http, limit: int):
    """The body as JSON, or an error line: larger than `limit` bytes (BodyTooLarge, known from its
    Content-Length before anything is read, or as soon as that many bytes arrived), cut off, not JSON, or
    nested too deep for the parser."""
    # starlette comes with the optional `serve` extra (FastAPI)
    from starlette.requests import ClientDisconnect
    too_big = f"the request body is larger than this server's limit of {limit:,} bytes (labkit serve --max-body-mib)"
    length = http.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise BodyTooLarge(too_big)
    chunks, got = [], 0
    try:
        async for chunk in http.stream():
            got += len(chunk)
            if got > limit:
                raise BodyTooLarge(too_big)
            chunks.append(chunk)
    except ClientDisconnect:                # the body was cut off: nobody is listening for an answer
        return None, "the client disconnected before sending the whole body"
    try:
        return json.loads(b"".join(chunks)), None
    except RecursionError:
        return None, "body is nested too deeply"
    except ValueError as ex:
        return None, f"body is not JSON: {ex}"


def _request_id(http, body: dict) -> str:
    """As vLLM names a request: the client's `X-Request-Id` header, else the body's `request_id`, else a fresh
    one (a client that sends its own id finds its request under it in /stats)."""
    rid = http.headers.get("x-request-id") or body.get("request_id")
    if isinstance(rid, str) and 0 < len(rid) <= 128 and rid.isprintable():
        return rid
    return uuid.uuid4().hex[:16]


def _prompt_bound(body: dict, chat: bool, text: TokenText) -> int:
    """The fewest tokens the request's prompt can become, from its length alone (before any tokenizing or
    template rendering); BadInput for text that is not valid Unicode."""
    if chat:                # the template renders each message's role as well as its text
        return sum(text.at_least(m["role"], "a message role") + text.at_least(m["content"], "message content")
                   for m in messages(body))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]
    return text.at_least(prompt) if isinstance(prompt, str) else len(prompt) if isinstance(prompt, list) else 0


def _body_reader(max_body_bytes: int, capacity: int, text: TokenText, model_name: str):
    """`read(http)`: a request's body as (body, None), or (None, the error response): larger than
    `max_body_bytes` (413), not a JSON object, a string that is not valid Unicode or cannot fit the context, a
    model that is not this server's (404, as vLLM answers)."""
    async def read(http):
        try:
            body, why = await _json_body(http, max_body_bytes)
        except BodyTooLarge as ex:
            return None, _error(413, str(ex), "RequestEntityTooLarge")
        if why or not isinstance(body, dict):
            return None, _error(400, why or "body must be a JSON object")
        try:
            check_text(body, capacity, text)      # every string, whatever its field: before anything reads it
        except BadInput as ex:
            return None, _error(400, str(ex))
        asked = body.get("model")
        if asked is not None and not isinstance(asked, str):
            return None, _error(400, "model must be a string", param="model")
        if asked is not None and asked != model_name:       # vLLM: 404 for a model it does not serve
            shown = asked if len(asked) <= 200 else asked[:200] + "...[truncated]"     # as vLLM cuts what it echoes
            return None, _error(404, f"The model `{shown}` does not exist. Valid aliases: {model_name}",
                                "NotFoundError", "model")
        return body, None
    return read


def create_app(loop: EngineLoop, model_name: str = "labkit", text: TokenText | None = None,
               max_body_bytes: int = MAX_BODY_MIB << 20):
    # FastAPI is the optional `serve` extra
    from fastapi import FastAPI, Request as HTTPRequest
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI(title="labkit engine")
    sched = loop.sched
    capacity = min(l.cache.capacity for l in sched.lanes.values())
    vocab = next(iter(sched.lanes.values())).engine.model.shape.vocab
    text = text or TokenText(None, vocab)
    metrics = ServeMetrics(sched, model_name, capacity)
    app.add_middleware(HttpMetrics, router=app.router, families=metrics.http)     # the http_* families
    started = int(time.time())

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    _body = _body_reader(max_body_bytes, capacity, text, model_name)
    _token_routes(app, _body, text, capacity)
    _info_routes(app, loop, metrics, model_name, capacity, started)

    async def serve(http: HTTPRequest, chat: bool):
        # the request's clock starts before its body is read and tokenized: a client's TTFT includes both
        arrival = sched.now()
        body, err = await _body(http)
        if err:
            return err
        try:
            at_least = _prompt_bound(body, chat, text)          # no tokenizing for a prompt that cannot fit
            asked = 0 if chat else max(0, int_field(body, "max_tokens", 16))
            if at_least + asked > capacity:
                raise BadInput(f"This model's maximum context length is {capacity:,} tokens: the prompt (at least "
                               f"{at_least:,} tokens)" + (f" and max_tokens {asked} exceed it" if asked else " exceeds it"))
            # tokenizing (and a chat template) off the event loop: /health and the streams go on meanwhile
            ids, shown = await asyncio.to_thread(prompt_ids, body, chat, text)
            sp = Sampling(body, chat, max(1, capacity - len(ids)) if chat else 16, vocab, text)
            gen = Generation(loop, ids, sp, f"{'chatcmpl' if chat else 'cmpl'}-{_request_id(http, body)}", metrics,
                             shown)
            gen.start(arrival)
        except BadInput as ex:
            return _error(400, str(ex), param=getattr(ex, "param", None))
        reply = Reply(gen, sp, chat, model_name)
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


def _token_routes(app, read_body, text: TokenText, capacity: int) -> None:
    """vLLM's /tokenize and /detokenize, answered with this server's tokens."""
    # FastAPI is the optional `serve` extra
    from fastapi import Request as HTTPRequest
    _body = read_body

    @app.post("/tokenize")
    async def tokenize(http: HTTPRequest):
        """vLLM's /tokenize: the tokenizer's ids for a prompt or chat messages (the template applied, the
        assistant turn opened unless `add_generation_prompt` is false), `count` (what `usage.prompt_tokens`
        will say) and `max_model_len`; `return_token_strs` adds the tokenizer's strings. /detokenize inverts it."""
        body, err = await _body(http)
        if err:
            return err
        chat = "messages" in body
        try:
            if _prompt_bound(body, chat, text) > capacity:
                raise BadInput(f"This model's maximum context length is {capacity:,} tokens: the prompt exceeds it")
            _, ids = await asyncio.to_thread(prompt_ids, body, chat, text)
            if len(ids) > capacity:     # what a completion would refuse: never millions of ids in an answer
                raise BadInput(f"This model's maximum context length is {capacity:,} tokens. However, your prompt "
                               f"contains {len(ids):,} input tokens, which exceeds this limit even without any "
                               f"output tokens. Please reduce the length of the input prompt.")
            strs = None
            if bool_field(body, "return_token_strs"):
                opened = bool_field(body, "add_generation_prompt", True)
                shown = await asyncio.to_thread(text.render, messages(body), opened) if chat else body.get("prompt")
                strs = await asyncio.to_thread(text.token_strs, shown) if isinstance(shown, str) else None
        except BadInput as ex:
            return _error(400, str(ex))
        return {"count": len(ids), "max_model_len": capacity, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(http: HTTPRequest):
        """vLLM's /detokenize: the tokenizer's text for its ids, so it inverts /tokenize and an answer's ids
        (`return_token_ids`, each generated word's id) give back its text (`TokenText.decode`)."""
        body, err = await _body(http)
        if err:
            return err
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            return _error(400, "tokens must be a list of integers")
        if len(ids) > capacity:         # no answer of this server is longer: never a text of millions of words
            return _error(400, f"This model's maximum context length is {capacity:,} tokens: {len(ids):,} tokens "
                               "exceed it")
        try:
            return {"prompt": await asyncio.to_thread(text.decode, ids)}
        except BadInput as ex:
            return _error(400, str(ex))


def _info_routes(app, loop: EngineLoop, metrics: "ServeMetrics", model_name: str, capacity: int, started: int) -> None:
    """What the server says about itself: /v1/models, /metrics, /stats, /timeline."""
    # FastAPI is the optional `serve` extra
    from fastapi.responses import Response
    sched = loop.sched

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                            "owned_by": "labkit", "root": model_name, "parent": None,
                                            "max_model_len": capacity}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.page(), media_type=CONTENT_TYPE)

    @app.get("/stats")
    async def stats(since: int = 0):
        """The newest finished requests (those numbered above `since`), the newest decode rounds, and totals
        over everything the server has done (`records_seen`, `records_dropped`: beyond the ring)."""
        req, rounds = loop.requests.view(since), loop.round_view()
        return {"records": req["records"], "records_seen": req["seen"], "records_dropped": req["dropped"],
                "totals": req["totals"], "rounds": rounds["rounds"], "round_totals": rounds["totals"],
                "rounds_dropped": rounds["dropped"], "errors": list(loop.errors), "graphs": sched.graphs,
                "graph_error": sched.graph_error}

    @app.get("/timeline")
    async def timeline():
        return {"timelines": list(sched.timelines)}


def _error(status: int, msg: str, kind: str = "BadRequestError", param=None):
    """An error as vLLM's OpenAI server words it."""
    # FastAPI is the optional `serve` extra
    from fastapi.responses import JSONResponse
    return JSONResponse({"error": {"message": msg, "type": kind, "param": param, "code": status}}, status_code=status)


class Overflow:
    """A placement as `labkit serve` uses it: where the policy says, but a request whose lane has no free
    slot (or pages) takes one of the other lane, so every slot serves, as all of vLLM's `--max-num-seqs` do.
    With the lanes full it waits for the lane its policy named (first come, first served)."""

    def __init__(self, inner):
        self.inner = inner

    def place(self, req, sched) -> str:
        name = self.inner.place(req, sched)
        if sched.lanes[name].fits(req):
            return name
        need = len(req.prompt) + req.max_tokens
        other = next((n for n, l in sched.lanes.items() if n != name and need <= l.cache.capacity and l.fits(req)),
                     None)
        return other or name


def build(args) -> EngineLoop:
    """The engine `labkit serve`'s options describe (checked by `labkit.serving.serve_cli` before this runs)."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    lanes = make_lanes(args.shape, device, args.resident_slots, args.offload_slots, capacity=args.capacity,
                       budget=args.budget, strategy=args.strategy, seed=args.seed, page_size=args.page_size,
                       prefill_chunk=args.prefill_chunk, compile=args.compile)
    costs = calibrate(lanes, graphs=args.graphs) if args.policy == "adaptive" else None
    policy = parse_policy(args.policy, costs)
    if isinstance(policy, Threshold) and getattr(args, "overflow", "on") == "on":
        policy = Overflow(policy)
    sched = Scheduler(lanes, policy, switching=args.switching == "on",
                      timeline_every=args.timeline_every, graphs=args.graphs)
    return EngineLoop(sched, keep=getattr(args, "keep_records", KEEP_RECORDS))


def serve_in_thread(app, port: int | None = None, **config):
    """`app` served by uvicorn on a thread of this process at 127.0.0.1 (a free port unless `port`), returned once
    `/health` answers 200 (up to ~30 s): (url, server, thread); `server.should_exit = True` stops it. How the tests
    and the client-TTFT split (`ttftsplit`) serve the engine's app beside their own clients."""
    port = port or free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **config))
    th = threading.Thread(target=srv.run, daemon=True)        # uvicorn's event loop runs on this thread
    th.start()
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    return url, srv, th
