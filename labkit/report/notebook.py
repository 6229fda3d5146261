"""HTML reports from the executed notebooks in a run folder, readable offline.

The notebooks set `plotly.io.renderers.default = "notebook"` in their first cell, so plotly.js is
embedded once in that cell's output and every figure after it is a `<div>` plus data. That bundle is
dropped from the stored notebook and the report gets plotly.js once in its head: a link to the results
folder's shared copy (`results/_assets/plotly.min.js`, see `assets.py`), or embedded with
`standalone=True` (`labkit report DIR --standalone`: one file to send). Code cells are hidden; cells
tagged `remove_output` (progress bars) lose their output; widgets are not used in reports (their loader
would come from a CDN).
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat

from ..atomic import write_text


def _exporter():
    from nbconvert import HTMLExporter
    from nbconvert.preprocessors import TagRemovePreprocessor
    from traitlets.config import Config
    c = Config()
    c.TagRemovePreprocessor.remove_all_outputs_tags = {"remove_output"}
    c.TagRemovePreprocessor.remove_cell_tags = {"remove_cell"}
    c.TagRemovePreprocessor.enabled = True
    ex = HTMLExporter(config=c, template_name="lab")
    ex.exclude_input = True
    ex.exclude_input_prompt = True
    ex.exclude_output_prompt = True
    ex.register_preprocessor(TagRemovePreprocessor(config=c), enabled=True)
    return ex


# nbconvert's lab template links require.js and MathJax from a CDN, and plotly's notebook renderer adds a
# MathJax <script src=cdn> to every figure. Reports have no LaTeX and plotly.js is embedded, so these
# tags only produce failed loads (console errors) offline: drop them.
_CDN_SCRIPT = re.compile(r'<script[^>]*\ssrc="https://cdnjs\.cloudflare\.com/ajax/libs/(?:require\.js|mathjax)/[^"]*"[^>]*>\s*</script>')


def strip_cdn_scripts(html: str) -> str:
    return _CDN_SCRIPT.sub("", html)


def _is_plotlyjs_bundle(output) -> bool:
    html = output.get("data", {}).get("text/html", "") if output.get("output_type") == "display_data" else ""
    html = "".join(html) if isinstance(html, list) else html
    return len(html) > 1_000_000 and "plotly.js" in html[:5000]


def shrink_notebook(nb) -> int:
    """Drop the plotly.js bundle (~4.8 MB) that the "notebook" renderer embeds in the setup cell's output;
    `render_report` puts plotly.js into the page itself. Returns the number of outputs dropped."""
    n = 0
    for cell in nb.cells:
        if cell.get("cell_type") == "code" and cell.get("outputs"):
            keep = [o for o in cell.outputs if not _is_plotlyjs_bundle(o)]
            n += len(cell.outputs) - len(keep)
            cell.outputs = keep
    return n


def _plotlyjs_script(out: Path, standalone: bool) -> str:
    from .assets import plotly_script
    return '<script type="text/javascript">window.PlotlyConfig = {MathJaxConfig: "local"};</script>\n' \
           + plotly_script(out, standalone)


def executed_notebooks(run_dir: str | Path) -> list[Path]:
    return sorted(p for p in Path(run_dir).glob("*.ipynb") if not p.name.startswith("."))


def render_report(run_dir: str | Path, out: str | Path | None = None, shrink: bool = True, standalone: bool = False) -> Path:
    """Write `run_dir/report.html` (or `out`) from the executed notebook(s) in the folder (one page,
    sections in order); `standalone` embeds plotly.js instead of linking the results folder's copy."""
    run_dir = Path(run_dir)
    nbs = executed_notebooks(run_dir)
    if not nbs:
        raise FileNotFoundError(f"{run_dir} holds no executed notebook to render")
    ex = _exporter()
    parts = []
    for path in nbs:
        one = nbformat.read(path, as_version=4)
        if shrink_notebook(one) and shrink:   # the run folder keeps the notebook without the 4.8 MB bundle
            write_text(path, nbformat.writes(one))     # whole or unchanged (a full disk must not cut it)
        parts.append(one)
    nb = parts[0]
    for more in parts[1:]:   # several notebooks (e.g. probe + sweep): one page
        nb.cells.extend(more.cells)
    nb.metadata.pop("widgets", None)   # widget state would pull the widget manager from a CDN; reports are widget-free
    nb.metadata.setdefault("title", f"labkit report {run_dir.name}")
    html, _ = ex.from_notebook_node(nb, resources={"metadata": {"name": f"labkit {run_dir.name}"}})
    # plotly.js exactly once, from the installed package, before any figure: readable offline
    out = Path(out) if out else run_dir / "report.html"
    html = strip_cdn_scripts(html).replace("<head>", "<head>\n" + _plotlyjs_script(out, standalone), 1)
    write_text(out, html)            # whole or absent
    return out
