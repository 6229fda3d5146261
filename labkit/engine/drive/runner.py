"""DecodeRunner: runs decode steps of one batch as fast as the strategy allows, and measures them.

- eager (CPU, or graphs off): the step generator is driven op by op, loads between its segments;
- one CUDA graph for the whole step when the strategy does only device work (`graphable`);
- one graph per segment, with the host-side load between replays, for the host strategies (piecewise
  graphs, as vLLM does around host-side ops).

What moved: every `load` returns a `LoadResult`; the runner keeps those of the last step it ran (for a
whole-step graph, those of the captured step, which every replay repeats) and sums them
(`h2d_bytes_per_step`, `rows_per_step`). Nothing here computes bytes from a formula.

Where the time goes (`anatomy`): the engine marks phase boundaries (`weights`, `deltanet`,
`index_score`, `selection`, `transfer`, `attention`, `head`, `other`) as it composes a step. A second
graph of the step is captured with a timing event recorded at each boundary (graph event-record
nodes), replayed a few times, and the time between consecutive events is the time of the phase that
began at the first. Each mark costs the step a few µs (~170 marks: ~9% of a 6 ms step on the H200), so
a third graph records every mark twice; the difference per mark is taken off every interval once. The
corrected phases' sum against the unmarked step (`anat_closure` in the sweep) is the check that this
accounting holds.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..model.forward import Engine, LoadRequest
from ..model.step_state import StepBuffers
from ..transfer import LoadResult
from .dispatch import capture, load, warm_up

PHASES = ("weights", "deltanet", "index_score", "selection", "transfer", "attention", "experts", "hc", "ngram",
          "head", "other")


class DecodeState(StepBuffers):
    """Static buffers of one decode batch (fixed addresses so CUDA graphs can replay them): the model's
    `StepBuffers`, and what the runner keeps beside them (the anatomy's marks)."""

    def __init__(self, engine: Engine, batch: int, trace: torch.Tensor | None, max_steps: int = 1024,
                 first: int = 0):
        c, s, dev = engine.cache, engine.model.shape, engine.model.device
        if first < 0 or first + batch > c.n_slots:
            raise ValueError(f"slots [{first}, {first + batch}) exceed the cache's {c.n_slots} slots")
        self.batch = batch
        # The batch's cache slots: a contiguous range, so per-slot state is a view (micro-batches of a
        # pipeline are neighbouring ranges of one cache).
        self.span = slice(first, first + batch)
        # The indexer scores positions [0, window): the batch's longest request now plus the steps this
        # runner may take, not the whole cache capacity (a 1M-token cache would cost every step a
        # 1M-position scan even at 8K of context). Read once here: no sync inside a step.
        longest = int(c.lens[self.span].max())
        self.window = min(c.capacity, longest + max_steps)
        self.k = min(engine.budget, self.window)
        self.slots = torch.arange(first, first + batch, device=dev)
        self.tokens = torch.randint(0, s.vocab, (batch,), generator=torch.Generator().manual_seed(batch)).to(dev)
        self.staging = torch.empty((batch * self.k, c.row_words()), dtype=torch.int64, device=dev)
        n_attn = engine.model.n_attn
        self.rows_buf = torch.zeros((n_attn, batch * self.k), dtype=torch.int64, device=dev)
        # this step's selection per QSA layer, written in place by the selection kernel
        self.last_sel = torch.zeros((n_attn, batch, self.k), dtype=torch.int64, device=dev)
        self.last_valid = torch.zeros((n_attn, batch, self.k), dtype=torch.bool, device=dev)
        # a pipeline stage's hand-off: the residual stream (hc_count copies of the hidden state)
        self.x_in = torch.zeros((batch, s.hidden * s.hc_count), dtype=engine.model.dtype, device=dev)
        self.x_out = torch.zeros((batch, s.hidden * s.hc_count), dtype=engine.model.dtype, device=dev)
        # distinct routed experts read, summed over the steps' MoE layers (the runner zeroes and reads it)
        self.experts_read = torch.zeros(1, dtype=torch.int64, device=dev)
        self.logits = torch.empty((batch, s.vocab), dtype=engine.model.dtype, device=dev)
        self.trace = None if trace is None else trace[..., :self.k].to(dev)
        self.trace_step = torch.zeros((), dtype=torch.int64, device=dev)
        self.marks: Marks | None = None      # set while a step is being marked for its anatomy

    def mark(self, phase: str, new_block: bool = False) -> None:
        if self.marks is not None:
            self.marks.mark(phase, new_block)


class Marks:
    """Phase boundaries of one step: CUDA events (recorded into a graph when captured) or wall clock.

    For the anatomy (`coarse=True`) a mark that names the phase already running is not recorded, so a
    run of DeltaNet blocks is one interval: every mark costs the step ~3 µs on the H200, and the
    fewer there are, the less the anatomy disturbs what it measures. A DeltaNet block's FFN (`dn_ffn`)
    is then inside its run and is not timed on its own; `durations` splits it out using the QSA
    blocks' own FFN interval (`ffn`: the same weights, batch and kernels)."""

    def __init__(self, cuda: bool, doubled: bool = False, coarse: bool = False):
        self.cuda, self.doubled, self.coarse = cuda, doubled, coarse
        self.phases: list[str] = []
        self.stamps: list = []
        self.block_starts: list[int] = []
        self.spare: list = []
        self.skipped: dict[str, int] = {}        # marks not recorded, per phase (coarse)

    def mark(self, phase: str, new_block: bool = False) -> None:
        last = self.phases[-1] if self.phases else None
        if self.coarse and (phase == last or (last == "deltanet" and phase == "dn_ffn")):
            self.skipped[phase] = self.skipped.get(phase, 0) + 1
            return
        if new_block:
            self.block_starts.append(len(self.stamps))
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True, external=True)
            ev.record()
            if self.doubled:     # a second, unread event at each mark: measures what one mark costs
                extra = torch.cuda.Event(enable_timing=True, external=True)
                extra.record()
                self.spare.append(extra)     # a captured graph refers to its events: keep them alive
        else:
            ev = time.perf_counter()
        self.phases.append(phase)
        self.stamps.append(ev)

    def durations(self, gaps: list[float] | None = None, mark_ms: float = 0.0) -> dict[str, float]:
        """ms per phase over the marked span (the phase named at a mark runs until the next mark), each
        interval less `mark_ms` (what one mark costs, measured by `DecodeRunner.anatomy`)."""
        gaps = self._gaps() if gaps is None else gaps
        raw: dict[str, float] = {}
        for ph, g in zip(self.phases, gaps):
            raw[ph] = raw.get(ph, 0.0) + max(0.0, g - mark_ms)
        out = dict.fromkeys(PHASES, 0.0)
        for ph, v in raw.items():
            if ph not in ("ffn", "dn_ffn", "end"):
                out[ph] += v
        n_ffn = self.phases.count("ffn")
        if self.skipped.get("dn_ffn") and n_ffn:   # DeltaNet runs' FFNs, at the QSA blocks' FFN time
            dn_ffn = raw["ffn"] / n_ffn * self.skipped["dn_ffn"]
            out["deltanet"] -= dn_ffn
        else:
            dn_ffn = raw.get("dn_ffn", 0.0)
        out["weights"] += raw.get("ffn", 0.0) + dn_ffn
        return out

    def block_durations(self) -> list[float]:
        """ms per block of the marked step (a block runs from its first mark to the next block's, the
        last one to the `head` mark): what the layer placement over several devices balances."""
        gaps = self._gaps()
        starts = self.block_starts + [self.phases.index("head")]
        return [sum(gaps[a:b]) for a, b in zip(starts, starts[1:])]

    def _gaps(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.stamps, self.stamps[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.stamps, self.stamps[1:])]


class DecodeRunner:
    """Runs decode steps for one batch: eager on CPU, one CUDA graph for device-only strategies,
    one graph per segment (loads in between) for host strategies."""

    def __init__(self, engine: Engine, batch: int, graphs: bool | None = None, trace: torch.Tensor | None = None,
                 max_steps: int = 1024, first: int = 0):
        self.engine, self.state = engine, DecodeState(engine, batch, trace, max_steps, first)
        self.cuda = engine.model.device.type == "cuda"
        self.graphs = self.cuda if graphs is None else (graphs and self.cuda)
        self._full: torch.cuda.CUDAGraph | None = None
        self._pieces: list[tuple[torch.cuda.CUDAGraph, LoadRequest | None]] = []
        self._pool = None
        self.results: list[LoadResult] = []
        engine.strategy.bind(engine.cache, batch, self.state.k)

    @property
    def graph_mode(self) -> str:
        return "full" if self._full is not None else ("piecewise" if self._pieces else "eager")

    # ------------------------------------------------------------------ what moved
    @property
    def h2d_bytes_per_step(self) -> int:
        return int(sum(int(r.h2d_bytes) for r in self.results))

    @property
    def rows_per_step(self) -> int:
        return sum(r.rows for r in self.results)

    # ------------------------------------------------------------------ running
    @torch.inference_mode()
    def _eager(self) -> None:
        """One step op by op, each load where the step yields it."""
        self.results = [load(self.engine, req) for req in self.engine.decode_segments(self.state)]

    @torch.inference_mode()
    def prepare(self, warmup: int = 2, warmed: bool = False) -> None:
        """Warm up (compiles kernels, sizes workspaces), then capture graphs. Each call advances lens.
        `warmed`: the caller already ran the warm-up steps (a pipeline stage warms up with real
        activations from the stage before it), only capture."""
        if warmed:
            pass
        else:   # on CUDA at least once: kernels compile outside any graph capture
            warm_up(self._eager, self.engine.model.device, max(warmup, 1) if self.cuda else warmup)
        if not self.graphs:
            return
        self._pool = torch.cuda.graph_pool_handle()
        if self.engine.strategy.graphable:
            self._full = self._capture_full()
        else:
            self._pieces = self._capture_pieces()
        torch.cuda.synchronize()

    def _capture_full(self) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        with capture(g, self.engine.model.device, self._pool):
            self._eager()
        return g

    def _capture_pieces(self) -> list:
        pieces, gen, done = [], self.engine.decode_segments(self.state), False
        while not done:
            g = torch.cuda.CUDAGraph()
            with capture(g, self.engine.model.device, self._pool):
                try:
                    req = next(gen)
                except StopIteration:
                    req, done = None, True
            pieces.append((g, req))
        return pieces

    @torch.inference_mode()
    def step(self) -> None:
        if self._full is not None:
            self._full.replay()
        elif self._pieces:
            self._replay_pieces(self._pieces)
        else:
            self._eager()

    def _replay_pieces(self, pieces) -> None:
        results = []
        for g, req in pieces:
            g.replay()
            if req is not None:
                results.append(load(self.engine, req))
        self.results = results

    # ------------------------------------------------------------------ anatomy
    @torch.inference_mode()
    def anatomy(self, repeats: int = 5) -> dict[str, float]:
        """Median ms per phase over `repeats` marked steps (run the way `step` runs them), plus
        `marked_step_ms` (a marked step's total), `mark_us` (what one mark costs: measured on a second
        graph with every mark doubled, and taken off each phase once per interval it spans) and
        `n_marks`. Advances lens by 2 x `repeats` + 2."""
        st = self.state
        if not self.graphs:
            runs = []
            for _ in range(repeats):
                st.marks = Marks(cuda=self.cuda, coarse=True)
                try:
                    self._eager()
                finally:
                    marks, st.marks = st.marks, None
                runs.append(marks.durations())
            out = {ph: statistics.median(r[ph] for r in runs) for ph in runs[0]}
            out.update(marked_step_ms=statistics.median(sum(r.values()) for r in runs), mark_us=0.0,
                       n_marks=len(marks.phases))
            return out
        single, doubled = Marks(cuda=True, coarse=True), Marks(cuda=True, doubled=True, coarse=True)
        replays = [self._capture_marked(single), self._capture_marked(doubled)]
        torch.cuda.synchronize()
        gaps, extra = [], []
        for _ in range(repeats):            # interleaved, so drift falls on both alike
            replays[0]()
            gaps.append(single._gaps())
            replays[1]()
            extra.append(sum(doubled._gaps()))
        marked = statistics.median(sum(g) for g in gaps)
        n = len(single.phases) - 1                                   # intervals
        mark_ms = max(0.0, (statistics.median(extra) - marked) / n)
        runs = [single.durations(g, mark_ms) for g in gaps]
        out = {ph: statistics.median(r[ph] for r in runs) for ph in runs[0]}
        out.update(marked_step_ms=marked, mark_us=mark_ms * 1e3, n_marks=n + 1)
        return out

    def _capture_marked(self, marks: "Marks"):
        """A graph (or graph pieces) of one step with `marks` recorded into it; returns its replay."""
        self.state.marks = marks
        try:
            if self.engine.strategy.graphable:
                return self._capture_full().replay
            pieces = self._capture_pieces()
            return lambda: self._replay_pieces(pieces)
        finally:
            self.state.marks = None
