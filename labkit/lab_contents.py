"""What `labkit lab`'s JupyterLab may write: every file but the notebooks git tracks in the folder it serves.

Opening a notebook and running it changes its outputs, and JupyterLab autosaves a changed notebook every
two minutes: run once, the explorer (`notebooks/explore.ipynb`) would be overwritten with whatever the session
drew, its saved first view lost and the checkout no longer as committed. This contents manager (JupyterLab's
server-side file access, `--ServerApp.contents_manager_class`) reports a tracked notebook as not writable, so
JupyterLab opens it read-only: no autosave, and Save answers "read-only: use Save as…", which keeps the
session in a new file beside it. A save, or a revert to a checkpoint, that reaches the server anyway is refused
with 403. Everything else (a notebook the user made or saved as, any other file) saves as usual.
`labkit lab --edit-tracked` starts JupyterLab without it, for editing the shipped notebooks themselves.

The tracked notebooks are read once, at the first request, with `git ls-files` in the served folder; a folder
outside a git work tree has none.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager
from tornado import web


def tracked_notebooks(root: str | Path) -> frozenset[str]:
    """The notebooks git tracks under `root`, as paths relative to it with '/' (the contents API's form);
    none when `root` is not in a git work tree or git is absent."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--", "*.ipynb"], capture_output=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(p for p in out.decode("utf-8", "surrogateescape").split("\0") if p)


class TrackedReadOnlyManager(AsyncLargeFileManager):
    """JupyterLab's default contents manager, with the notebooks git tracks in the served folder read-only."""

    _tracked: frozenset[str] | None = None

    def is_tracked(self, path: str) -> bool:
        if self._tracked is None:
            self._tracked = tracked_notebooks(self.root_dir)
        return path.strip("/") in self._tracked

    def _refuse(self, path: str, what: str) -> None:
        if self.is_tracked(path):
            raise web.HTTPError(403, f"{path.strip('/')} is tracked by git: labkit lab keeps it as committed and does "
                                     f"not {what} it (File > Save Notebook As... keeps this session in a new file; "
                                     f"`labkit lab --edit-tracked` lets you save it)")

    async def get(self, path, content=True, type=None, format=None, require_hash=False):
        model = await super().get(path, content=content, type=type, format=format, require_hash=require_hash)
        if model.get("type") == "directory" and isinstance(model.get("content"), list):
            for child in model["content"]:
                if self.is_tracked(child.get("path", "")):
                    child["writable"] = False
        elif self.is_tracked(model.get("path", path)):
            model["writable"] = False
        return model

    async def save(self, model, path=""):
        self._refuse(path, "save")
        return await super().save(model, path)

    async def restore_checkpoint(self, checkpoint_id, path):
        self._refuse(path, "revert")
        return await super().restore_checkpoint(checkpoint_id, path)
