"""Several requests' prompt chunks in one forward: chunked prefill with a token budget per forward, as vLLM's
scheduler fills `max_num_batched_tokens`.

    batch = BatchedPrefill(engine, max_tokens=8192)
    batch.add(PrefillRequest(slot=0, tokens=a)); batch.add(PrefillRequest(slot=1, tokens=b))
    while batch.pending:
        segments, finished = batch.step()     # one forward; finished: {slot: last-token logits}

    logits = yield from engine.prefill_batch([PrefillRequest(0, a), PrefillRequest(1, b)], max_tokens=8192)

Each forward takes the queued requests first come, first served: every request in turn gets as many of its
remaining tokens as the budget has left, so a long prompt spans several forwards and a short one ends mid-budget
with the next request's tokens behind it. At most one request is part-done between forwards (the last one a
forward reached), and it leads the next.

What runs once over all the forward's tokens, and what per request. The embedding, the n-gram rows, the dense
products, the hyper-connections and the routed experts see the forward's N rows as one matrix (the point of
batching: the expert GEMMs get a larger M). Per request: its K/V rows and index keys go to its own slot, its
queries attend causally to its own prefix (read back from its slot) and its own chunk (varlen attention: one
request's attention at a time, each over its own prefix), and DeltaNet's conv and chunked scan continue its own
state. `Engine.block` stays the one composition of a block; `BatchedPrefillIO` is the `io` it is given, and it
delegates each request's rows to that request's own prefill io (`Engine.request_io`: `sync`, or `rotating` with
four layer buffers of the request's length for each request in the forward).

A request's pages are reserved when it is added; its io (and with `rotating` its buffers) lives from its first
forward to its last. Bad input (a budget <= 0, a prompt longer than the cache's capacity, a slot given twice or
outside the cache, a start outside the prompt) is one ValueError before anything is reserved. The head is run
for a request once its last token is through, on that one row, as one-request prefill runs it; its slot's length
is set then. A pipeline stage (no embedding or no head) prefills through `Engine.prefill_chunks`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .hybrid import dn_prefill_segments
from .prefill_buffers import PrefillRequestIO
from .prefill_marks import NoMarks


@dataclass(frozen=True)
class PrefillRequest:
    slot: int
    tokens: torch.Tensor           # [T] the whole prompt's token ids
    start: int = 0                 # positions [0, start) are already in the slot (a cached prefix)


@dataclass(frozen=True)
class Segment:
    slot: int
    start: int                     # the request's positions [start, end) in this forward
    end: int


def check_requests(requests: list[PrefillRequest], max_tokens: int, cache, taken=()) -> None:
    """One ValueError for the first bad input, before anything is reserved; `taken`: slots already queued."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens (the token budget per forward) must be > 0, got {max_tokens}")
    seen = set(taken)
    for r in requests:
        if not 0 <= r.slot < cache.n_slots:
            raise ValueError(f"slot {r.slot} outside the cache's {cache.n_slots} slots")
        if r.slot in seen:
            raise ValueError(f"slot {r.slot} given to two requests of one batched prefill")
        seen.add(r.slot)
        if r.tokens.dim() != 1:
            raise ValueError(f"a request's tokens are one prompt [T], got shape {tuple(r.tokens.shape)}")
        T = r.tokens.numel()
        if T > cache.capacity:
            raise ValueError(f"prompt of {T} tokens (slot {r.slot}) exceeds the cache capacity {cache.capacity}")
        if not 0 <= r.start < T:
            raise ValueError(f"prefill start {r.start} outside the prompt [0, {T}) (slot {r.slot})")
    pages = cache.pages
    need = sum(max(0, math.ceil(r.tokens.numel() / pages.page_size) - len(pages.pages[r.slot])) for r in requests)
    if need > len(pages.free):
        raise ValueError(f"the requests need {need} KV pages, the pool has {len(pages.free)} free")


def plan_forward(queue: list, max_tokens: int) -> list[Segment]:
    """First come, first served: each queued request (`slot`, `T`, `next`: its first position not yet computed)
    takes what the budget has left of its remaining tokens."""
    left, out = max_tokens, []
    for r in queue:
        if left == 0:
            break
        n = min(left, r.T - r.next)
        out.append(Segment(r.slot, r.next, r.next + n))
        left -= n
    return out


@dataclass
class _Queued:
    slot: int
    tokens: torch.Tensor
    T: int
    next: int
    io: object = None              # the request's own prefill io, from its first forward to its last
    rows: slice | None = None      # its rows in the current forward


class BatchedPrefillIO(PrefillRequestIO):
    """The `io` of `Engine.block` for a forward over several requests' chunks (module docstring): the forward's
    rows are the requests' chunks one after another; what is per request goes to that request's io."""

    def __init__(self, engine, mark):
        self.e, self.fns, self.mark = engine, engine._eager_fns, mark
        self.reqs: list[_Queued] = []

    def begin_forward(self, reqs: list[_Queued], tokens: torch.Tensor) -> None:
        self.reqs, self.tokens = reqs, tokens

    def deltanet(self, blk, ki, x, d):
        c = self.e.cache
        segs = [(r.rows.start, r.rows.stop, c.dn_state[ki, r.slot], c.dn_conv[ki, r.slot]) for r in self.reqs]
        return dn_prefill_segments(blk, x, d, segs, self.mark)

    def write(self, ki, kv_rows, keys, scales) -> None:
        for r in self.reqs:
            r.io.write(ki, kv_rows[r.rows], keys[r.rows], scales[r.rows])

    def attend(self, ki, q, iq, iw, pos):
        outs = []
        for r in self.reqs:
            outs.append((yield from r.io.attend(ki, q[r.rows], iq[r.rows], iw[r.rows], pos[r.rows])))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class BatchedPrefill:
    """The queue of requests being prefilled and one forward at a time over `max_tokens` of their tokens
    (module docstring). `add` between forwards admits more (a slot freed by a finished request, say)."""

    def __init__(self, engine, max_tokens: int | None = None):
        m = engine.model
        if m.embed is None or m.lm_head is None:
            raise ValueError("batched prefill runs the whole model, embedding to head: a pipeline stage prefills "
                             "one request at a time (Engine.prefill_chunks)")
        self.e = engine
        self.max_tokens = engine.prefill_chunk if max_tokens is None else max_tokens
        check_requests([], self.max_tokens, engine.cache)
        self.queue: list[_Queued] = []
        self.io = BatchedPrefillIO(engine, NoMarks().mark)
        self.prefix: torch.Tensor | None = None

    @property
    def pending(self) -> int:
        """Requests not finished yet."""
        return len(self.queue)

    def add(self, *requests: PrefillRequest) -> None:
        """Queue requests (checked together, then their pages reserved)."""
        check_requests(list(requests), self.max_tokens, self.e.cache, taken=[r.slot for r in self.queue])
        for r in requests:
            self.e.cache.pages.reserve(r.slot, r.tokens.numel())
            self.queue.append(_Queued(r.slot, r.tokens, r.tokens.numel(), r.start))

    def _prefix(self) -> torch.Tensor | None:
        """`sync`'s prefix buffer, one for all requests: their attentions run one after another on one stream,
        so each reads its prefix into the same rows (the longest queued prompt's worth)."""
        if self.e.prefill_mode != "sync":
            return None
        T = max(r.T for r in self.queue)
        if self.prefix is None or self.prefix.shape[0] < T:
            self.prefix = torch.empty((T, self.e.cache.row_words()), dtype=torch.int64, device=self.e.model.device)
        return self.prefix

    def step(self) -> tuple[list[Segment], dict[int, torch.Tensor]]:
        """One forward: the segments it computed, and {slot: last-token logits [1, vocab]} of the requests it
        finished (their io finished, their slot's length set)."""
        segs = plan_forward(self.queue, self.max_tokens)
        reqs, at = self.queue[:len(segs)], 0
        for r, s in zip(reqs, segs):
            if r.io is None:
                r.io = self.e.request_io(r.slot, r.T, self._prefix())
                r.io.mark = self.io.mark
            r.io.begin_chunk(s.start, s.end)
            r.rows, at = slice(at, at + s.end - s.start), at + s.end - s.start
        m = self.e.model
        tokens = torch.cat([r.tokens[s.start:s.end] for r, s in zip(reqs, segs)]).to(m.device)
        pos = torch.cat([torch.arange(s.start, s.end, device=m.device) for s in segs])
        self.io.begin_forward(reqs, tokens)
        x = self.e.prefill_forward(tokens, None, pos, self.io)
        done = {}
        for r, s in zip(reqs, segs):
            r.next = s.end
            if r.next == r.T:          # the head on this request's last row alone, as one-request prefill runs it
                done[r.slot] = m.norm(x[r.rows.stop - 1:r.rows.stop]) @ m.lm_head
                r.io.finish()
                r.io = None            # its buffers go before the next forward's requests take theirs
                self.e.cache.lens[r.slot] = r.T
        self.io.begin_forward([], None)
        self.queue = [r for r in self.queue if r.next < r.T]
        return segs, done
