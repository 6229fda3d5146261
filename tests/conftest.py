import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device host: pytest -m gpu)")
    for it in items:
        if "gpu" in it.keywords and not HAS_CUDA:
            it.add_marker(skip)


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")


# ------------------------------------------------------------------ the run's last line
# A quiet "24 skipped" hides whole groups that never ran (the browser tests without Chromium, the GPU
# tests without CUDA). The run ends with one line naming each group that did not run, why, and the
# command that runs it.

HOW = {
    "browser": "as root: scripts/ensure_chromium.sh (apt-get install -y chromium), then make test",
    "gpu": "on a CUDA host: python -m pytest -m gpu (offline host: scripts/device.sh gpu-tests)",
}
_SKIPPED: dict[str, Counter] = {}


def _group(report) -> str:
    for g in ("gpu", "browser", "slow"):
        if g in report.keywords:
            return g
    return "other"


def pytest_runtest_logreport(report):
    if report.skipped and report.when in ("setup", "call"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _SKIPPED.setdefault(_group(report), Counter())[reason.removeprefix("Skipped: ")] += 1


def not_run_line(skipped: dict[str, Counter]) -> str:
    if not skipped:
        return "labkit: every collected test ran (none skipped)"
    parts = []
    for g in sorted(skipped, key=lambda g: (g == "other", g)):
        n = sum(skipped[g].values())
        why = "; ".join(r for r, _ in skipped[g].most_common(2))
        parts.append(f"{n} {g} test{'s' if n != 1 else ''} ({why}{'; run them ' + HOW[g] if g in HOW else ''})")
    return "labkit: NOT RUN: " + ", ".join(parts)


def pytest_unconfigure(config):
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None and getattr(config.option, "collectonly", False) is False:
        tr.write_line(not_run_line(_SKIPPED), yellow=bool(_SKIPPED), bold=True)
