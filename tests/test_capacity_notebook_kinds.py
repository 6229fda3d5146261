"""capacity.ipynb draws three run kinds (capacity, prefill, hot_replay): a run's report holds only its own
sections, under its own title, never an empty "Goodput" section or a capacity title over a prefill run."""
from __future__ import annotations

import html
import re
import shutil

import pytest

from browser_util import REPO

PREFILL = REPO / "results" / "20261130-121336-prefill-248k-full-h200"


@pytest.mark.slow
def test_a_prefill_report_is_titled_and_sectioned_as_prefill(tmp_path):
    from labkit.execute import rerender_notebook
    from labkit.experiments import EXPERIMENTS
    from labkit.report.notebook import render_report
    run = tmp_path / PREFILL.name
    shutil.copytree(PREFILL, run)
    rerender_notebook(EXPERIMENTS["prefill"], run)
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", render_report(run).read_text())).split())
    assert "Prefill by where the prompt's KV goes" in text and "Prefill tok/s and device memory per mode" in text
    for other in ("capacity and goodput", "Goodput per configuration", "Hit rate and link bytes",
                  "This section draws", "No replay run", "No decode run"):
        assert other not in text, other
