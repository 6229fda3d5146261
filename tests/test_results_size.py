"""results/ stays small and every page in it still opens offline: reports and the index link the one
shared plotly.js (`results/_assets/plotly.min.js`) by a relative path, executed notebooks carry no bundle,
and `labkit report DIR --standalone` still writes one self-contained file to send."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from browser_util import REPO
from labkit.report.assets import ASSETS, BUNDLE_BYTES, PLOTLY_JS, plotly_script, results_root_of

RESULTS = REPO / "results"
# of the 64 MiB a GPU call carries: the rest of the tracked tree is ~7 MiB, a snapshot of the code ~6 MiB and the
# carried wheels ~2 MiB beside it (about 40 MiB in all at this limit)
LIMIT_MB = 25
SCRIPT = re.compile(r"<script\b([^>]*)>(.*?)</script>", re.S)


def _inline_scripts(html: str) -> list[int]:
    return [len(body) for attrs, body in SCRIPT.findall(html) if "src=" not in attrs]


def test_results_folder_is_small():
    total = sum(p.stat().st_size for p in RESULTS.rglob("*") if p.is_file())
    assert total < LIMIT_MB * 2**20, f"results/ holds {total / 2**20:.1f} MB; the GPU host takes 64 MiB in all"


@pytest.mark.parametrize("page", sorted(RESULTS.rglob("*.html")), ids=lambda p: str(p.relative_to(RESULTS)))
def test_committed_page_links_the_shared_plotlyjs(page):
    html = page.read_text(encoding="utf-8")
    big = [n for n in _inline_scripts(html) if n > BUNDLE_BYTES]
    assert not big, f"{page.relative_to(REPO)} embeds its own plotly.js ({big[0] / 1e6:.1f} MB): re-render it (labkit report DIR)"
    srcs = re.findall(r'<script[^>]*src="([^"]+)"', html)
    assert srcs == [os.path.relpath(RESULTS / ASSETS / PLOTLY_JS, page.parent)], srcs
    assert (page.parent / srcs[0]).resolve().is_file()


@pytest.mark.parametrize("nb", sorted(RESULTS.rglob("*.ipynb")), ids=lambda p: str(p.relative_to(RESULTS)))
def test_committed_notebook_has_no_plotly_bundle(nb):
    assert nb.stat().st_size < BUNDLE_BYTES, f"{nb.relative_to(REPO)}: {nb.stat().st_size / 1e6:.1f} MB"
    assert "plotly.js v" not in nb.read_text(encoding="utf-8")


def test_where_a_page_gets_plotlyjs(tmp_path):
    run = tmp_path / "results" / "nightly-x" / "entry" / "report.html"
    run.parent.mkdir(parents=True)
    assert results_root_of(run) == tmp_path / "results"
    tag = plotly_script(run)
    assert tag == f'<script type="text/javascript" src="../../{ASSETS}/{PLOTLY_JS}"></script>'
    assert (tmp_path / "results" / ASSETS / PLOTLY_JS).stat().st_size > BUNDLE_BYTES
    assert len(plotly_script(run, standalone=True)) > BUNDLE_BYTES            # asked for one file
    assert len(plotly_script(tmp_path / "elsewhere" / "page.html")) > BUNDLE_BYTES   # no results folder above


def test_report_standalone_is_one_file(tmp_path):
    """A CPU run under a results folder: the report links the shared copy; --standalone embeds it."""
    from browser_util import cpu_run
    import shutil
    run = tmp_path / "results" / "run"
    shutil.copytree(cpu_run(), run)
    p = subprocess.run([sys.executable, "-m", "labkit", "report", str(run)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    shared = (run / "report.html").read_text()
    assert max(_inline_scripts(shared)) < BUNDLE_BYTES and f'src="../{ASSETS}/{PLOTLY_JS}"' in shared
    p = subprocess.run([sys.executable, "-m", "labkit", "report", str(run), "--standalone"], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    alone = Path(p.stdout.strip().splitlines()[-1])
    assert alone == (run / "report-standalone.html").resolve()
    html = alone.read_text()
    assert max(_inline_scripts(html)) > BUNDLE_BYTES and not re.search(r"<script[^>]+src=", html)
    assert html.count('class="plotly-graph-div"') == shared.count('class="plotly-graph-div"') > 0


def test_shared_assets_manifest_describes_the_bundle_and_is_no_run():
    import hashlib
    import json

    from labkit.results import list_runs
    mf = json.loads((RESULTS / ASSETS / "manifest.json").read_text())
    data = (RESULTS / ASSETS / PLOTLY_JS).read_bytes()
    entry = mf["files"][PLOTLY_JS]
    assert entry["bytes"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert not any(Path(p).name == ASSETS for p in list_runs(RESULTS)["path"])
