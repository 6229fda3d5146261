"""What a report's reader sees: no `NaN`, `None` or `<NA>` cells and no all-empty columns in its tables, and
the host link in words ("PCIe gen None xNone" never)."""
from __future__ import annotations

import re
import shutil

import numpy as np
import pandas as pd
import pytest

from browser_util import REPO
from labkit.report.summary import link_text
from labkit.report.tables import _html, readable

PROBE = REPO / "results" / "20261129-100118-probe-h200"


def test_readable_drops_empty_columns_and_blanks_missing_cells():
    df = pd.DataFrame({"strategy": ["contiguous", "zero_copy"], "gbps": [55.1, np.nan], "matrix": [None, None],
                       "rows": pd.array([1, pd.NA], dtype="Int64")})
    r = readable(df)
    assert list(r.columns) == ["strategy", "gbps", "rows"] and r.loc[1, "gbps"] == "" and r.loc[1, "rows"] == ""
    assert df["gbps"].isna().sum() == 1                       # the data are untouched
    html = _html(df)
    for wrong in ("NaN", "None", "&lt;NA&gt;", "matrix"):
        assert wrong not in html, wrong


def test_link_in_words():
    assert link_text({"gpu_name": None}) == "no PCIe link"
    assert link_text({"gpu_name": "NVIDIA H200", "pcie_gen": 5.0, "pcie_width": 16.0}) == "PCIe gen 5 x16"
    assert link_text({"gpu_name": "NVIDIA H200", "pcie_gen": None, "pcie_width": None}) == "PCIe link not read (no NVML)"


@pytest.mark.slow
def test_the_probe_report_has_no_nan_cells(tmp_path):
    """The committed H200 probe redrawn with today's notebook: its table had 102 NaN cells."""
    from labkit.execute import rerender_notebook
    from labkit.experiments import EXPERIMENTS
    from labkit.report.notebook import render_report
    run = tmp_path / PROBE.name
    shutil.copytree(PROBE, run)
    rerender_notebook(EXPERIMENTS["probe"], run)
    text = re.sub(r"<[^>]+>", " ", render_report(run).read_text())
    table = text[text.index("strategy"):]
    assert "NaN" not in table and "None" not in text.split("Plotly")[0] and "PCIe gen 5 x16" in text
