"""The head's side of a cluster run, and the task each node runs.

One job = one run (`labkit run X --cluster`) or one plan entry on one machine kind (`labkit nightly
--cluster`). Each job is a Ray task asking for `gpu:<kind>` (or `cpu_only`) times the GPUs its experiment
needs, the head's commit (`labkit@<sha>`) and, on boxes whose GPUs Ray sees, as many of Ray's GPUs (so Ray
sets CUDA_VISIBLE_DEVICES). On the node the task runs the `labkit` command (`labkit run ...`, `labkit nightly --only ...`) in the node's checkout as a
subprocess (dying with its parent), sends a tar snapshot of the folder to the head every few seconds while
it runs, and returns the finished folder as a tar archive; the head unpacks it where a local run would
have written it and adds a `cluster` section to its manifest (node, kind, GPU, link, attempt, transfer).

Faults, all decided on the head:
- a node that dies mid-job: the attempt's last snapshot is kept as `<folder>.attempt-N` (with
  `attempt.json` saying where and why), and the job is submitted again while a node of its kind at the
  head's commit is alive (at most `retries` times); otherwise it is recorded `failed` with the reason;
- a job nobody can run (no node of the kind at the commit is left) is cancelled and recorded, never waited
  on forever;
- Ctrl-C: every running job is asked to stop (its `labkit` gets SIGTERM and settles its folder as
  `interrupted`), the folders come back, jobs not started are cancelled; a second Ctrl-C cancels at once.
"""
from __future__ import annotations

import ctypes
import datetime as dt
import hashlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .. import envs, nightly as N
from ..atomic import write_text
from ..experiments import EXPERIMENTS, get
from ..nightly import DONE, EVERY_KIND
from ..outdir import make_own_folder
from ..params import BadInput, resolve
from ..report.index import rebuild_index
from . import (COMMIT_PREFIX, CPU_ONLY, GPU_PREFIX, checkout_commit, commit_resource, gpus_needed, kind_resource,
               token_auth_env)

token_auth_env()        # before Ray is imported: it reads the mode once
import ray  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

STOP_GRACE_S = 60          # how long a stopped job may take to settle its folder before it is cancelled
FEASIBLE_EVERY_S = 5       # how often the head checks that a waiting job still has a node to run on


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# ------------------------------------------------------------------------------------------ connecting
def connect(address: str) -> None:
    """Join the cluster as a driver (token authentication: `token_auth_env`, set when this module loads)."""
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    except Exception as ex:
        line = (str(ex).strip().splitlines() or [type(ex).__name__])[0]
        raise BadInput(f"--cluster {address}: cannot join the cluster ({line[:200]})") from None


def nodes() -> list[dict]:
    """The alive nodes: id, ip, host, kind, slots (GPUs of the kind, or 1), commit, whether Ray sees GPUs."""
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources") or {}
        kinds = [k[len(GPU_PREFIX):] for k in res if k.startswith(GPU_PREFIX)]
        commits = [k[len(COMMIT_PREFIX):] for k in res if k.startswith(COMMIT_PREFIX)]
        kind = kinds[0] if kinds else ("cpu" if CPU_ONLY in res else None)
        out.append({"id": n["NodeID"], "ip": n.get("NodeManagerAddress"), "host": n.get("NodeManagerHostname"),
                    "kind": kind, "slots": res.get(kind_resource(kind), 0) if kind else 0,
                    "commit": commits[0] if commits else None, "ray_gpus": res.get("GPU", 0)})
    return out


def kinds_present(ns: list[dict], commit: str) -> list[str]:
    """Kinds with a node at `commit`: GPU kinds by name, then cpu."""
    ks = {n["kind"] for n in ns if n["kind"] and n["commit"] == commit}
    return sorted(ks - {"cpu"}) + (["cpu"] if "cpu" in ks else [])


def refusals(ns: list[dict], commit: str) -> list[str]:
    """One line per labkit node whose checkout is at another commit: it is given no work."""
    return [f"node {n['host']} ({n['ip']}, {n['kind']}) is at commit {n['commit']}, this head at {commit}: "
            f"it refuses work until its checkout is at {commit}"
            for n in ns if n["kind"] and n["commit"] and n["commit"] != commit]


# ------------------------------------------------------------------------------------------ the node's side
def _die_with_parent() -> None:
    """In the child: SIGTERM when the Ray worker that started it dies (a node killed or a task cancelled leaves
    no orphan `labkit` process; SIGTERM lets it settle its folder as `interrupted`)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)    # PR_SET_PDEATHSIG
    except Exception:
        pass


def _tar(folder: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=3) as t:
        t.add(folder, arcname=folder.name)
    return buf.getvalue()


def _untar(data: bytes, dest: Path) -> None:
    """Unpack a folder sent by a node as `dest` (members stay inside it; nothing outside is written)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as t:
            t.extractall(tmp, filter="data")
        inner = [p for p in tmp.iterdir()]
        if len(inner) != 1 or not inner[0].is_dir():
            raise ValueError("the node sent no single folder")
        inner[0].rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _node_info() -> dict:
    kind = envs.get("LABKIT_NODE_KIND")
    info = {"host": socket.gethostname(), "ip": ray.util.get_node_ip_address(), "kind": kind,
            "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    return info


def run_job(job: dict, tracker) -> dict:
    """Runs on a node: the job's `labkit` command in this node's checkout; returns its folder as tar bytes.
    A node whose commit is not the head's refuses (one line)."""
    mine = envs.get("LABKIT_NODE_COMMIT") or checkout_commit()
    now = checkout_commit()
    info = _node_info()
    if mine != job["commit"] or now != job["commit"]:
        at = now if now != job["commit"] else mine
        return {"refused": f"node {info['host']} ({info['ip']}, {info['kind'] or 'no kind'}) is at commit {at}, "
                           f"the head at {job['commit']}: it refuses work", "node": info}
    if ray.get(tracker.stopping.remote()):
        return {"not_started": "the head stopped before this job started", "node": info}
    repo = Path(envs.get("LABKIT_NODE_REPO") or Path(__file__).resolve().parents[2])
    scratch = Path(envs.get("LABKIT_NODE_SCRATCH") or tempfile.gettempdir()) / "labkit-cluster"
    make_own_folder(scratch, "node scratch folder")     # in /tmp: refused if another user made it first
    work = scratch / f"{job['key']}.{job['attempt']}.{uuid.uuid4().hex[:8]}"
    work.mkdir()
    if job.get("plan_text"):
        (work / "plan.toml").write_text(job["plan_text"])
    argv = [sys.executable, "-m", "labkit", *[x.replace("{work}", str(work)) for x in job["argv"]]]
    folder = work / job["folder"]
    info["folder_on_node"] = str(folder)
    started = time.time()
    ray.get(tracker.started.remote(job["key"], job["attempt"], info))
    env = dict(os.environ)
    env["LABKIT_PLAIN_PROGRESS"] = "1"                   # the child's bars as plain lines in node-output.txt
    if envs.get("LABKIT_NODE_KIND"):      # a labkit node: the box's own thread count, not Ray's one per worker
        omp = envs.get("LABKIT_NODE_OMP_NUM_THREADS")
        env.pop("OMP_NUM_THREADS", None) if not omp else env.update(OMP_NUM_THREADS=omp)
    with open(work / "node-output.txt", "w") as out:
        proc = subprocess.Popen(argv, cwd=repo, stdout=out, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=_die_with_parent)
        last_snap, stop_at = time.time(), None
        while proc.poll() is None:
            time.sleep(0.5)
            if stop_at is None and ray.get(tracker.stopping.remote()):
                proc.send_signal(signal.SIGTERM)          # the run settles its folder as `interrupted`
                stop_at = time.time()
            elif stop_at is not None and time.time() - stop_at > STOP_GRACE_S - 10:
                proc.kill()
            if folder.is_dir() and time.time() - last_snap >= job["snapshot_s"]:
                try:
                    tracker.snapshot.remote(job["key"], job["attempt"], _tar(folder), time.time())
                except Exception:        # a file being written as it was read: the next snapshot has it
                    pass
                last_snap = time.time()
    tail = (work / "node-output.txt").read_text(errors="replace")[-3000:]
    result = {"rc": proc.returncode, "node": info, "wall_s": round(time.time() - started, 1), "output_tail": tail,
              "stopped": stop_at is not None}
    if folder.is_dir():
        t0 = time.time()
        result["tar"] = _tar(folder)
        result["pack_s"] = round(time.time() - t0, 3)
    shutil.rmtree(work, ignore_errors=True)
    return result


@ray.remote(num_cpus=0)
class Tracker:
    """Lives beside the head's driver: where each attempt runs, its latest folder snapshot, the stop flag."""

    def __init__(self):
        self.stop = False
        self.where: dict = {}
        self.snaps: dict = {}
        self.news: list = []

    def started(self, key, attempt, info):
        self.where[(key, attempt)] = {**info, "started": _now()}
        self.news.append((key, attempt, self.where[(key, attempt)]))

    def news_since(self, n):
        return self.news[n:]

    def snapshot(self, key, attempt, data, when):
        self.snaps[(key, attempt)] = (data, when)

    def stopping(self):
        return self.stop

    def request_stop(self):
        self.stop = True

    def attempt(self, key, attempt):
        return self.where.get((key, attempt)), self.snaps.pop((key, attempt), None)


# ------------------------------------------------------------------------------------------ the head's side
@dataclass
class Job:
    key: str                  # unique name, also the folder name's stem on the node
    kind: str
    gpus: int
    argv: list                # `labkit` arguments, "{work}" standing for the node's work folder
    folder: str               # the folder to send back, relative to the work folder
    dest: Path                # where it lands on the head
    plan_text: str = ""
    attempt: int = 1
    earlier: list = field(default_factory=list)
    ref: object = None
    submitted: float = 0.0


@dataclass
class Outcome:
    job: Job
    status: str               # ok, partial, failed, interrupted, refused, not started
    error: str | None
    node: dict | None
    result: dict | None


class Dispatcher:
    def __init__(self, commit: str, echo=print, retries: int = 2, snapshot_s: float = 5.0):
        self.commit, self.echo, self.retries, self.snapshot_s = commit, echo, retries, snapshot_s
        here = ray.get_runtime_context().get_node_id()
        self.tracker = Tracker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()
        self.task = ray.remote(run_job)

    def _feasible(self, job: Job, ns: list[dict] | None = None) -> bool:
        ns = nodes() if ns is None else ns
        return any(n["kind"] == job.kind and n["commit"] == self.commit and n["slots"] >= job.gpus for n in ns)

    def submit(self, job: Job, ns: list[dict] | None = None) -> None:
        ns = nodes() if ns is None else ns
        of_kind = [n for n in ns if n["kind"] == job.kind and n["commit"] == self.commit]
        real = bool(of_kind) and all(n["ray_gpus"] >= n["slots"] for n in of_kind) and job.kind != "cpu"
        spec = {"key": job.key, "attempt": job.attempt, "commit": self.commit, "argv": job.argv,
                "folder": job.folder, "plan_text": job.plan_text, "snapshot_s": self.snapshot_s}
        job.ref = self.task.options(num_cpus=0, num_gpus=job.gpus if real else 0, max_retries=0,
                                    resources={kind_resource(job.kind): job.gpus if job.kind != "cpu" else 1,
                                               commit_resource(self.commit): 0.001}).remote(spec, self.tracker)
        job.submitted = time.time()

    def _keep_attempt(self, job: Job, why: str) -> str | None:
        """The lost attempt's last snapshot as `<dest>.attempt-N` beside where the job lands."""
        where, snap = ray.get(self.tracker.attempt.remote(job.key, job.attempt))
        n = 1
        while (job.dest.parent / f"{job.dest.name}.attempt-{n}").exists():
            n += 1
        keep = job.dest.parent / f"{job.dest.name}.attempt-{n}"
        keep.parent.mkdir(parents=True, exist_ok=True)
        if snap is not None:
            _untar(snap[0], keep)
        else:
            keep.mkdir()
        write_text(keep / "attempt.json", json.dumps(
            {"attempt": job.attempt, "node": where, "error": why, "lost": _now(),
             "snapshot_taken": dt.datetime.fromtimestamp(snap[1], dt.timezone.utc).isoformat(timespec="seconds")
             if snap else None,
             "note": "the folder as it was at its last snapshot before the attempt was lost" if snap
             else "no snapshot reached the head before the attempt was lost"}, indent=1))
        return keep.name

    def land(self, job: Job, res: dict) -> Outcome:
        node = res.get("node")
        if "refused" in res:
            return Outcome(job, "refused", res["refused"], node, res)
        if "not_started" in res:
            return Outcome(job, "not started", res["not_started"], node, res)
        if job.dest.exists():
            n = 1
            while (job.dest.parent / f"{job.dest.name}.attempt-{n}").exists():
                n += 1
            job.dest.rename(job.dest.parent / f"{job.dest.name}.attempt-{n}")
            job.earlier.append(f"{job.dest.name}.attempt-{n}")
        if "tar" not in res:
            return Outcome(job, "failed", f"the node's labkit exited {res['rc']} without a folder: "
                           + (res["output_tail"].strip().splitlines() or [""])[-1][:300], node, res)
        t0 = time.time()
        job.dest.parent.mkdir(parents=True, exist_ok=True)
        _untar(res["tar"], job.dest)
        mf_path = job.dest / "manifest.json"
        status, error = ("ok" if res["rc"] == 0 else "failed"), None
        if mf_path.is_file():
            mf = json.loads(mf_path.read_text())
            link = (f"PCIe gen{mf['pcie_gen']} x{mf['pcie_width']}" if mf.get("pcie_gen") else None)
            mf["cluster"] = {"node": node["host"], "node_ip": node["ip"], "kind": job.kind,
                             "gpu": mf.get("gpu_name"), "link": link, "head": socket.gethostname(),
                             "attempt": job.attempt, "earlier_attempts": job.earlier,
                             "cuda_visible_devices": node.get("cuda_visible_devices"),
                             "transfer_bytes": len(res["tar"]), "pack_s": res.get("pack_s"),
                             "landed_s": round(time.time() - t0, 3), "node_wall_s": res.get("wall_s")}
            if mf.get("status", "running") == "running":
                # its process ended without settling the folder (a signal before its handlers were in place,
                # or killed): say so here, or the head would show it running forever (its writer is elsewhere)
                mf["status"] = "interrupted" if res.get("stopped") else "failed"
                mf["error"] = mf.get("error") or (f"stopped by the head before the run settled its folder (exit "
                                                  f"{res['rc']})" if res.get("stopped") else
                                                  f"the run's process exited {res['rc']} without settling its folder")
            write_text(mf_path, json.dumps(mf, indent=1, default=str))
            status = mf.get("status", status)
        if res.get("stopped") and status not in ("ok", "partial"):
            status = "interrupted"
        if res["rc"] != 0 and status == "ok":
            status = "failed"
        if status != "ok":
            error = (res["output_tail"].strip().splitlines() or [""])[-1][:300]
        return Outcome(job, status, error, node, res)

    def run(self, jobs: list[Job], on_done) -> list[Outcome]:
        """Submit every job (Ray queues those without a free node) and land each as it ends; `on_done(outcome)`
        is called for each. Returns the outcomes; raises KeyboardInterrupt after settling on Ctrl-C."""
        ns = nodes()
        outcomes, pending = [], {}
        for job in jobs:
            if not self._feasible(job, ns):
                o = Outcome(job, "failed", f"no node of kind {job.kind} with {job.gpus} GPU(s) at commit {self.commit} "
                                           f"in the cluster", None, None)
                outcomes.append(o)
                on_done(o)
                continue
            self.submit(job, ns)
            pending[job.ref] = job
        last_check, seen = time.time(), 0
        names = {j.key: j for j in jobs}
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
                for key, attempt, where in ray.get(self.tracker.news_since.remote(seen)):
                    seen += 1
                    self.echo(f"{names[key].dest.name}: started on {where['host']} ({where['ip']}, node "
                              f"{where['node_id'][:8]}) [{names[key].kind}, attempt {attempt}]")
                for ref in ready:
                    job = pending.pop(ref)
                    o = self._finish(job, ref)
                    if o is None:                        # resubmitted after a lost node
                        pending[job.ref] = job
                        continue
                    outcomes.append(o)
                    on_done(o)
                if time.time() - last_check >= FEASIBLE_EVERY_S:
                    last_check, ns = time.time(), nodes()
                    for ref, job in list(pending.items()):
                        if not self._feasible(job, ns):
                            ray.cancel(ref, force=True)
                            pending.pop(ref)
                            o = Outcome(job, "failed", f"no node of kind {job.kind} at commit {self.commit} is left "
                                                       f"to run it", None, None)
                            outcomes.append(o)
                            on_done(o)
        except KeyboardInterrupt:
            self._stop(pending, outcomes, on_done)
            raise
        return outcomes

    def _finish(self, job: Job, ref) -> Outcome | None:
        try:
            res = ray.get(ref)
        except ray.exceptions.RayTaskError as ex:          # the task's own code raised: not a node fault
            return Outcome(job, "failed", f"on the node: {str(ex).strip().splitlines()[-1][:300]}", None, None)
        except ray.exceptions.RayError as ex:              # the node or its worker died, the task was lost
            why = f"{type(ex).__name__}: " + (str(ex).strip().splitlines() or [""])[0][:200]
            kept = self._keep_attempt(job, why)
            job.earlier.append(kept)
            if job.attempt <= self.retries and self._feasible(job):
                self.echo(f"{job.dest.name}: attempt {job.attempt} lost ({why[:120]}); partial folder kept as {kept}; "
                          f"retrying on another {job.kind} node")
                job.attempt += 1
                self.submit(job)
                return None
            return Outcome(job, "failed", f"attempt {job.attempt} lost ({why}) and no other {job.kind} node at "
                                          f"commit {self.commit} to retry on", None, None)
        return self.land(job, res)

    def _stop(self, pending: dict, outcomes: list, on_done) -> None:
        """Ctrl-C: ask running jobs to stop, land what they send back, cancel the rest."""
        self.echo(f"interrupted: asking {len(pending)} job(s) to stop; their folders come back as interrupted "
                  f"(Ctrl-C again to cancel at once)")
        ray.get(self.tracker.request_stop.remote())
        deadline = time.time() + STOP_GRACE_S
        try:
            while pending and time.time() < deadline:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
                for ref in ready:
                    job = pending.pop(ref)
                    try:
                        o = self.land(job, ray.get(ref))
                    except ray.exceptions.RayError as ex:
                        o = Outcome(job, "interrupted", f"stopped: {type(ex).__name__}", None, None)
                    if o.status in ("ok", "partial", "failed") and o.result and o.result.get("stopped"):
                        o.status = "interrupted"
                    outcomes.append(o)
                    on_done(o)
        except KeyboardInterrupt:
            pass
        for ref, job in pending.items():
            ray.cancel(ref, force=True)
            o = Outcome(job, "interrupted", "cancelled by Ctrl-C on the head", None, None)
            outcomes.append(o)
            on_done(o)
        pending.clear()


# ------------------------------------------------------------------------------------------ commands
def _pick_kind(on: str | None, present: list[str], ns: list[dict], commit: str) -> str:
    if on:
        if on not in present:
            more = refusals(ns, commit)
            raise BadInput(f"--on {on}: no node of kind {on} at commit {commit} in the cluster (kinds there: "
                           f"{', '.join(present) or 'none'})" + (f"; {more[0]}" if more else ""))
        return on
    if not present:
        more = refusals(ns, commit)
        raise BadInput(f"no labkit node at commit {commit} in the cluster" + (f"; {more[0]}" if more else ""))
    return present[0]


def run_on_cluster(a, given: dict) -> int:
    """`labkit run X ... --cluster ADDRESS [--on KIND]`: one job; the folder lands as a local run's would."""
    exp = get(a.experiment)
    resolve(exp.spec, {k: v for k, v in given.items() if k != "out_dir"}, exp.name)    # names and types, here
    commit = checkout_commit()
    connect(a.cluster)
    ns = nodes()
    for line in refusals(ns, commit):
        print(f"labkit: {line}", file=sys.stderr)
    kind = _pick_kind(a.on, kinds_present(ns, commit), ns, commit)
    run_id = f"{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%d-%H%M%S')}-{exp.name}-{kind}-{uuid.uuid4().hex[:4]}"
    dest = Path(a.out) if a.out else Path("results") / run_id
    if dest.exists():
        raise BadInput(f"--out {dest} exists")
    argv = ["run", exp.name] + [x for p in (a.p or []) for x in ("-p", p)] + ["--out", "{work}/" + dest.name]
    job = Job(run_id, kind, gpus_needed(EXPERIMENTS[exp.name].needs), argv, dest.name, dest)
    d = Dispatcher(commit)
    print(f"labkit: {exp.name} on a node of kind {kind} in {a.cluster} (commit {commit})", file=sys.stderr)
    t0 = time.time()
    try:
        (o,) = d.run([job], lambda o: None)
    except KeyboardInterrupt:
        print(f"labkit: interrupted; {dest if dest.is_dir() else 'no folder came back'}", file=sys.stderr)
        return 130
    wall = time.time() - t0
    if o.status in ("refused", "not started") or not dest.is_dir():
        print(f"labkit: {exp.name} on {kind}: {o.status}: {o.error}", file=sys.stderr)
        return 1
    try:
        rebuild_index(dest.parent)
    except Exception as ex:     # the run landed; say why the index did not update
        print(f"labkit: run index not rebuilt: {ex}", file=sys.stderr)
    node = o.node or {}
    print(f"labkit: ran on {node.get('host')} ({node.get('ip')}, {kind}) in {wall:.1f} s on the head's clock; "
          f"folder {len(o.result['tar']) / 1e6:.2f} MB sent back", file=sys.stderr)
    report = dest / "report.html"
    if o.status != "ok":
        print(f"labkit: {exp.name} run {o.status}: {o.error}", file=sys.stderr)
        if report.exists():
            print(report.resolve())
        return 1
    print(report.resolve() if report.exists() else dest.resolve())
    return 0


def run_plan_on_cluster(plan, date: str | None, root, only: list[str] | None, address: str, on: str | None = None,
                        echo=print, retries: int = 2, snapshot_s: float = 5.0) -> dict:
    """`labkit nightly --plan P --cluster ADDRESS`: the local nightly's folder, record, lock and resume, with each
    entry (x each kind, for `on = "every kind"`) a job on the cluster, run side by side."""
    entries, date = _planned_entries(plan, date, only)
    commit = checkout_commit()
    connect(address)
    ns = nodes()
    present = kinds_present(ns, commit)
    default = _pick_kind(on, present, ns, commit)
    _check_kinds(entries, present, commit)
    root = Path(root)
    night = root / f"nightly-{date}"
    night.mkdir(parents=True, exist_ok=True)
    rec_path = night / "nightly.json"
    echo = N._logged(echo, night / N.LOG_NAME)
    plan_text = N.plan_text(plan)
    lock = N._Lock(night / ".lock")
    with lock:
        echo(f"nightly {date}: plan {plan} on the cluster {address} (kinds {', '.join(present)}; commit {commit}), "
             f"pid {os.getpid()}, host {os.uname().nodename}")
        for line in refusals(ns, commit):
            echo(f"nightly {date}: {line}")
        record = N.night_record(rec_path, lock, echo, date)
        record.update({"date": date, "plan": str(Path(plan)), "plan_sha256": hashlib.sha256(plan_text.encode()).hexdigest()[:16],
                       "started": _now(), "finished": None, "cluster": {"address": address, "commit": commit,
                                                                        "kinds": present}})
        by_name = {e["name"]: e for e in record.get("entries", [])}
        jobs, order, entry_of = _jobs(entries, present, default, night, date, plan_text, by_name, echo)
        order += [n for n in by_name if n not in order]
        echo(f"nightly {date}: {len(jobs)} job(s) to run, {len(order) - len(jobs)} already done")

        def done(o: Outcome) -> None:
            e, name, started = entry_of[o.job.key]
            info = _entry_outcome(o, e, name, started, night / name)
            status, node = info["status"], o.node or {}
            by_name[name] = info
            record["entries"] = [by_name[n] for n in order if n in by_name]
            N._write_json(rec_path, record)
            where = f" on {node.get('host')} ({node.get('ip')})" if node else ""
            echo(f"{name}: {status}{where} [{o.job.kind}, attempt {o.job.attempt}]"
                 + (f" — {info['error']}" if info.get("error") and status not in N.DONE else ""))
            _rebuild_index(root, echo)

        d = Dispatcher(commit, echo, retries=retries, snapshot_s=snapshot_s)
        interrupted = False
        try:
            d.run(jobs, done)
        except KeyboardInterrupt:
            interrupted = True
        record["entries"] = [by_name[n] for n in order if n in by_name]
        record["finished"] = _now()
        if interrupted:
            record["interrupted"] = True
        N._write_json(rec_path, record)
        ok = sum(e.get("status") in N.DONE for e in record["entries"])
        echo(f"nightly {date}: {'interrupted' if interrupted else 'finished'}, {ok} of {len(record['entries'])} "
             f"entries done")
    _rebuild_index(root, echo)
    if interrupted:
        raise KeyboardInterrupt
    return record


def _planned_entries(plan, date: str | None, only: list[str] | None) -> tuple[list, str]:
    """The plan's entries (those named by `only`) and the night's date, checked."""
    entries = N.load_plan(plan)
    if only:
        missing = sorted(set(only) - {e.name for e in entries})
        if missing:
            raise BadInput(f"--only: no entry named {', '.join(missing)} in {plan}")
        entries = [e for e in entries if e.name in only]
    date = date or dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    if not re.match(r"^\d{4}-\d{2}-\d{2}$", date):
        raise BadInput(f"--date {date!r}: expected YYYY-MM-DD")
    return entries, date


def _check_kinds(entries: list, present: list[str], commit: str) -> None:
    """Every kind an entry names has a node at this commit in the cluster (one line if not)."""
    for e in entries:
        k = e.raw.get("on")
        if k not in (None, EVERY_KIND) and k not in present:
            raise BadInput(f"plan entry {e.name!r}: on = {k!r}, but no node of kind {k} at commit {commit} is in the "
                           f"cluster (kinds there: {', '.join(present)})")


def _jobs(entries: list, present: list[str], default: str, night: Path, date: str, plan_text: str, by_name: dict,
          echo) -> tuple[list, list, dict]:
    """A job per entry and kind not done yet (an entry done on an earlier try is kept in `by_name` as it was; a
    folder left by an unfinished one is set aside): (jobs, the entries' names in order, job key -> (entry,
    name, queued at))."""
    jobs, order, entry_of = [], [], {}
    for e in entries:
        on_k = e.raw.get("on")
        kinds = present if on_k == EVERY_KIND else [on_k or default]
        for kind in kinds:
            name = f"{e.name}@{kind}" if on_k == EVERY_KIND else e.name
            order.append(name)
            out = night / name
            if out.exists() and N._entry_status(out) in N.DONE:
                echo(f"{name}: already done ({N._entry_status(out)}), skipped")
                by_name[name] = {**by_name.get(name, {}), **json.loads((out / "nightly-entry.json").read_text()),
                                 "skipped_on_resume": True}
                continue
            earlier = list(by_name.get(name, {}).get("earlier_attempts", []))
            if out.exists():
                earlier.append(N._set_aside(out).name)
            gpus = gpus_needed(EXPERIMENTS[e.experiment].needs) if e.experiment else 1
            argv = ["nightly", "--plan", "{work}/plan.toml", "--only", e.name, "--date", date, "--root", "{work}"]
            job = Job(name.replace("@", "."), kind, gpus, argv, f"nightly-{date}/{e.name}", out, plan_text,
                      earlier=earlier)
            entry_of[job.key] = (e, name, _now())
            jobs.append(job)
    return jobs, order, entry_of


def _entry_outcome(o: "Outcome", e, name: str, started: str, out: Path) -> dict:
    """An ended job's entry record (what the node's nightly wrote, completed with where and how it ran), kept in
    its folder with an error.txt when it did not succeed."""
    info = {}
    if (out / "nightly-entry.json").is_file():
        info = json.loads((out / "nightly-entry.json").read_text())
    status = info.get("status") if info.get("status") and o.status not in ("interrupted",) else o.status
    if status in ("refused", "not started"):
        status = "failed" if status == "refused" else "interrupted"
    node = o.node or {}
    info.update({"name": name, "entry": e.name, "experiment": e.experiment, "parameters": e.parameters,
                 "timeout_s": e.timeout_s, "status": status, "started": info.get("started", started),
                 "wall_s": info.get("wall_s", (o.result or {}).get("wall_s", 0.0)),
                 "error": info.get("error") or (o.error if status not in N.DONE else None),
                 "folder": name, "earlier_attempts": o.job.earlier, "kind": o.job.kind,
                 "node": node.get("host"), "node_ip": node.get("ip"), "attempt": o.job.attempt})
    if out.is_dir():
        if status not in N.DONE and not (out / "error.txt").exists():
            write_text(out / "error.txt", f"entry {name} {status} on the cluster\n{info['error']}\n"
                                          f"last output on the node:\n{(o.result or {}).get('output_tail', '')}\n")
        N._write_json(out / "nightly-entry.json", info)
    return info


def _rebuild_index(root: Path, echo) -> None:
    try:
        rebuild_index(root)
    except Exception as ex:
        echo(f"labkit: run index not rebuilt: {ex}")


def cmd_nightly_cluster(a) -> int:
    """`labkit nightly --cluster`: the plan on the cluster, then the local nightly's summary lines."""
    try:
        rec = run_plan_on_cluster(a.plan, a.date, a.root, a.only.split(",") if a.only else None, a.cluster, a.on)
    except KeyboardInterrupt:
        return 130
    bad = [e for e in rec["entries"] if e.get("status") not in DONE]
    night = Path(a.root) / f"nightly-{rec['date']}"
    print(f"nightly {rec['date']}: {len(rec['entries']) - len(bad)} of {len(rec['entries'])} entries done; "
          f"record {night / 'nightly.json'}; index {Path(a.root) / 'index.html'}")
    for e in bad:
        print(f"  FAILED {e['name']}: {e.get('error')} (see {night / e['name'] / 'error.txt'})")
    return 1 if bad else 0
