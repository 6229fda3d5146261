"""Layers split across devices: contiguous ranges of blocks per device, each stage with its own KV pool,
index keys and gather path, activations handed to the next device once per stage.

    stages = split_model(HybridModel(shape, "cpu", seed), place_layers(costs, 3), ["cuda:0", "cuda:1", "cuda:2"])
    pipe = PipelineEngine(stages, "zero_copy", budget=2048, n_slots=4, capacity=1 << 20)
    pipe.prefill(slot, tokens); runner = pipe.decoder(batch=4); runner.step()

Why: on the reference box (3x RTX 3090) every GPU reaches host RAM over its own PCIe link, so the
offloaded rows of a stage's QSA layers travel over that stage's link and the aggregate gather
bandwidth grows with the number of GPUs. Each stage's pinned host pool is allocated (and page-locked)
by a thread bound to that stage's device, so its pages are first touched where that GPU's driver
thread runs. Placement balances measured per-block cost (`measure_block_costs`), not block counts.

Every launch of a stage (prefill, warm-up, graph capture, replay, anatomy) runs under `device_guard`
of its device: Triton launches on the *current* device, whatever device its tensors are on.

Pipelining across requests: `decoder(batch, micro_batches=M)` splits the batch into M micro-batches
whose chains run on the stages at once (`PipelineRunner`); `timeline` and `bubbles` say how much of a
step each stage sat idle.
"""
from __future__ import annotations

import contextlib
import copy
import statistics
import time

import torch
from torch import nn

from ..model.cache import OffloadCache, build_on_devices
from ..model.forward import Engine
from ..model.hybrid import HybridModel, kind_index
from .runner import DecodeRunner, Marks
from ..transfer import get_strategy


class StageModel(nn.Module):
    """A contiguous slice of a HybridModel's blocks on one device; the embedding lives on the first
    stage and the final norm + head on the last. Duck-types HybridModel for Engine/OffloadCache."""

    def __init__(self, model: HybridModel, start: int, end: int, device: torch.device, first: bool, last: bool,
                 copy_weights: bool = False):
        super().__init__()
        move = (lambda m: copy.deepcopy(m).to(device)) if copy_weights else (lambda m: m.to(device))
        self.shape, self.dtype, self.device = model.shape, model.dtype, torch.device(device)
        self.weights_dtype, self.expert_banks, self.routing = model.weights_dtype, model.expert_banks, model.routing
        self.range = (start, end)
        # the n-gram table stays in host RAM; the stage holding its layer reads it onto its own device
        self.ngram = copy.copy(model.ngram) if model.ngram is not None else None
        if self.ngram is not None:
            self.ngram.device = self.device
        self.blocks = nn.ModuleList(move(b) for b in model.blocks[start:end])
        self.embed = nn.Parameter(model.embed.detach().to(device), requires_grad=False) if first else None
        self.norm = move(model.norm) if last else None
        self.lm_head = nn.Parameter(model.lm_head.detach().to(device), requires_grad=False) if last else None
        self.kind_index = kind_index(self.blocks)

    weight_bytes = HybridModel.weight_bytes
    step_weight_bytes = HybridModel.step_weight_bytes
    holding = HybridModel.holding
    n_attn = HybridModel.n_attn
    n_dn = HybridModel.n_dn


def place_layers(costs: list[float], n: int) -> list[tuple[int, int]]:
    """Split blocks 0..L-1 into n contiguous ranges minimising the largest range's summed cost
    (linear partition, dynamic programming). Every range gets at least one block."""
    L = len(costs)
    if not 1 <= n <= L:
        raise ValueError(f"cannot place {L} layers on {n} devices")
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    INF = float("inf")
    best = [[INF] * (L + 1) for _ in range(n + 1)]      # best[k][j]: first j blocks on k devices
    cut = [[0] * (L + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for k in range(1, n + 1):
        for j in range(k, L + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], pre[j] - pre[i])
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, i
    ranges, j = [], L
    for k in range(n, 0, -1):
        i = cut[k][j]
        ranges.append((i, j))
        j = i
    return ranges[::-1]


def model_block_costs(model: HybridModel, budget: int, link_gbps: float = 25.0, mem_gbps: float = 900.0) -> list[float]:
    """A byte model of each block's decode cost (seconds): its weights over memory bandwidth, plus for a
    QSA block its selected rows over the link. The fallback when nothing can be measured."""
    out = []
    for b in model.blocks:
        t = sum(p.numel() * p.element_size() for p in b.parameters()) / (mem_gbps * 1e9)
        if b.kind == "qsa":
            t += budget * model.shape.row_bytes / (link_gbps * 1e9)
        out.append(t)
    return out


def measure_block_costs(engine: Engine, batch: int = 1, steps: int = 5) -> list[float]:
    """Measured per-block time (ms, median over `steps` marked eager decode steps, transfers included)."""
    runner = DecodeRunner(engine, batch, graphs=False)
    runner.prepare(warmup=1)
    samples = []
    for _ in range(steps):
        runner.state.marks = Marks(cuda=runner.cuda)
        runner.step()
        samples.append(runner.state.marks.block_durations())
        runner.state.marks = None
    return [statistics.median(c) for c in zip(*samples)]


def split_model(model: HybridModel, ranges: list[tuple[int, int]], devices: list, copy_weights: bool = False) -> list[StageModel]:
    if len(ranges) != len(devices):
        raise ValueError(f"{len(ranges)} layer ranges for {len(devices)} devices")
    n = len(ranges)
    return [StageModel(model, a, b, torch.device(d), i == 0, i == n - 1, copy_weights) for i, ((a, b), d) in
            enumerate(zip(ranges, devices))]


def staged_prefill(engines: list[Engine], slot: int, tokens: torch.Tensor) -> torch.Tensor:
    """Prefill through the stages in order: each takes the previous stage's hidden states (all tokens)
    on its own device; the last returns the logits. One engine: a plain prefill."""
    hidden = None
    for i, e in enumerate(engines):
        dev = e.model.device
        with device_guard(dev):
            hidden = e.prefill(slot, tokens.to(dev) if i == 0 else None, hidden=None if i == 0 else hidden.to(dev))
    return hidden


class PipelineEngine:
    def __init__(self, stages: list[StageModel], strategy: str, budget: int, n_slots: int, capacity: int,
                 page_size: int = 256, compile: bool | None = None, **settings):
        self.stages, self.strategy, self.settings = stages, strategy, settings

        def build(stage: StageModel) -> Engine:
            st = get_strategy(strategy, **settings)
            cache = OffloadCache.allocate(stage, st.medium, n_slots, capacity, page_size)
            return Engine(stage, cache, st, budget, compile=compile)

        self.engines = build_on_devices(build, stages)

    def prefill(self, slot: int, tokens: torch.Tensor) -> torch.Tensor:
        return staged_prefill(self.engines, slot, tokens)

    def decoder(self, batch: int, graphs: bool | None = None, max_steps: int = 1024,
                micro_batches: int = 1) -> "PipelineRunner":
        """Slots [0, batch) as `micro_batches` neighbouring ranges, each with its own runner per stage
        (its own strategy instance: strategies that keep per-batch state bind once per runner)."""
        grid = []
        for first, size in micro_batch_ranges(batch, micro_batches):
            row = []
            for e in self.engines:
                mine = copy.copy(e)
                mine.strategy = get_strategy(self.strategy, **self.settings)
                with device_guard(e.model.device):
                    row.append(DecodeRunner(mine, size, graphs=graphs, max_steps=max_steps, first=first))
            grid.append(row)
        return PipelineRunner(grid)

    def fill_random_(self, context_lens: list[int], seed: int = 0) -> None:
        for e in self.engines:
            e.cache.fill_random_(context_lens, seed)


def micro_batch_ranges(batch: int, micro_batches: int) -> list[tuple[int, int]]:
    """(first slot, size) of each micro-batch: `batch` requests in `micro_batches` near-equal ranges
    (never more micro-batches than requests)."""
    if batch < 1 or micro_batches < 1:
        raise ValueError(f"batch and micro_batches must be >= 1, got {batch}, {micro_batches}")
    m = min(batch, micro_batches)
    sizes = [batch // m + (i < batch % m) for i in range(m)]
    return [(sum(sizes[:i]), n) for i, n in enumerate(sizes)]


class PipelineRunner:
    """Decode steps of a batch split over stages (devices) and micro-batches.

    `grid[m][k]` is the runner of micro-batch m on stage k. Each micro-batch is a chain: stage k's
    activations go to stage k+1, the last stage's sampled tokens back to stage 0 for the next step. On
    CUDA every stage has a compute stream and a hand-off stream, and the chain is kept by events only:
    the host issues (m, k) for all m and k without waiting, so while stage k+1 works on micro-batch m,
    stage k already works on micro-batch m+1 -- with two or more micro-batches both GPUs and both PCIe
    links are busy at once. Hand-offs are device-to-device copies (peer to peer: NVLink where present).
    One micro-batch is the plain layer split: the stages take turns.

    Pipelining pays where a step's per-request work (rows over each stage's own link, attention)
    dominates; weight reads do not shrink: every micro-batch re-reads its stage's weights.
    Only whole-step graphs (device-only strategies) overlap fully: a host strategy's loads run on the
    issuing thread between graph pieces and serialise the issue.
    """

    def __init__(self, grid):
        if grid and not isinstance(grid[0], (list, tuple)):
            grid = [list(grid)]               # one micro-batch: a list of stage runners
        self.grid = [list(row) for row in grid]
        self.runners = [r for row in self.grid for r in row]
        self.devices = [r.engine.model.device for r in self.grid[0]]
        self.cuda = self.devices[0].type == "cuda"
        M, N = len(self.grid), len(self.devices)
        if self.cuda:
            def on(k, make):
                with torch.cuda.device(self.devices[k]):
                    return make()
            self.compute = [on(k, torch.cuda.Stream) for k in range(N)]
            self.handoff = [on(k, torch.cuda.Stream) for k in range(N)]
            self.done = [[on(k, torch.cuda.Event) for k in range(N)] for _ in range(M)]
            self.ready = [[on(k, torch.cuda.Event) for k in range(N)] for _ in range(M)]
        self._spans = None          # set by `timeline`: (start, end) timing events per (m, k)

    @property
    def micro_batches(self) -> int:
        return len(self.grid)

    @property
    def state(self):
        """The last stage's state of a single micro-batch (logits, tokens)."""
        return self.grid[0][-1].state

    def logits(self) -> torch.Tensor:
        """Every request's logits of the last step, in slot order (on the last stage's device)."""
        return torch.cat([row[-1].state.logits for row in self.grid])

    @property
    def h2d_bytes_per_step(self) -> int:
        return sum(r.h2d_bytes_per_step for r in self.runners)

    @property
    def rows_per_step(self) -> int:
        return sum(r.rows_per_step for r in self.runners)

    def stage_h2d_bytes_per_step(self) -> list[int]:
        """Engine-counted bytes over each stage's link (its GPU's PCIe RX counter is the check)."""
        return [sum(row[k].h2d_bytes_per_step for row in self.grid) for k in range(len(self.devices))]

    @property
    def graph_mode(self) -> str:
        return self.runners[0].graph_mode

    def anatomy(self, repeats: int = 5) -> dict[str, float]:
        """Per phase, summed over the stages and micro-batches run one after another (so it describes
        the work of a step, not its overlap: with several micro-batches compare with `timeline`)."""
        total: dict[str, float] = {}
        for r in self.runners:
            with device_guard(r.engine.model.device):
                for k, v in r.anatomy(repeats).items():
                    total[k] = total.get(k, 0.0) + v
        total["mark_us"] /= len(self.runners)        # a mean cost per mark, not a sum
        return total

    @torch.inference_mode()
    def prepare(self, warmup: int = 2) -> None:
        """Warm-up steps through the whole chain (a stage warmed up on its own would write K/V rows of
        stale activations), then each runner captures its graphs."""
        for _ in range(max(warmup, 1) if self.cuda else warmup):
            self._sequential_step()
        for r in self.runners:
            with device_guard(r.engine.model.device):
                r.prepare(warmed=True)
        if self.cuda:
            for d in self.devices:
                torch.cuda.synchronize(d)

    def _sequential_step(self) -> list:
        """Micro-batch after micro-batch, stage after stage, on the current streams; returns each
        (micro-batch, stage)'s wall-clock (start, end) (the CPU timeline)."""
        spans = []
        for row in self.grid:
            spans.append([])
            for k, r in enumerate(row):
                with device_guard(r.engine.model.device):
                    if k > 0:
                        r.state.x_in.copy_(row[k - 1].state.x_out)
                    t0 = time.perf_counter()
                    r.step()
                    spans[-1].append((t0, time.perf_counter()))
            if len(row) > 1:
                with device_guard(row[0].engine.model.device):
                    row[0].state.tokens.copy_(row[-1].state.tokens)
        return spans

    @torch.inference_mode()
    def step(self) -> None:
        if not self.cuda:
            self._sequential_step()
            return
        N = len(self.devices)
        for m, row in enumerate(self.grid):
            for k, r in enumerate(row):
                with torch.cuda.stream(self.compute[k]):        # also makes stage k's device current
                    self.compute[k].wait_event(self.ready[m][k])
                    if self._spans is not None:
                        self._spans[m][k][0].record()
                    r.step()
                    if self._spans is not None:
                        self._spans[m][k][1].record()
                    self.done[m][k].record()
                if N > 1:
                    nxt = (k + 1) % N
                    src = r.state.x_out if nxt else r.state.tokens
                    dst = row[nxt].state.x_in if nxt else row[0].state.tokens
                    self._hand_off(m, k, nxt, src, dst)
        # The caller's stream (timing events, synchronize) sees the step end when every chain has.
        cur = torch.cuda.current_stream(self.devices[0])
        for m in range(len(self.grid)):
            cur.wait_event(self.done[m][N - 1])

    def _hand_off(self, m: int, k: int, nxt: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """src (stage k) -> dst (stage nxt) once (m, k) is done, on the hand-off streams: torch's
        cross-device copy fences the *current* streams of both devices, and those are the hand-off
        streams here, so neither compute stream is held up by the other's work."""
        hs, hd = self.handoff[k], self.handoff[nxt]
        with torch.cuda.stream(hs):
            hs.wait_event(self.done[m][k])
            with torch.cuda.stream(hd):
                dst.copy_(src, non_blocking=True)
                self.ready[m][nxt].record(hd)

    @torch.inference_mode()
    def timeline(self, steps: int = 3) -> list[dict]:
        """Run `steps` steps with a timing event at each (micro-batch, stage) start and end; returns one
        row per span: step, micro_batch, stage, device, start_ms, end_ms (from a common origin: every
        device's idle stream records an origin event right after a synchronize, µs apart)."""
        M, N = len(self.grid), len(self.devices)
        rows, mk = [], (lambda k: self._event(k))
        for d in self.devices:
            if self.cuda:
                torch.cuda.synchronize(d)
        origin = [self._event(k) for k in range(N)]
        for k in range(N):
            self._record(origin[k], k)
        taken = []
        for _ in range(steps):          # issued back to back: read only after the last (a read syncs)
            if self.cuda:
                self._spans = [[(mk(k), mk(k)) for k in range(N)] for _ in range(M)]
                self.step()
                taken.append(self._spans)
                self._spans = None
            else:
                taken.append(self._sequential_step())
        for s, spans in enumerate(taken):
            for m in range(M):
                for k in range(N):
                    a, b = spans[m][k]
                    rows.append(dict(step=s, micro_batch=m, stage=k, device=str(self.devices[k]),
                                     start_ms=self._since(origin[k], a), end_ms=self._since(origin[k], b)))
        return rows

    def _event(self, k: int):
        if not self.cuda:
            return None
        with torch.cuda.device(self.devices[k]):
            return torch.cuda.Event(enable_timing=True)

    def _record(self, ev, k: int) -> None:
        if self.cuda:
            with torch.cuda.device(self.devices[k]):
                ev.record()
        else:
            self._t0 = time.perf_counter()

    def _since(self, origin, ev) -> float:
        if self.cuda:
            ev.synchronize()
            return origin.elapsed_time(ev)
        return (ev - self._t0) * 1e3


def bubbles(spans: list[dict]) -> dict:
    """From a `timeline`: the steady-state cycle (median interval between consecutive steps' ends; one
    step: its whole span) and per stage its busy time in a cycle and the rest, its bubble. The first
    step counts only towards the cycle (nothing before it to overlap). `bubble_share`: the idle share
    of all stages together (two stages taking turns: >= 1/2)."""
    import pandas as pd         # for this summary only: the engine itself runs without pandas
    df = pd.DataFrame(spans)
    ends = df.groupby("step").end_ms.max().sort_index().to_numpy()
    cycle = float(statistics.median(ends[1:] - ends[:-1])) if len(ends) > 1 else float(ends[0] - df.start_ms.min())
    later = df[df.step > df.step.min()] if len(ends) > 1 else df
    out = {"cycle_ms": cycle}
    for k, g in later.groupby("stage"):
        busy = float((g.end_ms - g.start_ms).groupby(g.step).sum().median())
        out[f"busy_ms_stage{k}"] = busy
        out[f"bubble_ms_stage{k}"] = max(0.0, cycle - busy)
    n = df.stage.nunique()
    out["bubble_share"] = sum(out[f"bubble_ms_stage{k}"] for k in range(n)) / (n * cycle) if cycle > 0 else 0.0
    return out


def device_guard(device: torch.device):
    """The current-device guard of a stage (Triton launches on the current device, not the tensors')."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
