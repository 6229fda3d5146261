"""Where a page gets plotly.js (~4.8 MB) from.

A page written inside a results folder links one shared copy, `<results>/_assets/plotly.min.js`, by a
relative path: the folder still opens offline (from disk or any static server) and the committed
record does not carry one bundle per report (the GPU host takes a project tree of at most 64 MiB).
A page written anywhere else, or asked for `standalone=True` (`labkit report DIR --standalone`),
embeds plotly.js itself: one file that can be sent to someone.

The results folder of a page is the nearest folder above it that already has `_assets/` or is named
`results` (run folders, nightly entries and the index all sit below one).
"""
from __future__ import annotations

import os
from pathlib import Path
import hashlib
import json

from ..results import ASSETS      # the results folder's layout names it
from .. import lazy
from ..atomic import write_text

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
    """The results folder a page at `page` belongs to, or None (then the page embeds plotly.js)."""
    here = Path(page).resolve().parent
    for d in (here, *here.parents):
        if (d / ASSETS).is_dir() or d.name == "results":
            return d
    return None


def ensure_shared(root: str | Path) -> Path:
    """Write `<root>/_assets/plotly.min.js` from the installed plotly unless it already holds exactly that,
    and `_assets/manifest.json` saying what it is (plotly's version, bytes, sha256; not a run folder:
    `results.run_manifests` passes it over)."""
    path = Path(root) / ASSETS / PLOTLY_JS
    js = _plotlyjs()
    if not path.is_file() or path.stat().st_size != len(js.encode()) or path.read_text(encoding="utf-8") != js:
        _write(path, js)
    _write_manifest(path, js)
    return path


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, text)            # whole or absent, no stray temporary file on a full disk


def _write_manifest(path: Path, js: str) -> None:
    data = js.encode()
    text = json.dumps({"kind": "shared assets", "note": "the one plotly.js every report and the index link by a "
                       "relative path (labkit.report.assets); not a run", "files": {PLOTLY_JS: {
                           "plotly": plotly.__version__, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}},
                      indent=1) + "\n"
    mf = path.parent / "manifest.json"
    if not mf.is_file() or mf.read_text(encoding="utf-8") != text:
        _write(mf, text)


def plotly_script(page: str | Path, standalone: bool = False) -> str:
    """The <script> that gives a page at `page` plotly.js: a relative link to the shared copy, or the
    bundle inlined (standalone, or no results folder above the page)."""
    root = None if standalone else results_root_of(page)
    if root is None:
        return f'<script type="text/javascript">{_plotlyjs()}</script>'
    shared = ensure_shared(root)
    href = Path(os.path.relpath(shared, Path(page).resolve().parent)).as_posix()
    return f'<script type="text/javascript" src="{href}"></script>'
