"""Two decode batches on one GPU, switched at layer boundaries (PulseInfer).

    loader = Loader(off_engine)                      # side CUDA stream for the offloaded batch's loads
    stats = switched_round(norm_engine, norm_state, off_engine, off_state, loader, timeline)

A *normal* batch keeps its KV on the device (`resident` pool); an *offloaded* batch keeps it in host
RAM. One round is one decode step of each. The offloaded batch runs until its next QSA layer needs
rows (`Engine.decode_segments` yields a `LoadRequest` there); its load is issued on a side stream
and an event recorded after it; the GPU then runs the normal batch block by block
(`decode_segments(..., boundaries=True)` yields a `BlockDone` after each block), and at every block
boundary the event is *queried* (non-blocking): once the transfer is done, the main stream waits on
the event (a device-side wait, already satisfied) and the offloaded batch resumes until its next load.
When the normal batch has no blocks left, the remaining transfers are joined by device-side waits
(`Stream.wait_event`): the host never sleeps and there is no fixed prefetch depth.

The decision is taken when the host *enqueues* a block boundary; the host runs ahead of the GPU by
however many kernels are queued, so a transfer that finishes while queued normal work is still running
is picked up at the next boundary the host reaches. With eager (launch-bound) decode the host stays
close to the GPU.

On a machine without CUDA the loader is synchronous and every transfer is complete when issued: the
same code runs, switching back at the first boundary after each load (tests check the order and that
switching changes no token). `Pending.done` is the one place the completion check lives: tests give a
loader whose transfers complete after a set number of checks.

Timeline (`Timeline`, for sampled rounds): spans `(batch, kind, label, start_ms, end_ms)` with kind
`compute` (a block of the normal batch, a segment of the offloaded one), `transfer` (a load on the side
stream) and `stall` (the main stream waiting for a transfer because the normal batch had nothing left),
timed by CUDA events against one event at the round's start (wall clock on CPU).
"""
from __future__ import annotations

import collections
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..model.forward import BlockDone, Engine, LoadRequest
from ..transfer import LoadResult
from .dispatch import capture, load, load_async


class Timeline:
    """Spans of one round on one clock (CUDA events, or perf_counter without CUDA)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._raw: list[tuple] = []
        self._t0 = self.stamp()

    def stamp(self, stream=None):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def add(self, batch: str, kind: str, label: str, a, b) -> None:
        self._raw.append((batch, kind, label, a, b))

    def spans(self) -> list[dict]:
        """Resolve the stamps (synchronises on CUDA): ms from the round's start."""
        if self.cuda:
            torch.cuda.synchronize()
            at = lambda ev: self._t0.elapsed_time(ev)          # noqa: E731
        else:
            at = lambda t: (t - self._t0) * 1e3                 # noqa: E731
        end = lambda e: e.result() if isinstance(e, Future) else e     # noqa: E731  (an async load's event)
        return [{"batch": b, "kind": k, "label": lab, "start_ms": at(a), "end_ms": at(end(e))}
                for b, k, lab, a, e in self._raw]


class Pending:
    """A load in flight: its result, and the event recorded after it on the side stream (or a Future
    of that event, for a strategy whose load is issued from a background thread: `load_async`)."""

    def __init__(self, req: LoadRequest, result: LoadResult, event, start=None, end=None):
        self.req, self.result, self._event, self.start, self.end = req, result, event, start, end
        self.checks = 0

    @property
    def event(self):
        return self._event.result() if isinstance(self._event, Future) else self._event

    def done(self) -> bool:
        """Non-blocking completion check (an event query); always true for a synchronous load."""
        self.checks += 1
        if isinstance(self._event, Future) and not self._event.done():
            return False                       # the background thread has not issued every copy yet
        return True if self.event is None else self.event.query()

    def join(self) -> None:
        """Order the main stream after the load (a device-side wait: the host blocks only until an
        asynchronous load's copies are issued)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)


class Loader:
    """Issues the offloaded batch's loads: on CUDA on a side stream (after the main stream's work so far,
    which computed the rows), with an event after; without CUDA synchronously."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.cuda = engine.model.device.type == "cuda"
        self.side = torch.cuda.Stream(engine.model.device) if self.cuda else None

    def issue(self, req: LoadRequest, timeline: Timeline | None = None) -> Pending:
        e = self.engine
        if self.side is None:
            a = timeline.stamp() if timeline else None
            res = load(e, req)
            return Pending(req, res, None, a, timeline.stamp() if timeline else None)
        self.side.wait_stream(torch.cuda.current_stream())
        if e.strategy.async_load:   # gather + DMA from a background thread (coalesced, block_dma)
            a = timeline.stamp(self.side) if timeline else None
            res, fut = load_async(e, req, self.side)
            return Pending(req, res, fut, a, fut if timeline else None)
        with torch.cuda.stream(self.side):
            # rows/out are the DecodeState's static buffers: no allocator reuse across the two streams
            a = timeline.stamp(self.side) if timeline else None
            res = load(e, req)
            ev = torch.cuda.Event(enable_timing=timeline is not None)
            ev.record(self.side)
        return Pending(req, res, ev, a, ev if timeline else None)


@dataclass
class RoundStats:
    """What one round did: loads of each batch, the order work was enqueued in, switches and stalls."""
    loads_normal: list = field(default_factory=list)
    loads_offloaded: list = field(default_factory=list)
    order: list = field(default_factory=list)       # ("n", block) / ("o", layer of the load issued, or -1: end)
    switches: int = 0                               # transfers found done at a block boundary
    stalls: int = 0                                 # transfers joined with no normal work left
    checks: int = 0                                 # completion queries made


def switched_round(norm: Engine, norm_state, off: Engine, off_state, loader: Loader,
                   timeline: Timeline | None = None, n_gen=None, o_gen=None, lookahead: int = 0) -> RoundStats:
    """One decode step of the normal batch and one of the offloaded batch, switched at layer boundaries.
    Call under `torch.inference_mode()`.

    `n_gen`/`o_gen` replace the eager step generators with graph replays (`replay(capture_pieces(...))`),
    which yield the same items. Replays let the host run far ahead of the GPU, so its event queries
    would see every transfer unfinished: `lookahead > 0` keeps the host at most that many normal blocks
    ahead of the GPU (it waits on the event of the block `lookahead` back, which keeps that many blocks
    queued, so the GPU itself never waits for the host)."""
    st = RoundStats()
    tl = timeline
    n_gen = n_gen if n_gen is not None else norm.decode_segments(norm_state, boundaries=True)
    o_gen = o_gen if o_gen is not None else off.decode_segments(off_state)
    ahead: collections.deque = collections.deque()
    pace = lookahead > 0 and loader.cuda

    def run_offloaded() -> Pending | None:
        a = tl.stamp() if tl else None
        try:
            req = next(o_gen)
        except StopIteration:
            req = None
        if tl:
            tl.add("offloaded", "compute", "head" if req is None else f"to QSA {req.layer}", a, tl.stamp())
        st.order.append(("o", -1 if req is None else req.layer))
        if req is None:
            return None
        p = loader.issue(req, tl)
        st.loads_offloaded.append(p.result)
        if tl:
            tl.add("offloaded", "transfer", f"QSA {req.layer}", p.start, p.end)
        return p

    def join(p: Pending, kind: str) -> None:
        a = tl.stamp() if tl else None
        p.join()
        if tl:
            tl.add("offloaded", kind, f"QSA {p.req.layer}", a, tl.stamp())

    pending = run_offloaded()
    a = tl.stamp() if tl else None
    for item in n_gen:
        if isinstance(item, LoadRequest):           # the normal batch's own rows: a device gather, inline
            st.loads_normal.append(load(norm, item))
            continue
        assert isinstance(item, BlockDone)
        st.order.append(("n", item.block))
        if tl:
            tl.add("normal", "compute", f"block {item.block}", a, tl.stamp())
        if pace:
            ev = torch.cuda.Event()
            ev.record()
            ahead.append(ev)
            if len(ahead) > lookahead:
                ahead.popleft().synchronize()
        if pending is not None:
            st.checks += 1
            if pending.done():
                st.switches += 1
                join(pending, "wait")
                pending = run_offloaded()
        a = tl.stamp() if tl else None
    while pending is not None:                       # nothing left to hide the transfer behind
        st.stalls += 1
        join(pending, "stall")
        pending = run_offloaded()
    return st


def pingpong_round(a: Engine, a_state, b: Engine, b_state, loaders: tuple[Loader, Loader],
                   timeline: Timeline | None = None, a_gen=None, b_gen=None) -> RoundStats:
    """One decode step of each of two *offloaded* batches, each computing while the other's rows travel
    (the all-offloaded case of the concurrency-scaling experiment: no resident batch to hide behind).

    Strict alternation: A runs to its next QSA layer and issues that load on its side stream; B does
    the same; then A resumes after a device-side wait on its load's event, and so on. With two batches
    of equal size the load issued first is the one to resume, so no event query is needed and the host
    never sleeps. What it costs: each batch reads the weights once per step, twice per round where one
    merged batch reads them once (`experiments.pulse_scaling.measure.two_batch_bound`). `a_gen`/`b_gen`: graph
    replays (`replay(capture_pieces(e, s, "loads"))`) in place of the eager steps."""
    st = RoundStats()
    tl = timeline
    gens = [a_gen if a_gen is not None else a.decode_segments(a_state),
            b_gen if b_gen is not None else b.decode_segments(b_state)]
    names = ("offloaded A", "offloaded B")

    def advance(i: int) -> Pending | None:
        t0 = tl.stamp() if tl else None
        try:
            req = next(gens[i])
        except StopIteration:
            req = None
        if tl:
            tl.add(names[i], "compute", "head" if req is None else f"to QSA {req.layer}", t0, tl.stamp())
        st.order.append(("ab"[i], -1 if req is None else req.layer))
        if req is None:
            return None
        p = loaders[i].issue(req, tl)
        st.loads_offloaded.append(p.result)
        if tl:
            tl.add(names[i], "transfer", f"QSA {req.layer}", p.start, p.end)
        return p

    pending = [advance(0), advance(1)]
    while any(p is not None for p in pending):
        for i in (0, 1):
            p = pending[i]
            if p is None:
                continue
            t0 = tl.stamp() if tl else None
            st.switches += 1
            p.join()                # device-side: the GPU waits only if the rows have not arrived yet
            if tl:
                tl.add(names[i], "wait", f"QSA {p.req.layer}", t0, tl.stamp())
            pending[i] = advance(i)
    return st


def sequential_round(engines_states: list[tuple[Engine, object]], timeline: Timeline | None = None) -> RoundStats:
    """The no-switching baseline: each batch's step in turn, every load inline on the main stream."""
    st = RoundStats()
    for e, s in engines_states:
        normal = e.strategy.medium == "device"
        a = timeline.stamp() if timeline else None
        loads = [load(e, req) for req in e.decode_segments(s)]
        (st.loads_normal if normal else st.loads_offloaded).extend(loads)
        if timeline:
            timeline.add("normal" if normal else "offloaded", "compute", "step", a, timeline.stamp())
    return st


def capture_pieces(engine: Engine, state, split: str, pool=None, results: list | None = None) -> list:
    """CUDA graphs of one decode step of `state`'s batch, cut where a scheduler needs control:
    `split="loads"`: at each LoadRequest (the load is issued outside the graphs: the offloaded batch);
    `split="blocks"`: at each block boundary, loads captured inside (a graphable strategy: the normal
    batch); `split="none"`: the whole step in one graph, loads inside. Returns [(graph, item)], item the
    LoadRequest/BlockDone the piece ends at (None for the last); the LoadResults of loads captured inside
    are appended to `results`. Capture records work without running it: replay to run a step."""
    if split not in ("loads", "blocks", "none"):
        raise ValueError(f"split must be loads, blocks or none, not {split!r}")
    if split != "loads" and not engine.strategy.graphable:
        raise ValueError(f"{engine.strategy.name} cannot be captured with its loads")
    gen = engine.decode_segments(state, boundaries=split == "blocks")
    pieces, done = [], False
    while not done:
        g = torch.cuda.CUDAGraph()
        item = None
        with capture(g, engine.model.device, pool):
            while True:
                try:
                    item = next(gen)
                except StopIteration:
                    item, done = None, True
                    break
                if isinstance(item, LoadRequest) and split != "loads":
                    res = load(engine, item)
                    if results is not None:
                        results.append(res)
                    continue
                break
        pieces.append((g, item))
    return pieces


def replay_inline(pieces, engine: Engine) -> list[LoadResult]:
    """One step from pieces captured with split="loads" (or "none"): each piece replayed, the load it ends
    at run inline before the next (a host strategy's step without switching). Returns the loads' results."""
    out = []
    for g, item in pieces:
        g.replay()
        if item is not None:
            out.append(load(engine, item))
    return out


def replay(pieces):
    """Replay captured pieces as a step generator (yields what the eager step yields at each cut)."""
    for g, item in pieces:
        g.replay()
        if item is not None:
            yield item
