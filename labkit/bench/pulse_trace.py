"""`labkit run pulse`: the Mooncake conversation trace replayed against `labkit serve`, one placement
policy at a time (PulseInfer).

For each policy a fresh engine server (the same seeded model, empty pools) is started on 127.0.0.1 and
the load generator that drives vLLM (`labkit.serving.loadgen.run_load`, open loop at the trace's arrival
times divided by `rate`) sends the requests. Trace lengths are multiplied by `length_scale` and capped
to what a slot holds (`capacity`); the scaling used is recorded in the manifest and every row.

Policies: `adaptive` (measured costs, `scheduler.calibrate`), `threshold:N` (offload prompt + output
> N tokens, switching on), `noswitch:N` (the same placement, batches run one after the other: "offload
every long request, no switching"), `resident`, `offload`.

Run folder: `metrics.parquet` (one row per policy: vLLM's TTFT/TPOT/ITL/E2EL statistics, throughput,
goodput at `tpot_slo_ms`, share of requests offloaded, switches, stalls, GPU stall share of the sampled
rounds, link bytes), `requests.parquet` (the load generator's records + lane), `rounds.parquet` (per
decode iteration), `timeline.parquet` (sampled rounds' spans), `loads.parquet` (bytes per load).
"""
from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from ..shapes import REFERENCE_BUDGET
from ..params import BadInput, one_line, resolve_device

EXPERIMENT = "pulse"
# The first 1,000 requests (330 s of arrivals) of the Mooncake FAST'25 conversation trace (Apache-2.0,
# kvcache-ai/Mooncake, where the whole hour is), committed in
# the package: a GPU host gets only the repository tree, and the default replay uses the first 64.
TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake-conversation-first1000.jsonl"


DEFAULTS = {"cuda": dict(shape="qwen3.8-flash-next", n_requests=64, length_scale=1.0, max_output=128, capacity=131072,
                         budget=REFERENCE_BUDGET, tpot_slo_ms=50.0, page_size=256, prefill_chunk=8192),
            "cpu": dict(shape="tiny", n_requests=8, length_scale=1 / 200, max_output=6, capacity=512, budget=16,
                        tpot_slo_ms=2000.0, page_size=16, prefill_chunk=64)}


def _params(given: dict) -> dict:
    p = dict(given)
    dev = resolve_device(p["device"])
    d = DEFAULTS["cuda" if dev.type == "cuda" else "cpu"]
    for k, v in d.items():
        if p[k] in (0, 0.0, "auto", ""):
            p[k] = v
    p["trace"] = p["trace"] or str(TRACE)
    if p["rate"] <= 0:
        raise BadInput(f"rate must be > 0, got {p['rate']}")
    if p["length_scale"] <= 0:
        raise BadInput(f"length_scale must be > 0, got {p['length_scale']}")
    for k in ("n_requests", "max_output", "capacity", "budget", "page_size", "prefill_chunk"):
        if p[k] <= 0:
            raise BadInput(f"{k} must be > 0, got {p[k]}")
    if p["select_block"] < 1 or p["budget"] % p["select_block"] or p["page_size"] % p["select_block"]:
        raise BadInput(f"select_block must be >= 1 and divide budget ({p['budget']}) and page_size "
                       f"({p['page_size']}), got {p['select_block']}")
    from ..engine.transfer import STRATEGIES, get_strategy, setting_names, settings_of
    if p["strategy"] not in STRATEGIES:
        raise BadInput(f"unknown strategy {p['strategy']!r}: choose from {', '.join(STRATEGIES)}")
    try:                                  # its settings' values, as the strategy itself checks them
        get_strategy(p["strategy"], **{k: p[k] for k in setting_names()})
    except ValueError as ex:
        raise BadInput(str(ex)) from None
    # a setting given away from its default must be one the offload strategy has
    from ..engine.transfer import strategy_params
    mine = {s.param for s in settings_of(p["strategy"])}
    for sp in strategy_params():
        if p[sp.name] != sp.default and sp.name not in mine:
            users = [n for n, c in STRATEGIES.items() if any(s.param == sp.name for s in c.SETTINGS)]
            raise BadInput(f"{sp.name} applies to strategy {', '.join(users)}, not {p['strategy']}")
    if p["transport"] == "auto":
        import importlib.util
        have = all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "httpx"))
        p["transport"] = "http" if have else "inprocess"
    if p["transport"] not in ("http", "inprocess"):
        raise BadInput(f"transport must be http, inprocess or auto, got {p['transport']!r}")
    if p["resident_slots"] < 0 or p["offload_slots"] < 0 or p["resident_slots"] + p["offload_slots"] == 0:
        raise BadInput("resident_slots and offload_slots must be >= 0, not both 0")
    from ..engine.drive.scheduler import Costs, parse_policy
    for pol in p["policies"]:
        parse_policy(pol.replace("noswitch:", "threshold:"), Costs(0, 0, 0))
    if p["resident_slots"] and p["resident_pool_tokens"] and p["resident_pool_tokens"] < p["capacity"]:
        # a request of `capacity` tokens placed resident could never get its pages: say so now, not
        # as a failed policy row after the pools are allocated
        raise BadInput(f"resident_pool_tokens {p['resident_pool_tokens']} is below the {p['capacity']} tokens a "
                       "request slot holds (capacity): lower capacity or raise the pool")
    p["device"] = str(dev)
    return p


def check(given: dict) -> dict:
    """Validate resolved parameters, trace included, and decide the "auto" ones before anything is
    allocated (one line on bad input)."""
    p = _params(given)
    requests(p)
    return p


def requests(p: dict) -> list:
    """The trace's first `n_requests`, arrivals / rate, inputs x length_scale, capped to a slot."""
    from ..serving.workload import load_trace, trace_replay
    from ..shapes import ModelShape
    rows = load_trace(p["trace"])[:p["n_requests"]]
    for i, r in enumerate(rows):
        if r["timestamp"] < 0 or r["input_length"] < 1 or r["output_length"] < 1:
            raise BadInput(f"trace {p['trace']}: request {i} has a negative time or a length < 1")
    cap, scale = p["capacity"], p["length_scale"]
    vocab = ModelShape.from_name(p["shape"]).vocab
    specs = trace_replay(p["trace"], p["n_requests"], p["rate"], max(2, int(cap / scale)), vocab,
                         max_output=min(p["max_output"], cap - 1), seed=p["seed"])
    for s in specs:
        n = max(1, min(int(len(s.prompt) * scale), cap - s.output_len))
        s.prompt = [t % vocab for t in s.prompt[:n]]
        s.meta["length_scale"] = scale
    return specs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replay_policy(policy: str, p: dict, specs: list, model) -> dict:
    """One policy: a server on a free port, the load generator against it; returns records and stats."""
    from ..engine.drive.scheduler import Scheduler, calibrate, make_lanes, parse_policy
    from ..engine.transfer import setting_names, settings_of
    lanes = make_lanes(model.shape, model.device, p["resident_slots"], p["offload_slots"], capacity=p["capacity"],
                       budget=p["budget"], strategy=p["strategy"], page_size=p["page_size"],
                       prefill_chunk=p["prefill_chunk"], model=model, compile=p["compile"],
                       resident_pool_tokens=p["resident_pool_tokens"] or None, select_block=p["select_block"],
                       settings={k: p[k] for k in setting_names() if k in {s.param for s in settings_of(p["strategy"])}})
    costs = calibrate(lanes, graphs=p["graphs"]) if policy == "adaptive" else None
    switching = not policy.startswith("noswitch:")
    sched = Scheduler(lanes, parse_policy(policy.replace("noswitch:", "threshold:"), costs), switching=switching,
                      timeline_every=p["timeline_every"], graphs=p["graphs"])
    from ..engine.drive.scheduler import Request
    for s in specs:      # every request must fit where the policy may put it: one line before anything runs
        sched.validate(Request(s.prompt, s.output_len, id=str(s.index)))
    if p["transport"] == "inprocess":
        # the same scheduler on its own clock: arrivals at the trace's times, records in the load
        # generator's format (`Request.record`); no HTTP or streaming overhead in the latencies
        done = sched.run([Request(s.prompt, s.output_len, arrival=s.arrival_s, id=str(s.index)) for s in specs])
        recs = [r.record() for r in done]
        stats = {"records": recs, "rounds": list(sched.rounds), "graphs": sched.graphs, "graph_error": sched.graph_error}
        return {"records": recs, "stats": stats, "timelines": list(sched.timelines), "costs": costs}
    import httpx
    import uvicorn

    from ..serving.engine_server import EngineLoop, create_app
    from ..serving.loadgen import run_load
    loop = EngineLoop(sched).start()
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


def _summary(policy: str, p: dict, out: dict) -> dict:
    from ..serving.latency import summarize
    recs, st = out["records"], out["stats"]
    s = summarize(recs, slo_tpot_ms=p["tpot_slo_ms"])
    lanes = [r.get("lane") for r in st["records"]]
    rounds = st["rounds"]
    stall = span = 0.0
    for t in out["timelines"]:
        sp = t["spans"]
        if sp:
            span += max(x["end_ms"] for x in sp) - min(x["start_ms"] for x in sp)
            stall += sum(x["end_ms"] - x["start_ms"] for x in sp if x["kind"] == "stall")
    row = {"experiment": EXPERIMENT, "status": "ok" if s["failed"] == 0 else "partial", "error": None,
           "strategy": p["strategy"], "policy": policy, "switching": not policy.startswith("noswitch:"),
           "budget": p["budget"], "concurrency": p["resident_slots"] + p["offload_slots"],
           "tok_s": s["output_throughput"], "step_ms_median": s["tpot_ms_median"],
           "share_offloaded": (sum(x == "offload" for x in lanes) / len(lanes)) if lanes else None,
           "switched_rounds": sum(r["mode"] == "switched" for r in rounds), "rounds": len(rounds),
           "switches": sum(r["switches"] for r in rounds), "stalls": sum(r["stalls"] for r in rounds),
           "gpu_stall_share_sampled": stall / span if span else None,
           "h2d_bytes_total": sum(r["h2d_bytes"] for r in rounds),
           "graphs": st.get("graphs"), "graph_error": st.get("graph_error"),
           "rate": p["rate"], "length_scale": p["length_scale"], "n_requests": len(recs), "transport": p["transport"],
           **s}
    if out["costs"] is not None:
        row.update({f"cost_{k}": v for k, v in out["costs"].__dict__.items()})
    return row


def run(p: dict, progress_bar: bool = False):
    """`labkit run pulse`: every policy over the same trace slice into one run folder."""
    import pandas as pd
    import torch

    from ..engine.model.hybrid import HybridModel
    from ..results import Run
    from ..shapes import ModelShape
    specs = requests(p)
    run = Run.create(p["out_dir"] or None, EXPERIMENT, {**p, "policies": ",".join(p["policies"])})
    dev = torch.device(p["device"])
    base = {"device": str(dev), "gpu_name": run.manifest.get("gpu_name") or "cpu", "shape": p["shape"]}
    model = HybridModel(ModelShape.from_name(p["shape"]), dev, seed=p["seed"])
    reqs, rounds, spans, loads = [], [], [], []
    for pol in p["policies"]:
        try:
            out = replay_policy(pol, p, specs, model)
        except Exception as ex:   # noqa: BLE001 - recorded, the next policy runs
            run.add({**base, "experiment": EXPERIMENT, "policy": pol, "status": "failed", "error": one_line(ex)})
            continue
        run.add({**base, **_summary(pol, p, out)})
        lane = {r["request_id"]: r.get("lane") for r in out["stats"]["records"]}
        for r in out["records"]:
            reqs.append({"policy": pol, **{k: v for k, v in r.items() if k not in ("text", "token_times")},
                         "lane": lane.get(r.get("request_id")), "n_token_times": len(r.get("token_times") or [])})
        for r in out["stats"]["rounds"]:
            rounds.append({"policy": pol, **{k: v for k, v in r.items() if k not in ("batch", "load_bytes")},
                           **{f"batch_{k}": v for k, v in r["batch"].items()}})
            loads += [{"policy": pol, "iteration": r["iteration"], "bytes": b} for b in r.get("load_bytes", [])]
        for t in out["timelines"]:
            spans += [{"policy": pol, "iteration": t["iteration"], "mode": t["mode"], **s} for s in t["spans"]]
        # after every policy: a run cut short (a device session's time limit) keeps what it measured
        for name, rows in (("requests", reqs), ("rounds", rounds), ("timeline", spans), ("loads", loads)):
            run.write_table(name, pd.DataFrame(rows))
    for name, rows in (("requests", reqs), ("rounds", rounds), ("timeline", spans), ("loads", loads)):
        run.write_table(name, pd.DataFrame(rows))
    run.finish()
    return run

