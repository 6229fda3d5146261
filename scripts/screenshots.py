"""The README's pictures, from the real thing: `make screenshots` (or `.venv/bin/python scripts/screenshots.py`).

What a new user sees on a fresh clone after `make sweep` (a CPU decode sweep here) and `make lab`:

- docs/img/explorer.png: `labkit lab` (make lab's command) on a copy of notebooks/, explore.ipynb as it
  opens, before any cell runs: its saved first view of a committed run (`labkit.explore.save_first_view`),
  the run's id stored in the PNG (a `labkit-run` text chunk) so a test can check it is committed;
- docs/img/report-cpu.png: the CPU sweep's report, its header and first figures;
- docs/img/run-index.png: the run index (`results/index.html`) over the same runs;
- docs/img/report-decode-speed.png, docs/img/report-step-time.png: the first two figures of the committed
  H200 decode report (results/20261129-101629-decode-h200/report.html).

Everything is written to a scratch copy of results/ (the repository's own results/ is only read); every
page is opened offline in Debian's Chromium (/usr/bin/chromium; scripts/ensure_chromium.sh installs it).
The sweep is `make sweep`'s CPU grid with fewer repeats (`--repeats`), so the pictures take minutes, not ten.
"""
from __future__ import annotations

import argparse
import contextlib
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
sys.path.insert(0, str(REPO))          # this checkout's labkit, whichever one the venv was installed from
CHROMIUM = os.environ.get("LABKIT_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]
H200_REPORT = REPO / "results" / "20261129-101629-decode-h200" / "report.html"
# the explorer's three figures (vs context, the selected point, vs budget) each hold at least one trace with data
FILLED = """() => { const p = [...document.querySelectorAll('.js-plotly-plot')].slice(0, 3);
                    return p.length === 3 && p.every(e => (e.data || []).some(t => t.y && t.y.length > 0)); }"""


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


def labkit(*args: str, **kw) -> None:
    """`labkit ...` with this checkout's code, its output shown as it runs."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run([sys.executable, "-m", "labkit", *args], cwd=REPO, env=env, check=True, **kw)


def scratch_results(tmp: Path, repeats: int, sweep_from: Path | None = None) -> tuple[Path, Path]:
    """A copy of the repository's results/ with a CPU decode sweep added: a fresh one (with its report), or
    a copy of `sweep_from` (a run folder made earlier by `make sweep`). Returns (the copy, the sweep's folder)."""
    root = tmp / "results"
    shutil.copytree(REPO / "results", root, ignore=shutil.ignore_patterns("index.html"))
    if sweep_from:
        sweep = root / sweep_from.name
        shutil.copytree(sweep_from, sweep, dirs_exist_ok=True)
        if not (sweep / "report.html").is_file():
            labkit("report", str(sweep))
    else:
        sweep = root / time.strftime("%Y%m%d-%H%M%S-decode-cpu", time.gmtime())
        labkit("run", "decode", "-p", "device=cpu", "-p", f"repeats={repeats}", "--out", str(sweep))
    return root, sweep


def report_figures(out: Path, report: Path = H200_REPORT) -> list[Path]:
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


def page_top(out: Path, page_path: Path, name: str, height: int, figures: int = 1) -> Path:
    """The top `height` px of a page (its header and first figures), once its first `figures` plots drew."""
    with chromium(1300, height) as ctx:
        page = ctx.new_page()
        page.goto(page_path.resolve().as_uri())
        page.wait_for_function("n => document.querySelectorAll('.js-plotly-plot .main-svg').length >= n",
                               arg=figures, timeout=60000)
        page.wait_for_timeout(1000)
        page.screenshot(path=str(out / name))
    return out / name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def png_with_text(path: Path, key: str, value: str) -> None:
    """Add a tEXt chunk `key`=`value` to a PNG (before IEND), as the PNG format defines it."""
    import struct
    import zlib
    data = path.read_bytes()
    body = key.encode("latin-1") + b"\0" + value.encode("latin-1")
    chunk = struct.pack(">I", len(body)) + b"tEXt" + body + struct.pack(">I", zlib.crc32(b"tEXt" + body) & 0xFFFFFFFF)
    end = data.rindex(b"IEND") - 4
    path.write_bytes(data[:end] + chunk + data[end:])


def explorer(out: Path, results: Path) -> Path:
    """`labkit lab` on a scratch copy of the notebooks, with fresh Jupyter settings and data folders as a
    new user has them, explore.ipynb as it opens (no cell run): its saved first view of a committed run."""
    tmp = Path(tempfile.mkdtemp(prefix="labkit-shots-"))
    shutil.copytree(REPO / "notebooks", tmp / "notebooks")
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "LABKIT_LAB_TOKEN": token, "LABKIT_RESULTS": str(results), "JUPYTER_RUNTIME_DIR": str(tmp / "rt"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "ws"),
           "JUPYTER_DATA_DIR": str(tmp / "data"),
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    log = open(tmp / "lab.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "lab", "--port", str(port), "--port-exact",
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
        with chromium(1300, 1500) as ctx:
            page = ctx.new_page()
            errors = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(f"{base}/lab/tree/explore.ipynb?token={token}")
            page.wait_for_function(FILLED, timeout=120000)      # the saved first view, drawn on opening
            page.wait_for_timeout(2000)
            page.evaluate("() => window.jupyterapp.shell.collapseLeft()")      # the notebook, full width
            page.wait_for_timeout(1500)
            if errors:
                print("browser console errors:", *errors[:5], sep="\n  ", file=sys.stderr)
            page.screenshot(path=str(out / "explorer.png"))
            import json
            nb = json.loads((tmp / "notebooks" / "explore.ipynb").read_text())
            shown = next(o["data"]["text/plain"] for c in nb["cells"] for o in c.get("outputs", [])
                         if "saved first view" in "".join(o.get("data", {}).get("text/plain", "")))
            png_with_text(out / "explorer.png", "labkit-run", "".join(shown).split("of the run ")[1].rstrip(". \n"))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return out / "explorer.png"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "img"))
    ap.add_argument("--only", choices=["report", "explorer"], help="report: the H200 report's figures only (no sweep)")
    ap.add_argument("--repeats", type=int, default=2, help="repeats per point of the CPU sweep (make sweep: 5)")
    ap.add_argument("--sweep", help="a CPU decode run folder to show instead of measuring a fresh one")
    a = ap.parse_args(argv)
    if a.sweep and not (Path(a.sweep) / "manifest.json").is_file():
        ap.error(f"--sweep {a.sweep}: not a run folder (no manifest.json)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.only in (None, "report"):
        for p in report_figures(out):
            print(p)
    if a.only == "report":
        return 0
    if a.only == "explorer":          # the saved first view of committed runs: no sweep needed
        print(explorer(out, REPO / "results"))
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="labkit-shots-results-"))
    try:
        root, sweep = scratch_results(tmp, a.repeats, Path(a.sweep) if a.sweep else None)
        if a.only is None:
            print(page_top(out, sweep / "report.html", "report-cpu.png", 1400, figures=2))
            from labkit.report.index import rebuild_index
            with contextlib.chdir(root.parent):      # the page names its root as given: "results", as in a clone
                index = root.parent / rebuild_index(Path(root.name))
            print(page_top(out, index, "run-index.png", 1100))
        print(explorer(out, root))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
