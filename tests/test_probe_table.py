"""The probe notebook's table of measurements shows no pandas index (a bare column of row numbers before
`strategy`): the cell that draws it, run on a committed probe run's rows, without a kernel (well under a second)."""
from __future__ import annotations

import re

import nbformat
import pytest

from browser_util import REPO


def test_probe_table_has_no_row_number_column():
    from labkit.report import summary as S
    from labkit.results import load_run
    path = REPO / "results/20261129-153514-probe-h200"
    if not path.is_dir():
        pytest.skip("the committed probe run is not in this checkout")
    nb = nbformat.read(REPO / "notebooks/probe.ipynb", as_version=4)
    setup = next(c for c in nb.cells if "setup" in c.metadata.get("tags", []))
    cell = next(c for c in nb.cells if c.cell_type == "code" and "cols = [" in c.source)
    shown = []
    ns = {"m": load_run(path).metrics, "S": S}
    exec("\n".join(ln for ln in setup.source.splitlines() if ln.startswith(("import", "from")) and "renderer" not in ln),
         ns)
    ns["display"] = shown.append
    exec(cell.source, ns)
    html = shown[0]._repr_html_() if hasattr(shown[0], "_repr_html_") else None
    assert html is not None, f"the table is shown as {type(shown[0]).__name__}, not as HTML without its index"
    first = re.search(r"<th[^>]*>([^<]*)</th>", html).group(1)
    assert first == "strategy", first
    assert "<td>strategy" not in html and not re.search(r"<th>\s*0\s*</th>", html)   # no row labels
