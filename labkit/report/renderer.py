"""The plotly renderer of the lab's notebooks, "labkit": each figure as plotly's own JSON mimetype, which JupyterLab,
Notebook 7 and VS Code draw with the plotly.js they ship (offline), beside an HTML div that the lab's reports draw
with the plotly.js `labkit report` puts in their head (`report.notebook`). Nothing is loaded from a CDN (plotly's
"notebook" renderer adds a MathJax script from one to every figure; the lab's figures have no LaTeX), and a notebook
run headless (papermill, nbconvert) saves no 4.8 MB plotly.js bundle: each figure costs its data twice (the JSON
and the div's), a few kB for the lab's figures.

    from labkit.report.renderer import use
    use()            # the first cell of every notebook
"""
from __future__ import annotations

import json

import plotly.io as pio
from plotly.io.base_renderers import MimetypeRenderer

NAME = "labkit"
MIMETYPE = "application/vnd.plotly.v1+json"
HEIGHT = 525          # px, plotly's own default for a figure that sets none


def bundle(fig) -> dict:
    """One figure (a plotly Figure or its dict) as {plotly's JSON mimetype, an HTML div whose script calls the
    page's `Plotly`}: no plotly.js source, no script from a CDN."""
    spec = json.loads(pio.to_json(fig, validate=False, remove_uids=False))
    html = pio.to_html(fig, include_plotlyjs=False, include_mathjax=False, full_html=False,
                       default_width="100%", default_height=HEIGHT, validate=False)
    return {MIMETYPE: spec, "text/html": html}


class LabRenderer(MimetypeRenderer):
    """plotly's renderer interface over `bundle`: what `fig.show()` and a figure at the end of a cell display."""

    def to_mimebundle(self, fig_dict):
        return bundle(fig_dict)


def use() -> None:
    """Register the renderer and make it plotly's default in this kernel."""
    if NAME not in pio.renderers:
        pio.renderers[NAME] = LabRenderer()
    pio.renderers.default = NAME
