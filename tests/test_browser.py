"""Everything the lab shows, opened in a real headless Chromium with the network blocked:
every generated report, the run index and a comparison page render all their plotly figures with no
console errors; JupyterLab (127.0.0.1, random port, token) runs explore.ipynb, its widgets render, and
moving a slider changes a figure's data. Plus the explorer's update logic without a browser."""
from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from browser_util import (REPO, assert_plotly_renders, browser, derived_run, figures_in_notebook_report,
                          figures_in_page, needs_chromium, nightly_root, open_page)

EXPLORE = REPO / "notebooks" / "explore.ipynb"


# ---------------------------------------------------------------- explorer logic, no browser

def test_explorer_widgets_update_figures_in_place(monkeypatch):
    root = nightly_root()
    monkeypatch.setenv("LABKIT_RESULTS", str(root))
    nb = nbformat.read(EXPLORE, as_version=4)
    assert any("parameters" in c.metadata.get("tags", []) for c in nb.cells)
    ns: dict = {}
    import IPython.display
    monkeypatch.setattr(IPython.display, "display", lambda *a, **k: None)
    for c in nb.cells:
        if c.cell_type == "code":
            exec(compile(c.source, str(EXPLORE), "exec"), ns)
    assert len(ns["RUNS"]) == 1                     # decode-small (the failed entry has no decode points)
    fig_point, fig_ctx = ns["fig_point"], ns["fig_ctx"]
    assert type(fig_point).__name__ == "FigureWidget"
    assert [t.name for t in fig_ctx.data] == ["resident", "host_gather", "zero_copy"]
    ids = (id(fig_point), id(fig_ctx))
    w_ctx = ns["w_ctx"]
    before = tuple(fig_point.data[0].y)
    other = next(v for _, v in w_ctx.options if v != w_ctx.value)
    w_ctx.value = other
    assert tuple(fig_point.data[0].y) != before, "moving the context slider did not change the bars"
    assert fig_ctx.layout.shapes[0].x0 == other
    assert (id(ns["fig_point"]), id(ns["fig_ctx"])) == ids      # same objects: updated in place
    ns["w_strat"].value = ("zero_copy",)
    assert [t.name for t in fig_ctx.data] == ["zero_copy"] and list(fig_point.data[0].x) == ["zero_copy"]
    # no CUDA here: the button is disabled and says why
    import torch
    if not torch.cuda.is_available():
        assert ns["measure"].disabled and "no CUDA GPU" in ns["why"].value
    # the button's code path, on the CPU: one point through labkit.bench.decode, progress bar, live bar
    ns["w_repeats"].value, ns["w_steps"].value = 1, 2
    n_traces = len(fig_point.data)
    rec = ns["measure_point"]("cpu")
    assert rec["status"] == "ok" and rec["tok_s"] > 0 and rec["strategy"] == "zero_copy"
    assert ns["bar"].value == ns["bar"].max == 1 and ns["bar"].description == "done"
    assert len(fig_point.data) == n_traces + 1 and fig_point.data[-1].name == "live"
    assert len(ns["LIVE"]) == 1


# ---------------------------------------------------------------- pages in a real browser

def _check_reports(reports: list[Path]) -> int:
    checked = 0
    with browser() as ctx:
        for rep in reports:
            n = figures_in_notebook_report(rep.parent)
            if n == 0:       # a run whose notebook failed before any figure (the deliberately failing entry)
                page = open_page(ctx, rep.resolve().as_uri())
                page.wait_for_load_state("load")
                page.wait_for_timeout(300)
                assert page.locator(".js-plotly-plot").count() == 0
                assert not page.errors and not ctx.blocked, f"{rep}: {page.errors[:3]} {ctx.blocked[:3]}"
                page.close()
                continue
            assert_plotly_renders(ctx, rep, n)
            checked += 1
    return checked


@pytest.mark.browser
@needs_chromium
def test_generated_reports_render_all_figures_offline():
    """The reports the nightly test plan just wrote (probe, decode, and the failed entry's partial one)."""
    reports = sorted(nightly_root().glob("**/report.html"))
    assert len(reports) >= 3
    assert _check_reports(reports) >= 2


COMMITTED = sorted((REPO / "results").glob("*/report.html"))


@pytest.mark.browser
@needs_chromium
@pytest.mark.parametrize("report", COMMITTED, ids=[p.parent.name for p in COMMITTED])
def test_committed_reports_render_all_figures_offline(report):
    """Every report in the project's measured record opens offline with all its figures."""
    assert _check_reports([report]) == 1


@pytest.mark.browser
@needs_chromium
def test_index_and_comparison_render_offline(tmp_path):
    from labkit.compare import compare
    from labkit.index import rebuild_index
    root = nightly_root()
    a = derived_run(root / "cmp-a", "2026-01-03T00:00:00+00:00", spread=0.05)
    b = derived_run(root / "cmp-b", "2026-01-04T00:00:00+00:00", spread=0.05, scale={"zero_copy": 2.0})
    index = rebuild_index(root)
    cmp = compare(a, b, tmp_path / "cmp.html")
    assert figures_in_page(index) >= 2 and figures_in_page(cmp) == 1
    with browser() as ctx:
        assert_plotly_renders(ctx, index, figures_in_page(index))
        assert_plotly_renders(ctx, cmp, figures_in_page(cmp))
        # the index's report links resolve to files
        page = open_page(ctx, index.resolve().as_uri())
        hrefs = page.eval_on_selector_all("a[href$='report.html']", "els => els.map(e => e.getAttribute('href'))")
        page.close()
    assert hrefs and all((root / h).is_file() for h in hrefs)


# ---------------------------------------------------------------- JupyterLab

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyterlab(tmp_path):
    # a copy of the notebook in its own folder: JupyterLab autosaves, and the repo's file must stay as committed
    lab_root = tmp_path / "lab"
    (lab_root / "notebooks").mkdir(parents=True)
    shutil.copy(EXPLORE, lab_root / "notebooks" / EXPLORE.name)
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "LABKIT_RESULTS": str(nightly_root()), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "ws")}
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
                             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={lab_root}",
                             "--ServerApp.port_retries=0", "--allow-root", "--LabApp.expose_app_in_browser=True",
                             "--LabApp.news_url=None", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                             "--LabApp.extension_manager=readonly"],
                            cwd=lab_root, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=1)
                break
            except Exception:
                if proc.poll() is not None:
                    raise RuntimeError(f"jupyter lab exited: {(tmp_path / 'lab.log').read_text()[-2000:]}")
                time.sleep(0.5)
        else:
            raise RuntimeError("jupyter lab did not start in 60 s")
        yield base, token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.mark.browser
@needs_chromium
def test_jupyterlab_runs_explorer_and_slider_changes_figure(jupyterlab, tmp_path):
    base, token = jupyterlab
    point = ("() => { const p = document.querySelectorAll('.js-plotly-plot')[1]; "
             "return p && p.data && p.data[0] ? Array.from(p.data[0].y).map(Number) : null; }")
    with browser() as ctx:
        page = open_page(ctx, f"{base}/lab/tree/notebooks/explore.ipynb?token={token}")
        try:
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60000)
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.commands.hasCommand('notebook:run-all-cells')",
                                   timeout=30000)
            # JupyterLab may ask which kernel to start (a fresh settings folder): take the notebook's own
            try:
                page.wait_for_selector(".jp-Dialog .jp-mod-accept", timeout=8000)
                page.click(".jp-Dialog .jp-mod-accept")
            except Exception:
                pass
            # fire and forget: the command's promise settles only when every cell has run
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
            page.wait_for_selector(".widget-slider", timeout=120000)
            # four FigureWidgets: vs context, the selected point, vs budget, live PCIe
            page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 4 && "
                                   "[...document.querySelectorAll('.js-plotly-plot')].every(e => e.querySelector('.main-svg'))",
                                   timeout=60000)
            page.wait_for_function(f"() => ({point})() !== null", timeout=30000)
            before = page.evaluate(point)
            slider = page.locator(".widget-slider").filter(has_text="context").first
            assert "1K" in slider.inner_text()
            slider.locator(".noUi-handle").first.focus()
            page.keyboard.press("ArrowLeft")
            page.wait_for_function(f"b => JSON.stringify(({point})()) !== JSON.stringify(b)", arg=before, timeout=30000)
            after = page.evaluate(point)
            assert "256" in slider.inner_text()
            disabled_note = page.locator("text=measure now is disabled").count()
        except Exception:
            page.screenshot(path=str(tmp_path / "lab.png"), full_page=True)
            raise AssertionError(f"JupyterLab check failed; screenshot {tmp_path / 'lab.png'}, browser errors "
                                 f"{page.errors[:5]}, blocked {ctx.blocked[:5]}") from None
        errors = [e for e in page.errors if "pageerror" in e]
        page.close()
    assert after != before and len(after) == len(before) == 3
    import torch
    if not torch.cuda.is_available():
        assert disabled_note >= 1
    assert not errors, errors
