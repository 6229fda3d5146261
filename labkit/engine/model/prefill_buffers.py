"""Prefill through four layer-sized device buffers (FlashOffloading's prefill): a prompt
whose KV does not fit the device prefills with only four layers' worth of it there.

A chunked prefill's QSA layer l, for the chunk [a, e), attends densely over positions [0, e) of layer l.
The lab's default (`prefill_mode="sync"`, `engine._PrefillIO`) writes the chunk's rows to the pool and
reads the whole prefix [0, e) back into one device buffer, all on the compute stream: with a host pool
the link and the GPU take turns. Here (`prefill_mode="rotating"`) each QSA layer owns a buffer of the
prompt's length (`T x row_bytes`):

- buffer 0 is *resident*: QSA layer 0 keeps its rows there for the whole prompt, never loaded back;
- buffers 1..3 *rotate* over layers 1, 2, ... (layer l takes buffer 1 + (l - 1) % 3). At layer l's
  chunk the three are, at once: layer l+1's prefix arriving from the host (**load** stream), layer l
  being computed (compute stream: the chunk's new rows copied in at [a, e), attention over [0, e)),
  and layer l-1's new rows leaving for the host (**write-back** stream).

The rows the compute reads are the bytes the sync path reads (the prefix as the pool holds it, plus
the chunk's rows as computed), so the KV in the pool, the index keys and the logits are identical to
`sync`'s; `tests/test_prefill_buffers.py` compares them. A buffer remembers which layer and how many
rows it holds, so a shape with at most four QSA layers (`tiny`) never loads anything back.

Ordering, all by CUDA events (nothing waits on the host): a load into a buffer waits for its previous
layer's attention (compute) and write-back to finish, and for the loaded layer's own last write-back
(the rows it reads back); the compute of layer l waits for its load; the write-back of layer l waits
for the chunk's rows to be in the buffer. A load is issued when the layer before starts (depth 1
prefetch) unless its buffer is that layer's own, then when that layer's attention is enqueued. On a
machine without CUDA the three "streams" are the caller's order (same bytes, no overlap).

The cost: 4 x T x row_bytes of device memory (1M tokens of the reference shape: 8 GiB) against the
`resident` pool's attn_layers x T x row_bytes (24 GiB) and sync's one buffer of T rows.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from .attention import prefill_attend, split_rows
from .hybrid import dn_prefill

N_BUFFERS = 4


class _Lane:
    """A CUDA side stream, or on a CPU the caller's own order (events then do nothing)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def __call__(self):
        return torch.cuda.stream(self.stream) if self.cuda else nullcontext()

    def event(self):
        return torch.cuda.Event() if self.cuda else None

    def record(self, ev, stream=None) -> None:
        if ev is not None:
            ev.record(stream if stream is not None else self.stream)

    def wait(self, ev, stream=None) -> None:
        if ev is not None:
            (stream if stream is not None else self.stream).wait_event(ev)


def buffer_of(layer: int, n_buffers: int = N_BUFFERS) -> int:
    """Layer 0 keeps the resident buffer; the others rotate through buffers 1..n-1."""
    return 0 if layer == 0 else 1 + (layer - 1) % (n_buffers - 1)


def rotating_buffer_bytes(T: int, row_bytes: int, attn_layers: int, n_buffers: int = N_BUFFERS) -> int:
    return min(n_buffers, attn_layers) * T * row_bytes


class PrefillRequestIO:
    """What every prefill `io` of one request answers alike: the n-gram embedding's rows of the chunk's tokens
    (`tokens`, set per chunk by the prefill loop) and the routed experts' count, which prefill does not keep (a
    decode step's rows report it)."""
    tokens = None
    e = None

    def experts_read(self, n) -> None:
        pass

    def ngram_rows(self, pos):
        return self.e.model.ngram.lookup(self.tokens, pos)


class RotatingPrefillIO(PrefillRequestIO):
    """The `io` of `Engine.block` for one prompt prefilled through rotating layer buffers (docstring)."""

    def __init__(self, engine, slot: int, T: int, n_buffers: int = N_BUFFERS):
        if n_buffers < 2:
            raise ValueError(f"rotating prefill needs >= 2 buffers (one resident, one rotating), got {n_buffers}")
        c, dev = engine.cache, engine.model.device
        self.e, self.slot, self.T, self.fns, self.mark = engine, slot, T, engine._eager_fns, _no_mark
        self.n = min(n_buffers, c.pool.attn_layers)
        self.bufs = [torch.empty((T, c.row_words()), dtype=torch.int64, device=dev) for _ in range(self.n)]
        self.held: list[tuple[int, int]] = [(-1, 0)] * self.n     # (layer, rows [0, n) valid) per buffer
        self.load, self.wb = _Lane(dev), _Lane(dev)
        self.compute = torch.cuda.current_stream(dev) if self.load.cuda else None
        self.loaded = [self.load.event() for _ in range(self.n)]    # load stream: rows in the buffer
        self.used = [self.load.event() for _ in range(self.n)]      # compute: the buffer's attention done
        self.filled = [self.load.event() for _ in range(self.n)]    # compute: chunk rows copied in
        self.written = [self.load.event() for _ in range(c.pool.attn_layers)]   # write-back of layer l done
        self.user = [-1] * self.n            # the layer whose chunk rows a buffer last took
        self.issued: set[tuple[int, int]] = set()      # (chunk start, layer) loads already enqueued
        self.start = self.end = 0
        self.where = None
        self.active = -1                     # the buffer whose layer is between write and attend
        self.deferred: tuple[int, int] | None = None

    # ---------------------------------------------------------------- chunk and layer order
    def begin_chunk(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        slots = torch.full((end - start,), self.slot, dtype=torch.int64, device=self.e.model.device)
        self.where = self.e.cache.locate(slots, torch.arange(start, end, device=slots.device))
        for t in self.where:
            if self.wb.cuda:     # the write-back stream reads them after the compute stream moves on
                t.record_stream(self.wb.stream)
        if self.n:                           # a pipeline stage may hold no QSA layer
            self._prefetch(start, 0)

    def _next(self, start: int, layer: int) -> tuple[int, int] | None:
        if layer + 1 < self.e.cache.pool.attn_layers:
            return start, layer + 1
        return (self.end, 0) if self.end < self.T else None

    def _prefetch(self, start: int, layer: int) -> None:
        """Enqueue on the load stream: positions [held, start) of `layer` into its buffer."""
        if (start, layer) in self.issued:
            return
        b = buffer_of(layer, self.n)
        if b == self.active:                 # its events are not recorded yet: after that layer's attention
            self.deferred = (start, layer)
            return
        self.issued.add((start, layer))
        lay, rows = self.held[b]
        have = rows if lay == layer else 0
        if have >= start:
            return
        self.load.wait(self.used[b])
        if self.user[b] >= 0:
            self.load.wait(self.written[self.user[b]])
        self.load.wait(self.written[layer])  # the rows read back must have reached the host
        with self.load():
            self.e.cache.read_prefix(layer, self.slot, start, self.bufs[b], start=have)
        self.load.record(self.loaded[b])
        self.held[b] = (layer, start)

    # ---------------------------------------------------------------- what Engine.block calls
    def deltanet(self, blk, ki, x, d):
        c = self.e.cache
        return dn_prefill(blk, x, d, c.dn_state[ki, self.slot], c.dn_conv[ki, self.slot], self.mark)

    def write(self, ki: int, kv_rows: torch.Tensor, keys: torch.Tensor, scales: torch.Tensor) -> None:
        c, a, e = self.e.cache, self.start, self.end
        self.mark("kv_load")                 # the wait for this layer's prefix (its time: the stall)
        self._prefetch(a, ki)                # normally enqueued one layer earlier
        b = buffer_of(ki, self.n)
        nxt = self._next(a, ki)
        self.active = b
        if nxt is not None:                  # the next layer's prefix travels while this one computes
            self._prefetch(*nxt)
        self.load.wait(self.loaded[b], self.compute)
        self.mark("kv_write")
        prev = self.user[b]
        if prev not in (-1, ki):             # no load came in between (chunk 0): the previous layer's
            self.wb.wait(self.written[prev], self.compute)     # write-back may still read [a, e)
        buf = self.bufs[b]
        buf[a:e].copy_(kv_rows.reshape(e - a, -1).view(torch.int64))
        self.held[b] = (ki, e)
        self.user[b] = ki
        c.write_index(ki, self.where, keys, scales)
        self.wb.record(self.filled[b], self.compute)
        self.wb.wait(self.filled[b])
        with self.wb():
            self._write_back(ki, buf)
        self.wb.record(self.written[ki])

    def _write_back(self, ki: int, buf: torch.Tensor) -> None:
        st, c = self.e.strategy, self.e.cache
        if not st.mirrors:                               # plain rows: DMA by page runs (copy engines)
            c.write_back(ki, self.slot, self.start, self.end, buf)
        else:                                            # a strategy that mirrors rows sees every write
            st.store(c.pool, ki, self.where[0], buf[self.start:self.end])

    def attend(self, ki, q, iq, iw, pos):
        s = self.e.model.shape
        b = buffer_of(ki, self.n)
        k, v = split_rows(self.bufs[b][:self.end].view(torch.bfloat16), s.n_kv_heads, s.head_dim)
        att = prefill_attend(self.e, ki, self.slot, q, k, v, iq, iw, pos, self.mark)
        self.load.record(self.used[b], self.compute)
        self.active = -1
        if self.deferred is not None:
            d, self.deferred = self.deferred, None
            self._prefetch(*d)
        return att
        yield  # a generator that yields nothing, like the sync path's

    def finish(self) -> None:
        """The compute stream waits for every write-back (decode reads the pool next) and load, so the
        buffers can be freed into the compute stream's pool."""
        if self.compute is not None:
            self.compute.wait_stream(self.wb.stream)
            self.compute.wait_stream(self.load.stream)


def _no_mark(phase: str, new_block: bool = False) -> None:
    """Prefill is not marked for an anatomy."""
