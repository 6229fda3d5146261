"""Where a page gets plotly.js (~4.8 MB) from.

A page written inside a results folder links one shared copy, `<results>/_assets/plotly.min.js`, by a
relative path: the folder still opens offline (from disk or any static server) and the committed
record does not carry one bundle per report (the GPU host takes a project tree of at most 64 MiB).
A page written anywhere else, or asked for `standalone=True` (`labkit report DIR --standalone`),
embeds plotly.js itself: one file that can be sent to someone.

The results folder of a page is its own folder (the index), its run folder's parent, or a nightly folder's
parent, whichever holds `_assets/` or is named `results` and is this user's alone (`results_root_of`): never a
folder found by walking further up, never a shared one, never `_assets/` another user made.
"""
from __future__ import annotations

import os
from pathlib import Path
import hashlib
import json

from ..results import ASSETS      # the results folder's layout names it
from .. import lazy
from ..atomic import DIR_FLAGS, NOFOLLOW, read_regular_at, write_bytes_at
from ..outdir import FOLDER_MODE, open_own_folder, own_handle_problem, results_root_problem
from ..params import BadInput

# plotly imported only when plotly.js is copied: html.py, and through it the run index, import this module
plotly = lazy.module("plotly")
plotly_offline = lazy.module("plotly.offline")
PLOTLY_JS = "plotly.min.js"
# A page's plotly.js <script> larger than this is an embedded bundle (figure data never comes close
# inside a <script> without a src).
BUNDLE_BYTES = 1_000_000


def _plotlyjs() -> str:
    return plotly_offline.get_plotlyjs()


def results_root_of(page: str | Path) -> Path | None:
    """The results folder a page at `page` belongs to, or None (then the page embeds plotly.js). Looked for in
    three places only, never by walking further up: the page's own folder (the index), its run folder's parent,
    and a nightly folder's parent (a nightly entry's report). Each must hold `_assets/` or be named `results`, and
    be this user's alone with `_assets/` too (`results_root_problem`): a shared folder (`/tmp`) or another user's
    `_assets/` never serves a script to our pages."""
    here = Path(page).absolute().parent
    places = [here, here.parent] + ([here.parent.parent] if here.parent.name.startswith("nightly-") else [])
    for d in places:
        if (os.path.lexists(d / ASSETS) or d.name == "results") and not results_root_problem(d):
            return d
    return None


def _open_assets(root: Path) -> int:
    """A handle on `<root>/_assets`, made here if absent; a link planted at the name is refused, never followed."""
    rfd = open_own_folder(root, "results folder")
    try:
        try:
            os.mkdir(ASSETS, FOLDER_MODE, dir_fd=rfd)
        except FileExistsError:          # ours from an earlier report, or planted: checked on the handle below
            pass
        fd = os.open(ASSETS, DIR_FLAGS | NOFOLLOW, dir_fd=rfd)
    finally:
        os.close(rfd)
    why = own_handle_problem(fd)
    if why:
        os.close(fd)
        raise BadInput(f"{root / ASSETS} {why}")
    return fd


def _same(fd: int, name: str, data: bytes) -> bool:
    try:
        return read_regular_at(fd, name, len(data)) == data
    except OSError:            # absent, too long, or not a plain file: written anew
        return False


def ensure_shared(root: str | Path) -> Path:
    """Write `<root>/_assets/plotly.min.js` from the installed plotly unless it already holds exactly that,
    and `_assets/manifest.json` saying what it is (plotly's version, bytes, sha256; not a run folder:
    `results.run_manifests` passes it over). Both go through one handle on `_assets/`."""
    js = _plotlyjs().encode()
    fd = _open_assets(Path(root))
    try:
        for name, data in ((PLOTLY_JS, js), ("manifest.json", _manifest(js))):
            if not _same(fd, name, data):
                write_bytes_at(fd, name, data)      # whole or absent, never through a link
    finally:
        os.close(fd)
    return Path(root) / ASSETS / PLOTLY_JS


def _manifest(data: bytes) -> bytes:
    text = json.dumps({"kind": "shared assets", "note": "the one plotly.js every report and the index link by a "
                       "relative path (labkit.report.assets); not a run", "files": {PLOTLY_JS: {
                           "plotly": plotly.__version__, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}},
                      indent=1) + "\n"
    return text.encode()


def plotly_script(page: str | Path, standalone: bool = False) -> str:
    """The <script> that gives a page at `page` plotly.js: a relative link to the shared copy, or the
    bundle inlined (standalone, or no results folder above the page)."""
    root = None if standalone else results_root_of(page)
    try:
        shared = ensure_shared(root) if root is not None else None
    except (BadInput, OSError):          # the shared copy cannot be made safely: the page carries its own
        shared = None
    if shared is None:
        return f'<script type="text/javascript">{_plotlyjs()}</script>'
    href = Path(os.path.relpath(shared, Path(page).absolute().parent)).as_posix()
    return f'<script type="text/javascript" src="{href}"></script>'
