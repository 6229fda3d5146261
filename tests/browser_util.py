"""Shared helpers for the lab tests: CPU run folders made once per test session, and a headless Debian
Chromium (Playwright for Python, no browser download) with the network blocked.

Run folders are built once per pytest process (module-level cache) and reused by the index, compare
and browser tests, so the suite stays inside a few minutes on a 2-core machine.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = Path(os.environ.get("LABKIT_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]


def chromium_problem() -> str | None:
    """Why the browser tests cannot run here, or None. A Chromium that is present but cannot start (a
    half-installed package) is a reason to skip, said as such, not a wall of failing tests."""
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is absent"
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "the playwright package is not installed"
    try:
        subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--version"], capture_output=True, timeout=30, check=True)
    except Exception as ex:
        return f"{CHROMIUM} does not start ({type(ex).__name__})"
    return None


_PROBLEM = chromium_problem()
needs_chromium = pytest.mark.skipif(_PROBLEM is not None, reason=f"{_PROBLEM} (Debian's Chromium drives these tests)")

_CACHE: dict[str, Path] = {}
SWEEP = dict(shape="tiny", device="cpu", strategies="resident,zero_copy", context_lens="256,1024", budgets="64",
             concurrency="1", repeats=2, steps=3, prefill_lens="", probe=False)


def _tmp(name: str) -> Path:
    if "tmp" not in _CACHE:
        _CACHE["tmp"] = Path(tempfile.mkdtemp(prefix="labkit-test-"))
    return _CACHE["tmp"] / name


def cpu_run() -> Path:
    """One real CPU decode run folder (no notebook), made once."""
    if "cpu_run" not in _CACHE:
        from labkit import experiments
        out = _tmp("base-run")
        experiments.measure("decode", {**SWEEP, "out_dir": str(out)}, progress_bar=False)
        _CACHE["cpu_run"] = out
    return _CACHE["cpu_run"]


def derived_run(dest: Path, created: str, scale: dict[str, float] | None = None, spread: float | None = None,
                src: Path | None = None) -> Path:
    """A copy of a run folder with its own id and time; `scale` multiplies each strategy's step times
    (so tok/s divides), `spread` replaces each point's min..max by median x (1 -/+ spread) and records a quiet
    machine (the test decides the spreads, not the load the copied run happened to see)."""
    src = src or cpu_run()
    shutil.copytree(src, dest)
    mf = json.loads((dest / "manifest.json").read_text())
    mf.update(run_id=dest.name, created=created)
    if spread is not None:       # the spreads are the test's: so is the machine's load (quiet), whatever it was
        quiet = {"load_avg": [0.1, 0.1, 0.1], "cpu_count": mf.get("cpu_count"), "busy_processes": []}
        mf.update(machine_load_before=quiet, machine_load_after=quiet)
    (dest / "manifest.json").write_text(json.dumps(mf))
    m = pd.read_parquet(dest / "metrics.parquet")
    m["run_id"] = dest.name
    if spread is not None:
        d = m["experiment"] == "decode"
        m.loc[d, "step_ms_min"] = m.loc[d, "step_ms_median"] * (1 - spread)
        m.loc[d, "step_ms_max"] = m.loc[d, "step_ms_median"] * (1 + spread)
    for s, f in (scale or {}).items():
        sel = (m["strategy"] == s) & (m["experiment"] == "decode")
        for c in ("step_ms_median", "step_ms_min", "step_ms_max"):
            m.loc[sel, c] *= f
        m.loc[sel, "tok_s"] /= f
    m.to_parquet(dest / "metrics.parquet")
    (dest / "report.html").unlink(missing_ok=True)
    return dest


# A CPU sweep with a budget axis, as `make sweep` makes one (main table at the first budget, the other
# budgets at the largest context only), kept tiny: 2 contexts x 2 budgets x 2 strategies, 1 repeat of 2 steps.
BUDGET_AXIS_SWEEP = {**SWEEP, "context_lens": "256,1024", "budgets": "64,16", "repeats": 1, "steps": 2}
H200_RUN = REPO / "results" / "20261129-153810-decode-h200"     # committed: budget axis at 1M only


def explore_root() -> Path:
    """A results root as a new user has it: the committed H200 decode run and a fresh CPU sweep with a
    budget axis (the newest run, so the explorer opens on it). Made once."""
    if "explore" not in _CACHE:
        from labkit import experiments
        root = _tmp("explore-results")
        root.mkdir(parents=True)
        shutil.copytree(H200_RUN, root / H200_RUN.name)
        experiments.measure("decode", {**BUDGET_AXIS_SWEEP, "out_dir": str(root / "cpu-sweep")}, progress_bar=False)
        _CACHE["explore"] = root
    return _CACHE["explore"]


def nightly_root() -> Path:
    """`nightly/test_plan.toml` run once on CPU into a fresh results root (probe, a failing entry, a decode)."""
    if "nightly" not in _CACHE:
        from labkit.nightly import run_plan
        root = _tmp("results")
        rec = run_plan(REPO / "nightly" / "test_plan.toml", date="2026-01-02", root=root, echo=lambda *a: None)
        _CACHE["nightly"] = root
        _CACHE["nightly_record"] = rec
    return _CACHE["nightly"]


def nightly_record() -> dict:
    nightly_root()
    return _CACHE["nightly_record"]


def figures_in_notebook_report(run_dir: Path) -> int:
    """How many plotly figures the executed notebook(s) of a run folder hold (each `fig.show()` under the
    lab's renderer, `labkit/report/renderer.py`, is one `plotly-graph-div`)."""
    import nbformat
    n = 0
    for nb_path in sorted(run_dir.glob("*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        for c in nb.cells:
            if "remove_output" in c.get("metadata", {}).get("tags", []):
                continue
            for o in c.get("outputs", []):
                h = o.get("data", {}).get("text/html", "")
                h = "".join(h) if isinstance(h, list) else h
                n += h.count('class="plotly-graph-div"')
    return n


def figures_in_page(path: Path) -> int:
    """The figure count a labkit page declares (`<meta name="labkit-figures">`)."""
    import re
    m = re.search(r'<meta name="labkit-figures" content="(\d+)">', path.read_text(encoding="utf-8")[:5000])
    assert m, f"{path} does not declare its figure count"
    return int(m.group(1))


def _allowed(url: str) -> bool:
    return url.startswith(("file:", "data:", "blob:", "about:", "http://127.0.0.1", "ws://127.0.0.1"))


@contextmanager
def chromium():
    """Debian's Chromium, launched headless through Playwright (one per `with`: a launch costs seconds)."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS)
        try:
            yield b
        finally:
            b.close()


@contextmanager
def offline_context(b):
    """A fresh browser context (no cookies, no storage) of a launched Chromium; every request not to a file
    or 127.0.0.1 is aborted and remembered in `ctx.blocked`."""
    ctx = b.new_context(viewport={"width": 1400, "height": 1000})
    ctx.blocked = []

    def route(r):
        if _allowed(r.request.url):
            r.continue_()
        else:
            ctx.blocked.append(r.request.url)
            r.abort()
    ctx.route("**/*", route)
    try:
        yield ctx
    finally:
        ctx.close()


@contextmanager
def browser():
    """A Playwright browser context on Debian's Chromium with the network blocked (`offline_context`)."""
    with chromium() as b, offline_context(b) as ctx:
        yield ctx


def open_page(ctx, url: str):
    """A page with console errors and page errors collected in `page.errors`."""
    page = ctx.new_page()
    page.errors = []
    page.on("console", lambda m: page.errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: page.errors.append(f"pageerror: {e}"))
    page.goto(url)
    return page


def assert_plotly_renders(ctx, path: Path, expected: int, timeout_ms: int = 30000) -> None:
    """Open an HTML file offline: exactly `expected` plotly figures render (each `.js-plotly-plot` holds a
    `.main-svg` with drawn content), no console or page errors, no request leaves the machine."""
    assert expected > 0, f"{path}: no figures expected; the check would prove nothing"
    page = open_page(ctx, path.resolve().as_uri())
    page.wait_for_load_state("load")
    page.wait_for_function(
        """n => { const p = document.querySelectorAll('.js-plotly-plot');
                  return p.length >= n && [...p].every(e => e.querySelector('.main-svg')); }""",
        arg=expected, timeout=timeout_ms)
    plots = page.locator(".js-plotly-plot").count()
    with_svg = page.evaluate("() => [...document.querySelectorAll('.js-plotly-plot')].filter(e => e.querySelector('svg.main-svg')).length")
    # every figure drew something: traces or an annotation (an 'empty' figure says why it is empty)
    drawn = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].filter(e =>
                 e.querySelector('.scatterlayer .trace, .barlayer .trace, .infolayer .annotation, .gl-container canvas')).length""")
    page.wait_for_timeout(300)
    errors = list(page.errors)
    page.close()
    name = f"{path.parent.name}/{path.name}"
    assert plots == expected, f"{name}: {plots} plotly figures rendered, {expected} expected"
    assert with_svg == expected, f"{name}: {with_svg} of {expected} figures have an svg"
    assert drawn == expected, f"{name}: {drawn} of {expected} figures drew traces or a note"
    assert not errors, f"{path}: browser errors: {errors[:3]}; requests blocked: {ctx.blocked[:5]}"
    assert not ctx.blocked, f"{name}: tried to reach the network: {ctx.blocked[:5]}"
