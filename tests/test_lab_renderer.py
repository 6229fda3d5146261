"""The lab's plotly renderer (`labkit/report/renderer.py`): a notebook that draws a figure keeps plotly's JSON (what
JupyterLab draws) and a div (what the report draws with the plotly.js in its head), and never plotly.js itself.
A few seconds: one kernel runs a notebook's own setup cell and one figure, and the report is built from it."""
from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

from labkit.report.renderer import MIMETYPE

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p for p in (REPO / "notebooks").glob("*.ipynb") if p.name != "explore.ipynb")   # explore: widgets
BANNER = "plotly.js v"          # the first line of every plotly.js bundle


def _setup_cell(path: Path) -> str:
    nb = nbformat.read(path, as_version=4)
    return next(c for c in nb.cells if c.cell_type == "code").source


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.name)
def test_every_notebook_starts_with_the_lab_renderer(nb):
    src = _setup_cell(nb)
    assert "use_lab_renderer()" in src, f"{nb.name}: the first code cell must set the lab's renderer"
    whole = nb.read_text(encoding="utf-8")
    assert "renderers.default" not in whole and "include_plotlyjs" not in whole, \
        f"{nb.name} picks another renderer or embeds plotly.js"


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """decode_sweep.ipynb's setup cell and one figure, run in a kernel as papermill runs a notebook."""
    from nbclient import NotebookClient
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(_setup_cell(REPO / "notebooks" / "decode_sweep.ipynb")),
                nbformat.v4.new_code_cell("import plotly.graph_objects as go\n"
                                          "go.Figure(go.Scatter(x=[1, 2, 3], y=[3, 1, 2], name='probe-trace'),\n"
                                          "          layout=dict(title='renderer check')).show()")]
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    run = tmp_path_factory.mktemp("renderer") / "run"
    run.mkdir()
    nbformat.write(nb, run / "check.ipynb")
    return run


def test_a_figure_is_plotly_json_and_a_div_without_plotlyjs(executed):
    path = executed / "check.ipynb"
    text = path.read_text(encoding="utf-8")
    assert BANNER not in text, "a notebook's output embeds plotly.js again (4.8 MB in every run folder)"
    assert path.stat().st_size < 100_000, f"{path.stat().st_size} bytes for one small figure"
    nb = nbformat.read(path, as_version=4)
    assert not [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "error"]
    figs = [o for c in nb.cells for o in c.get("outputs", []) if MIMETYPE in o.get("data", {})]
    assert len(figs) == 1
    data = figs[0]["data"]
    assert data[MIMETYPE]["data"][0]["name"] == "probe-trace"          # JupyterLab's plotly extension draws this
    html = data["text/html"]
    assert html.count('class="plotly-graph-div"') == 1 and "Plotly.newPlot(" in html
    assert not re.search(r"<script[^>]+src=", html)                    # nothing from a CDN (MathJax, require.js)


def test_the_report_draws_the_div_with_one_plotlyjs_in_its_head(executed):
    from labkit.report.notebook import render_report
    out = render_report(executed, standalone=True)
    html = out.read_text(encoding="utf-8")
    head, body = html.split("<body", 1)
    assert BANNER in head and BANNER not in body                       # plotly.js once, before any figure
    assert body.count('class="plotly-graph-div"') == 1 and MIMETYPE not in body
    assert json.dumps("probe-trace") in body


def test_explore_run_headless_saves_figures_not_widget_state(tmp_path):
    """explore.ipynb under papermill (no front end to draw widgets): the figures as the renderer emits them and no
    widget state in the notebook (plotly's FigureWidget state carries its JavaScript: 40 MB for the explorer)."""
    import shutil

    import papermill as pm
    from browser_util import H200_RUN
    shutil.copytree(H200_RUN, tmp_path / "results" / H200_RUN.name)
    out = tmp_path / "explore.ipynb"
    pm.execute_notebook(str(REPO / "notebooks" / "explore.ipynb"), str(out), cwd=str(REPO / "notebooks"),
                        parameters={"results_root": str(tmp_path / "results")}, progress_bar=False)
    text = out.read_text(encoding="utf-8")
    assert BANNER not in text and out.stat().st_size < 500_000, out.stat().st_size
    nb = nbformat.read(out, as_version=4)
    assert "widgets" not in nb.metadata
    outputs = [o for c in nb.cells for o in c.get("outputs", [])]
    assert not [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    figs = [o["data"] for o in outputs if MIMETYPE in o.get("data", {})]
    assert len(figs) == 3 and all('class="plotly-graph-div"' in f["text/html"] for f in figs)
    assert any(H200_RUN.name in o.get("data", {}).get("text/plain", "") for o in outputs)
