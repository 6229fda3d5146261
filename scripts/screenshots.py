"""The README's pictures, from the real thing: `make screenshots` (or `.venv/bin/python scripts/screenshots.py`).

- docs/img/report-decode-speed.png, docs/img/report-step-time.png: the first two figures of the committed
  H200 decode report (results/20261129-101629-decode-h200/report.html), opened offline in Chromium;
- docs/img/explorer.png: `labkit lab` (make lab's command) on a copy of notebooks/, explore.ipynb run
  top to bottom over results/, as a new user sees it.

Needs Debian's Chromium (/usr/bin/chromium; scripts/ensure_chromium.sh installs it as root).
"""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = os.environ.get("LABKIT_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
REPORT = REPO / "results" / "20261129-101629-decode-h200" / "report.html"


@contextmanager
def chromium(width: int = 1400, height: int = 1000):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        ctx = b.new_context(viewport={"width": width, "height": height}, device_scale_factor=1)
        # offline, as the lab promises: anything not on this machine is refused
        ctx.route("**/*", lambda r: r.continue_() if r.request.url.startswith(
            ("file:", "data:", "blob:", "about:", "http://127.0.0.1", "ws://127.0.0.1")) else r.abort())
        try:
            yield ctx
        finally:
            ctx.close()
            b.close()


def report_figures(out: Path, report: Path = REPORT) -> list[Path]:
    """The first two plotly figures of a report, each cropped to its own box."""
    written = []
    with chromium() as ctx:
        page = ctx.new_page()
        page.goto(report.resolve().as_uri())
        page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot .main-svg').length >= 2", timeout=60000)
        page.wait_for_timeout(500)
        plots = page.locator(".js-plotly-plot")
        for i, name in enumerate(("report-decode-speed.png", "report-step-time.png")):
            plots.nth(i).scroll_into_view_if_needed()
            plots.nth(i).screenshot(path=str(out / name))
            written.append(out / name)
    return written


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def explorer(out: Path, results: Path = REPO / "results") -> Path:
    """`labkit lab` on a scratch copy of the notebooks, explore.ipynb run, first screen captured."""
    tmp = Path(tempfile.mkdtemp(prefix="labkit-shots-"))
    (tmp / "notebooks").mkdir()
    shutil.copy(REPO / "notebooks" / "explore.ipynb", tmp / "notebooks")
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "LABKIT_RESULTS": str(results), "JUPYTER_RUNTIME_DIR": str(tmp / "rt"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "ws")}
    # JupyterLab's one-time "get notified about news?" prompt would cover the figures: answer it in advance
    (tmp / "settings" / "@jupyterlab" / "apputils-extension").mkdir(parents=True)
    (tmp / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        '{"fetchNews": "false"}')
    log = open(tmp / "lab.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "lab", "--port", str(port), "--port-exact", "--token", token,
                             "--dir", str(tmp / "notebooks"), "--", "--LabApp.expose_app_in_browser=True"],
                            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=1)
                break
            except Exception:
                if proc.poll() is not None:
                    raise RuntimeError((tmp / "lab.log").read_text()[-2000:])
                time.sleep(0.5)
        with chromium(1400, 1100) as ctx:
            page = ctx.new_page()
            errors = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(f"{base}/lab/tree/explore.ipynb?token={token}")
            run_all_and_wait(page)
            if errors:
                print("browser console errors:", *errors[:5], sep="\n  ", file=sys.stderr)
            page.screenshot(path=str(out / "explorer.png"))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return out / "explorer.png"


def run_all_and_wait(page, timeout_ms: int = 400000) -> None:
    """Run every cell of the open notebook and wait until the explorer's figures have drawn their data."""
    page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=60000)
    page.wait_for_function("() => window.jupyterapp && window.jupyterapp.commands.hasCommand('notebook:run-all-cells')",
                           timeout=60000)
    try:      # a fresh settings folder may ask which kernel to start: take the notebook's own
        page.wait_for_selector(".jp-Dialog .jp-mod-accept", timeout=8000)
        page.click(".jp-Dialog .jp-mod-accept")
    except Exception:
        pass
    page.wait_for_function("() => { const w = window.jupyterapp.shell.currentWidget; const k = w && w.sessionContext "
                   "&& w.sessionContext.session && w.sessionContext.session.kernel; return k && k.status === 'idle'; }",
                   timeout=180000)     # run-all before the kernel is up is lost on a loaded machine
    page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
    page.wait_for_selector(".widget-slider", timeout=timeout_ms)
    page.wait_for_function("() => [...document.querySelectorAll('.js-plotly-plot')].filter(p => p.data && p.data.length).length >= 1",
                           timeout=timeout_ms)
    page.wait_for_timeout(5000)      # the other figures draw within moments of the first


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "img"))
    ap.add_argument("--only", choices=["report", "explorer"])
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.only in (None, "report"):
        for p in report_figures(out):
            print(p)
    if a.only in (None, "explorer"):
        print(explorer(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
