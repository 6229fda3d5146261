"""PulseInfer's ladder on the Mooncake trace windows: each window replayed once per rung by the same server
(the same seeded model, fresh pools per replay), so every rung's throughput and p99 TPOT is a ratio to the
published baseline's on the same requests, in the same process.

The rungs, as configurations of `trace_replay.replay_policy` (each a `Serving`: `rung_params`; every rung selects
16-position blocks, so a request's tokens are the same under every rung: `output_sha` in requests.parquet):

| rung | lanes | offload transfer | placement |
|---|---|---|---|
| `per_head` | offload only, R + O slots | `block_dma` cut into per-head units (`dma_unit_rows`) | every request offloaded |
| `prefetch` | offload only, R + O slots | `hot_cache` holding the last step's selection: only the guess's misses cross | every request offloaded |
| `coalesced` | offload only, R + O slots | `coalesced` (gather into staging, chunked copies) | every request offloaded |
| `retrieval_head` | offload only, R + O slots | `block_strategy` over whole blocks | every request offloaded |
| `switching` | R resident (pool = cap) + O offload | `block_strategy` | `threshold:N`, switched at layer boundaries |
| `adaptive` | the same | `block_strategy` | `adaptive:MIN:HIDE`, switched |
| `no_offload` | R + O resident slots, pool = cap | none | every request resident; those that do not fit wait |

Why the first three rungs offload every request and do not switch: the compared systems (ArkVale, InfiniGen,
PQCache) keep every request's KV in host RAM and select from it; they have no resident/offload split, so
there is no second batch to switch to (a `noswitch:N` policy would keep short requests on the device, which
those systems do not).

Per-head units: labkit's indexer scores positions, so one selection serves the whole layer (what PulseInfer's
retrieval head gives); the per-head rungs move that selection as per-head selections move theirs: each
16-position block in 2 x n_kv_heads copies of select_block / (2 n_kv_heads) rows (the reference shape: 4
copies of 8 KiB per 32 KiB block, as one KV head's K or V of a block is 16 x 256 x 2 B = 8 KiB). The count and
size of the copies are the published baselines'; the positions are the same for every head (theirs differ per
head: the same bytes, a different quality), and the selection is computed once, not once per head (theirs
costs more: this baseline is, if anything, faster than the published ones). Their copies are one DMA each
(`cuMemcpyBatchAsync` queues one copy per unit: 17.4 GB/s at 8 KiB on the H200 host, above the ~6 GB/s the
publication reports for such transfers, again the stronger baseline).

The unit size is a parameter (`per_head_unit_bytes`, auto: one KV head's K or V of a block, the 8 KiB above);
`bytes_per_copy` in the rows is what the copies measured. A request whose context is shorter than the budget
has its selection padded with masked blocks; those are whole blocks of the first positions
(`select.select_blocks`), so they move in units as any block. (Runs before that padded with position 0 once
per entry, a one-row copy each in every block_dma rung: the committed ladder's per_head shows 4.7 KiB a copy.)

The baselines' prefetch of the next layer's rows (InfiniGen speculates layer l + 1's selection from layer l's
input and loads it during layer l): the `prefetch` rung (`prefetch=true`, on by default on CUDA) takes the previous
step's selection of each layer as its guess and corrects it by the real one. It is the `hot_cache` strategy with
one selection of slots per request and layer (`hot_capacity` = budget, `lru`): after a step the device holds exactly
that step's selected rows, so at the next step only the rows the guess missed cross the link (read by the GPU from
mapped host memory) and the guessed rows cost no transfer at all. That is the prefetch at its best: a real
prefetch moves the guess over the link during the layer before (the same bytes again, hidden only where that
layer's compute is long enough), and its misses in per-head units. The guess is kept per batch: a batch that
changes (a request admitted or finished) starts with none, as the lane rebuilds its buffers. Without it the
per_head rung's loads sit on the critical path as every non-switching rung's do. The retrieval head itself (its
choice by mid-context attention share, and what it costs in quality) is measured by `labkit run quality`.

The device-memory cap (`device_kv_tokens`, tokens of KV in device memory) is the switching rungs' resident
pool and no_offload's whole pool; the all-offloaded rungs keep no KV on the device (every rung keeps the
index keys there, 66 B a token and layer against 2 KiB of KV). The offload lane's host pool
(`host_kv_tokens`) holds every window's requests together (checked before anything runs), so host RAM never
makes a request wait; it is sized to the requests because each replay registers its pool with the driver. It is recorded in the
manifest and every row (`device_kv_cap_tokens`, its bytes `device_kv_cap_bytes`), with each rung's own
device pool (`device_kv_tokens`).

On calibration windows the threshold and adaptive candidates are replayed beside the fixed rungs; their rows
have no `rung` (`candidate_for` names it), so the rungs per window are the chosen ones on test windows only.

Decode instance (`disaggregated=true`): PulseInfer's published figures are decode instances of a disaggregated
deployment, so here every request arrives with its prompt's KV prefilled elsewhere (`Request.prefilled`):
when the scheduler gives it a slot its KV is placed straight into the lane's pool, the device pool of a
resident lane or the host pool of an offloaded one, and no prefill forward runs. The handover's cost is
excluded from the timed window: the scheduler's clock stops while the KV is placed, and the seconds taken
out are their own column (`handover_s`, with `handovers`; `prefill_forwards` counts the prefill chunks run,
0 here). Every timed step is decode. TTFT has no meaning on a decode instance: its statistics are absent
(None, not 0), and TPOT runs from the request's admission (`decode_start_s` in requests.parquet; the wait
before it shows in E2EL and throughput). Outputs: `max_output=0` keeps the trace's own output lengths
(times `output_scale`). Memory pressure: `device_kv_tokens=auto` sizes the cap per window (`window_caps`)
so no_offload holds at most a third of the window's requests, or, where the window's longest request needs
more, that request alone; every row records the cap (`device_kv_cap_tokens`), its share of the window's KV
(`device_kv_share`), the most requests that fit it together (`most_held`, `third_held`) and what happened:
`max_running`, `held_share` (of the window's requests) and `max_waiting`.

Run folder: metrics.parquet (one row per window and rung: `rung`, `window`, `output_throughput`,
`tpot_ms_mean`, `tpot_ms_p99`, TTFT/TPOT/ITL/E2EL statistics, goodput, link bytes, `bytes_per_copy`, `copies_per_step`,
`share_offloaded`, `max_running` (requests running at once, at most), `gpu_stall_share_sampled`),
window_ratios.parquet (per window and rung: throughput, p99 and mean TPOT ratios to per_head;
`throughput_vs_no_offload`),
window_summary.parquet (per rung over the test windows: median, min, max, bootstrap interval),
selection.parquet (the calibration choice), requests.parquet (every request of every replay).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from ... import envs, sweep
from ...engine.drive.policies import check_policy, fitted_name
from ...engine.model.hybrid import HybridModel
from ...engine.transfer import STRATEGIES, get_strategy, setting_names
from ...params import BadInput, fill_auto, resolve_device
from ...serving.workload import load_trace
from ...shapes import ModelShape, model_kwargs
from ...stats import bootstrap
from .. import trace_windows as W
from ..trace_windows import candidates, window_bounds
from . import BLOCK_STRATEGIES, PulseLadderPlan
from .. import trace_replay as R

EXPERIMENT = "pulse_ladder"
RUNGS = ("per_head", "prefetch", "coalesced", "retrieval_head", "switching", "adaptive")
NO_OFFLOAD = "no_offload"
PREFETCH = "prefetch"
BASELINES = ("per_head", PREFETCH)       # the published offload systems' stand-ins: "the best offload system"
FIXED = ("per_head", PREFETCH, "coalesced", "retrieval_head", NO_OFFLOAD)      # rungs whose policy name is the rung's


def rung_of(policy: str) -> str:
    """The rung a replayed policy stands for: `threshold:N` the switching rung, `adaptive:MIN:HIDE` the adaptive
    rung, the fixed rungs by their names."""
    if policy.startswith("threshold:"):
        return "switching"
    if policy.startswith("adaptive"):
        return "adaptive"
    return policy


def unit_rows(plan: PulseLadderPlan) -> int:
    """Rows per per-head unit: `per_head_unit_bytes` over a row's bytes; auto (and the runs before the
    parameter): one KV head's K or V of a block, 1 / (2 n_kv_heads) of the block's rows (8 KiB for the
    reference shape: 16 positions x 256 head dims x 2 B)."""
    shape = ModelShape.from_name(plan.shape)
    given = plan.per_head_unit_bytes
    if given in ("auto", 0, None):
        return plan.select_block // (2 * shape.n_kv_heads)
    return int(given) // shape.row_bytes


def pages(plan: PulseLadderPlan, tokens: int) -> int:
    return -(-tokens // plan.page_size)


def window_caps(plan: PulseLadderPlan, needs: list[list[int]]) -> list[dict]:
    """Per window, the device-memory cap and how much pressure it puts on no_offload: {cap tokens, the
    window's KV tokens (its requests' pages together), the cap's share of them, the most requests of the
    window that fit it together (its shortest first), whether that is at most a third of them}. `needs`:
    per window, each request's prompt + output tokens.

    The pressure rule (`device_kv_tokens=auto` with `disaggregated`): in pages, the cap is the smaller of a
    third of the window's pages and one page less than its n // 3 + 1 shortest requests need together, so
    no_offload can hold neither a third of the window's KV nor more than a third of its requests at once;
    but never below the window's longest request, which must fit alone. Where that request needs more, it
    sets the cap, and `third_held` says whether the bound still holds. Otherwise one cap for every window:
    `device_kv_tokens` as given."""
    out = []
    for n in needs:
        pg = sorted(pages(plan, x) for x in n)
        k = len(pg) // 3
        if plan.device_kv_tokens == "auto":
            cap = max(pg[-1], min(sum(pg) // 3, sum(pg[:k + 1]) - 1)) * plan.page_size
        else:
            cap = int(plan.device_kv_tokens)
        fit = cap // plan.page_size
        held = next((i for i in range(len(pg)) if sum(pg[:i + 1]) > fit), len(pg))
        total = sum(pg) * plan.page_size
        out.append({"device_kv_cap_tokens": cap, "window_kv_tokens": total, "device_kv_share": cap / total,
                    "most_held": held, "third_held": held <= max(1, len(pg) // 3)})
    return out


def window_requests(plan: PulseLadderPlan, window: int) -> list:
    """A window's requests, their outputs scaled by the plan's `output_scale` (`trace_replay.requests`)."""
    return R.requests(plan, window, plan.output_scale)


def window_needs(plan: PulseLadderPlan, windows: range) -> list[list[int]]:
    """Per window, each request's prompt + output tokens: what `window_caps` sizes the cap by."""
    return [[len(s.prompt) + s.output_len for s in window_requests(plan, w)] for w in windows]


def rung_params(policy: str, plan: PulseLadderPlan, cap: int) -> tuple[R.Serving, str]:
    """(how the replay serves, its placement policy) for one rung's policy name, under the device-memory cap
    `cap` (tokens) of its window: every rung's host pool holds the window (`host_kv_tokens`); only per_head cuts
    its copies into units (`dma_unit_rows`)."""
    rung = rung_of(policy)
    both = plan.resident_slots + plan.offload_slots
    pools = {"offload_pool_tokens": plan.host_kv_tokens, "disaggregated": plan.disaggregated}
    units = {"dma_unit_rows": unit_rows(plan) if rung == "per_head" else 0}
    if rung == PREFETCH:       # the last step's selection kept per request and layer: the guess the next corrects
        return R.serving(plan, "hot_cache", {**units, "hot_capacity": plan.budget, "hot_policy": "lru"},
                         resident_slots=0, offload_slots=both, resident_pool_tokens=0, **pools), "offload"
    if rung in ("per_head", "coalesced", "retrieval_head"):
        strategy = {"per_head": "block_dma", "coalesced": "coalesced"}.get(rung, plan.block_strategy)
        return R.serving(plan, strategy, units, resident_slots=0, offload_slots=both, resident_pool_tokens=0,
                         **pools), "offload"
    if rung == NO_OFFLOAD:
        return R.serving(plan, "resident", units, resident_slots=both, offload_slots=0, resident_pool_tokens=cap,
                         **pools), "resident"
    return R.serving(plan, plan.block_strategy, units, resident_pool_tokens=cap, **pools), policy


def ladder_protocol(plan: PulseLadderPlan) -> W.Protocol:
    """The protocol `labkit.experiments.trace_windows` plans the ladder with: per_head the reference of every
    ratio, the other fixed rungs replayed on every window, the threshold and adaptive candidates fitted on the
    calibration windows (or, with none, the one value of each given replayed as fixed policies)."""
    fixed = [r for r in FIXED if r != "per_head" and (r != PREFETCH or plan.prefetch)]
    if plan.calibration_windows == 0:
        given = [*fixed[:-1], f"threshold:{int(plan.thresholds[0])}",              # fixed[-1]: no_offload
                 fitted_name(plan.adaptive_min_tokens[0], plan.adaptive_hide[0]), NO_OFFLOAD]
        return W.Protocol("per_head", given, p99_limit=plan.p99_limit, deadline_s=plan.deadline_s)
    return W.Protocol("per_head", fixed, plan.thresholds, plan.adaptive_min_tokens, plan.adaptive_hide,
                      plan.p99_limit, plan.deadline_s)


def check(given: dict, declared: list) -> PulseLadderPlan:
    """Validate resolved parameters, the trace, its windows and the cap before anything is allocated (one line
    on bad input), and find the run to resume. Returns the plan."""
    p = dict(given)
    dev = resolve_device(p["device"])
    fill_auto(declared, p, dev.type)
    cuda = dev.type == "cuda"
    if p["max_output"] == "auto":
        p["max_output"] = 256 if cuda else 6
    if p["device_kv_tokens"] == "auto" and not p["disaggregated"]:
        p["device_kv_tokens"] = 131072 if cuda else 256     # the pressure rule is the decode instance's (window_caps)
    if p["disaggregated"] and p["transport"] == "http":
        raise BadInput("disaggregated replays run in process (transport=inprocess): the server takes prompts, "
                       "not handed-over KV")
    p["trace"] = p["trace"] or str(R.TRACE)
    if p["transport"] == "auto":
        have = all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "httpx"))
        p["transport"] = "http" if have and not p["disaggregated"] else "inprocess"
    p["device"] = str(dev)
    plan = PulseLadderPlan.from_params(p)
    _check_blocks(plan)
    _check_rungs(plan)
    _check_windows(plan)
    plan = replace(plan, trace_sha=hashlib.sha256(Path(plan.trace).read_bytes()).hexdigest()[:16])
    return replace(plan, resume=R.find_resume(plan, EXPERIMENT))


def _check_blocks(plan: PulseLadderPlan) -> None:
    """The shape exists, and its blocks split into the per-head units the per_head rung copies."""
    try:
        shape = ModelShape.from_name(plan.shape)
    except ValueError as ex:
        raise BadInput(str(ex)) from None
    sb, heads = plan.select_block, 2 * shape.n_kv_heads
    if plan.budget % sb or plan.page_size % sb or (plan.per_head_unit_bytes == "auto" and sb % heads):
        raise BadInput(f"select_block {sb} must divide budget ({plan.budget}) and page_size ({plan.page_size}), "
                       f"and 2 x n_kv_heads ({heads}) must divide it (the per-head units of a block)")
    unit = plan.per_head_unit_bytes
    if unit != "auto" and (unit % shape.row_bytes or not 1 <= unit // shape.row_bytes <= sb):
        raise BadInput(f"per_head_unit_bytes {unit} must be a whole number of {shape.row_bytes}-byte KV rows "
                       f"({plan.shape}), from one row to a block of select_block {sb}")
    if plan.dma_unit_rows:
        raise BadInput("dma_unit_rows is set by the rungs (per_head: per_head_unit_bytes / the row's bytes), not given")


def _check_rungs(plan: PulseLadderPlan) -> None:
    """The switching and adaptive rungs' candidates, the block strategies and their settings, every policy."""
    if plan.calibration_windows == 0 and (len(plan.thresholds) != 1 or len(plan.adaptive_min_tokens) != 1
                                          or len(plan.adaptive_hide) != 1):
        raise BadInput("with calibration_windows=0 thresholds, adaptive_min_tokens and adaptive_hide hold one value "
                       "each (the switching and adaptive rungs, used as given)")
    if plan.calibration_windows > 0 and not (plan.thresholds and plan.adaptive_min_tokens and plan.adaptive_hide):
        raise BadInput("calibration windows need candidates: thresholds, adaptive_min_tokens and adaptive_hide")
    for name in BLOCK_STRATEGIES:
        if name not in STRATEGIES:
            raise BadInput(f"strategy {name} is not registered")
        try:                                  # the settings' values, as the strategies check them
            get_strategy(name, **{k: getattr(plan, k) for k in setting_names()})
        except ValueError as ex:
            raise BadInput(str(ex)) from None
    w = ladder_protocol(plan)
    for pol in [*(x for x in w.policies if x not in FIXED), *(c for cs in candidates(w).values() for c in cs)]:
        check_policy(pol)


def _check_windows(plan: PulseLadderPlan) -> None:
    """The trace's windows exist and are sound, every request fits the device cap alone and every window the
    host pool together."""
    rows = load_trace(plan.trace)
    window_bounds(len(rows), plan.windows, plan.window_size, plan.calibration_windows)
    for i, r in enumerate(rows[:plan.windows * plan.window_size]):
        if r["timestamp"] < 0 or r["input_length"] < 1 or r["output_length"] < 1:
            raise BadInput(f"trace {plan.trace}: request {i} has a negative time or a length < 1")
    # every request of every window must fit the cap alone, or no_offload (and a resident placement) waits forever
    need = window_needs(plan, range(plan.windows))
    for w_, (n, c) in enumerate(zip(need, window_caps(plan, need))):
        if pages(plan, max(n)) > c["device_kv_cap_tokens"] // plan.page_size:
            raise BadInput(f"device_kv_tokens {c['device_kv_cap_tokens']} holds no request of {max(n)} tokens (the "
                           f"longest of window {w_}): raise the cap or lower capacity / length_scale")
    # the offloaded rungs hold a whole window at once: host RAM must never be what makes a request wait
    most = max(sum(pages(plan, x) for x in n) * plan.page_size for n in need)
    if most > plan.host_kv_tokens:
        raise BadInput(f"host_kv_tokens {plan.host_kv_tokens} is below the {most} tokens of the largest window's "
                       "requests together: raise it (host RAM must not make an offloaded request wait)")


def _warm_up(plan: PulseLadderPlan, model, policies: list[str]) -> float:
    """Untimed replays before the measured ones (kernel compiles, first allocations, graphs per batch size):
    window 0's first requests, all at once, a few tokens each, under every rung's configuration."""
    t = time.monotonic()
    specs = window_requests(plan, 0)[:min(4, plan.window_size)]
    for s in specs:
        s.output_len, s.arrival_s = min(s.output_len, 4), 0.0
    cap = window_caps(plan, window_needs(plan, range(1)))[0]["device_kv_cap_tokens"]
    for pol in policies:
        how, placement = rung_params(pol, plan, cap)
        R.replay_policy(placement, replace(how, timeline_every=0), specs, model)
    return time.monotonic() - t


def run(plan: PulseLadderPlan, progress_bar: bool = False):
    """`labkit run pulse_ladder`: calibration windows, the choice, the test windows, every rung on each."""
    t0 = time.monotonic()
    wp = ladder_protocol(plan)
    bounds = W.window_bounds(len(load_trace(plan.trace)), plan.windows, plan.window_size, plan.calibration_windows)
    roles = {b["window"]: b["role"] for b in bounds}
    shape = ModelShape.from_name(plan.shape)
    caps = window_caps(plan, window_needs(plan, range(plan.windows)))
    for c in caps:
        c["device_kv_cap_bytes"] = c["device_kv_cap_tokens"] * shape.kv_bytes_per_token()
    one = len({c["device_kv_cap_tokens"] for c in caps}) == 1
    before = R.earlier_run(plan.resume)
    run = sweep.open_run(plan.params, EXPERIMENT)
    run.update_manifest(windows=bounds, calibration=[w for w, r in roles.items() if r == "calibration"],
                        test=[w for w, r in roles.items() if r == "test"], selection_rule=W.RULE,
                        rungs=[*(r for r in RUNGS if r != PREFETCH or plan.prefetch), NO_OFFLOAD], disaggregated=bool(plan.disaggregated),
                        # one cap for the run, or (the pressure rule) one per window: `device_kv_caps`
                        device_kv_cap_tokens=caps[0]["device_kv_cap_tokens"] if one else None,
                        device_kv_cap_bytes=caps[0]["device_kv_cap_bytes"] if one else None,
                        device_kv_caps=[{"window": w, **c} for w, c in enumerate(caps)],
                        per_head_unit_bytes=unit_rows(plan) * shape.row_bytes,
                        resumed_from=[before["me"], *before["resumed_from"]] if before else [])
    dev = torch.device(plan.device)
    base = {"device": str(dev), "gpu_name": run.manifest.get("gpu_name") or "cpu", "shape": plan.shape,
            "measured_in": run.run_id, "session": envs.get("LABKIT_SESSION"), "git_sha": run.manifest["git_sha"]}
    model = HybridModel(shape, dev, seed=plan.seed, **model_kwargs(plan.params))     # weights_dtype, ... by name
    run.update_manifest(holding=model.holding())
    base |= {"weights_dtype": model.weights_dtype, "expert_banks": model.expert_banks or None}
    reqs: list[dict] = []
    position: dict[int, int] = {}            # replays so far per window (this call): the rung order turned
    specs_of: dict[int, list] = {}

    def replay(w: int, pol: str) -> dict:
        rung = rung_of(pol)
        how, placement = rung_params(pol, plan, caps[w]["device_kv_cap_tokens"])
        # a candidate replayed on a calibration window is no rung yet (the choice comes after): its rows name
        # the rung it is a candidate for, so whoever reads rungs per window reads only what was chosen
        candidate = roles[w] == "calibration" and rung in ("switching", "adaptive")
        where = {"window": w, "window_role": roles[w], "rung": None if candidate else rung,
                 "candidate_for": rung if candidate else None, "position": position.get(w, 0)}
        position[w] = position.get(w, 0) + 1
        bar.set_postfix_str(f"window {w} ({roles[w]}) {rung}")
        head = {**base, **caps[w], "experiment": EXPERIMENT, "policy": pol, **where}
        try:
            if w not in specs_of:
                specs_of[w] = window_requests(plan, w)
            specs = specs_of[w]
            out = R.replay_policy(placement, how, specs, model)
        except Exception as ex:   # noqa: BLE001 - recorded, the next rung runs
            return sweep.failed_row(ex, head)
        finally:
            bar.update()
        by_id = {r["request_id"]: r for r in out["stats"]["records"]}
        for r in out["records"]:
            mine = by_id.get(r.get("request_id"), {})
            reqs.append({"policy": pol, **where, **{k: v for k, v in r.items() if k not in ("text", "token_times")},
                         "lane": mine.get("lane"), "output_sha": mine.get("output_sha"),
                         "n_token_times": len(r.get("token_times") or [])})
        run.write_table("requests", pd.DataFrame(reqs))      # a run cut short keeps what it measured
        row = {**base, **R.summary_row(placement, plan, how, out, EXPERIMENT), **head}
        row.update(switching=rung in ("switching", "adaptive"), placement=placement,
                   device_kv_tokens=0 if placement == "offload" else caps[w]["device_kv_cap_tokens"],
                   dma_unit_rows=how.settings.get("dma_unit_rows", 0),     # 0: whole runs (not per_head's strategy)
                   held_share=row["max_running"] / max(1, len(specs)))
        return row

    def record(row: dict) -> None:
        run.add({k: v for k, v in row.items() if k != "run_id"})

    if plan.warmup:
        run.update_manifest(warmup_s=_warm_rungs(plan, wp, model))
    earlier = before.get("metrics") if before else None
    fitted = {arm: arm for arm, c in W.candidates(wp).items() if c}
    total = sum(len(W.planned(wp, b["role"], fitted)) for b in bounds)
    with sweep.bar(total, EXPERIMENT, progress_bar) as bar:
        out = W.replay_windows(wp, bounds, replay, record, earlier=earlier, t0=t0)
    _close(run, out, before, reqs, wp, roles)
    sweep.headline(sweep.summary_lines(lambda: headline(run.path)), progress_bar, EXPERIMENT)
    return run


def _warm_rungs(plan: PulseLadderPlan, wp: W.Protocol, model) -> float:
    """Untimed replays of one policy of each rung (the candidates of a rung share its configuration); seconds."""
    one: dict[str, str] = {}
    for pol in W.planned(wp, "calibration", {}) + W.planned(wp, "test", {}):
        one.setdefault(rung_of(pol), pol)
    return round(_warm_up(plan, model, list(one.values())), 2)


def _close(run, out: dict, before: dict | None, reqs: list, wp: W.Protocol, roles: dict) -> None:
    """The run's tables once the windows are replayed (the kept windows' requests first), and its status: a run
    stopped at its deadline says which windows a resume still has to replay."""

    if out["kept"] and before and len(before.get("requests", [])):
        old = before["requests"]
        reqs[:0] = old[old["window"].isin(out["kept"])].to_dict("records")
    run.write_table("requests", pd.DataFrame(reqs))
    rung, why = strongest(out["selection"])
    run.update_manifest(strongest_rung=rung, strongest_rule=why)
    R.close_windows(run, wp, out, roles, ratios=ladder_ratios(run.metrics(), wp, out["chosen"], roles))


STRONGEST_RULE = ("the switching or adaptive rung whose chosen candidate had the better median throughput ratio to "
                  "per_head on the calibration windows, among those within p99_limit (none within: the lower median "
                  "p99 ratio); the held-out windows play no part")


def strongest(selection: pd.DataFrame) -> tuple[str, str]:
    """PulseInfer's strongest arm, chosen on the calibration windows only (`selection`: `trace_windows.choose`'s
    table, the candidates' calibration figures): (rung, the rule that chose it). Without calibration windows
    there is nothing to choose on: the full system, `adaptive`, as built."""
    arms = {W.STATIC: "switching", W.ADAPTIVE: "adaptive"}
    if selection is None or selection.empty or "chosen" not in selection:
        return "adaptive", "no calibration window: the full system (adaptive), as built"
    c = selection[selection["chosen"].astype(bool) & selection["arm"].isin(arms)]
    if c.empty:
        return "adaptive", "no candidate was chosen on the calibration windows: the full system (adaptive), as built"
    ok = c[c["acceptable"].astype(bool)]
    best = (ok.sort_values("throughput_ratio", ascending=False, kind="stable") if len(ok)
            else c.sort_values("tpot_p99_ratio", kind="stable")).iloc[0]
    return arms[best["arm"]], STRONGEST_RULE


def ladder_ratios(m, wp: W.Protocol, chosen: dict, roles: dict):
    """Per (window, rung): throughput and p99 TPOT over per_head's on the same window (`windows.window_ratios`,
    arms named by rung), and throughput over no_offload's (`throughput_vs_no_offload`)."""
    m = m[m["experiment"] == EXPERIMENT]
    t = W.window_ratios(m, wp, chosen, roles)
    t["arm"] = t["policy"].map(rung_of)
    ok = m[(m["status"] == "ok") & (m["rung"] == NO_OFFLOAD)].drop_duplicates("window", keep="last")
    t["throughput_vs_no_offload"] = t["output_throughput"] / t["window"].map(ok.set_index("window")["output_throughput"])
    order = {r: i for i, r in enumerate([*RUNGS, NO_OFFLOAD])}
    return t.sort_values(["window", "arm"], key=lambda c: c.map(order) if c.name == "arm" else c,
                         kind="stable").reset_index(drop=True)


def headline(path) -> list[str]:
    """Per rung over the test windows: throughput and p99 TPOT against per_head (median [95% interval]), the full
    rung against no_offload, and the transfer sizes; with no test window complete, what was measured."""

    path = Path(path)
    s = pd.read_parquet(path / "window_summary.parquet") if (path / "window_summary.parquet").is_file() else pd.DataFrame()
    lines = []
    mf = json.loads((path / "manifest.json").read_text()) if (path / "manifest.json").is_file() else {}
    best = f"; strongest arm on the calibration windows: {mf['strongest_rung']}" if mf.get("strongest_rung") else ""
    if len(s) and "throughput_ratio" in s:
        lines.append(f"test windows {s['test_windows'].iloc[0]}, against per_head (no prefetch of the next layer): " + ", ".join(
            f"{r['arm']} throughput {r['throughput_ratio']:.2f}x [{r['throughput_ratio_lo']:.2f}, {r['throughput_ratio_hi']:.2f}]"
            + (f", p99 TPOT {r['tpot_p99_ratio']:.2f}x" if r.get("tpot_p99_ratio") == r.get("tpot_p99_ratio") else "")
            + (f", mean TPOT {r['tpot_mean_ratio']:.2f}x" if r.get("tpot_mean_ratio") == r.get("tpot_mean_ratio")
               and r.get("tpot_mean_ratio") is not None else "")
            for r in s.to_dict("records") if r["arm"] != "per_head"))
        t = pd.read_parquet(path / "window_ratios.parquet")
        full = t[(t["role"] == "test") & (t["arm"] == "adaptive")]["throughput_vs_no_offload"].dropna()
        if len(full):
            ci = bootstrap(full, np.median)
            lines.append(f"adaptive (full PulseInfer) / no_offload under the same cap: throughput {full.median():.2f}x "
                         f"[{ci.lo:.2f}, {ci.hi:.2f}] over {len(full)} windows{best}")
    m = pd.read_parquet(path / "metrics.parquet")
    ok = m[m["status"] == "ok"]
    if len(ok):
        per = ok.groupby("rung", sort=False)[["bytes_per_copy", "copies_per_step", "max_running"]].median()
        lines.append("bytes per copy / copies per step / most running: " + ", ".join(
            f"{r} {x.bytes_per_copy / 1024:.1f} KiB / {x.copies_per_step:.0f} / {x.max_running:.0f}"
            if x.bytes_per_copy == x.bytes_per_copy else f"{r} - / - / {x.max_running:.0f}" for r, x in per.iterrows()))
        no = ok[ok["rung"] == NO_OFFLOAD]
        if len(no) and "disaggregated" in no and no["disaggregated"].all():
            lines.append(f"decode instance ({int(no['prefill_forwards'].sum())} prefill forwards): no_offload held at most "
                         f"{no['max_running'].max():.0f} of {no['n_requests'].max():.0f} requests a window (cap "
                         f"{no['device_kv_share'].median():.0%} of a window's KV, median), up to "
                         f"{no['max_waiting'].max():.0f} waiting")
    return lines
