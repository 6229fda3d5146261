"""The explorer as a newcomer opens it (`make lab`): a saved first view of a committed run, in plotly's
mimetype, that JupyterLab draws before any cell runs (in a browser: tests/test_browser.py); the README's
picture shows a run that is in results/; on a CPU the live PCIe plot is not drawn as empty axes."""
from __future__ import annotations

import struct

import nbformat
import pytest

from browser_util import REPO

EXPLORE = REPO / "notebooks" / "explore.ipynb"
PLOTLY = "application/vnd.plotly.v1+json"


def _saved_figures() -> list[dict]:
    nb = nbformat.read(EXPLORE, as_version=4)
    return [o["data"][PLOTLY] for c in nb.cells for o in c.get("outputs", []) if PLOTLY in o.get("data", {})]


def _saved_run() -> str:
    nb = nbformat.read(EXPLORE, as_version=4)
    text = next(o["data"]["text/plain"] for c in nb.cells for o in c.get("outputs", [])
                if "saved first view" in o.get("data", {}).get("text/plain", ""))
    return text.split("of the run ")[1].rstrip(". \n")


def test_the_notebook_is_saved_with_a_filled_first_view_of_a_committed_run():
    figs = _saved_figures()
    assert len(figs) == 3 and all(any(t.get("y") for t in f["data"]) for f in figs)
    assert (REPO / "results" / _saved_run() / "manifest.json").is_file()


def _png_text(path) -> dict:
    data, out, i = path.read_bytes(), {}, 8
    while i < len(data):
        n, kind = struct.unpack(">I4s", data[i:i + 8])
        if kind == b"tEXt":
            k, _, v = data[i + 8:i + 8 + n].partition(b"\0")
            out[k.decode("latin-1")] = v.decode("latin-1")
        i += 12 + n
    return out


def test_the_readme_picture_shows_a_committed_run():
    run = _png_text(REPO / "docs" / "img" / "explorer.png").get("labkit-run")
    assert run and (REPO / "results" / run / "manifest.json").is_file(), run


def test_no_live_pcie_axes_on_a_cpu(monkeypatch):
    import labkit.explore as E
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda *objs, **kw: shown.extend(objs))
    ex = E.Explorer(REPO / "results")
    if not E.cuda_note():
        pytest.skip("a CUDA GPU is here: the live plot is drawn")
    ex.show_measure()
    assert ex.fig_pcie not in shown and ex.why in shown


# Figures before any cell runs, in a real JupyterLab and Chromium: tests/test_browser.py (on the page the other
# JupyterLab tests open, before their Run All).
