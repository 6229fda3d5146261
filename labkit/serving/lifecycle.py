"""A `vllm serve` child process: start on 127.0.0.1 and a free port, wait for /health, keep its log, stop it.

    with VllmServer(args, env, log_path, startup_timeout_s=300) as srv:   # started and healthy
        srv.base_url                                                       # http://127.0.0.1:PORT
    # stopped: SIGTERM to its process group, SIGKILL after `grace_s`; also on errors and Ctrl-C

The server runs in its own session (process group), so stopping it by its PID also stops the engine-core
and worker processes vLLM forks; nothing is left behind. Every live server is also stopped at interpreter
exit. The Python that runs vLLM is `.venv-vllm/bin/python` (or `$LABKIT_VLLM_PYTHON`): vLLM pins its own
torch and transformers, so it lives in a venv of its own (see the Makefile).
"""
from __future__ import annotations

from .. import envs
import atexit
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path
import importlib.util

from labkit.atomic import open_append
from labkit.params import BadInput, Missing
from labkit.results import REPO

LAUNCHER = "labkit.serving.launcher"
_LIVE: "weakref.WeakSet[VllmServer]" = weakref.WeakSet()


class ServerFailed(RuntimeError):
    """The server exited or never became healthy; the message ends with the log's last lines."""


def vllm_python() -> Path:
    """The interpreter that has vLLM: $LABKIT_VLLM_PYTHON, else .venv-vllm in the repo, else this one."""
    env = envs.get("LABKIT_VLLM_PYTHON")
    if env:
        if not Path(env).is_file():
            raise Missing(f"LABKIT_VLLM_PYTHON={env} does not exist")
        return Path(env)
    venv = REPO / ".venv-vllm" / "bin" / "python"
    if venv.is_file():
        return venv
    if importlib.util.find_spec("vllm") is not None:
        return Path(sys.executable)
    raise Missing("no vLLM found: run `make vllm-venv` (creates .venv-vllm) or set LABKIT_VLLM_PYTHON")


def launcher_cmd(*args: str) -> list[str]:
    return [str(vllm_python()), "-m", LAUNCHER, *args]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    """Is something listening on (or bound to) 127.0.0.1:port? SO_REUSEADDR, as servers bind (uvicorn does), so
    connections in TIME_WAIT from an earlier server do not count as taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return False
        except OSError:
            return True


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


class VllmServer:
    def __init__(self, serve_args: list[str], env: dict[str, str] | None, log_path: str | Path,
                 startup_timeout_s: float = 300.0, port: int = 0, grace_s: float = 10.0):
        self.serve_args, self.extra_env = list(serve_args), dict(env or {})
        self.log_path = Path(log_path)
        self.startup_timeout_s, self.grace_s = startup_timeout_s, grace_s
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.started_at = self.healthy_at = None
        self.command: list[str] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def died(self, grace_s: float = 3.0) -> bool:
        """After a failed request: is the server gone, or going? A killed server's requests fail the moment
        its socket closes, while the process itself may still be tearing down (a large process takes
        a while to exit), so an `alive()` read at once can miss the death: wait up to `grace_s`."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def start(self) -> "VllmServer":
        if port_in_use(self.port):
            raise BadInput(f"port {self.port} on 127.0.0.1 is in use: choose another (port=0 picks a free one)")
        self.command = launcher_cmd("serve", *self.serve_args, "--host", "127.0.0.1", "--port", str(self.port))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.extra_env}
        # the server must import labkit (the launcher, the KV connector) from this tree
        env["LABKIT_WATCH_PARENT"] = str(os.getpid())     # the launcher stops the group if we die
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        with open_append(self.log_path, "ab") as log:
            log.write(("$ " + " ".join(self.command) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=str(REPO), start_new_session=True)
        self.started_at = time.time()
        _LIVE.add(self)
        return self

    def wait_healthy(self) -> float:
        """Seconds from start to the first 200 on /health; ServerFailed (with the log's tail) otherwise."""
        # httpx is the optional `serve` extra
        import httpx
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise ServerFailed(f"vllm serve exited with code {self.proc.returncode} before becoming healthy; "
                                       f"log {self.log_path}:\n{log_tail(self.log_path)}")
                try:
                    if client.get(self.base_url + "/health").status_code == 200:
                        self.healthy_at = time.time()
                        return self.healthy_at - self.started_at
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise ServerFailed(f"vllm serve not healthy after {self.startup_timeout_s:.0f} s; "
                                       f"log {self.log_path}:\n{log_tail(self.log_path)}")
                time.sleep(0.5)

    def stop(self) -> int | None:
        """SIGTERM the server's process group, SIGKILL after the grace period; returns the exit code."""
        if self.proc is None:
            return None
        pgid = self.proc.pid          # start_new_session: the group id is the server's PID
        if self.proc.poll() is None:
            _signal_group(pgid, signal.SIGTERM)
            try:
                self.proc.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(pgid, signal.SIGKILL)
                self.proc.wait(10)
        # workers that outlived the server (e.g. it crashed): same group, stop them too
        if _group_alive(pgid):
            _signal_group(pgid, signal.SIGTERM)
            t = time.monotonic()
            while _group_alive(pgid) and time.monotonic() - t < self.grace_s:
                time.sleep(0.1)
            _signal_group(pgid, signal.SIGKILL)
        _LIVE.discard(self)
        return self.proc.returncode

    def __enter__(self) -> "VllmServer":
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


@atexit.register
def _stop_all() -> None:
    for srv in list(_LIVE):
        try:
            srv.stop()
        except Exception:
            pass
