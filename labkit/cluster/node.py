"""`labkit node`: join this box to the lab's Ray cluster (or start it, `--head`), saying what the box is.

It runs `ray start --block` in the foreground (a terminal, tmux or a systemd service keeps it; Ctrl-C or
SIGTERM takes the box out of the cluster with every Ray process it started) with
- `--node-ip-address` = the address the user names with `--ip` (there is no default: never 0.0.0.0);
- resources `gpu:<kind>: <count>` from NVML (`gpu:rtx3090: 3`), or `cpu_only: 1` on a box without a GPU,
  and `labkit@<commit>` (this checkout's commit), so the head gives work only to boxes at its commit;
- Ray's token authentication (`RAY_AUTH_MODE=token`, the token file `--token-file`; the head makes one
  if none exists, every other box and the head's `--cluster` commands need a copy of it);
- the dashboard off unless `--dashboard` (then bound to `--ip`).
`--kind K --gpus N` declare the kind instead of detecting it (a box NVML cannot read; the tests' stand-ins
for two GPU kinds on one CPU machine).
"""
from __future__ import annotations

import ipaddress
import json
import os
import secrets
import shlex
import shutil
import sys
from pathlib import Path

from ..costmodel import gpu_kind
from ..nightly import KIND_RE
from ..params import BadInput
from ..results import REPO
from . import checkout_commit, commit_resource, kind_resource

DEFAULT_TOKEN = Path.home() / ".ray" / "auth_token"


def detect_gpus() -> tuple[str, int, str]:
    """(kind, count, name) of this box's GPUs via NVML; ("cpu", 0, "") without one. Mixed GPUs: the first's kind."""
    try:
        import pynvml as nv         # optional: without it (or without a driver) the box is a CPU box
        nv.nvmlInit()
        n = nv.nvmlDeviceGetCount()
        if n == 0:
            return "cpu", 0, ""
        name = nv.nvmlDeviceGetName(nv.nvmlDeviceGetHandleByIndex(0))
        name = name.decode() if isinstance(name, bytes) else name
        return gpu_kind(name), n, name
    except Exception:
        return "cpu", 0, ""


def ray_binary() -> str:
    here = Path(sys.executable).parent / "ray"
    found = str(here) if here.is_file() else shutil.which("ray")
    if not found:
        raise BadInput("Ray is not installed here: pip install 'labkit[cluster]' (or `make test`, which installs it)")
    return found


def _check_ip(ip: str | None) -> str:
    if not ip:
        raise BadInput("--ip is required: the address of this box on the lab's private network (127.0.0.1 for one box)")
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        raise BadInput(f"--ip {ip!r}: not an IP address") from None
    if addr.is_unspecified:
        raise BadInput(f"--ip {ip}: name this box's own address on the private network, not every interface")
    return ip


def token_env(token_file: str | None, create: bool, dry_run: bool = False) -> dict:
    """Ray's token authentication for this process and its children: RAY_AUTH_MODE=token and the token file."""
    path = Path(token_file).expanduser() if token_file else Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or DEFAULT_TOKEN)
    if not path.is_file() and not (create and dry_run):      # a dry run writes nothing
        if not create:
            raise BadInput(f"no cluster token at {path}: copy the head's token file here (or give --token-file)")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.write(fd, secrets.token_hex(32).encode())
        os.close(fd)
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(path.resolve())}


def node_command(a) -> tuple[list[str], dict, dict]:
    """(ray start argv, environment additions, what the box advertises); checks everything first."""
    ip = _check_ip(a.ip)
    if bool(a.head) == bool(a.address):
        raise BadInput("give either --head (start the cluster here) or --address HEAD:PORT (join it)")
    if a.kind:
        if not KIND_RE.match(a.kind):
            raise BadInput(f"--kind {a.kind!r}: a short lowercase word (h200, rtx3090, cpu)")
        kind, count, real = a.kind, (a.gpus if a.gpus is not None else (0 if a.kind == "cpu" else 1)), False
        if kind != "cpu" and count < 1:
            raise BadInput(f"--gpus must be >= 1 for kind {kind}")
    else:
        if a.gpus is not None:
            raise BadInput("--gpus goes with --kind (without it the GPUs are counted)")
        kind, count, _name = detect_gpus()
        real = kind != "cpu"
    commit = checkout_commit()
    if commit == "unknown":
        raise BadInput("this checkout's commit is unknown (no git, no LABKIT_GIT_SHA): the head could not match it")
    resources = {kind_resource(kind): (1 if kind == "cpu" else count), commit_resource(commit): 1000}
    argv = [ray_binary(), "start", "--block", "--node-ip-address", ip, "--resources", json.dumps(resources),
            "--num-gpus", str(count if real else 0), "--disable-usage-stats",
            "--include-log-monitor=false"]      # entries' output goes to their folders, not to the head's terminal
    if a.head:
        argv += ["--head", "--port", str(a.port)]
        argv += (["--include-dashboard=true", "--dashboard-host", ip] if a.dashboard else ["--include-dashboard=false"])
    else:
        argv += ["--address", a.address]
    if a.num_cpus is not None:
        argv += ["--num-cpus", str(a.num_cpus)]
    if a.temp_dir:
        argv += ["--temp-dir", str(Path(a.temp_dir).resolve())]
    env = {**token_env(a.token_file, create=bool(a.head), dry_run=a.dry_run), "LABKIT_NODE_KIND": kind, "LABKIT_NODE_REPO": str(REPO),
           "LABKIT_NODE_COMMIT": commit,
           # Ray gives its workers OMP_NUM_THREADS=1; an entry's `labkit` gets the box's own setting back
           "LABKIT_NODE_OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "")}
    if a.scratch:
        env["LABKIT_NODE_SCRATCH"] = str(Path(a.scratch).resolve())
    return argv, env, {"kind": kind, "gpus": count, "commit": commit, "resources": resources}


def cmd_node(a) -> int:
    argv, env, what = node_command(a)
    role = "head" if a.head else f"joining {a.address}"
    print(f"labkit node: {role} as {a.ip}, kind {what['kind']} ({what['gpus']} GPU(s)), commit {what['commit']}, "
          f"token {env['RAY_AUTH_TOKEN_PATH']}", flush=True)
    if a.dry_run:
        print(shlex.join(argv))
        return 0
    # exec: this process becomes `ray start --block`; its PID is the node's (signals stop the node)
    os.execve(argv[0], argv, {**os.environ, **env})
    return 0    # not reached
