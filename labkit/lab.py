"""`labkit lab` (what `make lab` runs): JupyterLab on `notebooks/`, opened on the explorer.

It binds 127.0.0.1 only, with a random token, so nothing on the network can reach it; from a laptop the
way in is an SSH tunnel, and the command prints both the URL and the tunnel line. The token never appears
on a command line (another local user could read it from /proc/PID/cmdline and run code as this user): it
reaches JupyterLab in a 0600 file (see `token_env`). It starts whoever runs
it: root is the usual user in containers, and Jupyter refuses root unless told `--allow-root` (a refusal
that protects nothing here, since the server is reachable only from this machine).

Two things JupyterLab would otherwise put in front of a new user are settled before it starts: its
"get notified about official Jupyter news?" prompt (the lab is offline by design: news fetching and update
checks are off, as defaults the user can still change in Settings), and the "not trusted" state of the
notebooks labkit ships (they are signed in the user's notebook-signature store, so their outputs show).
"""
from __future__ import annotations

import getpass
import json
import os
import secrets
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import nbformat
from jupyter_core.paths import jupyter_data_dir, jupyter_runtime_dir
from jupyterlab.commands import get_app_dir
from nbformat.sign import NotebookNotary

from . import envs
from .params import BadInput
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


# Plugin defaults for this lab (JupyterLab's overrides.json): no news feed, no update check, so no prompt
# asking whether to fetch them. Defaults, not locks: Settings → Notifications can still turn them on.
LAB_OVERRIDES = {"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False}}


def app_settings_dir() -> Path:
    """A JupyterLab app-settings folder holding labkit's overrides.json, merged over any overrides.json in
    the installed JupyterLab's own app-settings folder (so a site's own defaults still apply), beside a copy
    of that folder's page_config.json if it has one (JupyterLab reads both from the one folder)."""
    out = Path(jupyter_data_dir()) / "labkit" / "lab-settings"
    out.mkdir(parents=True, exist_ok=True)
    merged: dict = {}
    site_dir = Path(get_app_dir()) / "settings"
    for name in ("page_config.json", "page_config.json5"):      # the site's page config, read from here too
        if (site_dir / name).is_file():
            (out / name).write_bytes((site_dir / name).read_bytes())
    site = site_dir / "overrides.json"
    if site.is_file():
        try:
            merged = json.loads(site.read_text())
        except ValueError:        # a broken site file: JupyterLab would ignore it too
            merged = {}
    for plugin, values in LAB_OVERRIDES.items():
        merged[plugin] = {**merged.get(plugin, {}), **values}
    (out / "overrides.json").write_text(json.dumps(merged, indent=1))
    return out


def shipped_notebooks() -> set[str]:
    """The names of the notebooks labkit ships: those git tracks in notebooks/ (a notebook a user added there
    is not one), or every notebook there when this copy of labkit is not a git checkout."""
    folder = REPO / "notebooks"
    try:
        out = subprocess.run(["git", "-C", str(REPO), "ls-files", "--", "notebooks/*.ipynb"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        return {Path(ln).name for ln in out.splitlines() if ln.strip()}
    except (OSError, subprocess.SubprocessError):
        return {p.name for p in folder.glob("*.ipynb")}


def trust_shipped_notebooks(root: Path) -> list[str]:
    """Sign the notebooks under `root` that are labkit's own (in the repository's notebooks/, or a copy of
    one elsewhere), so JupyterLab opens them trusted instead of logging "Notebook … is not trusted" and
    hiding their rich outputs. Other notebooks are left as they are. Returns the names signed."""
    shipped, folder = shipped_notebooks(), REPO / "notebooks"
    ours = root.resolve() == folder.resolve()
    notary, signed = NotebookNotary(), []
    for path in sorted(root.glob("*.ipynb")):
        twin = folder / path.name
        if path.name not in shipped or not (ours or (twin.is_file() and twin.read_bytes() == path.read_bytes())):
            continue
        try:
            with warnings.catch_warnings():       # nbformat's validation notes are no news at lab start
                warnings.simplefilter("ignore")
                nb = nbformat.read(path, as_version=4)
        except Exception:          # not a notebook JupyterLab could open either
            continue
        if not notary.check_signature(nb):
            notary.sign(nb)
        signed.append(path.name)
    return signed


# The server's contents manager: the notebooks git tracks open read-only, so running one never autosaves over it
TRACKED_READ_ONLY = "labkit.lab_contents.TrackedReadOnlyManager"


def lab_command(port: int, root_dir: Path, open_notebook: str = "explore.ipynb",
                extra: list[str] | None = None, settings_dir: Path | None = None, edit_tracked: bool = False) -> list[str]:
    """The JupyterLab command line. The token is not on it (any local user can read a process's argv in
    /proc/PID/cmdline): `token_env` hands it over through a 0600 file named in the environment. The notebooks
    git tracks in `root_dir` are served read-only (`labkit.lab_contents`) unless `edit_tracked`."""
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", f"--ServerApp.root_dir={root_dir}",
           f"--LabApp.default_url=/lab/tree/{open_notebook}", "--LabApp.news_url=None",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if not edit_tracked:
        cmd.append(f"--ServerApp.contents_manager_class={TRACKED_READ_ONLY}")
    if settings_dir is not None:
        cmd.append(f"--LabApp.app_settings_dir={settings_dir}")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    return cmd + list(extra or [])


TOKEN_GLOB = "labkit-lab-*.token"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def token_file(token: str, runtime_dir: Path | None = None) -> Path:
    """Write the token to a new 0600 file in Jupyter's runtime folder (made 0700; it already holds the
    kernels' connection secrets), named after this process, which becomes the server. Files left by
    servers that are gone are removed first."""
    folder = Path(runtime_dir or jupyter_runtime_dir())
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = folder.stat()
    if st.st_uid != os.geteuid():
        raise BadInput(f"Jupyter's runtime folder {folder} belongs to another user; set JUPYTER_RUNTIME_DIR")
    if st.st_mode & 0o077:
        os.chmod(folder, 0o700)
    for old in folder.glob(TOKEN_GLOB):
        pid = old.stem.rsplit("-", 1)[-1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            old.unlink(missing_ok=True)
    path = folder / f"labkit-lab-{os.getpid()}.token"
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return path


def token_env(token: str, env: dict | None = None, runtime_dir: Path | None = None) -> dict:
    """The server's environment: the token in a 0600 file named by JUPYTER_TOKEN_FILE (jupyter_server reads
    it once at start). JUPYTER_TOKEN (which would win over the file) and LABKIT_LAB_TOKEN are removed, so
    neither the server nor its kernels carry the token in their environment."""
    env = dict(os.environ if env is None else env)
    for name in ("JUPYTER_TOKEN", "LABKIT_LAB_TOKEN"):
        env.pop(name, None)
    env["JUPYTER_TOKEN_FILE"] = str(token_file(token, runtime_dir))
    return env


def notebook_title(path: Path) -> str:
    """What a notebook is, from its first heading: the words before the first colon."""
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
        md = next("".join(c["source"]) for c in nb.get("cells", []) if c.get("cell_type") == "markdown")
        head = next(ln for ln in md.splitlines() if ln.startswith("#"))
    except (StopIteration, ValueError, OSError, KeyError):
        return ""
    return head.lstrip("# ").split(":")[0].strip()


def banner(port: int, token: str, open_notebook: str = "explore.ipynb", root_dir: Path | None = None,
           edit_tracked: bool = False) -> str:
    url = f"http://127.0.0.1:{port}/lab/tree/{open_notebook}?token={token}"
    host, user = socket.gethostname(), getpass.getuser()
    nbs = sorted(Path(root_dir or REPO / "notebooks").glob("*.ipynb"))
    listing = "".join(f"    {p.name:<20} {notebook_title(p)}\n" for p in nbs)
    return (f"\nlabkit lab: JupyterLab on notebooks/ (127.0.0.1 only, token required). Open:\n\n    {url}\n\n"
            f"From a laptop, tunnel first, then open the same URL there:\n\n"
            f"    ssh -N -L {port}:127.0.0.1:{port} {user}@{host}\n\n"
            f"The {len(nbs)} notebooks here (the file browser on the left opens any of them):\n{listing}\n"
            f"{TRACKED_NOTE if not edit_tracked else EDIT_NOTE}\n"
            f"Stop with Ctrl-C.\n")


TRACKED_NOTE = ("The notebooks git tracks open read-only, so running them never saves over the committed files: "
                "File > Save Notebook As... keeps a session (--edit-tracked lets you save them).\n")
EDIT_NOTE = "--edit-tracked: the notebooks git tracks save as any other (JupyterLab autosaves a changed one).\n"


def cmd_lab(a) -> int:
    root = Path(a.dir or REPO / "notebooks").resolve()
    if not root.is_dir():
        raise BadInput(f"{root} is not a folder of notebooks")
    port = a.port if a.port_exact else pick_port(a.port)
    token = a.token or envs.get("LABKIT_LAB_TOKEN") or os.environ.get("JUPYTER_TOKEN") or secrets.token_hex(24)
    trust_shipped_notebooks(root)
    env = token_env(token)
    edit = bool(getattr(a, "edit_tracked", False))
    print(banner(port, token, root_dir=root, edit_tracked=edit), flush=True)
    cmd = lab_command(port, root, extra=[x for x in a.jupyter_args if x != "--"], settings_dir=app_settings_dir(),
                      edit_tracked=edit)
    os.execve(cmd[0], cmd, env)     # JupyterLab in this process: Ctrl-C and the exit status are its own
