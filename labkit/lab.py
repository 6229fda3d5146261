"""`labkit lab` (what `make lab` runs): JupyterLab on `notebooks/`, opened on the explorer.

It binds 127.0.0.1 only, with a random token, so nothing on the network can reach it; from a laptop the
way in is an SSH tunnel, and the command prints both the URL and the tunnel line. It starts whoever runs
it: root is the usual user in containers, and Jupyter refuses root unless told `--allow-root` (a refusal
that protects nothing here, since the server is reachable only from this machine).
"""
from __future__ import annotations

import getpass
import os
import secrets
import socket
import sys
from pathlib import Path

from .results import REPO


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def pick_port(wanted: int) -> int:
    """`wanted` if free, else the next free one up to +50, else any free port."""
    for p in range(wanted, wanted + 50):
        if _port_free(p):
            return p
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lab_command(port: int, token: str, root_dir: Path, open_notebook: str = "explore.ipynb",
                extra: list[str] | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root_dir}",
           f"--LabApp.default_url=/lab/tree/{open_notebook}", "--LabApp.news_url=None",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    return cmd + list(extra or [])


def banner(port: int, token: str, open_notebook: str = "explore.ipynb") -> str:
    url = f"http://127.0.0.1:{port}/lab/tree/{open_notebook}?token={token}"
    host, user = socket.gethostname(), getpass.getuser()
    return (f"\nlabkit lab: JupyterLab on notebooks/ (127.0.0.1 only, token required). Open:\n\n    {url}\n\n"
            f"From a laptop, tunnel first, then open the same URL there:\n\n"
            f"    ssh -N -L {port}:127.0.0.1:{port} {user}@{host}\n\n"
            f"Stop with Ctrl-C. Other notebooks: decode_sweep.ipynb (measure or re-render a run), probe.ipynb.\n")


def cmd_lab(a) -> int:
    root = Path(a.dir or REPO / "notebooks").resolve()
    if not root.is_dir():
        from .params import BadInput
        raise BadInput(f"{root} is not a folder of notebooks")
    port = a.port if a.port_exact else pick_port(a.port)
    token = a.token or os.environ.get("LABKIT_LAB_TOKEN") or secrets.token_hex(24)
    print(banner(port, token), flush=True)
    cmd = lab_command(port, token, root, extra=[x for x in a.jupyter_args if x != "--"])
    os.execv(cmd[0], cmd)     # JupyterLab in this process: Ctrl-C and the exit status are its own
