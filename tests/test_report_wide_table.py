"""The decode report's main table at a laptop's width: 16 columns are wider than 1280 px and 40 rows taller
than a screen; its box scrolls both ways with its scrollbar within one screen and its header row held, so no
column is out of reach. The committed H200 run's table, in a one-cell report (a few seconds with Chromium)."""
from __future__ import annotations

import nbformat
import pytest

from browser_util import REPO


@pytest.mark.browser
def test_main_table_box_keeps_every_column_in_reach_at_1280px(tmp_path):
    from browser_util import CHROMIUM, chromium_problem
    if chromium_problem():
        pytest.skip(chromium_problem())
    from playwright.sync_api import sync_playwright

    from labkit.report import summary as S
    from labkit.report.notebook import render_report
    from labkit.results import load_run
    path = REPO / "results/20261129-153810-decode-h200"
    if not path.is_dir():
        pytest.skip("the committed H200 decode run is not in this checkout")
    table = S.scroll_table(S.table_view(load_run(path).metrics))
    cell = nbformat.v4.new_code_cell("", outputs=[nbformat.v4.new_output("display_data", data={"text/html": table})])
    run = tmp_path / "run"
    run.mkdir()
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("## The table"), cell]),
                   run / "decode_sweep.ipynb")
    report = render_report(run, standalone=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        pg = b.new_page(viewport={"width": 1280, "height": 900})
        pg.goto(report.resolve().as_uri())
        box = pg.evaluate("""() => { const d = document.querySelector('.lk-scroll'), r = d.getBoundingClientRect();
            return {ox: getComputedStyle(d).overflowX, oy: getComputedStyle(d).overflowY, sw: d.scrollWidth,
                    cw: d.clientWidth, h: r.height, right: r.right, table: d.querySelector('table').getBoundingClientRect().width,
                    head: getComputedStyle(d.querySelector('thead th')).position}; }""")
        b.close()
    assert box["table"] > box["cw"], box                     # the case at hand: wider than the page
    assert box["ox"] == "auto" and box["right"] <= 1280 and box["sw"] >= box["table"] - 1, box
    assert box["h"] <= 900 * 0.8, box        # its sideways scrollbar within one screen, not 40 rows further down
    assert box["oy"] == "auto" and box["head"] == "sticky", box       # the column names stay in view
