"""A request trace replayed through the scheduler, window by window: what PulseInfer's trace replay (`pulse`) and
its ladder (`pulse_ladder`) share. The trace and its requests per window, one policy's replay (in process or
through `labkit serve` and the load generator) and its summary row, and a run cut at its deadline continued by
whole windows (`find_resume`, `earlier_run`, `keep_earlier`, `close_windows`)."""
from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import pandas as pd

from .. import results
from ..engine.drive.policies import make_policy, needs_costs
from ..engine.drive.scheduler import Request, Scheduler, calibrate, make_lanes
from ..engine.transfer import setting_names, settings_of
from ..params import BadInput
from ..results import effective_status, load_run, manifest_object, run_manifests
from ..serving.latency import summarize
from ..serving.workload import trace_replay
from ..shapes import ModelShape
from . import trace_windows as W
from ..serving.engine_server import EngineLoop, create_app
from ..serving.loadgen import run_load


# The first 1,000 requests (330 s of arrivals) of the Mooncake FAST'25 conversation trace (Apache-2.0,
# kvcache-ai/Mooncake, where the whole hour is), committed in the package: a GPU host gets only the
# repository tree.
TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake-conversation-first1000.jsonl"


# parameters that may differ between a run cut short and the run that resumes it
RESUME_FREE = {"out_dir", "resume", "deadline_s", "trace"}


def _signature(params: dict) -> dict:
    """The parameters a resumed run must share with the run it continues, as the manifest stores them."""
    norm = lambda v: ",".join(str(x) for x in v) if isinstance(v, (list, tuple)) else v   # noqa: E731
    return {k: json.dumps(norm(v), default=str) for k, v in params.items() if k not in RESUME_FREE}


def find_resume(plan: Any, experiment: str) -> str:
    """A plan's `resume`: "" (a fresh run), a run folder, or "auto": the newest `experiment` run under results/
    that did not finish ok and has these parameters (a manifest's, compared with `plan.params`). A folder given
    that is no such run is one line."""
    want = plan.resume.strip()
    if not want:
        return ""
    sig = _signature(plan.params)
    if want != "auto":
        mf = Path(want) / "manifest.json"
        if not mf.is_file():
            raise BadInput(f"resume={want}: not a run folder (no manifest.json)")
        m = json.loads(mf.read_text())
        diff = sorted(k for k in set(sig) | set(_signature(m.get("parameters", {})))
                      if sig.get(k) != _signature(m.get("parameters", {})).get(k))
        if m.get("experiment") != experiment or diff:
            raise BadInput(f"resume={want}: not a {experiment} run of these parameters "
                           f"(differs in {', '.join(diff) or 'experiment'})")
        return str(Path(want))
    found = []
    for mf in run_manifests(results.REPO / "results"):     # read at call time: a test points it elsewhere
        try:
            m = manifest_object(mf)          # a FIFO, a huge file or a JSON list: passed over
        except (OSError, ValueError):
            continue
        if (m.get("experiment") == experiment and effective_status(m) != "ok"
                and _signature(m.get("parameters", {})) == sig):
            found.append((m.get("created") or "", str(mf.parent)))
    return max(found)[1] if found else ""


def requests(plan: Any, window: int = 0, output_scale: float = 1.0) -> list:
    """Window `window`'s requests of a replay's plan (trace requests window x window_size on), arrivals from the
    window's first request / rate, inputs x length_scale, capped to a slot; each request's id is its index in the
    trace. Outputs: the trace's lengths x `output_scale` (the ladder's parameter; 1: as the trace says), capped to
    `max_output` (0: uncapped) and to the slot (capacity - 1); the prompt then gets what the slot leaves."""
    cap, scale, n = plan.capacity, plan.length_scale, plan.window_size
    most, o_scale = plan.max_output, float(output_scale)
    vocab = ModelShape.from_name(plan.shape).vocab
    specs = trace_replay(plan.trace, n, plan.rate, max(2, int(cap / scale)), vocab,
                         max_output=min(most, cap - 1) if most > 0 else 0, start=window * n, seed=plan.seed)
    for s in specs:
        if o_scale != 1.0:
            s.output_len = max(1, round(s.meta["trace_output_length"] * o_scale))
            s.output_len = min(s.output_len, most) if most > 0 else s.output_len
        s.output_len = min(s.output_len, cap - 1)
        m = max(1, min(int(len(s.prompt) * scale), cap - s.output_len))
        s.prompt = [t % vocab for t in s.prompt[:m]]
        s.index += window * n
        s.meta["length_scale"] = scale
    return specs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Serving:
    """How one replay serves a window's requests: the offload lane's strategy and its settings, the lanes' slots
    and pools (0: slots x capacity), the paging, the graphs, the timeline's sampling and the transport. Derived
    from an experiment's plan (`serving`): pulse serves every policy alike, each ladder rung its own way."""
    strategy: str
    resident_slots: int
    offload_slots: int
    capacity: int
    budget: int
    page_size: int
    prefill_chunk: int
    select_block: int
    compile: bool
    graphs: bool
    timeline_every: int
    transport: str
    settings: Mapping[str, Any] = field(default_factory=dict)    # the strategy's own settings, by parameter name
    resident_pool_tokens: int = 0
    offload_pool_tokens: int = 0
    disaggregated: bool = False      # a decode instance: every request's KV arrives prefilled


def serving(plan: Any, strategy: str, settings: Mapping[str, Any] | None = None, **changes) -> Serving:
    """How a replay's `plan` serves with the offload lane's `strategy`: the plan's slots, paging, graphs, timeline
    and transport, the plan's values of that strategy's settings (`settings`: values that replace them), then
    `changes` (a rung's slots and pools)."""
    values = {k: getattr(plan, k) for k in setting_names()} | dict(settings or {})
    mine = {s.param for s in settings_of(strategy)}
    made = {"strategy": strategy, "resident_slots": plan.resident_slots, "offload_slots": plan.offload_slots,
            "capacity": plan.capacity, "budget": plan.budget, "page_size": plan.page_size,
            "prefill_chunk": plan.prefill_chunk, "select_block": plan.select_block, "compile": plan.compile,
            "graphs": plan.graphs, "timeline_every": plan.timeline_every, "transport": plan.transport,
            "settings": {k: v for k, v in values.items() if k in mine}}
    return Serving(**{**made, **changes})


def replay_policy(policy: str, how: Serving, specs: list, model) -> dict:
    """One policy served `how` says: a server on a free port, the load generator against it (or the scheduler in
    process); returns records and stats."""
    lanes = make_lanes(model.shape, model.device, how.resident_slots, how.offload_slots, capacity=how.capacity,
                       budget=how.budget, strategy=how.strategy, page_size=how.page_size,
                       prefill_chunk=how.prefill_chunk, model=model, compile=how.compile,
                       resident_pool_tokens=how.resident_pool_tokens or None, select_block=how.select_block,
                       offload_pool_tokens=how.offload_pool_tokens or None, settings=dict(how.settings))
    costs = calibrate(lanes, graphs=how.graphs) if needs_costs(policy) else None
    switching = not policy.startswith("noswitch:")
    sched = Scheduler(lanes, make_policy(policy, costs), switching=switching,
                      timeline_every=how.timeline_every, graphs=how.graphs)
    for s in specs:      # every request must fit where the policy may put it: one line before anything runs
        sched.validate(Request(s.prompt, s.output_len, id=str(s.index)))
    # a decode instance of a disaggregated deployment: each request's KV arrives prefilled (`Request.prefilled`)
    handed = how.disaggregated
    if handed and how.transport != "inprocess":
        raise BadInput("disaggregated replays run in process (transport=inprocess): the server takes prompts")
    if how.transport == "inprocess":
        # the same scheduler on its own clock: arrivals at the trace's times, records in the load
        # generator's format (`Request.record`); no HTTP or streaming overhead in the latencies
        done = sched.run([Request(s.prompt, s.output_len, arrival=s.arrival_s, id=str(s.index), prefilled=handed)
                          for s in specs])
        recs = [r.record() for r in done]
        stats = {"records": recs, "rounds": list(sched.rounds), "graphs": sched.graphs, "graph_error": sched.graph_error,
                 "prefill_forwards": sched.prefill_forwards, "handovers": sched.handovers,
                 "handover_s": sched.handover_s}
        return {"records": recs, "stats": stats, "timelines": list(sched.timelines), "costs": costs}
    # the http transport's packages (httpx, uvicorn, the server's fastapi): optional, transport=auto runs in-process
    # without them, so a replay never needs them installed
    import httpx
    import uvicorn

    loop = EngineLoop(sched, keep=None).start()     # every record and round of the replay: the row sums them
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(loop, "labkit"), host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() - t0 > 60:
            raise RuntimeError("labkit server did not start")
        time.sleep(0.1)
    try:
        recs = run_load(url, "labkit", specs, concurrency=0)
        stats = httpx.get(url + "/stats", timeout=30).json()
        tls = httpx.get(url + "/timeline", timeout=30).json()["timelines"]
    finally:
        srv.should_exit = True
        th.join(timeout=10)
        loop.stop()
    return {"records": recs, "stats": stats, "timelines": tls, "costs": costs}


def summary_row(policy: str, plan: Any, how: Serving, out: dict, experiment: str) -> dict:
    """One metrics row of a replay of `plan` served `how`: latency statistics (`serving.latency.summarize`), lanes,
    switches, stalls, the GPU stall share of the sampled rounds, link bytes and copies, the most requests running
    at once."""
    recs, st = out["records"], out["stats"]
    s = summarize(recs, slo_tpot_ms=plan.tpot_slo_ms)
    lanes = [r.get("lane") for r in st["records"]]
    rounds = st["rounds"]
    copies = sum(r.get("copies", 0) for r in rounds)
    moved = [r for r in rounds if r["h2d_bytes"]]         # the decode steps that crossed the link
    stall = span = 0.0
    for t in out["timelines"]:
        sp = t["spans"]
        if sp:
            span += max(x["end_ms"] for x in sp) - min(x["start_ms"] for x in sp)
            stall += sum(x["end_ms"] - x["start_ms"] for x in sp if x["kind"] == "stall")
    row = {"experiment": experiment, "status": "ok" if s["failed"] == 0 else "partial", "error": None,
           "strategy": how.strategy, "policy": policy, "switching": not policy.startswith("noswitch:"),
           "budget": how.budget, "concurrency": how.resident_slots + how.offload_slots,
           "tok_s": s["output_throughput"], "step_ms_median": s["tpot_ms_median"],
           "share_offloaded": (sum(x == "offload" for x in lanes) / len(lanes)) if lanes else None,
           "switched_rounds": sum(r["mode"] == "switched" for r in rounds), "rounds": len(rounds),
           "switches": sum(r["switches"] for r in rounds), "stalls": sum(r["stalls"] for r in rounds),
           "gpu_stall_share_sampled": stall / span if span else None,
           "h2d_bytes_total": sum(r["h2d_bytes"] for r in rounds),
           # transfer sizes: what per-copy costs scale with (copies counted by the strategies)
           "copies_total": copies, "bytes_per_copy": sum(r["h2d_bytes"] for r in rounds) / copies if copies else None,
           "copies_per_step": copies / len(moved) if moved else None,
           "max_running": max((sum(r["batch"].values()) for r in rounds), default=0),
           "graphs": st.get("graphs"), "graph_error": st.get("graph_error"),
           "first_round_s": rounds[0]["time"] if rounds else None,
           # arrived but not admitted (no slot or no pages), at most: what a memory cap makes wait
           "max_waiting": max((r.get("waiting", 0) for r in rounds), default=0),
           # a decode instance: prefill forwards run (0), requests handed over, the seconds their KV took to
           # place (off the scheduler's clock, so outside every timed figure); None: not recorded (http)
           "disaggregated": how.disaggregated, "prefill_forwards": st.get("prefill_forwards"),
           "handovers": st.get("handovers"), "handover_s": st.get("handover_s"),
           "rate": plan.rate, "length_scale": plan.length_scale, "n_requests": len(recs), "transport": how.transport,
           **s}
    if out["costs"] is not None:
        row.update({f"cost_{k}": v for k, v in out["costs"].__dict__.items()})
    return row


def earlier_run(path: str) -> dict:
    """A run cut short that this one continues: its metrics and per-window tables ({} for a fresh run)."""
    if not path:
        return {}
    lr = load_run(path)
    out = {n: lr.table(n) for n in ("metrics", "requests", "rounds", "timeline", "loads")}
    mf = lr.manifest
    # a device plan names its folder the same in every call: the session and the time tell the calls apart
    out["me"] = {k: mf.get(k) for k in ("run_id", "session", "created", "git_sha")}
    out["resumed_from"] = mf.get("resumed_from") or []
    return out


def keep_earlier(tables: dict, before: dict | None, kept: list, sampled: int) -> None:
    """Put in front of this run's tables what the earlier run measured on the windows kept from it."""
    for w in kept:
        for name in tables:
            t = before.get(name, pd.DataFrame())
            if name == "requests" and len(t):
                tables[name] = t[t["window"] == w].to_dict("records") + tables[name]
            elif w == sampled and len(t):
                tables[name] = t.to_dict("records") + tables[name]


def close_windows(run, protocol: W.Protocol, out: dict, roles: dict, ratios=None) -> None:
    """The per-window ratios (`ratios`, or the arms' to the reference), their summary and the choice; the run's
    status (a stopped run names the windows a resume still has to replay). The ladder closes through it too."""
    ratios = W.window_ratios(run.metrics(), protocol, out["chosen"], roles) if ratios is None else ratios
    run.write_table("window_ratios", ratios)
    run.write_table("window_summary", W.summarize(ratios))
    run.write_table("selection", out["selection"])
    run.update_manifest(chosen=out["chosen"], complete_windows=out["complete"], kept_windows=out["kept"],
                        measured_windows=sorted({w for w, _ in out["order"]}))
    if out["stopped"]:
        left = [w for w in roles if w not in out["complete"]]
        run.finish(error=f"{out['stopped']}: windows {', '.join(map(str, left))} not replayed (resume=auto continues)")
    else:
        run.finish()
