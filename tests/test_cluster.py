"""A real Ray cluster on this machine: a head and two worker nodes, each `labkit node` (`ray start --block`) in
its own process tree, with token authentication. The head stands for an H200-like box (kind `b`, 1 slot),
the two workers for two boxes of another GPU kind (`a`, 1 slot each): the GPU kinds are declared with
`--kind`, since this machine has no GPU, and the entries are the probe at toy size on CPU. What is checked:
- a plan with an entry on "every kind" fans out, one job per kind, and the folders land on the head with
  a manifest naming the node and kind; a second entry of kind `b` queues behind the first (one slot);
- a worker killed by the PID of its raylet mid-entry: the entry finishes on the other `a` node, the lost
  attempt's partial folder kept beside it, no `labkit` process of the killed node left behind;
- the head restarted with the same --date runs nothing again;
- a head at another commit than the nodes: refused with one line, nothing written;
- Ctrl-C on the head: the running job stops, its folder lands `interrupted`, no process left on the node;
- after the cluster is stopped, no Ray process of it is left.
Ray listens on every interface whatever address a node names, and swaps a loopback address for the host's
(docs/cluster.md); the token keeps unauthenticated clients out. So that a test's cluster talks over loopback
alone, the cluster tests run in a network namespace of their own, whose one interface is `lo`:
`test_the_cluster_tests_in_a_network_of_their_own` starts this file's cluster tests there (root and `unshare`
needed; skipped with the reason otherwise), and they skip when collected outside it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(900)
# the cluster tests share one cluster (startup ~25-35 s) and take ~2.5-3 minutes together on 2 cores
slow = pytest.mark.slow

ray_missing = shutil.which("ray", path=str(Path(sys.executable).parent)) is None
PROBE = {"repeats": 2, "pool_gib": 0.02}
DATE = "2026-01-05"


def _labkit(*args, env, **kw):
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True, text=True, cwd=REPO, env=env, **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, root: Path):
        self.root = root
        self.ray_dir = Path(tempfile.mkdtemp(prefix="lkray-", dir="/tmp"))    # Ray's socket paths must stay short
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_TOKEN_PATH": str(root / "token")}
        self.env.pop("RAY_AUTH_MODE", None)
        self.nodes: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.args: dict[str, tuple] = {}

    def start(self, name: str, *args) -> None:
        self.args[name] = args
        log = self.root / f"{name}.log"
        self.logs[name] = log
        self.nodes[name] = subprocess.Popen(
            [sys.executable, "-m", "labkit", "node", "--ip", "127.0.0.1", "--num-cpus", "1", "--temp-dir",
             str(self.ray_dir), "--scratch", str(self.root / f"scratch-{name}"), *args],
            cwd=REPO, env=self.env, stdout=open(log, "w"), stderr=subprocess.STDOUT)

    def wait_up(self, *names, timeout=240) -> None:
        end = time.time() + timeout
        for n in names:
            while "Ray runtime started" not in self.logs[n].read_text():
                assert self.nodes[n].poll() is None, f"node {n} exited: {self.logs[n].read_text()[-2000:]}"
                assert time.time() < end, f"node {n} not up in {timeout} s: {self.logs[n].read_text()[-2000:]}"
                time.sleep(0.5)

    def wait_up_retrying(self, *names) -> None:
        """Ray gives a node 30 s to register with the head: a machine busy enough can miss that. Such a node is
        started again (at most twice), its leftovers (found by the scratch folder in their environment) stopped."""
        for n in names:
            for attempt in (1, 2, 3):
                try:
                    self.wait_up(n)
                    break
                except AssertionError:
                    text = self.logs[n].read_text()
                    if attempt == 3 or not ("timed out during startup" in text or "registration" in text):
                        raise
                    mark = str(self.root / f"scratch-{n}")
                    for p in psutil.process_iter():
                        try:
                            if p.environ().get("LABKIT_NODE_SCRATCH") == mark:
                                p.kill()
                        except psutil.Error:
                            pass
                    self.start(n, *self.args[n])

    def tree(self, name: str) -> list[psutil.Process]:
        try:
            p = psutil.Process(self.nodes[name].pid)
            return [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def labkit_children(self, name: str, word: str) -> list[psutil.Process]:
        """The `python -m labkit <word> ...` processes a node's tasks started."""
        out = []
        for p in self.tree(name):
            try:
                cmd = p.cmdline()
            except psutil.Error:
                continue
            if "-m" in cmd and "labkit" in cmd and word in cmd and "node" not in cmd:
                out.append(p)
        return out

    def ray_processes(self) -> list[psutil.Process]:
        """Every process of this cluster: those naming its session folder, and the nodes' trees."""
        procs = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(str(self.ray_dir) in c for c in (p.info["cmdline"] or [])):
                    procs.append(p)
            except psutil.Error:
                pass
        for n in self.nodes:
            procs += self.tree(n)
        return [p for p in {p.pid: p for p in procs}.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


INSIDE = os.environ.get("CLUSTER_TEST_NETNS") == "1"      # set by the namespace wrapper below


def _netns_reason() -> str | None:
    if ray_missing:
        return "Ray is not installed (pip install -e '.[cluster]'; make test installs it)"
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None:
        return "a network namespace of its own needs root, unshare and ip (Ray would otherwise use the host's address)"
    return None


def _sigint_as_at_a_terminal():
    """In the child before exec: SIGINT unblocked and default, as a shell gives it, whatever the test process
    inherited or an earlier test left (the Ctrl-C test inside must be able to interrupt its head)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@slow
def test_the_cluster_tests_in_a_network_of_their_own():
    """This file's cluster tests, run by pytest inside a new network namespace with only loopback up: Ray finds no
    address but 127.0.0.1, so every byte between head and nodes stays on loopback."""
    if INSIDE:
        pytest.skip("already inside the namespace")
    why = _netns_reason()
    if why:
        pytest.skip(why)
    inner = (f"ip link set lo up && exec {sys.executable} -m pytest -q -p no:cacheprovider "
             f"{Path(__file__).relative_to(REPO)} -k 'fans_out or another_commit or ctrl_c_on_the_head'")
    r = subprocess.run(["unshare", "--net", "sh", "-c", inner], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "CLUSTER_TEST_NETNS": "1"}, timeout=880, preexec_fn=_sigint_as_at_a_terminal)
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0 and "3 passed" in r.stdout, tail


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not INSIDE:
        pytest.skip("runs inside its own network namespace (test_the_cluster_tests_in_a_network_of_their_own)")
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    t0 = time.time()
    try:
        c.start("head", "--head", "--port", str(c.port), "--kind", "b", "--gpus", "1")
        c.wait_up_retrying("head")
        c.start("a1", "--address", c.address, "--kind", "a", "--gpus", "1")
        c.start("a2", "--address", c.address, "--kind", "a", "--gpus", "1")
        c.wait_up_retrying("a1", "a2")
        c.startup_s = time.time() - t0
        yield c
    finally:
        for p in c.nodes.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)        # `ray start --block` stops its node's processes
        for p in c.nodes.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
        end = time.time() + 30
        while c.ray_processes() and time.time() < end:
            time.sleep(0.5)
        left = c.ray_processes()
        for p in left:
            p.kill()
        shutil.rmtree(c.ray_dir, ignore_errors=True)
        assert not left, f"Ray processes left after the cluster stopped: {[p.cmdline()[:3] for p in left]}"


def test_local_commands_never_import_ray(tmp_path):
    code = ("import sys, labkit.cli as c\n"
            f"assert c.main(['runs', '--root', {str(tmp_path)!r}]) == 0\n"
            f"assert c.main(['nightly', '--dry-run', '--plan', {str(REPO / 'nightly' / 'test_plan.toml')!r}]) == 0\n"
            "assert 'ray' not in sys.modules, 'a local command imported Ray'\n"
            "print('no ray')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert p.returncode == 0 and "no ray" in p.stdout, p.stderr[-2000:]


@pytest.mark.parametrize("args, message", [
    (["node", "--head"], "--ip is required"),
    (["node", "--head", "--ip", "0.0.0.0"], "not every interface"),
    (["node", "--ip", "10.0.0.5"], "either --head"),
    (["node", "--head", "--ip", "10.0.0.5", "--kind", "H200!"], "--kind"),
    (["node", "--address", "10.0.0.5:6379", "--ip", "10.0.0.7", "--token-file", "/nonexistent/token"], "no cluster token"),
    (["run", "probe", "--on", "h200"], "give --cluster"),
])
def test_bad_cluster_input_is_one_line(args, message):
    p = _labkit(*args, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    err = p.stderr.strip()
    assert p.returncode == 2 and err.startswith("labkit: ") and len(err.splitlines()) == 1 and message in err, p.stderr


@pytest.mark.skipif(ray_missing, reason="Ray is not installed (make test installs it)")
def test_node_dry_run_says_what_the_box_advertises_and_writes_nothing(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_AUTH_TOKEN_PATH": str(tmp_path / "token")}
    p = _labkit("node", "--head", "--ip", "10.0.0.5", "--kind", "h200", "--gpus", "1", "--dry-run", env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    cmd = p.stdout.strip().splitlines()[-1]
    from labkit.cluster import checkout_commit
    assert "--node-ip-address 10.0.0.5" in cmd and '"gpu:h200": 1' in cmd and f"labkit@{checkout_commit()}" in cmd
    assert "--include-dashboard=false" in cmd and "0.0.0.0" not in cmd
    assert not (tmp_path / "token").exists(), "a dry run wrote the token"


def test_plan_entry_on_is_checked(tmp_path):
    from labkit.nightly import load_plan
    from labkit.params import BadInput
    plan = tmp_path / "plan.toml"
    plan.write_text('[[entry]]\nname = "p"\nexperiment = "probe"\non = "every kinds"\n')
    with pytest.raises(BadInput, match="machine kind"):
        load_plan(plan)
    plan.write_text('[[entry]]\nname = "p"\nexperiment = "probe"\non = "every kind"\n')
    assert load_plan(plan)[0].raw["on"] == "every kind"      # a local nightly runs it once, here


def test_runs_and_index_group_by_machine_kind(tmp_path, capsys):
    """The kind a run is grouped under: its cluster kind, else its GPU's, else cpu; `labkit runs` and the
    index's runs table carry it (no cluster needed: manifests as a cluster run and local runs write them)."""
    from labkit.cli import main
    from labkit.report.index import collect, machine_kind
    assert machine_kind({"cluster": {"kind": "h200"}, "gpu_name": "NVIDIA H200"}) == "h200"
    assert machine_kind({"gpu_name": "NVIDIA GeForce RTX 3090"}) == "rtx3090"
    assert machine_kind({"gpu_name": float("nan"), "cluster": float("nan")}) == "cpu"    # a table's empty cells
    runs = {"r-h200": {"gpu_name": "NVIDIA H200", "pcie_gen": 5, "pcie_width": 16, "cluster": {"kind": "h200"}},
            "r-3090": {"gpu_name": "NVIDIA GeForce RTX 3090", "pcie_gen": 4, "pcie_width": 16},
            "r-cpu": {"host": "lab-ws"}}
    for i, (rid, extra) in enumerate(runs.items()):
        (tmp_path / rid).mkdir()
        (tmp_path / rid / "manifest.json").write_text(json.dumps(
            {"run_id": rid, "experiment": "probe", "status": "ok", "created": f"2026-01-0{i + 1}T00:00:00+00:00",
             "git_sha": "abc", **extra}))
    assert main(["runs", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["RUN", "EXPERIMENT", "STATUS", "KIND"]
    assert [(Path(ln.split()[0]).name, ln.split()[3]) for ln in out[1:]] == [
        ("r-cpu", "cpu"), ("r-h200", "h200"), ("r-3090", "rtx3090")], out
    table, _, _ = collect(tmp_path)
    assert dict(zip(table["run_id"], table["kind"])) == {"r-h200": "h200", "r-3090": "rtx3090", "r-cpu": "cpu"}


def _kill_mid_entry(c: Cluster, hold_s: float = 8.0, timeout: float = 300) -> tuple[str, int]:
    """Wait for an `a` node's run of the probe entry to have written its log, let it go on past a snapshot
    interval (5 s) with room to spare, SIGKILL that node's raylet. Waiting for the log, not for the process to start: on a
    loaded machine the run's imports alone can take longer than a fixed hold, and then no snapshot had reached
    the head yet (seen in CI)."""
    end = time.time() + timeout
    while time.time() < end:
        for n in ("a1", "a2"):
            if c.labkit_children(n, "nightly") and list((c.root / f"scratch-{n}").glob("**/log.txt")):
                time.sleep(hold_s)               # mid-entry: its folder has started, a snapshot reached the head
                raylet = next(p for p in c.tree(n) if p.name() == "raylet")
                raylet.kill()
                return n, raylet.pid
        time.sleep(0.3)
    raise AssertionError("no a node started the entry")


@slow
def test_plan_fans_out_survives_a_killed_node_and_resumes(cluster):
    c = cluster
    root = c.root / "results"
    plan = c.root / "plan.toml"
    params = "".join(f"{k} = {v}\n" for k, v in PROBE.items())
    plan.write_text(f'[[entry]]\nname = "probe"\nexperiment = "probe"\non = "every kind"\n[entry.parameters]\n{params}'
                    f'[[entry]]\nname = "queued"\nexperiment = "probe"\non = "b"\n[entry.parameters]\n{params}')
    head = subprocess.Popen([sys.executable, "-m", "labkit", "nightly", "--plan", str(plan), "--cluster", c.address,
                             "--root", str(root), "--date", DATE], cwd=REPO, env=c.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    killed, raylet_pid = _kill_mid_entry(c)
    other = "a2" if killed == "a1" else "a1"
    out, _ = head.communicate(timeout=600)
    assert head.returncode == 0, out[-4000:]
    night = root / f"nightly-{DATE}"
    rec = json.loads((night / "nightly.json").read_text())
    st = {e["name"]: e for e in rec["entries"]}
    assert set(st) == {"probe@a", "probe@b", "queued"}, out
    assert all(e["status"] == "ok" for e in st.values()), st

    # the killed attempt: its partial folder kept beside the entry, saying where it ran and why it was lost
    assert st["probe@a"]["attempt"] == 2 and st["probe@a"]["earlier_attempts"] == ["probe@a.attempt-1"]
    lost = night / "probe@a.attempt-1"
    why = json.loads((lost / "attempt.json").read_text())
    assert why["attempt"] == 1 and why["snapshot_taken"] and (lost / "log.txt").is_file(), why
    assert str(c.root / f"scratch-{killed}") in why["node"]["folder_on_node"]
    # ... and the entry finished on the other `a` node: the nightly log names two different nodes for it
    starts = [ln for ln in (night / "nightly.log").read_text().splitlines() if "probe@a: started on" in ln]
    assert len(starts) == 2 and starts[0].split("node ")[1][:8] != starts[1].split("node ")[1][:8], starts

    # every folder landed on the head, its manifest naming node, kind, GPU and link, as a local run's would
    for name, kind in (("probe@a", "a"), ("probe@b", "b"), ("queued", "b")):
        mf = json.loads((night / name / "manifest.json").read_text())
        assert mf["status"] == "ok" and mf["experiment"] == "probe"
        cl = mf["cluster"]
        assert cl["kind"] == kind and cl["node_ip"] and {"gpu", "link"} <= set(cl) and cl["transfer_bytes"] > 0
        assert (night / name / "report.html").is_file()
    assert json.loads((night / "probe@a" / "manifest.json").read_text())["cluster"]["attempt"] == 2
    # one slot of kind b: `queued` started only after probe@b had finished
    log = (night / "nightly.log").read_text().splitlines()
    done_b = next(i for i, ln in enumerate(log) if "probe@b: ok" in ln)
    start_q = next(i for i, ln in enumerate(log) if "queued: started on" in ln)
    assert start_q > done_b, log

    # the killed node left no `labkit` process behind, and its `labkit node` ended with its raylet
    assert not psutil.pid_exists(raylet_pid) or psutil.Process(raylet_pid).status() == psutil.STATUS_ZOMBIE
    assert not c.labkit_children(killed, "nightly")
    strays = [p for p in psutil.process_iter(["cmdline"])
              if any(str(c.root / f"scratch-{killed}") in x for x in (p.info["cmdline"] or []))]
    assert not strays, [p.info["cmdline"] for p in strays]

    # the index groups the kinds; `labkit runs` too
    idx = (root / "index.html").read_text()
    assert "Trends — a:" in idx or "probe@a" in idx
    runs = _labkit("runs", "--root", str(root), env=c.env, timeout=120).stdout
    kinds = [ln.split()[3] for ln in runs.splitlines()[1:]]
    assert kinds == sorted(kinds) and {"a", "b"} <= set(kinds), runs

    # the head restarted with the same date: nothing runs again
    before = {n: (night / n / "report.html").stat().st_mtime_ns for n in st}
    again = _labkit("nightly", "--plan", str(plan), "--cluster", c.address, "--root", str(root), "--date", DATE,
                    env=c.env, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count(": already done (ok), skipped") == 3 and "0 job(s) to run" in again.stdout
    assert {n: (night / n / "report.html").stat().st_mtime_ns for n in st} == before
    print(f"\ncluster startup (head, then two workers side by side) {c.startup_s:.1f} s")
    print((night / "nightly.log").read_text())
    for n in st:
        print(n, json.loads((night / n / "manifest.json").read_text())["cluster"])
    c.killed = killed


@slow
def test_head_at_another_commit_is_refused(cluster):
    out = cluster.root / "refused"
    p = _labkit("run", "probe", "--cluster", cluster.address, "--on", "a", "--out", str(out),
                env={**cluster.env, "LABKIT_GIT_SHA": "0123456789ab"}, timeout=300)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("labkit: ")]
    assert p.returncode == 2, p.stderr[-3000:]
    assert "refuses work" in lines[0] and "0123456789ab" in lines[0], lines
    assert "no node of kind a at commit 0123456789ab" in lines[-1], lines
    assert not out.exists()


@slow
def test_ctrl_c_on_the_head_leaves_an_interrupted_folder_and_no_process(cluster):
    c = cluster
    alive = [n for n in ("a1", "a2") if n != getattr(c, "killed", None)]
    out = c.root / "interrupted-run"
    head = subprocess.Popen([sys.executable, "-m", "labkit", "run", "probe", *[x for k, v in PROBE.items()
                             for x in ("-p", f"{k}={v}")], "-p", "repeats=200", "--cluster", c.address, "--on", "a",
                             "--out", str(out)], cwd=REPO, env=c.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    end = time.time() + 240
    node = None
    while node is None:                  # wait until the run is measuring on a node (its manifest is written)
        assert time.time() < end and head.poll() is None, "the run did not start on a node"
        node = next((n for n in alive if list((c.root / f"scratch-{n}").glob(f"**/{out.name}/manifest.json"))), None)
        time.sleep(0.3)
    assert c.labkit_children(node, "run")
    time.sleep(2)         # mid-measure: 200 repeats take ~1 min on a quiet machine, so a loaded one is still at it
    head.send_signal(signal.SIGINT)
    text, _ = head.communicate(timeout=180)
    assert head.returncode == 130, text[-3000:]
    mf = json.loads((out / "manifest.json").read_text())
    assert mf["status"] == "interrupted" and mf["cluster"]["kind"] == "a", mf.get("status")
    end = time.time() + 30
    while c.labkit_children(node, "run") and time.time() < end:
        time.sleep(0.5)
    assert not c.labkit_children(node, "run"), "the node's labkit run outlived Ctrl-C on the head"


if not INSIDE:      # collected only inside the namespace, where the wrapper above runs them
    del test_plan_fans_out_survives_a_killed_node_and_resumes, test_head_at_another_commit_is_refused
    del test_ctrl_c_on_the_head_leaves_an_interrupted_folder_and_no_process
