"""A decode point and what measuring one takes: the grid a checked decode plan implies (`derive`: `DecodeGrid`,
its `Point`s), the model or its stages and the caches the points share (`DecodeSession`, `Caches`), and one point
timed into a record (`measure_decode`): step times, link bytes engine-counted and NVML's, memory held, the step's
anatomy. The decode sweep measures its grid through it; the capacity run times a batch at its cap and the multigpu
run each layout's points through it too. One point at a time:

    grid = derive(experiments.plan("decode", {"context_lens": "8K"}))
    with DecodeSession(grid) as s:
        rec = s.measure(grid.points[0])

Everything here reads the decode plan's fields (`grid.plan.steps`), never a dict of parameters.
"""
from __future__ import annotations

import gc
import hashlib
import time
from dataclasses import asdict, dataclass, field

import psutil
import torch

from .. import sweep
from ..engine import Engine, HybridModel, OffloadCache, get_strategy
from ..engine.drive.pipeline import (PipelineRunner, bubbles, device_guard, micro_batch_ranges, model_block_costs,
                                     place_layers, split_model)
from ..engine.drive.runner import DecodeRunner
from ..engine.model.cache import build_on_devices
from ..engine.model.trace_replay import load_selection_trace
from ..engine.transfer import setting_names
from ..params import gib
from ..shapes import MODEL_PARAMS, ModelShape, model_kwargs
from ..stats import spread
from ..telemetry import Sampler

EXPERIMENT = "decode"     # the experiment column of a decode point's record, whichever run measured it
MARGIN = 64          # tokens of cache beyond a point's context and its warm-up + timed steps (see margin)
ANATOMY_STEPS = 3    # marked steps per point (the anatomy is their per-phase median)


@dataclass(frozen=True)
class Point:
    concurrency: int
    context_len: int
    budget: int
    strategy: str
    axis: str            # "context" (the main table) or "budget" (the budget axis)
    micro_batches: int = 1   # the batch in this many micro-batches, pipelined over the stages


@dataclass(frozen=True)
class DecodeGrid:
    """What a checked decode plan implies: the shape, the devices, the points in the order they run, the strategy
    settings."""
    plan: "DecodePlan"                # labkit.experiments.decode's checked plan; its `params` are the manifest's
    shape: ModelShape
    devices: tuple[torch.device, ...]
    points: tuple[Point, ...]
    settings: dict = field(default_factory=dict)     # strategy settings (their sweep names) for get_strategy

    @property
    def margin(self) -> int:
        """Cache tokens a point needs beyond its context: the steps it decodes, and a margin."""
        return 8 + 4 + 2 * ANATOMY_STEPS + 2 + self.plan.steps * self.plan.repeats + MARGIN

    @property
    def cuda(self) -> bool:
        return self.devices[0].type == "cuda"

    def group_context(self, concurrency: int) -> int:
        """The largest context of a concurrency group: its caches are sized for it once."""
        return max(q.context_len for q in self.points if q.concurrency == concurrency)


def derive(plan: "DecodePlan") -> DecodeGrid:
    """What a checked plan implies (shape, devices, the grid, strategy settings); checks nothing. The grid in the
    order it runs: grouped by concurrency (one cache allocation per group); the main table's points take the first
    budget, the budget axis the others at `budget_context`."""
    points = []
    for c in plan.concurrency:
        mbs = sorted({min(m, c) for m in plan.micro_batches})     # never more micro-batches than requests
        for context_len in sorted(set(plan.context_lens)):
            points += [Point(c, context_len, plan.budgets[0], s, "context", m) for m in mbs for s in plan.strategies]
        if c == plan.concurrency[0]:
            for budget in plan.budgets[1:]:
                points += [Point(c, plan.budget_context, budget, s, "budget") for s in plan.strategies]
    devs = tuple(torch.device(d) for d in plan.device.split(","))
    return DecodeGrid(plan, ModelShape.from_name(plan.shape), devs, tuple(points),
                      {k: getattr(plan, k) for k in setting_names()})


class Caches:
    """Per concurrency group, one host and one device cache per stage (one stage unless the layers are
    split over several devices), sized to the group's largest context, filled once; points reuse
    prefixes of them, each placing its requests at its own context (`measure_decode`'s `set_lengths`; a device
    that cannot hold the largest gets one sized to the point, see `_capacity`). Each stage's cache is built by a
    thread bound to its device."""

    def __init__(self, stages: list, grid: DecodeGrid):
        self.stages, self.grid = stages, grid
        self.cache: dict[str, list[OffloadCache]] = {}
        self.group = None

    def get(self, medium: str, concurrency: int, context_len: int) -> list[OffloadCache]:
        if self.group != concurrency:
            self.release()
            self.group = concurrency
        have = self.cache.get(medium)
        if have is None or have[0].capacity < context_len + self.grid.margin:
            if have is not None:            # a point-sized device cache gives way to a longer point's
                self.cache.pop(medium)
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            cap = self._capacity(medium, concurrency, context_len)

            def build(stage):       # filled for its whole capacity: each point sets its own length (set_lengths)
                c = OffloadCache.allocate(stage, medium, concurrency, cap)
                c.fill_random_([cap] * concurrency, seed=self.grid.plan.seed)
                return c

            self.cache[medium] = build_on_devices(build, self.stages)
        return self.cache[medium]

    def _capacity(self, medium: str, concurrency: int, context_len: int) -> int:
        """Tokens per slot: the group's longest context, so its points share one fill; on a device that cannot
        hold that but holds this point, the point's own (a resident 64K point beside 1M ones still runs).
        Raises MemoryError in one line when not even the point fits."""
        shape, margin = self.stages[0].shape, self.grid.margin
        for cap in (self.grid.group_context(concurrency) + margin, context_len + margin):
            need = concurrency * cap * shape.kv_bytes_per_token()          # over all stages together
            if medium == "host" or self.stages[0].device.type == "cpu":
                avail = psutil.virtual_memory().available
                if need > 0.9 * avail:
                    raise MemoryError(f"host KV of {gib(need)} exceeds 90% of the {gib(avail)} RAM available now")
                return cap
            short = [(st.device, free) for st in self.stages
                     for free in [torch.cuda.mem_get_info(st.device)[0]]
                     if need * st.n_attn // max(1, shape.attn_layers) > free - (2 << 30)]
            if not short:
                return cap
        dev, free = short[0]
        raise MemoryError(f"device KV of {gib(need)} does not fit the {gib(free)} free on {dev}")

    def release(self) -> None:
        self.cache.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


class DecodeSession:
    """What the points of one plan share: the model (or its stages), the caches, the telemetry sampler.
    `measure(point)` gives one record; `run_sweep` and the explorer both measure through it."""

    def __init__(self, grid: DecodeGrid, tel: Sampler | None = None):
        self.grid, self.tel = grid, tel or Sampler(gpus=[])
        self.stage_layers = None
        plan = grid.plan
        torch.manual_seed(plan.seed)
        held = model_kwargs({q.name: getattr(plan, q.name) for q in MODEL_PARAMS})     # weights_dtype, ...
        if len(grid.devices) == 1:
            self.stages = [HybridModel(grid.shape, grid.devices[0], seed=plan.seed, **held)]
        else:   # built on the CPU and moved stage by stage: the same weights whatever the split
            model = HybridModel(grid.shape, "cpu", seed=plan.seed, **held)
            self.stage_layers = place_layers(model_block_costs(model, plan.budgets[0]), len(grid.devices))
            self.stages = split_model(model, self.stage_layers, list(grid.devices))
        self.caches = Caches(self.stages, grid)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.caches.release()

    def measure(self, pt: Point, timeline: list | None = None) -> dict:
        """One decode point as a record; a failure becomes a failed record (the caller goes on).
        `timeline`: a list that receives the spans of a split point's sampled steps."""
        def free(ex):
            if isinstance(ex, (torch.cuda.OutOfMemoryError, MemoryError)):
                self.caches.release()
        return sweep.attempt(lambda: measure_decode(self.stages, self.caches, pt, self.grid, self.tel, timeline),
                             {"experiment": EXPERIMENT}, on_fail=free, **asdict(pt))


def measure_decode(stages: list, caches: Caches, pt: Point, grid: DecodeGrid, tel: Sampler,
                   timeline: list | None = None) -> dict:
    plan, shape, dev = grid.plan, grid.shape, stages[0].device
    trace = None
    if plan.selection.startswith("trace:"):   # recorded selections, scaled to this point's context and budget
        trace = load_selection_trace(plan.selection[6:], shape.attn_layers, pt.context_len, pt.budget,
                                     steps=grid.margin, stable=True)   # keeps the trace's reuse (hot_cache)
    concurrency, context_len = pt.concurrency, pt.context_len
    strat = get_strategy(pt.strategy, **grid.settings)
    stage_caches = caches.get(strat.medium, concurrency, context_len)
    for cache in stage_caches:
        cache.set_lengths(context_len, slice(0, concurrency))
        cache.random_states_(plan.seed)     # the states the fill left, whatever points ran before (`logits_sha`)
    runner, runners = _runners(stages, stage_caches, pt, grid, trace)
    slow = strat.slow             # ~0.4 s a step per request (per_row): fewer steps, one repeat, no anatomy
    steps, repeats = (plan.per_row_steps, 1) if slow else (plan.steps, plan.repeats)
    with device_guard(dev):
        runner.prepare(warmup=1 if slow else 2)
    cuda = dev.type == "cuda"
    counted = [r.engine.strategy.counters() for r in runners]    # hot_cache: device counts before the timed steps
    for r in runners:
        r.state.experts_read.zero_()
    t_start = time.time()
    times, rx, tx, rx_ok, per_gpu = _timed_steps(runner, dev, tel, steps, repeats)
    n = len(times)
    experts_read = sum(int(r.state.experts_read.item()) for r in runners)
    t = spread(times)
    used_kv = concurrency * context_len * shape.kv_bytes_per_token()
    on_dev = strat.medium == "device"
    pool_bytes = sum(c.pool.nbytes for c in stage_caches)
    moe_layers = sum(len(st.blocks) for st in stages) if shape.moe else 0
    per_layer = experts_read / (n * moe_layers) if moe_layers and n else None      # distinct experts a layer
    step_weights = sum(st.step_weight_bytes(concurrency, per_layer) for st in stages)
    ngram_bytes = shape.ngram_fetch_bytes * concurrency if shape.ngram_heads else 0
    first = runners[0]
    rec = {
        "experiment": EXPERIMENT, "status": "ok", "error": None, **asdict(pt),
        "repeats": repeats, "steps": steps, "step_ms_median": t.median, "step_ms_min": t.min,
        "step_ms_max": t.max, "tok_s": concurrency / (t.median / 1e3),
        "h2d_bytes_per_step": runner.h2d_bytes_per_step,                 # summed from the strategies' LoadResults
        "selected_rows_per_step": runner.rows_per_step,
        "nvml_rx_bytes_per_step": rx / n if rx_ok and tel.enabled else None,
        "nvml_tx_bytes_per_step": tx / n if rx_ok and tel.enabled else None,
        "device_kv_bytes": used_kv if on_dev else 0,
        "device_index_bytes": concurrency * context_len * shape.index_key_bytes * shape.attn_layers,
        "host_kv_bytes": 0 if on_dev else used_kv,
        "device_kv_alloc_bytes": pool_bytes if on_dev else 0,
        "device_index_alloc_bytes": sum(c.index.nbytes for c in stage_caches),
        "host_kv_alloc_bytes": 0 if on_dev else pool_bytes,
        "graph_mode": first.graph_mode,
        "compiled": first.engine.fns.compiled,
        "devices": ",".join(str(st.device) for st in stages),
        "stage_layers": ";".join(f"{st.range[0]}-{st.range[1]}" for st in stages) if len(stages) > 1 else None,
        "weight_bytes": sum(st.weight_bytes() for st in stages),
        "step_weight_bytes": step_weights,
        "weight_gbps": step_weights / (t.median / 1e3) / 1e9,
        "experts_read_per_step": per_layer * moe_layers if per_layer is not None else None,
        "experts_read_per_layer": per_layer,
        "ngram_bytes_per_step": ngram_bytes or None,
        **stages[0].holding(),
        "selection": plan.selection, "t_start": t_start, "t_end": time.time(),
        "device_mem_peak_bytes": sum(torch.cuda.max_memory_allocated(st.device) for st in stages) if cuda else None,
        **strat.settings(),
        # the logits after the warm-up and timed steps, before the anatomy's: an offloaded strategy attending the
        # resident's tokens with its arithmetic from another memory gives the resident's hash (FlashOffloading)
        "logits_sha": logits_sha(runners[len(stages) - 1::len(stages)]),
        "logits_after_steps": (1 if slow else 2) + steps * repeats,
    }
    rec.update(counted_per_step(runners, counted, n))
    if rec["nvml_rx_bytes_per_step"] is not None and rec["h2d_bytes_per_step"]:
        rec["nvml_over_engine"] = rec["nvml_rx_bytes_per_step"] / rec["h2d_bytes_per_step"]
    for i, (a_rx, a_tx) in enumerate(per_gpu):        # each link's bytes when several GPUs are sampled
        rec[f"nvml_rx_bytes_per_step_gpu{i}"] = a_rx / n
        rec[f"nvml_tx_bytes_per_step_gpu{i}"] = a_tx / n
    if isinstance(runner, PipelineRunner):
        rec.update(_pipeline_fields(runner, pt, timeline))
    if plan.anatomy and not slow and pt.micro_batches == 1:   # phases of overlapped micro-batches do not add up
        rec.update(_anatomy_fields(runner, dev, t.median))
    del runner, runners
    return rec


def logits_sha(last_stage: list) -> str:
    """The first 16 hex digits of the SHA-256 of the last stage's logits, each micro-batch's in order (their
    bytes as computed: any difference in a selected row or in the arithmetic changes it)."""
    h = hashlib.sha256()
    for r in last_stage:
        h.update(r.state.logits.detach().contiguous().view(torch.int16).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _runners(stages: list, stage_caches: list, pt: Point, grid: DecodeGrid, trace) -> tuple:
    """(the runner a point times, every DecodeRunner under it): one per micro-batch and stage, a PipelineRunner
    over them when there are several; each stage replays its layers' share of a selection trace."""
    table = []                    # a row of runners per micro-batch, one per stage
    for first, size in micro_batch_ranges(pt.concurrency, pt.micro_batches):
        row, first_attn = [], 0
        for stage, cache in zip(stages, stage_caches):
            engine = Engine(stage, cache, get_strategy(pt.strategy, **grid.settings), pt.budget,
                            select_block=grid.plan.select_block)
            tr = None if trace is None else trace[:, first_attn:first_attn + stage.n_attn]
            first_attn += stage.n_attn
            with device_guard(stage.device):
                row.append(DecodeRunner(engine, size, trace=tr, max_steps=grid.margin, first=first))
        table.append(row)
    runners = [r for row in table for r in row]
    return (runners[0] if len(runners) == 1 else PipelineRunner(table)), runners


def _timed_steps(runner, dev: torch.device, tel: Sampler, steps: int, repeats: int) -> tuple:
    """`repeats` runs of `steps` consecutive steps: (step times in ms, NVML RX and TX bytes over them summed over
    the sampled GPUs, whether every window could be read, each GPU's [rx, tx] when several are sampled)."""
    times, rx, tx = [], 0.0, 0.0
    rx_ok = True
    n_gpu = len(tel.handles) if tel.enabled else 0
    per_gpu = [[0.0, 0.0] for _ in range(n_gpu if n_gpu > 1 else 0)]
    for _ in range(repeats):
        a = tel.mark()
        with device_guard(dev):       # the timing events on the first stage's device, where a step starts and ends
            times += sweep.event_ms(runner.step, steps, dev, mode="chained")   # consecutive steps, no gap
        b = tel.mark()
        rs = [tel.rx_bytes(a, b, g) for g in range(max(n_gpu, 1))]
        ts = [tel.tx_bytes(a, b, g) for g in range(max(n_gpu, 1))]
        rx_ok = rx_ok and all(r is not None for r in rs)
        rx += sum(r or 0.0 for r in rs)
        tx += sum(t or 0.0 for t in ts)
        for g, acc in enumerate(per_gpu):
            acc[0] += rs[g] or 0.0
            acc[1] += ts[g] or 0.0
    return times, rx, tx, rx_ok, per_gpu


def _pipeline_fields(runner: PipelineRunner, pt: Point, timeline: list | None) -> dict:
    """Each stage's engine-counted link bytes (beside its GPU's NVML RX) and the overlap of a step; the step's
    spans go to `timeline`."""
    rec = {f"h2d_bytes_per_step_stage{i}": b for i, b in enumerate(runner.stage_h2d_bytes_per_step())}
    spans = runner.timeline(steps=4)
    rec.update(bubbles(spans))
    if timeline is not None:
        timeline += [{**asdict(pt), **s} for s in spans]
    return rec


def _anatomy_fields(runner, dev: torch.device, step_ms: float) -> dict:
    """Where the step's time goes: its phases, marked inside extra steps."""
    with device_guard(dev):
        anat = runner.anatomy(repeats=ANATOMY_STEPS)
    phases = {k: v for k, v in anat.items() if k not in ("marked_step_ms", "mark_us", "n_marks")}
    rec = {f"anat_{k}_ms": v for k, v in phases.items()}
    rec.update(anat_marked_step_ms=anat["marked_step_ms"], anat_mark_us=anat["mark_us"], anat_marks=anat["n_marks"])
    # The corrected phases against the unmarked step (1.0: they account for it exactly); the
    # anatomy is trusted where this stays within 5% (targets.py).
    rec["anat_closure"] = sum(phases.values()) / step_ms
    return rec


def counted_per_step(runners, before: list[dict], n: int) -> dict:
    """Means over the timed steps of what strategies that `count` counted on the device (hot_cache: hits,
    misses, inserts, evictions, bytes), as columns named with the strategy's `counter_prefix`;
    `h2d_bytes_per_step` becomes the counted bytes' mean."""
    after = [r.engine.strategy.counters() for r in runners]
    tot = {k: sum(a[k] - b[k] for a, b in zip(after, before)) for k in after[0]} if after and after[0] else {}
    if not tot:
        return {}
    pre = runners[0].engine.strategy.counter_prefix
    out = {f"{pre}{k}_per_step": v / n for k, v in tot.items()}
    if "hits" in tot and "misses" in tot:
        out[f"{pre}hit_rate"] = tot["hits"] / max(1, tot["hits"] + tot["misses"])
    out["h2d_bytes_per_step"] = tot["h2d_bytes"] / n
    return out
