"""Engine: chunked prefill and the batched decode step, both through one block forward.

    engine = Engine(model, cache, get_strategy("zero_copy"), budget=2048)
    engine.prefill(slot, tokens)             # K/V rows to the pool, index keys to the device
    runner = DecodeRunner(engine, batch=4)   # drive/runner.py: static buffers, CUDA graphs where they fit
    runner.step()                            # one token for each of the 4 requests

`Engine.block` is the one composition of a block. It is a generator: a QSA block's attention is
`yield from io.attend(...)`, and the decode step's attention yields a `LoadRequest` (the selected rows
of that layer) at exactly the point where a runner must move them, or a scheduler may switch to other
work while they travel. Prefill's attention (dense, over the prefix read back from the pool) yields
nothing. Requests in one decode batch may have different lengths.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import deltanet_step, qsa_step
from .attention import PREFILL_ATTENTION, prefill_attend, split_rows
from .cache import OffloadCache
from .deltanet_step import delta_step, deltanet_mix
from .gemv import norm_matmul
from .hc_mix import add_rows, settle
from .hybrid import block_fns, dn_prefill, hc_head
from .indexer import index_scores
from .prefill_batch import BatchedPrefill, PrefillRequest
from .prefill_buffers import PrefillRequestIO, RotatingPrefillIO
from .prefill_marks import NoMarks
from .select import select_blocks, select_topk
from .step_state import StepBuffers

if TYPE_CHECKING:      # the model does not depend on the transfer mechanisms, only on their interface
    from ..transfer.base import TransferStrategy


@dataclass
class LoadRequest:
    layer: int                 # QSA layer (pool layer)
    rows: torch.Tensor         # [B*k] physical rows to load
    out: torch.Tensor          # [B*k, W] int64 staging on the compute device


@dataclass(frozen=True)
class BlockDone:
    block: int                 # model block just enqueued (a layer boundary of the decode step)


class _NoMarks:
    def mark(self, phase: str, new_block: bool = False) -> None:
        pass


NO_MARKS = _NoMarks()


class Engine:
    def __init__(self, model, cache: OffloadCache, strategy: TransferStrategy, budget: int,
                 prefill_chunk: int = 8192, compile: bool | None = None, prefill_mode: str = "sync",
                 select_block: int = 1, prefill_attention: str = "dense"):
        if budget <= 0:
            raise ValueError(f"budget must be > 0, got {budget}")
        # select_block > 1: decode keeps whole aligned blocks of positions (select.select_blocks); a block
        # must lie inside one page so that it is consecutive pool rows (one copy for block_dma)
        if select_block < 1 or budget % select_block or cache.pages.page_size % select_block:
            raise ValueError(f"select_block must be >= 1 and divide the budget ({budget}) and the page size "
                             f"({cache.pages.page_size}), got {select_block}")
        self.select_block = select_block
        check_prefill_mode(prefill_mode, cache.pool.medium)
        if prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(f"unknown prefill_attention {prefill_attention!r}: choose from {', '.join(PREFILL_ATTENTION)}")
        self.prefill_mode, self.prefill_attention = prefill_mode, prefill_attention
        if (cache.pool.medium == "device") != (strategy.medium == "device"):
            raise ValueError(f"strategy {strategy.name} needs a {strategy.medium} pool, cache has {cache.pool.medium}")
        self.model, self.cache, self.strategy, self.budget = model, cache, strategy, budget
        self.prefill_chunk = prefill_chunk
        self.fns = block_fns(model.device.type == "cuda" if compile is None else compile)
        self._eager_fns = block_fns(False)      # prefill: every chunk a new shape, nothing to reuse

    # ------------------------------------------------------------------ the block
    def block(self, blk, ki: int, x: tuple[torch.Tensor, torch.Tensor], pos: torch.Tensor, io):
        """The residual pair x = (h, d) [N, hidden] each, hidden state h + d, at positions pos [N] ->
        the pair after the block (`hybrid.py` says why a pair). `io` says how attention and the
        DeltaNet state are reached (prefill: one request's chunk; decode: a batch, one token each)
        and where the anatomy's phase lines fall. With hyper-connections the pair is the stream of
        `hc_count` copies [N, hc * hidden]: each sub-block takes its mix as a pair of its own and the stream
        gets its output back injected (`hybrid.hc_in`, `hc_out`)."""
        f, mark = io.fns, io.mark
        if blk.ngram:                      # the n-gram embedding joins the stream (every copy)
            mark("ngram", new_block=True)
            e = io.ngram_rows(pos)
            x = (x[0], add_rows(x[1], e) if blk.hc1 is not None else x[1] + e)
        if blk.hc1 is not None:
            mark("hc", new_block=not blk.ngram)
            stream, *x, inj = f.hc_in(blk.hc1, *x)
        if blk.kind == "dn":
            mark("deltanet", new_block=blk.hc1 is None and not blk.ngram)
            x = io.deltanet(blk, ki, *x)
            if not blk.moe and blk.hc1 is None:
                mark("dn_ffn")
        else:
            mark("weights", new_block=blk.hc1 is None and not blk.ngram)
            if qsa_step.FUSED_QSA and f.compiled:       # the decode step: q/k norms, RoPE, the row in one kernel
                h, y, k8, sc, iq, iw = f.qsa_project(blk, *x)
                q, gate, kv_row = qsa_step.qsa_heads(blk.mixer, y, pos)
            else:
                h, q, gate, kv_row, k8, sc, iq, iw = f.qsa_pre(blk, *x, pos)
            io.write(ki, kv_row, k8, sc)
            att = yield from io.attend(ki, q, iq, iw, pos)
            mark("weights")
            x = (h, f.qsa_out(blk, att, gate))
            if not blk.moe and blk.hc1 is None:
                mark("ffn")
        if blk.hc1 is not None:
            mark("hc")
            x = f.hc_out(stream, inj, x[1])
            stream, *x, inj = f.hc_in(blk.hc2, *x)
        if blk.moe:
            mark("experts")
            h, out, n = f.moe_residual(blk, *x)
            io.experts_read(n)
            x = (h, out)
        else:
            if blk.hc1 is not None:
                mark("dn_ffn" if blk.kind == "dn" else "ffn")
            x = f.ffn_residual(blk, *x)
        if blk.hc1 is not None:
            mark("hc")
            x = f.hc_out(stream, inj, x[1])
        return x

    # ------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def prefill(self, slot: int, tokens: torch.Tensor | None, hidden: torch.Tensor | None = None,
                start: int = 0, marks=None) -> torch.Tensor:
        """Run a prompt through the model in chunks; K/V rows go to the pool, index keys to the device.
        Returns the last token's logits; a pipeline stage without the head returns the hidden states
        of all tokens instead, and one without the embedding takes them as `hidden` [T, hidden]."""
        chunks = self.prefill_chunks(slot, tokens, hidden, start, marks)
        while True:
            try:
                next(chunks)
            except StopIteration as done:
                return done.value

    def prefill_chunks(self, slot: int, tokens: torch.Tensor | None, hidden: torch.Tensor | None = None,
                       start: int = 0, marks=None):
        """`prefill` one chunk at a time: a generator that yields `(start, end)` after each chunk and
        returns what `prefill` returns, so a scheduler can run decode steps between a prompt's chunks.
        The slot's length is set when the last chunk is done. Drive it under `torch.inference_mode()`
        (a context entered inside a generator would stay on in the caller between chunks).
        `start`: positions [0, start) are already in the cache (a cached prefix, or a bench that
        measures the last chunks of a long prompt); only [start, T) is computed.
        `self.prefill_mode` says how a chunk reaches its prefix: `sync` (read back from the pool on
        the compute stream) or `rotating` (four layer-sized buffers, `prefill_buffers.py`).
        `marks`: a `prefill_marks.PrefillMarks` that times each chunk's phases (the prefill anatomy)."""
        m, c = self.model, self.cache
        T = tokens.numel() if hidden is None else hidden.shape[0]
        if T > c.capacity:
            raise ValueError(f"prompt of {T} tokens exceeds the cache capacity {c.capacity}")
        if not 0 <= start < T:
            raise ValueError(f"prefill start {start} outside the prompt [0, {T})")
        c.pages.reserve(slot, T)
        io = self.request_io(slot, T)
        marks = marks or NoMarks()
        io.mark = marks.mark
        outs, x = [], None
        for a in range(start, T, self.prefill_chunk):
            e = min(T, a + self.prefill_chunk)
            marks.begin_chunk(a, e)
            pos = torch.arange(a, e, device=m.device)
            io.begin_chunk(a, e)
            io.tokens = tokens[a:e] if tokens is not None else None
            x = None                   # the last chunk's states are not held through this chunk's forward
            x = self.prefill_forward(io.tokens, None if hidden is None else hidden[a:e], pos, io, marks)
            if m.lm_head is None:
                outs.append(x)
            marks.end_chunk()
            if e < T:
                yield a, e
        io.finish()
        c.lens[slot] = T
        return m.norm(x[-1:]) @ m.lm_head if m.lm_head is not None else torch.cat(outs)

    def request_io(self, slot: int, T: int, prefix: torch.Tensor | None = None):
        """The prefill `io` of one request's prompt of T tokens as `prefill_mode` says: `sync` (its prefix read
        back into `prefix` [>= T, row words], or a buffer of its own) or `rotating` (four layer buffers of T)."""
        if self.prefill_mode == "rotating":
            return RotatingPrefillIO(self, slot, T)
        return _PrefillIO(self, slot, T, prefix)

    def prefill_forward(self, tokens: torch.Tensor | None, hidden: torch.Tensor | None, pos: torch.Tensor, io,
                        marks=NO_MARKS) -> torch.Tensor:
        """One prefill forward: the tokens [N] (or a pipeline stage's input hidden states [N, hidden]) at positions
        pos [N] through every block, with `io` saying where each row's KV and state live. Returns the hidden
        states [N, hidden] (the residual pair summed; a stage without the head: its stream). The embedding is
        looked up here, not by the caller: an argument would hold it through the whole forward."""
        m = self.model
        x = _stream(m.embed[tokens] if hidden is None else hidden, m.shape)
        for blk, ki in zip(m.blocks, m.kind_index):
            x = _run(self.block(blk, ki, x, pos, io))
        marks.mark("other")
        x = settle(x)
        if m.lm_head is not None:
            x = _unstream(x, m.shape)
        return x[0] + x[1]

    def prefill_batch(self, requests: list[PrefillRequest], max_tokens: int | None = None):
        """Prefill several requests with up to `max_tokens` tokens per forward (default `prefill_chunk`), taken
        first come, first served (vLLM's `max_num_batched_tokens`; `prefill_batch.py` says what runs once over
        the forward's rows and what per request). A generator like `prefill_chunks`: yields the forward's
        `Segment`s (slot, start, end) after each forward but the last and returns each request's last-token
        logits [1, vocab], in the order of `requests`; each slot's length is set when its prompt is done. Drive
        it under `torch.inference_mode()`. Both prefill modes: with `rotating` each request in a forward holds
        its own four layer buffers. Bad input (a budget <= 0, a prompt over the capacity, a slot twice): one
        ValueError at the first step, before anything is reserved. A scheduler that admits requests as slots
        free up drives `BatchedPrefill` itself (`add`, `step`)."""
        batch = BatchedPrefill(self, max_tokens)
        batch.add(*requests)
        out = {}
        while batch.pending:
            segs, done = batch.step()
            out.update(done)
            if batch.pending:
                yield segs
        return [out[r.slot] for r in requests]

    # ------------------------------------------------------------------ decode
    def decode_segments(self, st: StepBuffers, boundaries: bool = False):
        """One decode step for the slots of `st` (`st.span`; the runner's `DecodeState` provides them): yields a LoadRequest at each QSA
        layer; with `boundaries`, also a `BlockDone` after each block (where a two-batch scheduler,
        `switching.py`, may hand the GPU to the other batch)."""
        m, c = self.model, self.cache
        pos = c.lens[st.span].clone()
        io = _DecodeIO(self, st, pos)
        x = _stream(m.embed[st.tokens] if m.embed is not None else st.x_in, m.shape)
        for i, (blk, ki) in enumerate(zip(m.blocks, m.kind_index)):
            x = yield from self.block(blk, ki, x, pos, io)
            if boundaries:
                yield BlockDone(i)
        self.strategy.end_step()
        st.mark("head")
        x = settle(x)
        if m.lm_head is None:          # a pipeline stage: hand the activations (the stream) to the next one
            st.x_out.copy_(x[0] + x[1])
        else:
            x = _unstream(x, m.shape)
            # the last add, the norm and the head: one GEMV at decode batch sizes on the GPU
            _, logits = norm_matmul(x[0], x[1], m.norm, m.lm_head)
            st.logits.copy_(logits)
            st.tokens.copy_(logits.argmax(-1))
        c.lens[st.span] += 1
        if st.trace is not None:
            st.trace_step.copy_((st.trace_step + 1) % st.trace.shape[0])
        st.mark("end")



PREFILL_MODES = ("sync", "rotating")


def check_prefill_mode(mode: str, medium: str) -> None:
    if mode not in PREFILL_MODES:
        raise ValueError(f"unknown prefill_mode {mode!r}: choose from {', '.join(PREFILL_MODES)}")
    if mode == "rotating" and medium != "host":
        raise ValueError("prefill_mode=rotating offloads the prompt's KV: it needs a host pool (not the resident strategy)")


def _stream(x: torch.Tensor, s=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual pair that starts a forward: the embeddings (in every copy of the stream where the model has
    hyper-connections; a pipeline stage's input is the stream already) and nothing added yet."""
    if s is not None and s.hc_count > 1 and x.shape[-1] == s.hidden:
        x = x.repeat(1, s.hc_count)
    return x, torch.zeros_like(x)


def _unstream(x, s):
    """The pair as one hidden state's pair for the head: the copies' mean where there are several."""
    return hc_head(*x, s.hc_count) if s.hc_count > 1 else x


def _run(gen):
    """Drive a block generator that must not yield (prefill) to its return value."""
    try:
        req = next(gen)
    except StopIteration as done:
        return done.value
    raise RuntimeError(f"prefill attention yielded a load request for layer {req.layer}")


class _PrefillIO(PrefillRequestIO):
    """Prefill of one request: a chunk's tokens attend densely to the whole prefix so far, read back
    from the pool (where the chunk's own rows were just written) into `prefix` (a batched prefill's requests
    share one: their attentions run one after another on one stream)."""

    def __init__(self, engine: Engine, slot: int, T: int, prefix: torch.Tensor | None = None):
        m = engine.model
        self.e, self.slot, self.fns, self.mark = engine, slot, engine._eager_fns, NO_MARKS.mark
        self.prefix = (prefix if prefix is not None
                       else torch.empty((T, engine.cache.row_words()), dtype=torch.int64, device=m.device))
        self.end, self.where = 0, None

    def write(self, ki, kv_rows, keys, scales) -> None:
        self.mark("kv_write")
        self.e.cache.write(ki, self.where, kv_rows, keys, scales, self.e.strategy)

    def finish(self) -> None:
        pass

    def begin_chunk(self, start: int, end: int) -> None:
        self.end = end
        slots = torch.full((end - start,), self.slot, dtype=torch.int64, device=self.prefix.device)
        self.where = self.e.cache.locate(slots, torch.arange(start, end, device=slots.device))

    def deltanet(self, blk, ki, x, d):
        c = self.e.cache
        return dn_prefill(blk, x, d, c.dn_state[ki, self.slot], c.dn_conv[ki, self.slot], self.mark)

    def attend(self, ki, q, iq, iw, pos):
        s = self.e.model.shape
        self.mark("kv_load")
        prefix = self.e.cache.read_prefix(ki, self.slot, self.end, self.prefix)
        k, v = split_rows(prefix.view(torch.bfloat16), s.n_kv_heads, s.head_dim)
        return prefill_attend(self.e, ki, self.slot, q, k, v, iq, iw, pos, self.mark)
        yield  # a generator that yields nothing: prefill moves no rows on request


class _DecodeIO:
    """Decode of a batch, one token per request: score every written position, keep the top `k`,
    yield the rows to load, attend over them."""

    def __init__(self, engine: Engine, st: StepBuffers, pos: torch.Tensor):
        self.e, self.st, self.fns, self.mark = engine, st, engine.fns, st.mark
        # Layer-independent, so once per step: the new token's pool row and key slot, the lengths.
        self.where = engine.cache.locate(st.slots, pos)
        self.lens = pos + 1

    def write(self, ki, kv_rows, keys, scales) -> None:
        self.e.cache.write(ki, self.where, kv_rows, keys, scales, self.e.strategy)

    def experts_read(self, n) -> None:
        """The distinct experts a layer read this step, summed over the step's layers (device, no sync)."""
        self.st.experts_read.add_(n)

    def ngram_rows(self, pos):
        return self.e.model.ngram.lookup(self.st.tokens, pos)

    def deltanet(self, blk, ki, x, d):
        c, sp, f = self.e.cache, self.st.span, self.fns
        if deltanet_step.FUSED_MIX:   # between the projections two kernels on CUDA (deltanet_step.deltanet_mix)
            h, y = f.dn_project(blk, x, d)
            g = deltanet_mix(blk.mixer, y, c.dn_state[ki, sp], c.dn_conv[ki, sp])
            return h, f.dn_out(blk, g)
        h, q, k, v, log_a, beta, z = f.dn_pre(blk, x, d, c.dn_conv[ki, sp])
        o = delta_step(c.dn_state[ki, sp], q, k, v, log_a, beta)      # the recurrence alone as one kernel
        return h, f.dn_post(blk, o, z)

    def attend(self, ki, q, iq, iw, pos):
        e, st, c, mark = self.e, self.st, self.e.cache, self.mark
        B, k, W = st.batch, st.k, st.window
        mark("index_score")
        sp = st.span
        scores = index_scores(iq, iw, c.index.keys[ki, sp, :W], c.index.scales[ki, sp, :W], self.lens)
        mark("selection")
        rows = st.rows_buf[ki].view(B, k)
        if e.select_block > 1 and k < W:       # (k == W keeps every position: nothing to choose)
            sel, valid = select_blocks(scores, k, e.select_block, self.lens, out=(st.last_sel[ki], st.last_valid[ki]))
            rows.copy_(c.pages.rows(st.slots, sel))
        else:
            sel, valid = select_topk(scores, k, out=(st.last_sel[ki], st.last_valid[ki]),
                                     pages=(rows, c.pages.table[sp], c.pages.page_size))
        if st.trace is not None:   # replay recorded selections (scaled to this context)
            mark("other")
            # index_select with the step as a 1-element device tensor: plain indexing would .item() (a sync)
            step_sel = torch.index_select(st.trace, 0, st.trace_step.view(1))[0, ki]
            sel.copy_(torch.minimum(step_sel.expand(B, k), pos[:, None]))
            valid.fill_(True)
            rows.copy_(c.pages.rows(st.slots, sel))
        mark("transfer")
        yield LoadRequest(ki, st.rows_buf[ki], st.staging)
        mark("attention")
        if e.strategy.attends:      # the strategy's kernel reads the rows as it attends (hot_cache, fused)
            return e.strategy.attend(c.pool, ki, q, valid, e.model.shape.n_kv_heads)
        rows = st.staging.view(torch.bfloat16).view(B, k, -1)
        return self.fns.sparse_attention(q, rows, valid, e.model.shape.n_kv_heads)
