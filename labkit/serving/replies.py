"""A started generation's answer in the shapes vLLM 0.32's OpenAI server gives: the same fields (null where
labkit has nothing to put), server-sent chunks or one whole response. A client that reads vLLM reads these.

Streamed chat sends the `{"role": "assistant", "content": ""}` chunk when the first token is ready, just
before that token's chunk, as vLLM does: a client that times the first chunk (`vllm bench serve`'s chat
backend) then measures the time to the first token, not to the request's acceptance.
"""
from __future__ import annotations

import json
import time

from .. import __version__
from .generation import Event, Generation, Sampling, TokenLogprob
from .tokentext import piece

FINGERPRINT = f"labkit-{__version__}"


def _token_entry(tok: int, logprob: float) -> dict:
    text = piece(tok)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[TokenLogprob], n: int) -> dict:
    """Chat's `logprobs`: per token its text, log-probability, UTF-8 bytes and the `n` most likely."""
    out = []
    for e in entries:
        alts, seen = [], set()
        for tok, lp in [(e.token, e.logprob), *e.top]:     # vLLM: the chosen token first, then the best
            if tok not in seen:
                seen.add(tok)
                alts.append(_token_entry(tok, lp))
        out.append({**_token_entry(e.token, e.logprob), "top_logprobs": alts[:n]})
    return {"content": out}


def completion_logprobs(entries: list[TokenLogprob], n: int) -> dict:
    """Completions' `logprobs`: tokens, their log-probabilities and text offsets, and per token a map of the
    chosen token and the `n` most likely (by text, as vLLM's)."""
    tops = []
    for e in entries:
        d = {piece(e.token): e.logprob}
        for tok, lp in e.top[:n]:
            d.setdefault(piece(tok), lp)
        tops.append(d)
    return {"text_offset": [e.text_offset for e in entries], "token_logprobs": [e.logprob for e in entries],
            "tokens": [piece(e.token) for e in entries], "top_logprobs": tops}


class Reply:
    def __init__(self, gen: Generation, sp: Sampling, chat: bool, model_name: str):
        self.gen, self.sp, self.chat, self.model_name = gen, sp, chat, model_name
        self.rid, self.created = gen.req.id, int(time.time())

    def head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model_name}

    def _lp(self, entries: list[TokenLogprob]):
        if self.sp.logprobs is None:
            return None
        return (chat_logprobs if self.chat else completion_logprobs)(entries, self.sp.logprobs)

    def _usage(self, n: int, details: bool = False) -> dict:
        u = self.gen.usage(n)
        if details:                        # chat's per-chunk usage carries this one null
            u["completion_tokens_details"] = None
        return u

    # -- streamed
    def _chunk(self, ev: Event) -> dict:
        gen, sp = self.gen, self.sp
        ids = [sp.shown(ev.token)] if sp.token_ids else None
        lp = self._lp([ev.logprob] if ev.logprob is not None else [])
        if self.chat:
            choice = {"index": 0, "delta": {"content": ev.text}, "logprobs": lp, "finish_reason": ev.finish}
            if ev.finish:
                choice["stop_reason"] = gen.stop_reason
            choice["token_ids"] = ids
            msg = {**self.head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": ev.text, "logprobs": lp, "finish_reason": ev.finish,
                      "stop_reason": gen.stop_reason if ev.finish else None, "prompt_token_ids": None,
                      "token_ids": ids}
            msg = {**self.head("text_completion"), "choices": [choice]}
        if sp.usage_on and sp.continuous_usage:
            msg["usage"] = self._usage(ev.n_tokens, details=self.chat)     # as of this token
        if ev.finish and not sp.usage_on:       # else the usage chunk that follows carries it
            msg["system_fingerprint"] = FINGERPRINT
        return msg

    def _role_chunk(self) -> dict:
        msg = {**self.head("chat.completion.chunk"),
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}]}
        if self.sp.usage_on and self.sp.continuous_usage:
            p = len(self.gen.req.prompt)
            msg["usage"] = {"prompt_tokens": p, "total_tokens": p, "completion_tokens": 0,
                            "completion_tokens_details": None}
        msg.update(prompt_token_ids=list(self.gen.shown_prompt) if self.sp.token_ids else None, prompt_text=None)
        return msg

    async def events(self):
        gen, sp = self.gen, self.sp

        def sse(msg: dict) -> str:
            return f"data: {json.dumps(msg)}\n\n"

        try:
            first = True
            async for ev in gen.deltas():
                if first and self.chat:          # vLLM's role chunk: with the first token, not before it
                    yield sse(self._role_chunk())
                msg = self._chunk(ev)
                if first and not self.chat and sp.token_ids:
                    msg["choices"][0]["prompt_token_ids"] = list(gen.shown_prompt)
                first = False
                yield sse(msg)
            if gen.req.status == "failed":
                yield sse({"error": {"message": gen.req.error, "type": "InternalServerError", "code": 500}})
            elif sp.usage_on:
                yield sse({**self.head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                           "usage": gen.usage(), "system_fingerprint": FINGERPRINT})
            yield "data: [DONE]\n\n"
        finally:
            gen.abort()     # a no-op once ended; otherwise the client went away mid-stream

    # -- whole
    def whole(self) -> dict:
        gen, sp = self.gen, self.sp
        finish = gen.finish_reason or "length"
        ids = [sp.shown(t) for t in gen.req.tokens] if sp.token_ids else None
        prompt_ids = list(gen.shown_prompt) if sp.token_ids else None
        usage = {**gen.usage(), "prompt_tokens_details": None, "completion_tokens_details": None}
        lp = self._lp(gen.logprobs)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": gen.text, "refusal": None,
                                              "annotations": None, "audio": None, "function_call": None,
                                              "reasoning": None},
                      "logprobs": lp, "finish_reason": finish, "stop_reason": gen.stop_reason, "token_ids": ids,
                      "routed_experts": None}
            return {**self.head("chat.completion"), "choices": [choice], "service_tier": None,
                    "system_fingerprint": FINGERPRINT, "usage": usage, "prompt_logprobs": None,
                    "prompt_token_ids": prompt_ids, "prompt_text": None, "kv_transfer_params": None,
                    "ec_transfer_params": None, "metrics": None}
        choice = {"index": 0, "text": gen.text, "logprobs": lp, "finish_reason": finish,
                  "stop_reason": gen.stop_reason, "token_ids": ids, "prompt_logprobs": None,
                  "prompt_token_ids": prompt_ids, "routed_experts": None}
        return {**self.head("text_completion"), "choices": [choice], "service_tier": None,
                "system_fingerprint": FINGERPRINT, "usage": usage, "kv_transfer_params": None,
                "ec_transfer_params": None, "metrics": None}
