"""What a request to `labkit serve` asks of generation, and one request from submission to its end, with
vLLM's (0.32) semantics where a client can tell them apart.

- **Stop conditions.** `max_tokens` (chat: `max_completion_tokens` first); `stop` strings (at most 4, vLLM's
  cap, each at most 1,024 characters, labkit's): the text ends before the stop string unless
  `include_stop_str_in_output`; when several complete in the same token, the one that completes first wins
  (ties: list order); `stop_token_ids`: the token counts, its text is dropped unless
  `include_stop_str_in_output`. `min_tokens` m: as vLLM's logits processor does, the stop token ids are
  banned (masked in the logits) for the first m tokens, so a stop token can end a request only from token
  m + 1 on, and a stop string counts only when it completes in a token after the m-th. There is no EOS
  (the weights are random; `ignore_eos` changes nothing).
- **Logprobs.** Completions' `logprobs` N and chat's `logprobs` + `top_logprobs` N (0-20, vLLM's default
  cap), from the raw logits of the token's step (before any ban), as vLLM's default `raw_logprobs` mode:
  the chosen token's log-probability and the N most likely. `prompt_logprobs` is refused (400): the engine
  computes no logits for prompt positions.
- Decoding is greedy whatever `temperature` / `top_p` say: the weights are random, sampling measures nothing
  more. Only a request that needs its logits (logprobs, or banned tokens) reads them back (`Request.pick`).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..params import BadInput
from .promserve import ServeMetrics
from .tokentext import TokenText, piece, utf8_len
from ..engine.drive.scheduler import Request
from .. import lazy

torch = lazy.module("torch")     # imported at the first token, not when this module loads

MAX_LOGPROBS = 20          # vLLM's default --max-logprobs
MAX_STOP_STRINGS = 4       # vLLM 0.32's VLLM_MAX_STOP_STRINGS default (OpenAI's API takes "up to 4" too)
MAX_STOP_CHARS = 1024      # labkit's: vLLM has no length cap (a stop string is searched for after every token)


class BadParam(BadInput):
    """A 400 about one request field, worded as vLLM words it (the field named in `param`)."""

    def __init__(self, msg: str, param: str, value=None):
        tail = f"parameter={param}" + (f", value={value}" if value is not None else "")
        super().__init__(f"{msg} ({tail})")
        self.param = param


def int_field(body: dict, key: str, default):
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool):
        raise BadInput(f"{key} must be an integer")
    return v


def bool_field(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadInput(f"{key} must be true or false")
    return v


def prompt_ids(body: dict, chat: bool, text: TokenText) -> tuple[list[int], list[int]]:
    """A request's prompt as (the engine's ids, the ids a client sees): chat messages through the template
    (the assistant turn opened unless `add_generation_prompt` is false, as vLLM) and a string prompt through
    the tokenizer, folded for the engine (`TokenText.engine_ids`); a list of ids as it is, both ways."""
    if chat:
        shown = text.chat(messages(body), bool_field(body, "add_generation_prompt", True))
        return text.engine_ids(shown), shown
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        if len(prompt) != 1:
            raise BadInput("one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, str):
        shown = text.encode(prompt)
        return text.engine_ids(shown), shown
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt, prompt
    raise BadInput("prompt must be a string or a list of token ids")


def messages(body: dict) -> list[dict]:
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
    """The request's stop strings: at most MAX_STOP_STRINGS (vLLM's cap), each at most MAX_STOP_CHARS long
    (labkit's: every one is searched for after every token, on the scheduler's thread that all requests share,
    and streamed text is held back by the longest one's length)."""
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadInput("stop must be a string or a list of strings")
    if len(stop) > MAX_STOP_STRINGS:
        raise BadParam(f"stop takes at most {MAX_STOP_STRINGS} strings (vLLM's VLLM_MAX_STOP_STRINGS), got "
                       f"{len(stop):,}", "stop")
    for s in stop:
        utf8_len(s, "a stop string")
        if len(s) > MAX_STOP_CHARS:
            raise BadParam(f"a stop string may be at most {MAX_STOP_CHARS:,} characters long, got one of "
                           f"{len(s):,}", "stop")
    return [s for s in stop if s]


def _logprobs(body: dict, chat: bool, vocab: int) -> int | None:
    """How many alternatives per token the request asks for (None: no logprobs), as vLLM checks it."""
    if body.get("prompt_logprobs") is not None:
        raise BadInput("prompt_logprobs is not supported: the engine computes no logits for prompt positions")
    if chat:
        want = bool_field(body, "logprobs")
        n = int_field(body, "top_logprobs", None)
        if n is not None and not want and n != 0:
            raise BadParam("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        if not want:
            return None
        n = n or 0
    else:
        v = body.get("logprobs")
        if v is None:
            return None
        if not isinstance(v, int):         # vLLM's parser takes true/false as 1/0 too
            raise BadInput("logprobs must be an integer")
        n = int(v)
    if n == -1:
        n = vocab                          # vLLM: -1 asks for the whole vocabulary
    if n < 0:
        raise BadInput(f"logprobs must be non-negative, got {n}")
    if n > MAX_LOGPROBS:
        raise BadParam(f"Requested sample logprobs of {n}, which is greater than max allowed: {MAX_LOGPROBS}",
                       "logprobs", n)
    return n


class Sampling:
    """What a request asks of generation, parsed and checked (BadInput: one line, HTTP 400)."""

    def __init__(self, body: dict, chat: bool, default_max: int, vocab: int, text: TokenText | None = None):
        """`text`: the ids a client sees (`TokenText.shown`; stop_token_ids are read in them); None: the
        engine's own."""
        if chat:
            mt = int_field(body, "max_completion_tokens", None)
            mt = int_field(body, "max_tokens", default_max) if mt is None else mt
        else:
            mt = int_field(body, "max_tokens", default_max)
        self.max_tokens = mt
        self.min_tokens = int_field(body, "min_tokens", 0)
        if self.min_tokens < 0:
            raise BadInput(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.min_tokens > mt:
            raise BadInput(f"min_tokens must be less than or equal to max_tokens={mt}, got {self.min_tokens}.")
        if int_field(body, "n", 1) != 1:
            raise BadInput("n must be 1 (one choice per request)")
        if bool_field(body, "echo"):
            raise BadInput("echo is not supported")
        self.stop = _stops(body)
        ids = body.get("stop_token_ids") or []
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise BadInput("stop_token_ids must be a list of integers")
        # only ids the engine can generate can stop it: the set kept for the request's life is at most the
        # vocabulary, however long the list (vLLM refuses ids outside it; labkit keeps accepting them)
        text = text or TokenText(None, vocab)
        self.stop_ids = text.engine_stop_ids(ids)
        self.shown = text.shown             # a generated token's id as a client sees it
        self.include_stop = bool_field(body, "include_stop_str_in_output")
        bool_field(body, "ignore_eos")
        self.logprobs = _logprobs(body, chat, vocab)
        self.token_ids = bool_field(body, "return_token_ids")
        self.stream = bool_field(body, "stream")
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise BadInput("stream_options must be an object")
        if opts is not None and not self.stream:
            raise BadParam("Stream options can only be defined when `stream=True`.", "stream_options")
        self.usage_on = bool_field(opts or {}, "include_usage")
        self.continuous_usage = bool_field(opts or {}, "continuous_usage_stats")
        # vLLM holds back as many characters as a stop string could still be completed by (none when the
        # stop string is kept in the output)
        self.holdback = 0 if self.include_stop else max((len(s) for s in self.stop), default=1) - 1
        self.vocab = vocab


@dataclass
class TokenLogprob:
    """One generated token's log-probability and its most likely alternatives (ids, best first)."""
    token: int
    logprob: float
    top: list[tuple[int, float]]
    text_offset: int = 0


@dataclass
class Event:
    """What one generated token adds to the answer: its text delta (held-back text comes later), the
    finish reason once the request ends, the token itself, its logprobs, and how many tokens there are now."""
    text: str
    finish: str | None
    token: int
    logprob: TokenLogprob | None
    n_tokens: int


class Generation:
    """One request from submission to its end: the stop conditions are checked on the scheduler's thread
    right after each token (so a stopped request frees its slot at once); every token goes to the event
    loop as an `Event`."""

    def __init__(self, loop, ids: list[int], sp: Sampling, rid: str, metrics: ServeMetrics,
                 shown_prompt: list[int] | None = None):
        """`ids`: the engine's prompt; `shown_prompt`: the same prompt in the ids a client sees (default `ids`)."""
        self.sp, self.metrics, self.engine = sp, metrics, loop
        self.shown_prompt = list(ids) if shown_prompt is None else shown_prompt
        self.aio = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.text, self.sent = "", 0
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.ended = False
        self.logprobs: list[TokenLogprob] = []
        self._next_lp: TokenLogprob | None = None
        self.req = Request(ids, sp.max_tokens, id=rid, on_token=self._on_token, on_done=self._on_done)
        self._banned = sorted(i for i in sp.stop_ids if 0 <= i < sp.vocab) if sp.min_tokens else []
        if sp.logprobs is not None or self._banned:
            self.req.pick = self._pick

    # -- the scheduler's thread
    def _pick(self, req, logits) -> int:
        """The request's next token: the argmax, with the stop tokens banned until `min_tokens` are out; its
        logprobs noted from the raw logits when asked for."""
        if self._banned and len(req.tokens) < self.sp.min_tokens:
            masked = logits.clone()
            masked[self._banned] = float("-inf")
            tok = int(masked.argmax())
        else:
            tok = int(logits.argmax())
        if self.sp.logprobs is not None:
            lp = torch.log_softmax(logits.float(), dim=-1)
            n = min(self.sp.logprobs, lp.numel())
            top = lp.topk(n) if n else None
            pairs = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else []
            self._next_lp = TokenLogprob(tok, float(lp[tok]), pairs)
        return tok

    def _on_token(self, req, tok: int, t: float) -> None:
        self.metrics.token(req, t)
        if self.finish_reason is not None:          # a token after the request stopped (not expected): not shown
            return
        n, sp = len(req.tokens), self.sp
        before = len(self.text)
        lp, self._next_lp = self._next_lp, None
        if lp is not None:
            lp.text_offset = before
            self.logprobs.append(lp)
        self.text += piece(tok)
        if tok in sp.stop_ids:                      # banned until min_tokens: here only after them
            if not sp.include_stop:
                self.text = self.text[:before]
            self.finish_reason, self.stop_reason = "stop", sp.shown(tok)
        elif sp.stop and n > sp.min_tokens:
            best = None                             # the stop string that completes first in this token
            for s in sp.stop:
                i = self.text.find(s, max(0, before - len(s) + 1))
                if i >= 0 and (best is None or i + len(s) < best[0] + len(best[1])):
                    best = (i, s)
            if best is not None:
                i, s = best
                self.text = self.text[:i + len(s) if sp.include_stop else i]
                self.finish_reason, self.stop_reason = "stop", s
        if self.finish_reason is not None:
            req.max_tokens = n                      # ends now, through the scheduler's own finish path
        elif req.remaining == 0:
            self.finish_reason = "length"
        upto = len(self.text) if self.finish_reason else max(self.sent, len(self.text) - sp.holdback)
        delta, self.sent = self.text[self.sent:upto], upto
        self.aio.call_soon_threadsafe(self.events.put_nowait, Event(delta, self.finish_reason, tok, lp, n))

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
        """One `Event` per token; ends when the request has ended."""
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

    def usage(self, n: int | None = None) -> dict:
        """The usage block, after `n` tokens (default: all so far)."""
        n, p = len(self.req.tokens) if n is None else n, len(self.req.prompt)
        return {"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n}
