"""The run index compares a figure only with the same figure: one prefill run's modes (resident, sync,
rotating) and a capped run are separate figures, so no run is flagged against its own other mode."""
from __future__ import annotations

import shutil

import pandas as pd

from browser_util import REPO
from labkit.report.index import collect, headlines

FULL = REPO / "results" / "20261130-121336-prefill-248k-full-h200"      # resident, zero_copy sync + rotating
CAPPED = REPO / "results" / "20261130-121920-prefill-1m-full-cap24-h200"


def test_each_prefill_mode_is_its_own_figure():
    m = pd.read_parquet(FULL / "metrics.parquet")
    keys = [h.key for h in headlines(m) if h.family == "prefill tok/s"]
    assert len(keys) == len(set(keys)) == 3, keys
    assert any("zero_copy sync @ 248K" in k for k in keys) and any("zero_copy rotating @ 248K" in k for k in keys)
    capped = [h.key for h in headlines(pd.read_parquet(CAPPED / "metrics.parquet")) if h.family == "prefill tok/s"]
    assert capped == ["zero_copy rotating @ 1M cap 24 GiB (qwen3.8-flash-next)"]


def test_no_regression_between_two_modes_of_one_run(tmp_path):
    for run in (FULL, CAPPED):
        shutil.copytree(run, tmp_path / run.name, ignore=shutil.ignore_patterns("*.html", "*.ipynb"))
    _, heads, _ = collect(tmp_path)
    pf = heads[heads["family"] == "prefill tok/s"]
    assert len(pf) == 4 and set(pf["verdict"]) == {"first"}, pf[["run_id", "key", "verdict"]]
