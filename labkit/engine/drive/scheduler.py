"""Request-level engine: continuous batching over one or two KV pools ("lanes").

    lanes = make_lanes("tiny", "cpu", resident_slots=4, offload_slots=4, capacity=1024, budget=64)
    sched = Scheduler(lanes, policy=Threshold(512), switching=True)
    done = sched.run([Request(prompt, max_tokens=32, arrival=0.0), ...])    # arrivals in seconds
    records = [r.record() for r in done]       # the load generator's record format (serving/latency.py)

Primitives:
- `Request`: prompt token ids, `max_tokens`, arrival (s on the scheduler's clock); filled in as it runs:
  output tokens, the clock time of each (vLLM's TTFT, TPOT, ITL, E2EL come from these), lane, status.
- `Lane`: one engine with its own cache (a `resident` pool on the device, or a host pool with an
  offload strategy). Its running requests sit in slots `[0, n)` in order, because a decode step runs
  slots `[0, B)` of its cache (`Engine.decode_segments`): when a request finishes, the last one moves
  into its slot (`move_slot`: page-table row, length, DeltaNet state and the written index keys; the
  KV rows stay where they are in the pool).
- `Scheduler.step()`: one iteration: take arrivals, start the head of the waiting queue if its lane has
  a slot and pages (first come, first served: nobody is overtaken), run one prefill chunk of the
  request being prefilled, then one decode step of every running request; with two busy lanes and
  `switching`, the two batches are interleaved at layer boundaries (`switching.py`).
- Placement policies (`Threshold`, `AllTo`): which lane a request goes to.

Pages for prompt + max_tokens are reserved when a request starts (no preemption). One prompt is
prefilled at a time, one chunk (`Engine.prefill_chunk` tokens) per iteration.

Handed-over requests (`Request(prefilled=True)`), a decode instance of a disaggregated deployment: the
prompt was prefilled elsewhere and its KV arrives with the request, so nothing is prefilled here. When the
request gets a slot its KV is placed straight into the lane's pool (seeded random contents,
`OffloadCache.fill_slot_random_`: the device pool of a resident lane, the host pool of an offloaded one),
its first token (prefilled elsewhere; here the prompt's last token stands in) is its first output, and it
decodes from the next iteration. The placing is the handover's cost, not the decode instance's: the
scheduler's clock stops while it runs (`handover_s` holds the seconds taken out), so every timed iteration
is decode. Every waiting handed-over request that fits is admitted in the same iteration (FCFS still: the
head of the queue first, nobody overtakes it). A handed-over request has no TTFT (its record says None); its
TPOT runs from the iteration it was admitted in (`decode_start_s`).

Starvation bound (tested): a request whose prefill has started finishes within
`ceil(prompt / chunk) + max_tokens - 1` iterations; a request's prefill starts within
`sum over the requests ahead of it of (ceil(prompt_i / chunk) + max_tokens_i)` iterations of its
arrival in the queue (every iteration does a unit of work for a request ahead of it, and the head
always fits once the lanes drain, since a request that can never fit is rejected at `submit`).
"""
from __future__ import annotations

import collections
import hashlib
import math
import time
import zlib
from dataclasses import dataclass, field

import torch

from ...params import BadInput, one_line
from ...shapes import ModelShape
from ..model.cache import OffloadCache
from ..model.forward import Engine
from ..model.hybrid import HybridModel
from ..transfer import get_strategy
from .dispatch import load
from .runner import DecodeState
from .switching import (Loader, RoundStats, Timeline, capture_pieces, replay, replay_inline, sequential_round,
                        switched_round)


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_tokens: int
    arrival: float = 0.0
    id: str = ""
    lane: str | None = None
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)   # scheduler clock (s) at each output token
    status: str = "new"              # new -> waiting -> prefill -> decode -> done | failed
    error: str | None = None
    queued_iter: int | None = None
    start_iter: int | None = None    # iteration whose prefill chunk was this request's first
    end_iter: int | None = None
    start_time: float | None = None
    end_time: float | None = None
    on_token: object = None          # callable(req, token, t) from the scheduler's thread (streaming)
    on_done: object = None           # callable(req)
    # callable(req, logits) -> token, from the scheduler's thread: picks this request's next token from its
    # logits row (vocab,) instead of the engine's argmax (a server's banned tokens, its logprobs); the token
    # picked is the one fed to the next step. None: the engine's argmax, nothing read back.
    pick: object = None
    # its KV was prefilled elsewhere and arrives with it (a disaggregated decode instance): no prefill here
    prefilled: bool = False

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.tokens)

    def record(self) -> dict:
        """One record in the load generator's format (`labkit.serving.loadgen`), times from `arrival`."""
        ok = self.status == "done"
        tt = [t - self.arrival for t in self.token_times]
        end = self.end_time if self.end_time is not None else self.arrival
        # handed over: the first token came with the KV from the prefill instance, so there is no TTFT here;
        # its time is when the request got a slot (its wait for one), where its decode starts
        first = None if self.prefilled else (self.token_times[0] if self.token_times else None)
        return {"request_id": self.id, "status": "ok" if ok else "failed", "error": self.error,
                "input_len": len(self.prompt), "prompt_tokens": len(self.prompt), "output_len": len(self.tokens),
                "output_len_requested": self.max_tokens, "send_time": self.arrival, "end_time": end,
                "first_token_time": first, "ttft_s": None if self.prefilled else (tt[0] if tt else None),
                "prefilled": self.prefilled, "decode_start_s": tt[0] if tt else None,
                "e2el_s": end - self.arrival, "token_times": tt,
                "lane": self.lane, "start_iter": self.start_iter, "end_iter": self.end_iter,
                # the output tokens' digest: replays of one request under other placements compare by it
                "output_sha": hashlib.sha1(",".join(map(str, self.tokens)).encode()).hexdigest()[:16]}


class Lane:
    """One engine and its cache; running requests in slots [0, n) in order."""

    def __init__(self, name: str, engine: Engine):
        self.name, self.engine, self.cache = name, engine, engine.cache
        self.running: list[Request] = []
        self.state: DecodeState | None = None
        self.offloaded = engine.strategy.medium == "host"
        self.graphs: dict = {}
        self.graph_loads: dict = {}
        self.warm = False               # one eager step done with this batch (kernels compiled)

    def reset(self) -> None:
        """The batch changed: new static buffers (and graphs) at the next step."""
        self.state, self.graphs, self.warm = None, {}, False

    @property
    def step_split(self) -> str:
        """How a whole step of this lane is captured: in one graph with its loads ("none"), or, for a host
        strategy whose loads need the indices on the host, cut at its loads ("loads")."""
        return "none" if self.engine.strategy.graphable else "loads"

    def replay_step(self, stats: RoundStats) -> None:
        """One step from the captured graphs; a host strategy's loads run inline between the pieces
        (what its eager step does, without the launch cost of the pieces)."""
        split = self.step_split
        loads = stats.loads_offloaded if self.offloaded else stats.loads_normal
        loads.extend(replay_inline(self.pieces(split), self.engine))
        loads.extend(self.graph_loads[split])

    def pieces(self, split: str) -> list:
        """CUDA graphs of this batch's step cut for `split` (see `switching.capture_pieces`), captured
        once per batch composition; `self.graph_loads[split]`: the LoadResults captured inside them."""
        if split not in self.graphs:
            results: list = []
            self.graphs[split] = capture_pieces(self.engine, self.state, split, torch.cuda.graph_pool_handle(),
                                                results=results)
            self.graph_loads[split] = results
        return self.graphs[split]

    @property
    def free_slots(self) -> int:
        return self.cache.n_slots - len(self.running)

    def fits(self, req: Request) -> bool:
        return self.free_slots > 0 and self.cache.pages.n_free >= self.pages_for(req)

    def pages_for(self, req: Request) -> int:
        return math.ceil((len(req.prompt) + req.max_tokens) / self.cache.pages.page_size)

    def decode_state(self) -> DecodeState:
        """The batch's static buffers, rebuilt when the batch changed (fed each request's last token)."""
        if self.state is None:
            e, n = self.engine, len(self.running)
            # window >= budget: the selection's k is then min(budget, capacity) whatever the batch, so a
            # request's tokens do not depend on who it is batched with
            st = DecodeState(e, n, None, max(max(r.remaining for r in self.running), e.budget))
            st.tokens.copy_(torch.tensor([r.tokens[-1] for r in self.running], dtype=torch.int64))
            e.strategy.bind(self.cache, n, st.k)
            self.state = st
        return self.state


def move_slot(cache: OffloadCache, src: int, dst: int) -> None:
    """Move a request's state from slot `src` to the empty slot `dst` of the same cache."""
    n = int(cache.lens[src])
    cache.pages.move(src, dst)
    cache.index.keys[:, dst, :n].copy_(cache.index.keys[:, src, :n])
    cache.index.scales[:, dst, :n].copy_(cache.index.scales[:, src, :n])
    cache.dn_state[:, dst].copy_(cache.dn_state[:, src])
    cache.dn_conv[:, dst].copy_(cache.dn_conv[:, src])
    cache.lens[dst] = n
    clear_slot(cache, src)


def clear_slot(cache: OffloadCache, slot: int) -> None:
    """Free a slot: its pages back to the pool, length 0, DeltaNet state zeroed (a prefill starts from it)."""
    cache.pages.release(slot)
    cache.lens[slot] = 0
    cache.dn_state[:, slot].zero_()
    cache.dn_conv[:, slot].zero_()


# ---------------------------------------------------------------------------- placement
class AllTo:
    """Every request to one lane."""

    def __init__(self, lane: str):
        self.lane = lane

    def place(self, req: Request, sched: "Scheduler") -> str:
        return self.lane


class Threshold:
    """Requests whose prompt + max_tokens exceed `tokens` go to the offload lane, the rest stay resident."""

    def __init__(self, tokens: int):
        self.tokens = tokens

    def place(self, req: Request, sched: "Scheduler") -> str:
        return "offload" if len(req.prompt) + req.max_tokens > self.tokens else "resident"


@dataclass(frozen=True)
class Costs:
    """Measured decode costs (ms per step; `calibrate`): a batch of B requests takes
    `step_ms + per_req_ms * B` of compute; an offloaded batch of B adds `xfer_fixed_ms + xfer_ms * B`
    of transfer (a load's fixed cost: one batched DMA call a layer, the index fetch, whatever B is)."""
    step_ms: float
    per_req_ms: float
    xfer_ms: float
    xfer_fixed_ms: float = 0.0

    def compute(self, batch: int) -> float:
        return self.step_ms + self.per_req_ms * batch if batch > 0 else 0.0

    def transfer(self, batch: int) -> float:
        return self.xfer_fixed_ms + self.xfer_ms * batch if batch > 0 else 0.0


class Adaptive:
    """Placement from measured costs and device memory left, re-evaluated at every arrival:

    - a request that needs more than its share of the device pool left (free pages / free slots) goes
      to the offload lane (if it fits there): long requests do not crowd short ones off the device;
    - within its share, a request of at least `budget` tokens (its per-step transfer is then the full
      budget) is offloaded when that is free: the offloaded batch's transfers, with it, stay hidden
      behind the normal batch's compute (`transfer(B_o + 1) <= compute(B_n)`);
    - otherwise resident; when the resident lane is full it overflows to the offload lane only if the
      transfer stays hidden there, else it waits for a resident slot (an offloaded request whose
      transfer cannot hide slows every round it is in: measured on the H200, overflowing regardless
      put half the trace's requests, short ones too, on the offload lane)."""

    hide = 1.0         # a transfer counts as hidden when transfer(B_o + 1) <= hide x compute(B_n)

    def __init__(self, costs: Costs):
        self.costs = costs

    def offload_from(self, res: Lane) -> int:
        """The prompt length from which a request within its share is offloaded when that is free."""
        return res.engine.budget

    def place(self, req: Request, sched: "Scheduler") -> str:
        res, off = sched.lanes.get("resident"), sched.lanes.get("offload")
        if res is None or off is None:
            return next(iter(sched.lanes))
        need = len(req.prompt) + req.max_tokens
        if need > res.cache.capacity:
            return "offload"
        if need > off.cache.capacity:
            return "resident"
        busy_r, busy_o = sched.lane_load(res), sched.lane_load(off)
        share = res.cache.pages.n_free / max(1, res.cache.n_slots - busy_r)
        if res.pages_for(req) > share:
            return "offload" if off.fits(req) or not res.fits(req) else "resident"
        hidden = self.costs.transfer(busy_o + 1) <= self.hide * self.costs.compute(busy_r)
        if len(req.prompt) >= self.offload_from(res) and hidden and off.fits(req):
            return "offload"
        return "offload" if not res.fits(req) and off.fits(req) and hidden else "resident"


@torch.inference_mode()
def calibrate(lanes: dict[str, Engine], context: int | None = None, steps: int = 3, graphs: bool = False) -> Costs:
    """Measure `Costs` on the (empty) lanes: decode steps at batch 1 and at the lane's slot count over
    random contents of `context` tokens (default: the budget), then free every slot again. `graphs`
    (CUDA): time the steps as a scheduler with graphs runs them (one eager step, then replays of the
    captured step, a host strategy's loads inline): an eager step is launch-bound, ~10x a graphed one
    at small batches, and would make every transfer look hidden behind compute."""
    def step_ms(e: Engine, b: int) -> float:
        st = DecodeState(e, b, None, 2 * steps + 4)
        e.strategy.bind(e.cache, b, st.k)

        def eager():
            for req in e.decode_segments(st):
                load(e, req)
        run = eager
        if graphs and e.model.device.type == "cuda":
            eager()                                   # kernels compiled, workspaces made, outside any capture
            sync(e)
            pieces = capture_pieces(e, st, "none" if e.strategy.graphable else "loads", torch.cuda.graph_pool_handle())
            run = lambda: replay_inline(pieces, e)    # noqa: E731
        ts = []
        for i in range(steps + 1):
            sync(e)
            t = time.perf_counter()
            run()
            sync(e)
            ts.append((time.perf_counter() - t) * 1e3)
        return sorted(ts[1:])[len(ts[1:]) // 2]

    def sync(e):
        if e.model.device.type == "cuda":
            torch.cuda.synchronize()

    res, off = lanes.get("resident"), lanes.get("offload")
    budget = next(iter(lanes.values())).budget
    fits = [budget + 1, *(e.cache.capacity - 2 * steps - 4 for e in lanes.values())]
    ctx = context or min(fits)
    out = {}
    for name, e in lanes.items():
        c, n = e.cache, e.cache.n_slots
        n = max(1, min(n, c.pages.n_pages // -(-(ctx + 2 * steps + 4) // c.pages.page_size)))
        for slot in range(n):       # as OffloadCache.fill_random_, for a pool smaller than slots x capacity
            c.pages.reserve(slot, ctx + 2 * steps + 4)
        c.pool.fill_random_(7)
        c.index.fill_random_(8)
        c.lens[:n] = ctx
        out[name] = (step_ms(e, 1), step_ms(e, n), n)
        for slot in range(n):
            clear_slot(e.cache, slot)

    def slope(one, many, n):                       # ms per request; timing noise can make it < 0
        return max(0.0, (many - one) / max(1, n - 1))
    if res is None or off is None:
        one, many, n = next(iter(out.values()))
        per = slope(one, many, n)
        return Costs(max(0.0, one - per), per, 0.0)
    (r1, rn, nr), (o1, on, no) = out["resident"], out["offload"]
    rper = slope(r1, rn, nr)
    # the transfer is what the offload lane's step costs above the resident step of the same batch, at
    # batch 1 and at the lane's slot count: a line through both (fixed cost + per request)
    t1 = max(0.0, o1 - r1)
    tn = max(0.0, on - (r1 + rper * (no - 1)))
    per = max(0.0, (tn - t1) / (no - 1)) if no > 1 else t1
    return Costs(max(0.0, r1 - rper), rper, per, max(0.0, t1 - per))


def parse_policy(text: str, costs: Costs | None = None):
    """`resident`, `offload` (all to one lane), `threshold:N` or `adaptive` (needs measured `costs`)."""
    if text in ("resident", "offload"):
        return AllTo(text)
    if text == "adaptive":
        if costs is None:
            raise BadInput("the adaptive policy needs measured costs (scheduler.calibrate)")
        return Adaptive(costs)
    if text.startswith("threshold:"):
        try:
            n = int(text.split(":", 1)[1])
        except ValueError:
            n = -1
        if n >= 0:
            return Threshold(n)
    raise BadInput(f"unknown placement policy {text!r}: use resident, offload, adaptive or threshold:N (N >= 0 tokens)")


# ---------------------------------------------------------------------------- the scheduler
class Scheduler:
    def __init__(self, lanes: dict[str, Engine], policy=None, switching: bool = True,
                 timeline_every: int = 0, clock=time.perf_counter, graphs: bool = False, lookahead: int = 2):
        """`graphs` (CUDA): after one eager step of each new batch, replay CUDA graphs captured for it:
        whole steps when one batch runs, steps cut at block boundaries / loads when two are switched
        (the host then paced `lookahead` blocks ahead of the GPU, see `switched_round`)."""
        if not lanes:
            raise ValueError("a scheduler needs at least one lane")
        self.lanes = {name: Lane(name, e) for name, e in lanes.items()}
        self.policy = policy or AllTo(next(iter(self.lanes)))
        self.switching = switching
        dev = next(iter(lanes.values())).model.device
        self.graphs = graphs and dev.type == "cuda"
        self.graph_error: str | None = None
        self.lookahead = lookahead
        self.timeline_every = timeline_every
        self.clock = clock
        self.t0 = clock()
        self.future: list[Request] = []              # not yet arrived (sorted by arrival)
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: tuple[Request, Lane, int, object] | None = None
        self.iteration = 0
        self.finished: list[Request] = []
        self.timelines: list[dict] = []               # sampled rounds: {"iteration", "spans", stats}
        self.rounds: list[dict] = []                  # per decode iteration: what ran, switches, stalls
        self.prefill_forwards = 0                     # prefill chunks run (0 on a decode instance)
        self.handovers = 0                            # handed-over requests placed
        self.handover_s = 0.0                         # seconds of placing their KV, taken off the clock
        self._paused = 0.0
        self._loaders = {n: Loader(l.engine) for n, l in self.lanes.items() if l.offloaded}

    # -------------------------------------------------------------- requests in
    def now(self) -> float:
        """Seconds on the scheduler's clock: wall time less the handovers' (`handover_s`)."""
        return self.clock() - self.t0 - self._paused

    def validate(self, req: Request) -> None:
        """One line for a request that can never run (raised before it is queued)."""
        if len(req.prompt) < 1:
            raise BadInput(f"request {req.id}: empty prompt")
        if req.max_tokens < 1:
            raise BadInput(f"request {req.id}: max_tokens must be >= 1, got {req.max_tokens}")
        if req.arrival < 0:
            raise BadInput(f"request {req.id}: negative arrival {req.arrival}")
        name = self.policy.place(req, self)
        lane = self.lanes.get(name)
        if lane is None:
            raise BadInput(f"request {req.id}: placed in lane {name!r}, which does not exist")
        need = len(req.prompt) + req.max_tokens
        if need > lane.cache.capacity or lane.pages_for(req) > lane.cache.pages.n_pages:
            raise BadInput(f"request {req.id}: {len(req.prompt)} prompt + {req.max_tokens} new tokens exceed "
                           f"lane {lane.name}'s cache of {lane.cache.capacity} tokens per request")
        vocab = lane.engine.model.shape.vocab
        if min(req.prompt) < 0 or max(req.prompt) >= vocab:
            raise BadInput(f"request {req.id}: token ids must be in [0, {vocab})")

    def submit(self, req: Request) -> Request:
        self.validate(req)
        req.status = "waiting"
        if req.arrival <= self.now():
            req.queued_iter = self.iteration
            self.waiting.append(req)
        else:
            self.future.append(req)
            self.future.sort(key=lambda r: r.arrival)
        return req

    def lane_load(self, lane: Lane) -> int:
        """Requests holding a slot of `lane` (running, or being prefilled)."""
        pre = self.prefilling is not None and self.prefilling[1] is lane
        return len(lane.running) + int(pre)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or any(l.running for l in self.lanes.values()))

    # -------------------------------------------------------------- one iteration
    @torch.inference_mode()
    def step(self) -> bool:
        """One iteration; False when there was nothing to do."""
        now = self.now()
        while self.future and self.future[0].arrival <= now:
            r = self.future.pop(0)
            r.queued_iter = self.iteration
            self.waiting.append(r)
        did = self._admit()
        if self.prefilling is not None:
            self._prefill_chunk()
            did = True
        if any(l.running for l in self.lanes.values()):
            self._decode()
            did = True
        if did:
            self.iteration += 1
        return did

    def run(self, requests: list[Request], idle_sleep: float = 1e-3) -> list[Request]:
        """Submit all (validated first: one bad request stops nothing from running), run to completion."""
        for r in requests:
            self.validate(r)
        for r in requests:
            self.submit(r)
        while self.busy or self.future:
            if not self.step() and self.future:
                time.sleep(min(idle_sleep, max(0.0, self.future[0].arrival - self.now())))
        order = {id(r): i for i, r in enumerate(requests)}
        return sorted((r for r in self.finished if id(r) in order), key=lambda r: order[id(r)])

    def _admit(self) -> bool:
        """Start the head of the queue if it fits (a prompt to prefill: one at a time); handed-over requests
        are admitted as long as the head fits. True when a handed-over request was placed."""
        placed = False
        while self.prefilling is None and self.waiting:
            head = self.waiting[0]
            if not self._start(head) or not head.prefilled:
                break
            placed = True
        return placed

    def _start(self, req: Request) -> bool:
        lane = self.lanes[self.policy.place(req, self)]
        if not lane.fits(req):
            return False                             # FCFS: the head waits, nobody overtakes it
        self.waiting.popleft()
        slot = len(lane.running)
        c = lane.cache
        clear_slot(c, slot)
        c.pages.reserve(slot, len(req.prompt) + req.max_tokens)
        req.lane, req.status, req.start_iter, req.start_time = lane.name, "prefill", self.iteration, self.now()
        if req.prefilled:
            self._hand_over(req, lane, slot)
            return True
        toks = torch.tensor(req.prompt, dtype=torch.int64, device=lane.engine.model.device)
        self.prefilling = (req, lane, slot, lane.engine.prefill_chunks(slot, toks))
        return True

    def _hand_over(self, req: Request, lane: Lane, slot: int) -> None:
        """Place a handed-over request's KV in its slot with the clock stopped, emit its first token (the
        prefill instance's; the prompt's last token stands in) and put it in the running batch."""
        # a strategy whose copies `bind` drops is safe: `lane.reset()` below makes the next step bind afresh
        if lane.engine.strategy.mirrors and not lane.engine.strategy.mirrors_until_bind:
            raise BadInput(f"lane {lane.name}: {lane.engine.strategy.name} mirrors pool rows, so a handover "
                           "that writes the pool directly would bypass it")
        t = self.clock()
        # the request's contents follow from its id alone: the same KV in any lane, under any policy
        lane.cache.fill_slot_random_(slot, len(req.prompt), seed=zlib.crc32(req.id.encode()))
        if lane.engine.model.device.type == "cuda":
            torch.cuda.synchronize(lane.engine.model.device)
        dt = self.clock() - t
        self._paused += dt
        self.handover_s += dt
        self.handovers += 1
        self._emit(req, req.prompt[-1], self.now())
        if req.remaining == 0:
            clear_slot(lane.cache, slot)
            self._finish(req)
            return
        lane.running.append(req)
        req.status = "decode"
        lane.reset()

    def _prefill_chunk(self) -> None:
        req, lane, slot, gen = self.prefilling
        self.prefill_forwards += 1
        try:
            next(gen)
            return
        except StopIteration as done:
            logits = done.value
        except Exception as ex:                      # noqa: BLE001 - recorded, the scheduler goes on
            self.prefilling = None
            clear_slot(lane.cache, slot)
            self._fail(req, ex)
            return
        self.prefilling = None
        tok = int(logits.argmax(-1)[0]) if req.pick is None else int(req.pick(req, logits[0]))
        self._emit(req, tok, self.now())
        if req.remaining == 0:
            clear_slot(lane.cache, slot)
            self._finish(req)
            return
        n = len(lane.running)
        if slot != n:                                # a request finished during this prefill
            move_slot(lane.cache, slot, n)
        lane.running.append(req)
        req.status = "decode"
        lane.reset()

    def _decode(self) -> None:
        busy = [l for l in self.lanes.values() if l.running]
        sample = self.timeline_every > 0 and len(self.rounds) % self.timeline_every == 0
        cuda = busy[0].engine.model.device.type == "cuda"
        tl = Timeline(cuda) if sample else None
        norm = [l for l in busy if not l.offloaded]
        off = [l for l in busy if l.offloaded]
        copies = sum(l.engine.strategy.copies for l in off)
        try:
            states = [(l.engine, l.decode_state()) for l in busy]
            graphs = self.graphs and all(l.warm for l in busy) and self._capture(busy, norm, off)
            if self.switching and norm and off:
                (ne, ns), (oe, os_) = (norm[0].engine, norm[0].state), (off[0].engine, off[0].state)
                kw = {}
                if graphs and ne.strategy.graphable:
                    kw = dict(n_gen=replay(norm[0].pieces("blocks")), o_gen=replay(off[0].pieces("loads")),
                              lookahead=self.lookahead)
                stats = switched_round(ne, ns, oe, os_, self._loaders[off[0].name], tl, **kw)
                if kw:
                    stats.loads_normal = list(norm[0].graph_loads["blocks"])
                mode = "switched"
            elif graphs:
                stats = RoundStats()
                for l in busy:
                    a = tl.stamp() if tl else None
                    l.replay_step(stats)
                    if tl:
                        tl.add("offloaded" if l.offloaded else "normal", "compute", "step", a, tl.stamp())
                mode = "sequential"
            else:
                stats = sequential_round(states, tl)
                mode = "sequential"
            for l in busy:
                l.warm = True
            toks = {l.name: l.state.tokens.tolist() for l in busy}     # the one sync of the iteration
            for l in busy:
                for slot, r in enumerate(l.running):
                    if r.pick is not None:         # the request picks its own token; the next step embeds it
                        tok = int(r.pick(r, l.state.logits[slot]))
                        if tok != toks[l.name][slot]:
                            toks[l.name][slot] = tok
                            l.state.tokens[slot] = tok
        except Exception as ex:                      # noqa: BLE001 - the batch fails, the scheduler goes on
            for l in busy:
                for r in l.running:
                    r.end_iter = self.iteration
                    self._fail(r, ex)
                for slot in range(len(l.running)):
                    clear_slot(l.cache, slot)
                l.running = []
                l.reset()
            return
        t = self.now()
        rec = {"iteration": self.iteration, "mode": mode, "switches": stats.switches, "stalls": stats.stalls,
               "checks": stats.checks, "batch": {l.name: len(l.running) for l in busy},
               "waiting": len(self.waiting),     # arrived, not yet admitted (memory or slots full)
               "h2d_bytes": sum(int(r.h2d_bytes) for r in stats.loads_offloaded), "time": t,
               # host-issued copies of the offloaded loads (a background thread's are all issued once
               # the round's loads are joined, which the token read above waits for)
               "copies": sum(l.engine.strategy.copies for l in off) - copies,
               "load_bytes": [int(r.h2d_bytes) for r in stats.loads_offloaded]}
        self.rounds.append(rec)
        if tl is not None:
            self.timelines.append({**rec, "spans": tl.spans()})
        for l in busy:
            for r, tok in zip(l.running, toks[l.name]):
                self._emit(r, tok, t)
            self._retire(l)

    def _capture(self, busy, norm, off) -> bool:
        """Capture this round's graphs (once per batch composition). A capture that fails turns graphs
        off for the rest of the run (recorded in `graph_error`); capture runs nothing, so the round then
        runs eagerly from the same state."""
        try:
            if self.switching and norm and off:
                if norm[0].engine.strategy.graphable:
                    norm[0].pieces("blocks")
                    off[0].pieces("loads")
            else:
                for l in busy:
                    l.pieces(l.step_split)
            return True
        except Exception as ex:                      # noqa: BLE001
            self.graphs = False
            self.graph_error = f"{type(ex).__name__}: {str(ex).strip()[:300]}"
            for l in busy:
                l.graphs = {}
            return False

    def _retire(self, lane: Lane) -> None:
        """Finish requests that have all their tokens; keep the rest in slots [0, n) in order."""
        if all(r.remaining > 0 for r in lane.running):
            return
        keep = []
        for slot, r in enumerate(lane.running):
            if r.remaining > 0:
                if slot != len(keep):
                    move_slot(lane.cache, slot, len(keep))
                keep.append(r)
            else:
                clear_slot(lane.cache, slot)
                self._finish(r)
        lane.running = keep
        lane.reset()

    def _emit(self, req: Request, tok: int, t: float) -> None:
        req.tokens.append(tok)
        req.token_times.append(t)
        if req.on_token is not None:
            req.on_token(req, tok, t)

    def _finish(self, req: Request) -> None:
        req.status, req.end_iter, req.end_time = "done", self.iteration, self.now()
        self.finished.append(req)
        if req.on_done is not None:
            req.on_done(req)

    def _fail(self, req: Request, ex: Exception) -> None:
        req.status, req.end_time = "failed", self.now()
        req.end_iter = self.iteration
        req.error = one_line(ex)[:400]
        self.finished.append(req)
        if req.on_done is not None:
            req.on_done(req)


def make_lanes(shape, device="cpu", resident_slots: int = 4, offload_slots: int = 0, capacity: int = 4096,
               budget: int = 2048, strategy: str = "zero_copy", seed: int = 0, page_size: int = 256,
               prefill_chunk: int = 8192, compile: bool = False, model: HybridModel | None = None,
               resident_pool_tokens: int | None = None, select_block: int = 1,
               settings: dict | None = None, offload_pool_tokens: int | None = None) -> dict[str, Engine]:
    """Engines over one model: `resident` (device pool) and/or `offload` (host pool, `strategy` with its
    `settings`, the sweep's names, e.g. dma_units_per_call).
    `resident_pool_tokens` caps the device pool below slots x capacity (device memory is what the
    placement policies share out); `offload_pool_tokens` the host pool (each replay registers its host pool
    with the driver, seconds per tens of GiB: a pool sized to the requests, not to slots x capacity). `select_block` applies to both lanes, so a request's tokens do not
    depend on where it is placed."""
    if isinstance(shape, str):
        shape = ModelShape.from_name(shape)
    model = model or HybridModel(shape, device, seed=seed)
    lanes = {}
    for name, slots, strat in (("resident", resident_slots, "resident"), ("offload", offload_slots, strategy)):
        if slots <= 0:
            continue
        st = get_strategy(strat, **((settings or {}) if name == "offload" else {}))      # resident takes none
        pool = resident_pool_tokens if name == "resident" else offload_pool_tokens
        cache = OffloadCache.allocate(model, st.medium, slots, capacity, page_size=page_size, pool_tokens=pool)
        lanes[name] = Engine(model, cache, st, budget, prefill_chunk=prefill_chunk, compile=compile,
                             select_block=select_block)
    if not lanes:
        raise BadInput("at least one of resident_slots and offload_slots must be > 0")
    return lanes
