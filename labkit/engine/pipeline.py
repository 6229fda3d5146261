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

Not here yet: pipelining concurrent requests across stages (micro-batches in flight on different
stages at once); a step runs the stages one after another.
"""
from __future__ import annotations

import contextlib
import copy
import statistics

import torch
from torch import nn

from .cache import OffloadCache, build_on_devices
from .engine import Engine
from .model import HybridModel, kind_index
from .runner import Marks
from .transfer import get_strategy


class StageModel(nn.Module):
    """A contiguous slice of a HybridModel's blocks on one device; the embedding lives on the first
    stage and the final norm + head on the last. Duck-types HybridModel for Engine/OffloadCache."""

    def __init__(self, model: HybridModel, start: int, end: int, device: torch.device, first: bool, last: bool,
                 copy_weights: bool = False):
        super().__init__()
        move = (lambda m: copy.deepcopy(m).to(device)) if copy_weights else (lambda m: m.to(device))
        self.shape, self.dtype, self.device = model.shape, model.dtype, torch.device(device)
        self.range = (start, end)
        self.blocks = nn.ModuleList(move(b) for b in model.blocks[start:end])
        self.embed = nn.Parameter(model.embed.detach().to(device), requires_grad=False) if first else None
        self.norm = move(model.norm) if last else None
        self.lm_head = nn.Parameter(model.lm_head.detach().to(device), requires_grad=False) if last else None
        self.kind_index = kind_index(self.blocks)

    weight_bytes = HybridModel.weight_bytes
    step_weight_bytes = HybridModel.step_weight_bytes
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
    runner = engine.decoder(batch, graphs=False)
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
                 page_size: int = 256, compile: bool | None = None):
        self.stages = stages

        def build(stage: StageModel) -> Engine:
            st = get_strategy(strategy)
            cache = OffloadCache.allocate(stage, st.medium, n_slots, capacity, page_size)
            return Engine(stage, cache, st, budget, compile=compile)

        self.engines = build_on_devices(build, stages)

    def prefill(self, slot: int, tokens: torch.Tensor) -> torch.Tensor:
        return staged_prefill(self.engines, slot, tokens)

    def decoder(self, batch: int, graphs: bool | None = None, max_steps: int = 1024) -> "PipelineRunner":
        return PipelineRunner([e.decoder(batch, graphs=graphs, max_steps=max_steps) for e in self.engines])

    def fill_random_(self, context_lens: list[int], seed: int = 0) -> None:
        for e in self.engines:
            e.cache.fill_random_(context_lens, seed)


class PipelineRunner:
    """One decode step = each stage's step in turn, activations copied to the next device in between,
    the sampled tokens copied from the last stage back to the first."""

    def __init__(self, runners):
        self.runners = runners

    @property
    def state(self):
        return self.runners[-1].state

    @property
    def h2d_bytes_per_step(self) -> int:
        return sum(r.h2d_bytes_per_step for r in self.runners)

    @property
    def rows_per_step(self) -> int:
        return sum(r.rows_per_step for r in self.runners)

    @property
    def graph_mode(self) -> str:
        return self.runners[0].graph_mode

    def anatomy(self, repeats: int = 5) -> dict[str, float]:
        """Per phase, summed over the stages (a step runs them one after another)."""
        total: dict[str, float] = {}
        for r in self.runners:
            with device_guard(r.engine.model.device):
                for k, v in r.anatomy(repeats).items():
                    total[k] = total.get(k, 0.0) + v
        total["mark_us"] /= len(self.runners)        # a mean cost per mark, not a sum
        return total

    def prepare(self, warmup: int = 2) -> None:
        for r in self.runners:
            with device_guard(r.engine.model.device):
                r.prepare(warmup)

    @torch.inference_mode()
    def step(self) -> None:
        rs = self.runners
        for i, r in enumerate(rs):
            with device_guard(r.engine.model.device):     # every launch of a stage on its own GPU
                if i > 0:
                    r.state.x_in.copy_(rs[i - 1].state.x_out, non_blocking=True)
                r.step()
        rs[0].state.tokens.copy_(rs[-1].state.tokens, non_blocking=True)


def device_guard(device: torch.device):
    """The current-device guard of a stage (Triton launches on the current device, not the tensors')."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
