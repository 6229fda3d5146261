"""What makes "nightly" nightly on the GPU box: the shipped schedule (systemd timer + service, or a cron
line), the runner's own log in the nightly folder, and a lock left by a crashed or rebooted run that is
cleared with a note instead of blocking every later run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from browser_util import REPO
from labkit.nightly import LOG_NAME, run_plan

# a one-entry plan that runs no kernel: a notebook whose only cell is its parameters cell
NB = {"cells": [{"cell_type": "code", "execution_count": None, "id": "p", "metadata": {"tags": ["parameters"]},
                 "outputs": [], "source": "x = 1"}],
      "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
      "nbformat": 4, "nbformat_minor": 5}


def _plan(tmp_path):
    (tmp_path / "tiny.ipynb").write_text(json.dumps(NB))
    plan = tmp_path / "plan.toml"
    plan.write_text('[[entry]]\nname = "tiny"\nnotebook = "tiny.ipynb"\n')
    return plan


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_locks_are_cleared_with_a_note_and_the_run_is_logged(tmp_path):
    root = tmp_path / "results"
    night = root / "nightly-2026-01-05"
    night.mkdir(parents=True)
    # crashed: its process is gone
    (night / ".lock").write_text(json.dumps({"pid": _dead_pid(), "started": "2026-01-05T02:00:00+00:00"}))
    rec = run_plan(_plan(tmp_path), date="2026-01-05", root=root, echo=lambda *a: None)
    assert rec["entries"][0]["status"] == "ok"
    assert not (night / ".lock").exists()
    assert any("stale lock" in n and "exited" in n for n in rec["notes"])
    log = (night / LOG_NAME).read_text()
    assert "cleared a stale lock" in log and "finished, 1 of 1 entries done" in log
    # rebooted: this very process holds it, but on another boot
    (night / ".lock").write_text(json.dumps({"pid": os.getpid(), "boot_id": "another-boot", "started": "x"}))
    rec = run_plan(_plan(tmp_path), date="2026-01-05", root=root, echo=lambda *a: None)
    assert any("rebooted" in n for n in rec["notes"]) and not (night / ".lock").exists()


def test_shipped_schedule_runs_make_nightly_in_this_repo():
    units = subprocess.run([str(REPO / "nightly" / "install_schedule.sh"), "--print", "--at", "03:15"],
                           capture_output=True, text=True, check=True).stdout
    assert f"WorkingDirectory={REPO}" in units and "ExecStart=/usr/bin/env make nightly" in units
    assert "OnCalendar=*-*-* 03:15:00" in units and "Persistent=true" in units and "@" not in units.replace("@jupyter", "")
    cron = subprocess.run([str(REPO / "nightly" / "install_schedule.sh"), "--print", "--cron", "--at", "03:15"],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert cron == f"15 3 * * * cd {REPO} && make nightly >> {REPO}/results/.nightly-cron.log 2>&1"
    bad = subprocess.run([str(REPO / "nightly" / "install_schedule.sh"), "--print", "--at", "25:00"], capture_output=True, text=True)
    assert bad.returncode == 2


def test_make_test_ends_with_the_groups_that_did_not_run(tmp_path):
    """pytest's last line (tests/conftest.py) names each skipped group, why, and how to run it."""
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "@pytest.mark.browser\n@pytest.mark.skipif(True, reason='/usr/bin/chromium is absent')\ndef test_b(): pass\n"
        "@pytest.mark.gpu\ndef test_g(): pass\n"
        "def test_ok(): pass\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n  gpu: x\n  browser: x\n")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("labkit: NOT RUN:") and "1 browser test (/usr/bin/chromium is absent; run them as root:" in last
    import torch
    if not torch.cuda.is_available():
        assert "1 gpu test (needs a CUDA GPU" in last


def test_ensure_chromium_never_fails(tmp_path):
    """Where apt cannot install Chromium, the script says so and exits 0 (CI goes on; the tests skip)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "apt-get").write_text("#!/bin/sh\nexit 100\n")
    (fake / "apt-get").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "LABKIT_CHROMIUM": str(tmp_path / "no-chromium")}
    p = subprocess.run([str(REPO / "scripts" / "ensure_chromium.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "browser tests will be skipped" in p.stdout, p.stdout
