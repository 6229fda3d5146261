"""Prefill throughput under a device-memory cap (FlashOffloading's 1.38x, in its terms): N prompts of T tokens
prefilled on one device whose memory cannot hold them all with their KV, in three configurations:

| config    | where a prompt's KV goes while it prefills          | what a finished prompt holds on the device  |
|-----------|-----------------------------------------------------|---------------------------------------------|
| `none`    | the device pool (`resident`); one prefix buffer     | its KV, index keys, DeltaNet state          |
| `prefill` | pinned host RAM through four rotating layer buffers | its index keys and DeltaNet state           |
| `both`    | as `prefill`                                        | as `prefill`                                |

    labkit run prefill_throughput --out DIR -p context_lens=64K -p prompts=4 -p mem_cap_gib=14
    labkit run prefill_throughput --out DIR -p context_lens=128K -p prompts=8 -p mem_cap_gib=24 -p repeats=1

Why this measure. The published setting is disaggregated: a prefill node prefills prompts and keeps each
finished prompt's KV until the decode side takes it; with no offload that KV occupies device memory, with
offload it sits in host RAM and the freed device memory buys larger batches. By default a run prefills one
request's chunk per forward (`Engine.prefill_chunks`); with `batched` it prefills several prompts a forward
(`Engine.prefill_batch`'s `BatchedPrefill`, first come, first served) under a token budget per forward, vLLM's
`max_num_batched_tokens`, where a forward's tokens may span prompts. The experiment composes through those APIs
only (the prefill internals are not touched), so what freed memory can buy here is
1. tokens per forward: the chunk (batched: the budget) the cap allows beside everything else (activations grow
   with it; batched, the experts' GEMMs see all of a forward's tokens at once);
2. prompts held at once (`in_flight`): slots of the cache, one per prompt between its prefill and its hand-off
   (batched: at least one for every prompt a forward touches, `per_forward`).
Each config takes, from the cap, the largest chunk (a multiple of 64 tokens, at most `chunk`; batched, the
largest budget, at most `max_num_batched_tokens`) with one prompt (batched: `per_forward` prompts)
held, then as many prompts held as fit beside it (`fit.py`: the byte formulas of every allocation for the kernels the
engine takes on the device, the torch form of DeltaNet's recurrence checked against the allocator's peaks of the
committed H200 prefill runs within 1%). The chunk goes first because it is
paid on every forward; a second slot only lets a hand-off overlap the next prompt. On CUDA the cap is enforced by
the caching allocator (`torch.cuda.set_per_process_memory_fraction`, as `labkit run prefill` does): a config the
formulas got wrong is a failed row with the allocator's message, and every row carries the predicted peak next
to the allocator's. A config the formulas say cannot hold one prompt at the smallest chunk is still tried on
CUDA at that chunk (the allocator then speaks); on a CPU, where nothing enforces a cap, it is a failed row with
the formulas' line.

The hand-off. When a prompt is done the decode side takes it: the bytes the slot holds on the device (for `none`
its KV, 2 KiB x QSA layers per token; for all configs its index keys and DeltaNet state) are copied to a pinned
host buffer on a side stream, a stand-in for the link they would leave by; for `prefill`/`both` the KV is
already in host RAM (the rotating buffers wrote it back during the prefill). A slot is prefilled again only once
its hand-off is done (the compute stream waits on its event; the host never waits). This is the most favourable
hand-off for `none` (the decode side takes each prompt at once); a slower taker would stall `none` once its
`in_flight` prompts wait, and never `prefill`/`both`.

What `both` changes for a prefill measure: nothing on the prefill node. Offloading decode too (the hot cache) is
the decode node's business, so `both` runs the prefill path of `prefill` again; its row is a second measurement
of the same thing, and its distance to `prefill` is the run-to-run noise.

What to expect on an H200: prefill of the reference shape is compute-bound at chunks of several thousand tokens
(8K-token chunks: ~6K tok/s at 128K), so while the cap leaves `none` a large chunk its throughput equals the
offloaded configs' (~1.0x), whatever `in_flight` is; the ratio moves only when the cap squeezes `none`'s chunk
(small chunks starve the attention of parallel work) and becomes infinite when `none` cannot hold one prompt
(a 1M-token prompt's 24 GiB of KV under a 24 GiB cap). The rows record chunk and in_flight so a reader sees why.

Rows (metrics.parquet, one per length and config): `prompts_per_s` = N / the batch's wall time (median over
`repeats` batches; `_min`/`_max` from the slowest/fastest), `tok_s` = N x T / that time, `step_ms_*` = wall time per
prompt, `concurrency` = `in_flight`, `chunk`, `predicted_bytes` (the formulas) and `device_mem_peak_bytes` (the
allocator), `vs_none` (prompts_per_s over `none`'s at that length, this run), `batched`, `per_forward`,
`max_num_batched_tokens` (0 unbatched), `forwards` per batch, `weights_dtype` and `expert_banks` as held. A batch's time runs from the first
chunk's enqueue to the last hand-off's end (host wall time between two synchronizes). Bad parameters: one line
before anything is allocated.
"""
from __future__ import annotations

import contextlib
import gc
import math
import statistics
from dataclasses import replace

import psutil
import torch

from ...engine import Engine, HybridModel, OffloadCache, get_strategy
from ...engine.model.attention import prefill_kernel
from ...engine.model.hybrid import resolve_holding
from ...engine.model.layers import dn_prefill_kernel
from ...engine.model.prefill_batch import BatchedPrefill, PrefillRequest
from ...params import BadInput, fill_auto, resolve_device
from ...results import Run
from ...shapes import ModelShape, model_kwargs, planned_shape
from ... import sweep
from ..device_cap import apply_cap, check_cap
from .fit import KV_ON_DEVICE, Fit, cap_holding, chunk_step, fit, held_weight_bytes, padded, size, slot_bytes
from . import CONFIGS, SPEC, PrefillThroughputPlan

EXPERIMENT = "prefill_throughput"
HOW = {"none": ("resident", "sync"), "prefill": ("zero_copy", "rotating"), "both": ("zero_copy", "rotating")}
RAM_SHARE = 0.9              # of the RAM available now, the most the host side of a config may take


# ---------------------------------------------------------------------------------------------- the plan
def check(p: dict) -> PrefillThroughputPlan:
    """Validate resolved parameters and decide the "auto" ones (the cap among them); BadInput, one line, before
    anything is allocated. Returns the plan."""
    p = dict(p)
    dev = resolve_device(p["device"])
    fill_auto(SPEC, p, dev.type)
    p["device"] = str(dev)
    shape = planned_shape(p["shape"])
    if not p["configs"]:
        raise BadInput(f"configs: none given; choose from {', '.join(CONFIGS)}")
    p["configs"] = list(dict.fromkeys(p["configs"]))
    if not p["context_lens"]:
        raise BadInput("context_lens: none given")
    p["max_num_batched_tokens"] = token_budget(p["max_num_batched_tokens"], p["batched"], p["prompts"], p["chunk"])
    # how the weights are held, decided here as the model will decide it, so the byte formulas count what it holds
    p["weights_dtype"], banks = resolve_holding(shape, dev, p["weights_dtype"], p["expert_banks"] or None)
    p["expert_banks"] = banks if shape.moe else 0
    weights = held_weight_bytes(shape, p["weights_dtype"], p["expert_banks"])
    if p["mem_cap_gib"] == 0:        # just too small for none to hold every prompt: it holds half, rounded up
        T = max(p["context_lens"])
        held = math.ceil(p["prompts"] / 2)
        cap = cap_holding(shape, T, p["prompts"], held, p["chunk"], p["reserve_gib"] * 2**30, **prefill_kernels(dev),
                          weight_bytes=weights)
        cap += slot_bytes(shape, T, True) // 2           # half a slot over: never one short by rounding
        p["mem_cap_gib"] = cap / 2**30
    plan = PrefillThroughputPlan.from_params(p)
    try:
        check_cap(plan.mem_cap_gib, shape, dev, plan.weights_dtype, plan.expert_banks)
    except BadInput as ex:
        bank = (f"; fewer expert_banks hold less (now {plan.expert_banks})" if shape.moe else "")
        raise BadInput(f"{ex} (prompts={plan.prompts} of {max(plan.context_lens)} tokens{bank})") from None
    check_host_memory(plan, shape, dev)
    return plan


def token_budget(given: int, batched: bool, prompts: int, chunk: int) -> int:
    """The batched prefill's token budget per forward (`max_num_batched_tokens`): `given`, or where 0 a chunk of
    every prompt; refused in one line where it is below one chunk or given without `batched` (0 then)."""
    if not batched:
        if given:
            raise BadInput(f"max_num_batched_tokens={given} is the batched prefill's budget per forward: set "
                           "batched=true, or leave it 0")
        return given
    if given and given < chunk:
        raise BadInput(f"max_num_batched_tokens={given} is below one chunk ({chunk} tokens): a forward over "
                       f"several prompts would take fewer tokens than one prompt's chunk; give at least {chunk}")
    return given or prompts * chunk


def prefill_kernels(dev: torch.device) -> dict[str, str]:
    """The kernels the engine's prefill takes on `dev` (DeltaNet's recurrence, dense attention), as `fit` names
    them: its activations depend on them."""
    return {"dn_kernel": dn_prefill_kernel(dev), "attention_kernel": prefill_kernel(dev)}


def fits_of(plan: PrefillThroughputPlan, shape: ModelShape, T: int, weight_bytes: int | None = None) -> dict[str, Fit]:
    """What the cap holds per config at prompt length T (checked parameters; arithmetic only). With `batched`,
    several prompts a forward under a token budget of at most `max_num_batched_tokens` (a `Batch` made from such
    a fit prefills that way), else one prompt's chunk of at most `chunk`. `weight_bytes`: the weights held (a
    built model's; default the formula's for the plan's `weights_dtype` and `expert_banks`)."""
    kernels = prefill_kernels(torch.device(plan.device))
    top = plan.max_num_batched_tokens if plan.batched else plan.chunk
    if weight_bytes is None:
        weight_bytes = held_weight_bytes(shape, plan.weights_dtype, plan.expert_banks)
    return {c: fit(shape, T, plan.prompts, plan.mem_cap_gib * 2**30, c, top, plan.reserve_gib * 2**30, **kernels,
                   batched=plan.batched, weight_bytes=weight_bytes) for c in plan.configs}


def host_bytes(shape: ModelShape, T: int, f: Fit, dev: torch.device, ngram: int = 0) -> int:
    """Host RAM a config takes: its pinned KV pool (offloaded), the hand-off's receive buffer, the n-gram table
    (`ngram` bytes), and on a CPU everything the "device" holds."""
    held = max(1, f.in_flight)
    pool = 0 if KV_ON_DEVICE[f.config] else held * padded(T) * shape.kv_bytes_per_token()
    device = f.predicted_bytes if dev.type != "cuda" else 0
    return pool + f.slot_bytes + device + ngram


def check_host_memory(plan: PrefillThroughputPlan, shape: ModelShape, dev: torch.device) -> None:
    avail = psutil.virtual_memory().available
    for T in plan.context_lens:
        for c, f in fits_of(plan, shape, T).items():
            ngram = model_kwargs(plan.params)["ngram_table_bytes"] if shape.ngram_heads else 0
            need = host_bytes(shape, T, f, dev, ngram)
            if need > RAM_SHARE * avail:
                raise BadInput(f"config {c}: {max(1, f.in_flight)} prompt(s) of {T} tokens need {size(need)} of host "
                               f"RAM; {size(avail)} is available now: lower context_lens or prompts")


# ---------------------------------------------------------------------------------------------- one batch
class _Lane:
    """The hand-off's side stream (CUDA), or on a CPU the caller's own order."""

    def __init__(self, dev: torch.device):
        self.dev, self.cuda = dev, dev.type == "cuda"
        self.stream = torch.cuda.Stream(dev) if self.cuda else None

    def after_compute(self):
        """Enter the side stream once the compute stream's work so far is done."""
        if not self.cuda:
            return contextlib.nullcontext()
        self.stream.wait_stream(torch.cuda.current_stream(self.dev))
        return torch.cuda.stream(self.stream)

    def mark(self):
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def compute_waits(self, ev) -> None:
        if ev is not None:
            torch.cuda.current_stream(self.dev).wait_event(ev)


class Batch:
    """One config's cache (one slot per prompt held), engine and hand-off, reused by every repeat:
    `prefill_all(prompts)` prefills the prompts in order through `in_flight` slots and hands each off."""

    def __init__(self, model, config: str, T: int, f: Fit):
        strategy, mode = HOW[config]
        st = get_strategy(strategy)
        self.model, self.config, self.T, self.in_flight, self.batched = model, config, T, f.in_flight, f.batched
        self.cache = OffloadCache.allocate(model, st.medium, f.in_flight, T)
        self.engine = Engine(model, self.cache, st, 2048, prefill_chunk=f.chunk, prefill_mode=mode)
        self.lane = _Lane(model.device)
        self.done: list = [None] * f.in_flight       # per slot: the event of its last hand-off
        self.dirty = [False] * f.in_flight           # per slot: holds a prompt (pages, state)
        c, pin = self.cache, model.device.type == "cuda"
        n_attn, n_dn = c.index.keys.shape[0], c.dn_state.shape[0]
        self.kv_on_device = c.pool.medium == "device"
        # the decode side's receive buffers: what a slot holds on the device, one prompt at a time
        self.recv_kv = (torch.empty((n_attn, T, c.row_words()), dtype=torch.int64, pin_memory=pin)
                        if self.kv_on_device else None)
        self.recv_keys = torch.empty((n_attn, T, c.index.keys.shape[-1]), dtype=c.index.keys.dtype, pin_memory=pin)
        self.recv_scales = torch.empty((n_attn, T), dtype=c.index.scales.dtype, pin_memory=pin)
        self.recv_dn = torch.empty((n_dn,) + tuple(c.dn_state.shape[2:]), dtype=c.dn_state.dtype, pin_memory=pin)
        self.recv_conv = torch.empty((n_dn,) + tuple(c.dn_conv.shape[2:]), dtype=c.dn_conv.dtype, pin_memory=pin)

    @property
    def handoff_bytes(self) -> int:
        """Device bytes one prompt's hand-off moves."""
        return sum(t.numel() * t.element_size() for t in (self.recv_kv, self.recv_keys, self.recv_scales,
                                                          self.recv_dn, self.recv_conv) if t is not None)

    def take_back(self, slot: int) -> None:
        """Make `slot` free for a new prompt: after its hand-off (the compute stream waits on it, the host does
        not), its pages go back and its DeltaNet state starts from zero."""
        if not self.dirty[slot]:
            return
        self.lane.compute_waits(self.done[slot])
        self.cache.free_slot(slot)
        self.dirty[slot] = False

    def hand_off(self, slot: int, T: int) -> None:
        """The decode side takes the prompt of T tokens in `slot`: its device-resident bytes copied out on the
        side stream (layer by layer: each piece is contiguous, so no staging copy on the device)."""
        c = self.cache
        with self.lane.after_compute():
            for layer in range(c.index.keys.shape[0]):
                if self.recv_kv is not None:
                    c.read_prefix(layer, slot, T, self.recv_kv[layer])
                self.recv_keys[layer, :T].copy_(c.index.keys[layer, slot, :T], non_blocking=True)
                self.recv_scales[layer, :T].copy_(c.index.scales[layer, slot, :T], non_blocking=True)
            for j in range(c.dn_state.shape[0]):
                self.recv_dn[j].copy_(c.dn_state[j, slot], non_blocking=True)
                self.recv_conv[j].copy_(c.dn_conv[j, slot], non_blocking=True)
        self.done[slot] = self.lane.mark()

    @torch.inference_mode()
    def prefill_all(self, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Prefill every prompt (slot i % in_flight), hand each off; returns each prompt's last logits. Ends with
        the compute stream waiting for every hand-off. A batched fit (`Fit.batched`) prefills several prompts a
        forward (`prefill_batched`)."""
        if self.batched:
            out = self.prefill_batched(prompts)
        else:
            out = []
            for i, tokens in enumerate(prompts):
                slot = i % self.in_flight
                self.take_back(slot)
                out.append(self.engine.prefill(slot, tokens))
                self.dirty[slot] = True
                self.hand_off(slot, tokens.numel())
        for ev in self.done:
            self.lane.compute_waits(ev)
        return out

    def prefill_batched(self, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
        """The prompts several to a forward under the fit's chunk as token budget (`prefill_batch.BatchedPrefill`,
        first come, first served): a prompt joins the queue as soon as a slot is free (after that slot's last
        hand-off), and is handed off once the forward that finishes it is enqueued."""
        batch = BatchedPrefill(self.engine, self.engine.prefill_chunk)
        waiting, free, owner = list(enumerate(prompts)), list(range(self.in_flight)), {}
        out: list = [None] * len(prompts)
        while waiting or batch.pending:
            while waiting and free:
                (i, tokens), slot = waiting.pop(0), free.pop(0)
                self.take_back(slot)
                batch.add(PrefillRequest(slot, tokens))
                owner[slot] = i
            for slot, logits in batch.step()[1].items():
                out[owner[slot]] = logits
                self.dirty[slot] = True
                self.hand_off(slot, prompts[owner.pop(slot)].numel())
                free.append(slot)
        return out

    @torch.inference_mode()
    def warm_up(self, tokens: torch.Tensor) -> None:
        """A prompt's first tokens through slot 0 (kernels, cuBLAS heuristics, the allocator's pools)."""
        self.take_back(0)
        self.engine.prefill(0, tokens)
        self.dirty[0] = True
        self.hand_off(0, tokens.numel())

    def kv_rows(self, slot: int) -> torch.Tensor:
        """The KV rows of the prompt held in `slot`, every QSA layer: [layers, T, row words] (for checks)."""
        c = self.cache
        out = torch.empty((c.pool.attn_layers, self.T, c.row_words()), dtype=torch.int64, device=self.model.device)
        for layer in range(c.pool.attn_layers):
            c.read_prefix(layer, slot, self.T, out[layer])
        return out


def make_prompts(shape: ModelShape, T: int, n: int, seed: int, dev: torch.device) -> list[torch.Tensor]:
    """N seeded prompts of T random token ids, on the device (the same for every config)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, shape.vocab, (T,), generator=gen).to(dev) for _ in range(n)]


# ---------------------------------------------------------------------------------------------- a point
def measure(model, config: str, T: int, f: Fit, prompts: list[torch.Tensor], plan: PrefillThroughputPlan,
            warm: int) -> dict:
    """`repeats` timed batches of the prompts in `config` with `f`'s chunk and in-flight count, after a warm-up
    prompt of `warm` tokens; a record."""
    dev, shape = model.device, model.shape
    n = len(prompts)
    batch = Batch(model, config, T, f)
    batch.warm_up(prompts[0][:warm])
    sweep.sync(dev)
    last = {}
    walls = sweep.wall_ms(lambda: last.update(logits=batch.prefill_all(prompts)), plan.repeats, dev)
    med, lo, hi = statistics.median(walls), min(walls), max(walls)
    kv = f.in_flight * T * shape.kv_bytes_per_token()
    strategy, mode = HOW[config]
    rec = {"status": "ok", "error": None, "strategy": strategy, "prefill_mode": mode,
           "repeats": plan.repeats, "concurrency": f.in_flight, "budget": 0, "steps": n,
           "prompts_per_s": n / (med / 1e3), "prompts_per_s_min": n / (hi / 1e3), "prompts_per_s_max": n / (lo / 1e3),
           "tok_s": n * T / (med / 1e3), "wall_s": med / 1e3, "wall_s_min": lo / 1e3, "wall_s_max": hi / 1e3,
           "step_ms_median": med / n, "step_ms_min": lo / n, "step_ms_max": hi / n,
           "chunks_per_prompt": math.ceil(T / f.chunk), "handoff_bytes_per_prompt": batch.handoff_bytes,
           "forwards": math.ceil(n * T / f.chunk) if f.batched else n * math.ceil(T / f.chunk),
           "device_kv_bytes": kv if KV_ON_DEVICE[config] else 0, "host_kv_bytes": 0 if KV_ON_DEVICE[config] else kv,
           "device_mem_peak_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
           "device_mem_reserved_peak_bytes": torch.cuda.max_memory_reserved(dev) if dev.type == "cuda" else None,
           "logits_finite": all(bool(torch.isfinite(x.float()).all()) for x in last["logits"])}
    del batch
    return rec


def _fresh(dev: torch.device) -> None:
    """Free what the last point left (a failed point's frames included) and restart the peak counters."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def point_row(shape: ModelShape, f: Fit, config: str, T: int, plan: PrefillThroughputPlan,
              fits_formula: bool) -> dict:
    """A point's coordinates and what the formulas chose (the head of its row, ok or failed)."""
    return {"experiment": EXPERIMENT, "config": config, "context_len": T, "prompts": plan.prompts,
            "mem_cap_bytes": int(plan.mem_cap_gib * 2**30), "chunk": f.chunk, "in_flight": f.in_flight,
            "fits_formula": fits_formula, "predicted_bytes": f.predicted_bytes,
            "predicted_allocated_bytes": f.predicted_bytes - f.reserve_bytes, "weight_bytes": f.weight_bytes,
            "slot_bytes": f.slot_bytes, "prefix_bytes": f.prefix_bytes, "activation_bytes": f.activation_bytes,
            "reserve_bytes": f.reserve_bytes, "strategy": HOW[config][0], "prefill_mode": HOW[config][1],
            "batched": f.batched, "per_forward": f.per_forward,
            "max_num_batched_tokens": plan.max_num_batched_tokens if f.batched else 0,
            "weights_dtype": plan.weights_dtype, "expert_banks": plan.expert_banks}


# ---------------------------------------------------------------------------------------------- the run
def run(plan: PrefillThroughputPlan, progress_bar: bool = True) -> Run:
    """Every (length, config) of checked parameters into a run folder."""
    shape, dev = ModelShape.from_name(plan.shape), torch.device(plan.device)
    apply_cap(plan.mem_cap_gib, dev)
    r = sweep.open_run(plan.params, EXPERIMENT)        # the manifest records the plan as a dict
    base = {"device": plan.device, "gpu_name": r.manifest.get("gpu_name") or "cpu", "shape": shape.name}
    model = HybridModel(shape, dev, seed=plan.seed, **model_kwargs(plan.params))    # weights_dtype, ... by name
    # the fits count the weights the model holds; the formula's count beside it in the manifest
    fits = {T: fits_of(plan, shape, T, model.weight_bytes()) for T in plan.context_lens}
    r.update_manifest(weight_bytes=model.weight_bytes(), holding=model.holding(),
                      formula_weight_bytes=held_weight_bytes(shape, plan.weights_dtype, plan.expert_banks),
                      shape_info=shape.summary(),
                      fits=[{"context_len": T, **f.row()} for T, fs in fits.items() for f in fs.values()])
    points = sweep.grid(T=plan.context_lens, config=plan.configs)
    first = True
    with sweep.bar(len(points), f"{EXPERIMENT} {shape.name}", progress_bar) as bar:
        for T in plan.context_lens:
            prompts = make_prompts(shape, T, plan.prompts, plan.seed, dev)
            for config in plan.configs:
                f = fits[T][config]
                bar.set_postfix_str(f"{config} T={T}: chunk {f.chunk}, {f.in_flight} held")
                _fresh(dev)
                if f.fits:
                    tried = f
                elif dev.type == "cuda":          # the formulas say no: let the allocator say why
                    tried = replace(f, chunk=min(chunk_step(plan.chunk), T), in_flight=1)
                else:
                    row = point_row(shape, f, config, T, plan, False)
                    r.add({**base, **sweep.failed_row(ValueError(f.why_not(T)), row)})
                    bar.update()
                    continue
                head = point_row(shape, tried, config, T, plan, f.fits)
                # the first point warms up on a whole prompt: a fresh GPU's clocks and allocator settle over its
                # first seconds (the committed 248K prefill runs: the first mode's early chunks 0.45 s slower)
                warm = min(T, plan.warmup_tokens or (T if first else 2 * tried.chunk))
                rec = sweep.attempt(lambda: measure(model, config, T, tried, prompts, plan, warm), head,
                                    on_fail=lambda ex: _fresh(dev))
                first = False
                if rec.get("status") == "failed" and not f.fits:
                    rec["error"] = f"{rec['error']} (the byte formulas: {f.why_not(T)})"
                r.add({**base, **head, **rec})
                bar.update()
            del prompts
    df = r.metrics()
    ok = df[df["status"] == "ok"]
    for T in plan.context_lens:
        none = ok[(ok["context_len"] == T) & (ok["config"] == "none")]
        if len(none):
            sel = (df["context_len"] == T) & (df["status"] == "ok")
            df.loc[sel, "vs_none"] = df.loc[sel, "prompts_per_s"] / float(none["prompts_per_s"].iloc[0])
    r.records = df.to_dict("records")
    r.write_table("metrics", df)
    r.write_csv("metrics", df)
    r.finish()
    sweep.headline(sweep.summary_lines(lambda: headline(df, plan)), progress_bar, EXPERIMENT)
    return r


def headline(df, plan: PrefillThroughputPlan) -> list[str]:
    """Per config at the longest length: prompts/s, chunk and prompts held, and each against none."""
    ok = df[df["status"] == "ok"]
    T = int(df["context_len"].max())
    lines = [f"{plan.prompts} prompts of {T} tokens under a {size(plan.mem_cap_gib * 2**30)} cap:"]
    parts = []
    for r in ok[ok["context_len"] == T].to_dict("records"):
        vs = r.get("vs_none")
        ratio = f", {vs:.2f}x none" if r["config"] != "none" and vs == vs and vs is not None else ""
        parts.append(f"{r['config']} {r['prompts_per_s']:.3g}/s (chunk {int(r['chunk'])}, {int(r['in_flight'])} held{ratio})")
    lines.append("; ".join(parts) if parts else "no config measured")
    failed = df[(df["status"] == "failed") & (df["context_len"] == T)]
    if len(failed):
        lines.append(f"did not fit: {', '.join(failed['config'])}")
    return lines
