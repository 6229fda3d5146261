"""HTML pages (the run index, comparisons), readable offline.

    page = Page("labkit runs")
    page.heading("Trends"); page.figure(fig); page.table(df); page.write("results/index.html")

Each figure is a `<div>` plus its data; plotly.js comes once, in the page head: linked from the results
folder's shared copy when the page is written inside one, embedded otherwise or with `standalone=True`
(see `assets.py`), so the file works with no network either way. The page records how many figures it holds (`<meta name="labkit-figures">`)
so a browser check can compare it with what rendered. Text and table cells are HTML-escaped; links
are only ever relative paths we built.
"""
from __future__ import annotations

import html
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go

from ..atomic import write_text
from .assets import plotly_script

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:1.5rem auto;max-width:1400px;padding:0 1rem;color:#222}
h1{font-size:1.5rem} h2{font-size:1.2rem;margin-top:2rem;border-bottom:1px solid #ddd}
table.lk{border-collapse:collapse;font-size:.85rem;margin:.5rem 0;display:block;overflow-x:auto;max-width:100%}
table.lk th,table.lk td{border:1px solid #ddd;padding:.25rem .5rem;text-align:right;white-space:nowrap}
table.lk td.t.wrap{white-space:normal;min-width:16rem}
table.lk th{background:#f5f5f5} table.lk td.t{text-align:left}
.regression{background:#fdd;font-weight:600} .improvement{background:#dfd} .noise{color:#888}
.failed{color:#b00;font-weight:600} .ok{color:#080} .note{color:#555;font-size:.9rem}
"""


def esc(x) -> str:
    return html.escape("" if x is None else str(x))


class Page:
    def __init__(self, title: str):
        self.title = title
        self.parts: list[str] = []
        self.n_figures = 0

    def heading(self, text: str, level: int = 2) -> "Page":
        self.parts.append(f"<h{level}>{esc(text)}</h{level}>")
        return self

    def text(self, text: str, cls: str = "note") -> "Page":
        self.parts.append(f'<p class="{cls}">{esc(text)}</p>')
        return self

    def raw(self, fragment: str) -> "Page":
        """Trusted HTML built by the caller (escape what came from data with `esc`)."""
        self.parts.append(fragment)
        return self

    def figure(self, fig: go.Figure) -> "Page":
        self.n_figures += 1
        self.parts.append(fig.to_html(full_html=False, include_plotlyjs=False, div_id=f"fig{self.n_figures}",
                                      config={"displaylogo": False, "responsive": True}))
        return self

    def table(self, df: pd.DataFrame, classes: dict[int, str] | None = None, links: dict[str, str] | None = None,
              fmt: dict[str, str] | None = None, wrap: tuple[str, ...] = ()) -> "Page":
        """A table (it scrolls sideways when wider than the page; cells do not wrap except the `wrap`
        columns); `classes` maps row position -> CSS class, `links` column -> column holding its href."""
        classes, links, fmt = classes or {}, links or {}, fmt or {}
        shown = [c for c in df.columns if c not in set(links.values())]
        head = "".join(f"<th>{esc(c)}</th>" for c in shown)
        body = []
        for i, (_, r) in enumerate(df.iterrows()):
            cells = []
            for c in shown:
                v = r[c]
                txt = "" if v is None or (isinstance(v, float) and v != v) else (
                    format(v, fmt[c]) if c in fmt and isinstance(v, (int, float)) else str(v))
                if c in links and isinstance(r[links[c]], str) and r[links[c]]:
                    txt = f'<a href="{esc(r[links[c]])}">{esc(txt)}</a>'
                else:
                    txt = esc(txt)
                num = isinstance(v, (int, float)) and not isinstance(v, bool)
                cls_attr = "" if num else ' class="t wrap"' if c in wrap else " class=t"
                cells.append(f"<td{cls_attr}>{txt}</td>")
            cls = classes.get(i)
            body.append(f'<tr{f" class={cls}" if cls else ""}>' + "".join(cells) + "</tr>")
        self.parts.append(f'<table class="lk"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>')
        return self

    def render(self, path: str | Path | None = None, standalone: bool = False) -> str:
        """The page as it would be written at `path` (None: standalone, plotly.js embedded)."""
        script = plotly_script(path, standalone) if path is not None else plotly_script("", standalone=True)
        return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
                f'<meta name="viewport" content="width=device-width, initial-scale=1">'
                f'<meta name="labkit-figures" content="{self.n_figures}">'
                f"<title>{esc(self.title)}</title><style>{CSS}</style>"
                f"{script}</head>\n<body>\n"
                f"<h1>{esc(self.title)}</h1>\n" + "\n".join(self.parts) + "\n</body></html>\n")

    def write(self, path: str | Path, standalone: bool = False) -> Path:
        """Write atomically (a reader never sees half a page)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, self.render(path, standalone))    # no stray temporary file if the disk is full
        return path
