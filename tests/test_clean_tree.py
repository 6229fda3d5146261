"""Running anything leaves the checkout clean: the run index every run rewrites is not a tracked file, and a
manifest's `-dirty` means tracked code changed, not that a run wrote under results/."""
from __future__ import annotations

import subprocess

from browser_util import REPO
from labkit.results import git_sha


def _git(cwd, *args) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def test_the_run_index_is_not_tracked_and_is_ignored():
    assert _git(REPO, "ls-files", "results/index.html").strip() == ""
    assert _git(REPO, "check-ignore", "results/index.html").strip() == "results/index.html"


def test_a_comparison_page_is_ignored():
    """`labkit compare A B` writes results/compare-A-vs-B.html beside B: a page to read, not a file to commit."""
    page = "results/compare-20261129-101629-decode-h200-vs-20261129-153810-decode-h200.html"
    assert _git(REPO, "check-ignore", page).strip() == page
    assert _git(REPO, "ls-files", "results/compare-*.html").strip() == ""


def test_dirty_means_code_changed_not_results(tmp_path, monkeypatch):
    monkeypatch.delenv("LABKIT_GIT_SHA", raising=False)
    repo = tmp_path / "clone"
    (repo / "results" / "run").mkdir(parents=True)
    (repo / "code.py").write_text("x = 1\n")
    (repo / "results" / "run" / "report.html").write_text("<p>first</p>\n")
    _git(repo, "init", "-q")
    _git(repo, "-c", "user.email=lab@example.org", "-c", "user.name=lab", "add", ".")
    _git(repo, "-c", "user.email=lab@example.org", "-c", "user.name=lab", "commit", "-qm", "first")
    clean = git_sha(repo)
    assert clean != "unknown" and not clean.endswith("-dirty")
    (repo / "results" / "run" / "report.html").write_text("<p>redrawn by a later run</p>\n")
    assert git_sha(repo) == clean                    # a run rewrote a committed report: still clean
    (repo / "code.py").write_text("x = 2\n")
    assert git_sha(repo) == clean + "-dirty"         # code changed
