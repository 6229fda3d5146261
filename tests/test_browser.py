"""Everything the lab shows, opened in a real headless Chromium with the network blocked:
every generated report, the run index and a comparison page render all their plotly figures with no
console errors; `make lab`'s command (`labkit lab`, as the current user: root in CI) serves JupyterLab on
127.0.0.1 with a token, explore.ipynb shows its controls before any code, runs, and moving a slider
changes a figure's data."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from browser_util import (REPO, assert_plotly_renders, chromium, derived_run, figures_in_notebook_report,
                          figures_in_page, needs_chromium, nightly_root, offline_context, open_page)
from test_lab_tracked import git_clone_of_the_explorer

EXPLORE = REPO / "notebooks" / "explore.ipynb"


# The explorer's logic without a browser: tests/test_explore.py.


# ---------------------------------------------------------------- pages in a real browser

@pytest.fixture(scope="module")
def launched():
    """One Chromium for every browser test of this module (a launch per test costs seconds on 2 cores); each
    test opens its pages in a context of its own."""
    with chromium() as b:
        yield b


@pytest.fixture
def ctx(launched):
    with offline_context(launched) as c:
        yield c


def _check_reports(ctx, reports: list[Path]) -> int:
    checked = 0
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
def test_generated_reports_render_all_figures_offline(ctx):
    """The reports the nightly test plan just wrote (probe, decode, and the failed entry's partial one)."""
    reports = sorted(nightly_root().glob("**/report.html"))
    assert len(reports) >= 3
    assert _check_reports(ctx, reports) >= 2


COMMITTED = sorted((REPO / "results").glob("**/report.html"))


@pytest.mark.browser
@needs_chromium
@pytest.mark.parametrize("report", COMMITTED, ids=[str(p.parent.relative_to(REPO / "results")) for p in COMMITTED])
def test_committed_reports_render_all_figures_offline(ctx, report):
    """Every report in the project's measured record opens offline with all its figures (a nightly entry
    that failed before its first figure opens without errors and with none)."""
    assert _check_reports(ctx, [report]) == (1 if figures_in_notebook_report(report.parent) else 0)


@pytest.mark.browser
@needs_chromium
def test_index_and_comparison_render_offline(ctx, tmp_path):
    from labkit.report.compare import compare
    from labkit.report.index import rebuild_index
    root = nightly_root()
    a = derived_run(root / "cmp-a", "2026-01-03T00:00:00+00:00", spread=0.05)
    b = derived_run(root / "cmp-b", "2026-01-04T00:00:00+00:00", spread=0.05, scale={"zero_copy": 2.0})
    index = rebuild_index(root)
    cmp = compare(a, b, tmp_path / "cmp.html")
    assert figures_in_page(index) >= 2 and figures_in_page(cmp) == 1
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


@contextmanager
def lab_server(tmp_path: Path, results: Path):
    """`make lab`'s own command (`labkit lab`) as the current user, on a git clone of the explorer in `tmp_path`
    (the repository's own file is never put at risk: the clone's, tracked there, is what must stay as committed),
    over the runs under `results`, with fresh
    Jupyter settings, data (signature store) and runtime folders, as on a new user's machine, and
    `window.jupyterapp` exposed so the test can run all cells. Yields the base URL, token, the URL it
    printed, its output so far, and the path of its log."""
    lab_root = git_clone_of_the_explorer(tmp_path)      # committed, as in a clone: `labkit lab` serves it read-only
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "LABKIT_LAB_TOKEN": token, "LABKIT_RESULTS": str(results), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "ws"),
           "JUPYTER_DATA_DIR": str(tmp_path / "data"), "PYTHONUNBUFFERED": "1"}
    log_path = tmp_path / "lab.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "lab", "--port", str(port), "--port-exact",
                             "--dir", str(lab_root), "--", "--LabApp.expose_app_in_browser=True"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=1)
                break
            except Exception:
                if proc.poll() is not None:
                    raise RuntimeError(f"labkit lab exited ({proc.returncode}): {log_path.read_text()[-2000:]}")
                time.sleep(0.5)
        else:
            raise RuntimeError("labkit lab did not start in 60 s")
        printed = log_path.read_text()
        url = next(w for w in printed.split() if w.startswith(base) and "token=" in w)
        yield base, token, url, printed, log_path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()




# a kernel chosen for the open notebook (started or starting), or JupyterLab's dialog asking which to start
KERNEL_OR_DIALOG = ("() => { const w = window.jupyterapp.shell.currentWidget; const s = w && w.sessionContext; "
                    "return !!document.querySelector('.jp-Dialog .jp-mod-accept') || !!(s && s.session && s.session.kernel); }")


def accept_kernel_dialog(page) -> None:
    """JupyterLab may ask which kernel to start (a fresh settings folder): take the notebook's own. Waits until
    it asks or has chosen a kernel by itself (then it never asks), not a fixed time for a dialog that may not come."""
    page.wait_for_function(KERNEL_OR_DIALOG, timeout=60000)
    if page.locator(".jp-Dialog .jp-mod-accept").count():
        page.click(".jp-Dialog .jp-mod-accept")


def run_all_cells(page) -> None:
    """Wait for the notebook and its kernel, then Run All (fire and forget: the command's promise settles
    only when every cell has run)."""
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60000)
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.commands.hasCommand('notebook:run-all-cells')",
                           timeout=30000)
    accept_kernel_dialog(page)
    page.wait_for_function("() => { const w = window.jupyterapp.shell.currentWidget; const k = w && w.sessionContext "
                           "&& w.sessionContext.session && w.sessionContext.session.kernel; return k && k.status === 'idle'; }",
                           timeout=180000)     # run-all before the kernel is up is lost on a loaded machine
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")


# per explorer figure (vs context, the selected point, vs budget: the first three plots), how many traces
# hold at least one point
FILLED = """() => [...document.querySelectorAll('.js-plotly-plot')].slice(0, 3).map(p =>
              (p.data || []).filter(t => t.y && t.y.length > 0).length)"""
# per figure, whether its title lies inside the figure's box (plotly clips a long one at the right)
TITLES_FIT = """() => [...document.querySelectorAll('.js-plotly-plot')].slice(0, 3).map(p => {
              const t = p.querySelector('.gtitle'); if (!t) return true;
              const a = p.getBoundingClientRect(), b = t.getBoundingClientRect();
              return b.left >= a.left - 1 && b.right <= a.right + 1; })"""
SHAPES = "() => [...document.querySelectorAll('.widget-dropdown')].filter(d => d.innerText.trim().startsWith('shape'))" \
         ".map(d => [...d.querySelectorAll('option')].map(o => o.textContent))[0]"


@pytest.mark.browser
@needs_chromium
def test_explorer_first_view_is_filled_and_a_run_change_keeps_the_shapes(launched, tmp_path):
    """What a new user gets from `make lab` on a fresh clone: no news prompt, no "not trusted" notebook;
    after Run All on a fresh CPU sweep every explorer figure holds data, and so it does after switching
    to the committed H200 run, whose shape the shape dropdown then offers (no widget state errors)."""
    from browser_util import H200_RUN, explore_root
    root = explore_root()
    with lab_server(tmp_path, root) as (base, token, url, printed, log_path):
        with urllib.request.urlopen(f"{base}/lab/api/settings/@jupyterlab/apputils-extension:notification?token={token}") as r:
            notif = json.loads(r.read())
        with offline_context(launched) as ctx:
            page = open_page(ctx, url)
            try:
                run_all_cells(page)
                page.wait_for_function(f"() => ({FILLED})().length === 3", timeout=300000)
                # the three figures draw within moments of each other: until each holds data, not a fixed time
                page.wait_for_function(f"() => ({FILLED})().every(n => n >= 1)", timeout=30000)
                first = {"filled": page.evaluate(FILLED), "titles": page.evaluate(TITLES_FIT), "shapes": page.evaluate(SHAPES)}
                news = page.get_by_text("official Jupyter news").count()
                h200 = next(o for o in page.eval_on_selector_all(".widget-dropdown option", "os => os.map(o => o.textContent)")
                            if o.startswith(H200_RUN.name))
                run_select = page.locator(".widget-dropdown").filter(has=page.locator("label", has_text="run")).locator("select")
                run_select.select_option(label=h200)
                page.wait_for_function(f"() => JSON.stringify(({FILLED})()) === JSON.stringify([3, 1, 3])", timeout=60000)
                page.wait_for_timeout(1000)
                second = {"filled": page.evaluate(FILLED), "titles": page.evaluate(TITLES_FIT), "shapes": page.evaluate(SHAPES)}
            except Exception:
                page.screenshot(path=str(tmp_path / "lab.png"), full_page=True)
                raise AssertionError(f"explorer check failed; screenshot {tmp_path / 'lab.png'}, browser errors "
                                     f"{page.errors[:5]}, blocked {ctx.blocked[:5]}") from None
            errors = list(page.errors)
            page.close()
        log = log_path.read_text()
    assert first["shapes"] == ["tiny"] and all(n >= 1 for n in first["filled"]), first
    assert all(first["titles"]) and all(second["titles"]), (first, second)
    assert second["shapes"] == ["qwen3.8-flash-next"], second
    assert not [e for e in errors if "Error setting state" in e or "pageerror" in e], errors
    assert news == 0, "JupyterLab asked about official Jupyter news"
    assert notif["schema"]["properties"]["fetchNews"]["default"] == "false"
    assert notif["schema"]["properties"]["checkForUpdates"]["default"] is False
    assert "is not trusted" not in log, log[-2000:]


def test_banner_and_explorer_name_every_notebook():
    """`labkit lab` prints every notebook it serves, and the explorer's intro links every other one."""
    import nbformat
    from labkit.lab import banner
    text = banner(8888, "t")
    names = sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb"))
    assert len(names) >= 9 and all(n in text for n in names), text
    intro = nbformat.read(EXPLORE, as_version=4).cells[0].source
    assert all(f"]({n}" in intro for n in names if n != EXPLORE.name), intro


def test_lab_signs_only_the_notebooks_labkit_ships(tmp_path, monkeypatch):
    from nbformat.sign import NotebookNotary
    import nbformat
    from labkit.lab import shipped_notebooks, trust_shipped_notebooks
    assert shipped_notebooks() == {p.name for p in (REPO / "notebooks").glob("*.ipynb")}
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "data"))
    shutil.copy(EXPLORE, tmp_path / EXPLORE.name)
    other = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(1)")])
    nbformat.write(other, tmp_path / "mine.ipynb")
    assert trust_shipped_notebooks(tmp_path) == [EXPLORE.name]
    notary = NotebookNotary(data_dir=str(tmp_path / "data"))
    assert notary.check_signature(nbformat.read(tmp_path / EXPLORE.name, as_version=4))
    assert not notary.check_signature(nbformat.read(tmp_path / "mine.ipynb", as_version=4))


def test_make_lab_runs_labkit_lab_as_any_user():
    """`make lab` is `labkit lab` (dry run: nothing started), and that command lets root start JupyterLab."""
    out = subprocess.run(["make", "-n", "lab"], cwd=REPO, capture_output=True, text=True).stdout
    assert "labkit lab" in out and "jupyter lab" not in out, out
    from labkit.lab import lab_command
    cmd = lab_command(8888, REPO / "notebooks")
    assert "--ServerApp.ip=127.0.0.1" in cmd and not any("token" in c.lower() for c in cmd)
    assert ("--allow-root" in cmd) == (os.geteuid() == 0)


# the first three figures each hold a trace with points
FIRST_VIEW_FILLED = """() => { const p = [...document.querySelectorAll('.js-plotly-plot')].slice(0, 3);
                               return p.length === 3 && p.every(e => (e.data || []).some(t => t.y && t.y.length > 0)); }"""


@pytest.fixture(scope="module")
def lab_explorer(launched, tmp_path_factory):
    """`make lab`'s command over the nightly runs, its printed URL opened and explore.ipynb run once (Run All),
    shared by the three tests below: what the notebook shows before any cell runs and the first screen after
    Run All are recorded here, before anything is touched; the slider test then moves a control on the page."""
    from types import SimpleNamespace
    tmp = tmp_path_factory.mktemp("lab")
    with lab_server(tmp, nightly_root()) as (base, token, url, printed, _), offline_context(launched) as ctx:
        page = open_page(ctx, url)
        try:
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60000)
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.commands.hasCommand('notebook:run-all-cells')",
                                   timeout=30000)
            accept_kernel_dialog(page)
            # before any cell runs: the saved first view draws its figures (no Run All yet)
            try:
                page.wait_for_function(FIRST_VIEW_FILLED, timeout=120000)
                first_view = True
            except Exception:
                first_view = False
            executed_before = page.evaluate("() => window.jupyterapp.shell.currentWidget.content.widgets"
                                            ".filter(c => c.model.type === 'code' && c.model.executionCount).length")
            errors_before = [e for e in page.errors if "pageerror" in e]
            # hidden code: no code editor is shown in any code cell
            shown_editors = page.evaluate("() => [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-editor')]"
                                          ".filter(e => e.offsetParent !== null).length")
            page.wait_for_function("() => { const w = window.jupyterapp.shell.currentWidget; const k = w && w.sessionContext "
                                   "&& w.sessionContext.session && w.sessionContext.session.kernel; return k && k.status === 'idle'; }",
                                   timeout=180000)     # run-all before the kernel is up is lost on a loaded machine
            # fire and forget: the command's promise settles only when every cell has run
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
            page.wait_for_selector(".widget-dropdown", timeout=300000)
            page.wait_for_selector(".widget-slider", timeout=60000)
            page.wait_for_timeout(500)
            vh = page.viewport_size["height"]
            boxes = page.evaluate("""() => [...document.querySelectorAll('.widget-dropdown, .widget-slider')].map(e => {
                                        const r = e.getBoundingClientRect(); return [r.top, r.bottom, r.height]; })""")
            scrolled = page.evaluate("() => document.querySelector('.jp-WindowedPanel-outer, .jp-Notebook').scrollTop")
        except Exception:
            page.screenshot(path=str(tmp / "lab.png"))
            raise AssertionError(f"JupyterLab check failed; screenshot {tmp / 'lab.png'}, browser errors "
                                 f"{page.errors[:5]}, blocked {ctx.blocked[:5]}") from None
        yield SimpleNamespace(base=base, token=token, url=url, printed=printed, page=page, ctx=ctx, tmp=tmp,
                              first_view=first_view, executed_before=executed_before, errors_before=errors_before,
                              shown_editors=shown_editors, vh=vh, boxes=boxes, scrolled=scrolled)
        page.close()


@pytest.mark.browser
@needs_chromium
def test_explore_opens_with_figures_before_any_cell_runs(lab_explorer):
    """explore.ipynb draws its saved first view (a committed run) the moment it opens, before any cell runs."""
    lab = lab_explorer
    assert lab.first_view, f"no first view before Run All; screenshot of the page later: {lab.tmp / 'lab.png'}"
    assert lab.executed_before == 0, "a cell ran: the first view must not need one"
    assert not lab.errors_before, lab.errors_before


@pytest.mark.browser
@needs_chromium
def test_lab_opens_on_the_explorer_controls_not_code(lab_explorer):
    """The URL `make lab` prints opens explore.ipynb; after Run All the controls are visible in the first
    screen, above every line of code (the code cells are hidden)."""
    lab = lab_explorer
    assert lab.url == f"{lab.base}/lab/tree/explore.ipynb?token={lab.token}"
    assert f"ssh -N -L {lab.base.rsplit(':', 1)[1]}:127.0.0.1:" in lab.printed      # how to reach it from a laptop
    assert "Running as root is not recommended" not in lab.printed
    assert lab.shown_editors == 0, f"{lab.shown_editors} code cells show their code"
    assert len(lab.boxes) >= 5 and all(h > 0 for _, _, h in lab.boxes)
    assert lab.scrolled == 0
    first_screen = [b for b in lab.boxes if b[1] <= lab.vh]
    assert len(first_screen) >= 5, f"controls below the first screen ({lab.vh} px): {lab.boxes}"


@pytest.mark.browser
@needs_chromium
def test_jupyterlab_runs_explorer_and_slider_changes_figure(lab_explorer):
    page, ctx = lab_explorer.page, lab_explorer.ctx
    # the selected point's figure as drawn: its first trace's y values, or null while it is (re)drawing (no trace
    # yet, or not every value a number); a wait below takes only a drawn figure, never a null caught mid-redraw
    point = ("() => { const p = document.querySelectorAll('.js-plotly-plot')[1]; "
             "const y = p && p.data && p.data[0] && p.data[0].y ? Array.from(p.data[0].y).map(Number) : []; "
             "return y.length && y.every(Number.isFinite) ? y : null; }")
    try:
        # FigureWidgets: vs context, the selected point, vs budget (and live PCIe, on a GPU only)
        page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot').length >= 3 && "
                               "[...document.querySelectorAll('.js-plotly-plot')].every(e => e.querySelector('.main-svg'))",
                               timeout=60000)
        # a loaded 2-core machine draws late; the value is the one the wait saw (no second read to race a redraw)
        before = page.wait_for_function(point, timeout=120000).json_value()
        slider = page.locator(".widget-slider").filter(has_text="context").first
        assert "1K" in slider.inner_text()
        slider.locator(".noUi-handle").first.focus()
        page.keyboard.press("ArrowLeft")
        after = page.wait_for_function(f"b => {{ const y = ({point})(); return y && JSON.stringify(y) !== JSON.stringify(b) "
                                       f"? y : null; }}", arg=before, timeout=30000).json_value()
        assert "256" in slider.inner_text()
        disabled_note = page.locator("text=measure now is disabled").count()
        n_plots = page.locator(".js-plotly-plot").count()
    except Exception:
        shot = lab_explorer.tmp / "lab-slider.png"
        page.screenshot(path=str(shot), full_page=True)
        raise AssertionError(f"JupyterLab check failed; screenshot {shot}, browser errors "
                             f"{page.errors[:5]}, blocked {ctx.blocked[:5]}") from None
    errors = [e for e in page.errors if "pageerror" in e]
    assert after != before and len(after) == len(before) == 3
    import torch
    if not torch.cuda.is_available():
        assert disabled_note >= 1
        assert n_plots == 3, "a CPU draws no live PCIe plot (it would stay empty axes)"
    assert not errors, errors


@pytest.mark.browser
@needs_chromium
def test_the_explorer_leaves_its_tracked_file_alone(lab_explorer):
    """After Run All and a slider move (the session's outputs differ from the saved ones), the explorer is open
    read-only: JupyterLab's autosave skips it (`canSave` false), Save (the menu command and the document's own
    save, as autosave calls it) writes nothing, and the committed file is byte for byte as it was."""
    page, clone = lab_explorer.page, lab_explorer.tmp / "notebooks"
    state = page.evaluate("""async () => { const w = window.jupyterapp.shell.currentWidget, c = w.context;
        const out = {dirty: c.model.dirty, canSave: c.canSave, writable: c.contentsModel.writable,
                     readOnlyShown: !!document.querySelector('[data-jp-item-name="read-only-indicator"], '
                                                              + '.jp-ToolbarLabelComponent[title*="read-only"]')};
        window.jupyterapp.commands.execute('docmanager:save').catch(() => null);   // answers with a dialog: not awaited
        out.saveError = await Promise.race([c.save().then(() => '', e => String(e && (e.message || e))),
                                            new Promise(r => setTimeout(() => r('no answer in 20 s'), 20000))]);
        return out; }""")
    page.wait_for_timeout(1000)
    assert state["writable"] is False and state["canSave"] is False, state
    assert state["readOnlyShown"], state
    changed = subprocess.run(["git", "-C", str(clone), "status", "--porcelain", "--", EXPLORE.name], capture_output=True,
                             text=True, check=True).stdout
    assert not changed, f"JupyterLab saved over the tracked explorer: {changed}"
