"""Tables as a reader sees them in a notebook and its report: a column with no value at all is not shown
(a probe's table carries every probe's columns, most empty for any one row kind), and a missing value in
a column that has some is a blank cell rather than `NaN` / `None` / `<NA>`.

`readable_tables()` (each notebook's first cell) makes every DataFrame an IPython `display` shows come out
that way; the data are untouched (the tables on disk keep their NaN)."""
from __future__ import annotations

import pandas as pd

from .summary import SCROLL_BOX


def readable(df: pd.DataFrame) -> pd.DataFrame:
    """`df` without its all-empty columns, missing values as blank cells (for display only)."""
    keep = [c for c in df.columns if df[c].notna().any()]
    out = df[keep] if len(df) else df
    return out.astype(object).where(out.notna(), "")


def _html(df: pd.DataFrame) -> str:
    shown = readable(df)
    return shown.to_html(max_rows=pd.get_option("display.max_rows"), max_cols=pd.get_option("display.max_columns"),
                         float_format=lambda v: f"{v:.6g}", border=1, classes="dataframe")


def readable_tables() -> None:
    """Register `readable` as the HTML form of every DataFrame this kernel displays."""
    # IPython is there only inside a notebook (the optional `lab` extra)
    from IPython import get_ipython
    ip = get_ipython()
    if ip is not None:
        ip.display_formatter.formatters["text/html"].for_type(pd.DataFrame, _html)


def rows_table(df: pd.DataFrame):
    """A table of rows, each a measurement, for `display`: readable as above and without pandas' index (a column
    of row numbers that says nothing), in a box that scrolls sideways when it is wider than the page."""
    # IPython is there only inside a notebook (the optional `lab` extra)
    from IPython.display import HTML
    html = readable(df).to_html(index=False, max_rows=pd.get_option("display.max_rows"),
                                float_format=lambda v: f"{v:.6g}", border=1, classes="dataframe")
    return HTML(f'<div class="lk-scroll" style="{SCROLL_BOX}">{html}</div>')
