"""`labkit run pulse`: the Mooncake conversation trace replayed against `labkit serve`, one placement
policy at a time (PulseInfer), over disjoint windows of the trace.

The trace's first `windows x window_size` requests are cut into disjoint windows (`pulse_windows`); the
first `calibration_windows` choose the static threshold and fit the adaptive policy's constants, the rest
(test windows) report them against the reference policy of the same window. For each replay a fresh engine
server (the same seeded model, empty pools) is started on 127.0.0.1 and the load generator that drives
vLLM (`labkit.serving.loadgen.run_load`, open loop at the trace's arrival times divided by `rate`) sends
the window's requests (`transport=inprocess`: the scheduler on its own clock, no server). Trace lengths
are multiplied by `length_scale` and capped to what a slot holds (`capacity`); the scaling used is
recorded in the manifest and every row. One window, no calibration (`windows=1 calibration_windows=0`)
is the replay of the trace's first `window_size` requests under the policies given.

Policies (`pulse_policy`): `adaptive` (measured costs, `scheduler.calibrate`), `adaptive:MIN:HIDE` (its
constants given), `threshold:N` (offload prompt + output > N tokens, switching on), `noswitch:N` (the same
placement, batches run one after the other: "offload every long request, no switching"), `resident`,
`offload`.

Run folder: `metrics.parquet` (one row per window and policy: vLLM's TTFT/TPOT/ITL/E2EL statistics,
throughput, goodput at `tpot_slo_ms`, share of requests offloaded, switches, stalls, GPU stall share of
the sampled rounds, link bytes; `window`, `window_role`), `window_ratios.parquet` (per window and arm: the
ratios to the reference), `window_summary.parquet` (per arm over the test windows: median, min, max and
a bootstrap interval), `selection.parquet` (every candidate's calibration figures, the chosen ones),
`requests.parquet` (the load generator's records + lane, every window); `rounds`, `timeline` and `loads`
of the first test window only (results/ stays small).
"""
from __future__ import annotations

import hashlib
import importlib.util
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from ... import envs, sweep
from ...engine.drive.policies import check_policy
from ...engine.model.hybrid import HybridModel
from ...engine.transfer import STRATEGIES, get_strategy, setting_names, settings_of, strategy_params
from ...params import BadInput, fill_auto, resolve_device
from ...serving.workload import load_trace
from ...shapes import ModelShape
from .. import trace_windows as W
from ..trace_windows import candidates, window_bounds
from ..trace_replay import (TRACE, Serving, close_windows, earlier_run, find_resume, keep_earlier, replay_policy,
                            requests, serving, summary_row)
from . import PulsePlan

EXPERIMENT = "pulse"


def _check_crossed(plan: PulsePlan) -> None:
    """What crosses parameters: the candidates, the blocks, the strategy, the slots, the policies and the device
    pool (one BadInput line)."""
    if plan.calibration_windows > 0 and not (plan.thresholds or plan.adaptive_min_tokens and plan.adaptive_hide):
        raise BadInput("calibration windows need candidates: thresholds, or adaptive_min_tokens with adaptive_hide")
    if plan.select_block < 1 or plan.budget % plan.select_block or plan.page_size % plan.select_block:
        raise BadInput(f"select_block must be >= 1 and divide budget ({plan.budget}) and page_size "
                       f"({plan.page_size}), got {plan.select_block}")
    _check_strategy(plan)
    if plan.resident_slots < 0 or plan.offload_slots < 0 or plan.resident_slots + plan.offload_slots == 0:
        raise BadInput("resident_slots and offload_slots must be >= 0, not both 0")
    for pol in [plan.reference, *plan.policies, *(c for cs in candidates(W.Protocol.of(plan)).values() for c in cs)]:
        check_policy(pol)
    if plan.resident_slots and plan.resident_pool_tokens and plan.resident_pool_tokens < plan.capacity:
        # a request of `capacity` tokens placed resident could never get its pages: say so now, not
        # as a failed policy row after the pools are allocated
        raise BadInput(f"resident_pool_tokens {plan.resident_pool_tokens} is below the {plan.capacity} tokens a "
                       "request slot holds (capacity): lower capacity or raise the pool")


def _check_strategy(plan: PulsePlan) -> None:
    """The offload lane's strategy exists, its settings' values are ones it takes, and no setting is given away
    from its default that only another strategy has."""
    if plan.strategy not in STRATEGIES:
        raise BadInput(f"unknown strategy {plan.strategy!r}: choose from {', '.join(STRATEGIES)}")
    try:                                  # its settings' values, as the strategy itself checks them
        get_strategy(plan.strategy, **{k: getattr(plan, k) for k in setting_names()})
    except ValueError as ex:
        raise BadInput(str(ex)) from None
    mine = {s.param for s in settings_of(plan.strategy)}
    for sp in strategy_params():
        if getattr(plan, sp.name) != sp.default and sp.name not in mine:
            users = [n for n, c in STRATEGIES.items() if any(s.param == sp.name for s in c.SETTINGS)]
            raise BadInput(f"{sp.name} applies to strategy {', '.join(users)}, not {plan.strategy}")


def check(given: dict, declared: list) -> PulsePlan:
    """Validate resolved parameters, the trace and its windows included, find the run to resume, and decide
    the "auto" ones, before anything is allocated (one line on bad input). `declared`: the experiment's SPEC (its
    declared per-device values and bounds), handed over by `plan` so this module need not import it. Returns
    the plan, with the trace's identity and the run it resumes."""
    p = dict(given)
    dev = resolve_device(p["device"])
    fill_auto(declared, p, dev.type)    # each "auto" for this device, then the declared bounds and choices
    p["trace"] = p["trace"] or str(TRACE)
    p["device"] = str(dev)
    if p["transport"] == "auto":
        have = all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "httpx"))
        p["transport"] = "http" if have else "inprocess"
    plan = PulsePlan.from_params(p)
    _check_crossed(plan)
    rows = load_trace(plan.trace)
    window_bounds(len(rows), plan.windows, plan.window_size, plan.calibration_windows)
    for i, r in enumerate(rows[:plan.windows * plan.window_size]):
        if r["timestamp"] < 0 or r["input_length"] < 1 or r["output_length"] < 1:
            raise BadInput(f"trace {plan.trace}: request {i} has a negative time or a length < 1")
    plan = replace(plan, trace_sha=hashlib.sha256(Path(plan.trace).read_bytes()).hexdigest()[:16])
    return replace(plan, resume=find_resume(plan, EXPERIMENT))


def _warm_up(plan: PulsePlan, model, policies: list[str]) -> float:
    """Untimed replays before the measured ones: the first replay of a process pays for kernel compiles
    and first allocations (2-7 s more before the first round in the one-window runs on the H200, every
    time on the reference, which ran first). The first requests of window 0, all at once, a few tokens
    each, under the reference and one policy of each other kind (switching, adaptive). Returns seconds."""
    t = time.monotonic()
    kinds = {}
    for pol in policies:
        kinds.setdefault(pol.split(":")[0], pol)
    specs = requests(plan, 0)[:min(4, plan.window_size)]
    for s in specs:
        s.output_len, s.arrival_s = min(s.output_len, 4), 0.0
    for pol in kinds.values():
        replay_policy(pol, serving_of(plan, timeline_every=0), specs, model)
    return time.monotonic() - t


def serving_of(plan: PulsePlan, **changes) -> Serving:
    """How every policy of a pulse plan is served: its strategy, slots and device pool (`changes`: a replay's
    timeline sampling)."""
    return serving(plan, plan.strategy, resident_pool_tokens=plan.resident_pool_tokens, **changes)


def run(plan: PulsePlan, progress_bar: bool = False):
    """`labkit run pulse`: the calibration windows, the choice, then the test windows, into one run folder."""
    t0 = time.monotonic()
    protocol = W.Protocol.of(plan)
    bounds = W.window_bounds(len(load_trace(plan.trace)), plan.windows, plan.window_size, plan.calibration_windows)
    roles = {b["window"]: b["role"] for b in bounds}
    sampled = next(b["window"] for b in bounds if b["role"] == "test")     # the window whose rounds are kept
    before = earlier_run(plan.resume)
    run = sweep.open_run(plan.params, EXPERIMENT, {**plan.params, "policies": ",".join(plan.policies)})
    run.update_manifest(windows=bounds, calibration=[w for w, r in roles.items() if r == "calibration"],
                        test=[w for w, r in roles.items() if r == "test"], selection_rule=W.RULE, sampled_window=sampled,
                        resumed_from=[before["me"], *before["resumed_from"]] if before else [])
    dev = torch.device(plan.device)
    base = {"device": str(dev), "gpu_name": run.manifest.get("gpu_name") or "cpu", "shape": plan.shape,
            "measured_in": run.run_id, "session": envs.get("LABKIT_SESSION"), "git_sha": run.manifest["git_sha"]}
    model = HybridModel(ModelShape.from_name(plan.shape), dev, seed=plan.seed)
    tables = {n: [] for n in ("requests", "rounds", "timeline", "loads")}

    def write_tables():
        for name, rows in tables.items():
            run.write_table(name, pd.DataFrame(rows))

    def replay(w: int, pol: str) -> dict:
        where = {"window": w, "window_role": roles[w]}
        bar.set_postfix_str(f"window {w} ({roles[w]}) {pol}")
        how = serving_of(plan, timeline_every=plan.timeline_every if w == sampled else 0)   # one window's rounds
        try:
            out = replay_policy(pol, how, requests(plan, w), model)
        except Exception as ex:   # noqa: BLE001 - recorded, the next policy runs
            return sweep.failed_row(ex, {**base, "experiment": EXPERIMENT, "policy": pol})
        finally:
            bar.update()
        lane = {r["request_id"]: r.get("lane") for r in out["stats"]["records"]}
        for r in out["records"]:
            tables["requests"].append({"policy": pol, **where, **{k: v for k, v in r.items() if k not in ("text", "token_times")},
                                       "lane": lane.get(r.get("request_id")), "n_token_times": len(r.get("token_times") or [])})
        if w == sampled:
            for r in out["stats"]["rounds"]:
                tables["rounds"].append({"policy": pol, **{k: v for k, v in r.items() if k not in ("batch", "load_bytes")},
                                         **{f"batch_{k}": v for k, v in r["batch"].items()}})
                tables["loads"] += [{"policy": pol, "iteration": r["iteration"], "bytes": b} for b in r.get("load_bytes", [])]
            for t in out["timelines"]:
                tables["timeline"] += [{"policy": pol, "iteration": t["iteration"], "mode": t["mode"], **s} for s in t["spans"]]
        # after every replay: a run cut short (a device session's time limit) keeps what it measured
        write_tables()
        return {**base, **summary_row(pol, plan, how, out, EXPERIMENT), **where}

    def record(row: dict) -> None:
        run.add({k: v for k, v in row.items() if k != "run_id"})

    if plan.warmup:
        warm = [plan.reference, *W.planned(protocol, "calibration", {})]
        run.update_manifest(warmup_s=round(_warm_up(plan, model, warm), 2))
    earlier = before.get("metrics") if before else None
    # the replays planned (a test window runs the reference, each fitted arm's choice and the extra policies)
    fitted = {arm: arm for arm, c in W.candidates(protocol).items() if c}
    total = sum(len(W.planned(protocol, b["role"], fitted)) for b in bounds)
    with sweep.bar(total, EXPERIMENT, progress_bar) as bar:
        out = W.replay_windows(protocol, bounds, replay, record, earlier=earlier, t0=t0)
    keep_earlier(tables, before, out["kept"], sampled)
    write_tables()
    close_windows(run, protocol, out, roles)
    sweep.headline(sweep.summary_lines(lambda: headline(run.metrics(), run.path, plan)), progress_bar, EXPERIMENT)
    return run


def headline(m, path, plan: PulsePlan) -> list[str]:
    """Per policy arm over the test windows: throughput and p99 TPOT against the reference (median of the
    windows); with no test window, each policy's throughput and p99 TPOT."""
    s = pd.read_parquet(path / "window_summary.parquet") if (path / "window_summary.parquet").is_file() else pd.DataFrame()
    if len(s) and "throughput_ratio" in s:
        return [f"test windows, against {plan.reference}: " + ", ".join(
            f"{r['arm']} ({r['policy']}) throughput {r['throughput_ratio']:.2f}x"
            + (f", p99 TPOT {r['tpot_p99_ratio']:.2f}x" if r.get("tpot_p99_ratio") == r.get("tpot_p99_ratio") else "")
            for r in s.to_dict("records") if r["arm"] != "reference")]
    ok = m[(m["experiment"] == EXPERIMENT) & (m["status"] == "ok")]
    per = ok.groupby("policy", sort=False)[["output_throughput", "tpot_ms_p99"]].median()
    return ["per policy: " + ", ".join(f"{pol} {r.output_throughput:,.1f} tok/s (p99 TPOT {r.tpot_ms_p99:.1f} ms)"
                                       for pol, r in per.iterrows())]
