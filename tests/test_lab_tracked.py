"""`labkit lab` leaves the notebooks git tracks as committed: its JupyterLab serves them not writable (so it opens
them read-only and never autosaves over them) and refuses a save that reaches the server anyway, while a notebook
the user made saves as usual. Against the real server `labkit lab` starts, on a git clone of the explorer in a
temporary folder (the repository's own files are never put at risk); in a real browser: tests/test_browser.py."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from browser_util import REPO

EXPLORE = REPO / "notebooks" / "explore.ipynb"


def test_the_repository_notebooks_are_the_tracked_ones_and_the_lab_command_protects_them():
    from labkit.lab import TRACKED_READ_ONLY, lab_command
    from labkit.lab_contents import tracked_notebooks
    assert "explore.ipynb" in tracked_notebooks(REPO / "notebooks")
    assert f"--ServerApp.contents_manager_class={TRACKED_READ_ONLY}" in lab_command(8888, REPO / "notebooks")
    assert not any("contents_manager_class" in c for c in lab_command(8888, REPO / "notebooks", edit_tracked=True))


def git_clone_of_the_explorer(tmp_path: Path) -> Path:
    """A folder as a fresh clone has it: explore.ipynb committed in a git work tree."""
    root = tmp_path / "notebooks"
    root.mkdir()
    shutil.copy(EXPLORE, root / EXPLORE.name)
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for args in (["init", "-q"], ["add", EXPLORE.name], ["commit", "-q", "-m", "clone"]):
        subprocess.run([*git, *args], check=True, capture_output=True, timeout=60)
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _api(base: str, token: str, path: str, method: str = "GET", body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{base}/api/contents/{path}?token={token}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as ex:
        return ex.code, json.loads(ex.read() or b"{}")


@pytest.fixture
def lab(tmp_path):
    """`labkit lab` (no browser) on a git clone of the explorer, with fresh Jupyter folders."""
    root = git_clone_of_the_explorer(tmp_path)
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "LABKIT_LAB_TOKEN": token, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "ws"),
           "JUPYTER_DATA_DIR": str(tmp_path / "data"), "PYTHONUNBUFFERED": "1"}
    log_path = tmp_path / "lab.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "labkit", "lab", "--port", str(port), "--port-exact",
                                 "--dir", str(root)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            for _ in range(240):
                try:
                    urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=1)
                    break
                except Exception:
                    if proc.poll() is not None:
                        raise RuntimeError(f"labkit lab exited ({proc.returncode}): {log_path.read_text()[-2000:]}")
                    time.sleep(0.5)
            else:
                raise RuntimeError("labkit lab did not start in 120 s")
            yield base, token, root, log_path
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_a_tracked_notebook_is_served_read_only_and_never_saved_over(lab):
    base, token, root, log_path = lab
    before = (root / EXPLORE.name).read_bytes()
    status, model = _api(base, token, EXPLORE.name)
    assert status == 200 and model["writable"] is False, model.get("writable")
    status, listing = _api(base, token, "")
    assert {c["name"]: c["writable"] for c in listing["content"]}[EXPLORE.name] is False
    # what an autosave would send: the notebook as the session has it, its outputs gone
    session = json.loads(before)
    for cell in session["cells"]:
        cell["outputs"] = [] if cell["cell_type"] == "code" else cell.get("outputs")
    session["cells"] = [{k: v for k, v in c.items() if v is not None} for c in session["cells"]]
    status, err = _api(base, token, EXPLORE.name, "PUT", {"type": "notebook", "format": "json", "content": session})
    assert status == 403 and "tracked by git" in err.get("message", ""), (status, err)
    assert (root / EXPLORE.name).read_bytes() == before
    # Save As: the same session in a new file saves, and that one stays writable
    status, saved = _api(base, token, "mine.ipynb", "PUT", {"type": "notebook", "format": "json", "content": session})
    assert status in (200, 201) and saved["writable"] is True, (status, saved)
    assert (root / "mine.ipynb").is_file() and (root / EXPLORE.name).read_bytes() == before
    assert "read-only" in log_path.read_text()       # the banner says so, and how to keep a session
