"""The papermill path end to end on CPU: `labkit run decode` executes the notebook into a run folder and
writes a self-contained report.html with every figure embedded (plotly.js once, nothing fetched)."""
import re
import subprocess
import sys

import pytest

from labkit.results import load_run


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "run"
    p = subprocess.run([sys.executable, "-m", "labkit", "run", "decode", "-p", "device=cpu", "-p", "context_lens=128,512",
                        "-p", "budgets=64,16", "-p", "concurrency=1,2", "-p", "repeats=1", "-p", "steps=2",
                        "-p", "prefill_lens=256", "-p", "per_row_steps=1", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return out, p


def test_cli_prints_report_path_and_folder_is_complete(cli_run):
    out, p = cli_run
    assert p.stdout.strip().splitlines()[-1].endswith("report.html")
    for f in ("manifest.json", "metrics.parquet", "telemetry.parquet", "decode_sweep.ipynb", "report.html"):
        assert (out / f).is_file(), f
    r = load_run(out)
    assert r.manifest["parameters"]["context_lens"] == [128, 512]      # CLI strings parsed by the notebook
    assert (r.metrics["status"] == "ok").all()


def test_report_is_self_contained_with_all_figures(cli_run):
    out, _ = cli_run
    html = (out / "report.html").read_text()
    assert len(html) < 8_000_000
    # plotly.js embedded exactly once, and no script fetched from the network
    assert html.count("plotly.js v") >= 1 and len(re.findall(r"define\('plotly'|window\.Plotly\s*=", html)) <= 2
    assert not re.search(r"<script[^>]+src=[\"']https?://", html)
    # every figure drawn has data; the two a CPU run cannot fill (NVML bytes, telemetry) are a line of text
    n_divs = len(re.findall(r'class="plotly-graph-div"', html))
    assert n_divs == 7, n_divs          # the notebook's nine figures less NVML bytes and telemetry
    assert html.count("Plotly.newPlot(") >= 7
    assert not re.search(r'Plotly\.newPlot\(\s*"[^"]+",\s*\[\]', html)          # no figure without traces
    assert "H2D bytes per step: engine vs NVML: NVML PCIe counters not available" in html
    assert "Telemetry: no NVML telemetry in this run" in html
    assert "def " not in html.split("<body", 1)[1][:200000] or "run_sweep(" not in html   # code cells hidden
    assert "Decode speed vs context length" in html          # a CPU has no host link: no bound drawn or named
    assert not re.search(r"link bound \(|(\u25b2|\\u25b2) link bound", html)


def test_report_command_rerenders(cli_run, tmp_path):
    out, _ = cli_run
    (out / "report.html").unlink()
    (out.parent / "index.html").unlink(missing_ok=True)
    p = subprocess.run([sys.executable, "-m", "labkit", "report", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and (out / "report.html").is_file(), p.stderr[-2000:]
    # the run index beside the run is rebuilt and links the new report
    assert f'href="{out.name}/report.html"' in (out.parent / "index.html").read_text()
    p = subprocess.run([sys.executable, "-m", "labkit", "report", str(tmp_path)], capture_output=True, text=True)
    assert p.returncode == 2 and "no manifest.json" in p.stderr


def test_report_of_a_run_whose_points_all_failed(tmp_path):
    """A sweep where nothing could be measured still gets a report (it lists the failures)."""
    from labkit.results import Run
    run = Run.create(tmp_path / "bad", "decode", {"shape": "tiny", "budgets": [64], "concurrency": [1], "repeats": 1,
                                                  "steps": 1})
    for s in ("resident", "zero_copy"):
        run.add({"experiment": "decode", "status": "failed", "error": "RuntimeError: boom", "strategy": s,
                 "context_len": 256, "budget": 64, "concurrency": 1, "axis": "context"})
    run.finish("partial")
    p = subprocess.run([sys.executable, "-m", "labkit", "report", str(run.path)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    html = (run.path / "report.html").read_text()
    assert "Failed points: 2" in html and "RuntimeError: boom" in html


def _text(html: str) -> str:
    """The report's visible text, roughly (tags and the figures' JSON dropped)."""
    html = re.sub(r"<script.*?</script>", " ", html, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


def test_cpu_report_says_what_it_is_and_shows_no_gpu_rows(cli_run):
    out, _ = cli_run
    text = _text((out / "report.html").read_text())
    # what the run is, and what a GPU run adds, in plain words; no None fields or NVML errors in the header
    assert "What this run is." in text and "a check that the pipeline runs" in text and "What a GPU run adds:" in text
    assert "no GPU, no PCIe link" in text
    assert "1-min load average" in text and "busiest other processes" in text    # the machine's load, recorded
    for wrong in ("gen None", "xNone", "driver None", "CUDA None", "NVMLError", "never compared with GPU figures"):
        assert wrong not in text, wrong
    # targets: verdicts in words, no rows for points a CPU run never measures, no GPU figures as comparisons
    targets = text.split("Targets (ratios within this run)", 1)[1].split("Decode speed vs context", 1)[0]
    assert "True" not in targets and "False" not in targets and " — " not in targets
    assert "not judged (CPU run)" in targets and " met " not in targets.replace("met / not met", "")
    assert "Not measured in this run" in targets and "at 64K" not in targets.split("Not measured")[0]
    for gpu_figure in ("3,701", "RTX 3090", "~60 / ~80", "published by"):
        assert gpu_figure not in text, gpu_figure
    for tracker in ("seed 000", "foundation issue", "roofline issue", "issue 10"):
        assert tracker not in text, tracker
    # token counts as people write them; the anatomy says what holds on a CPU; no contradiction below it
    # (whole numbers only: a measured rate such as 256.041 tok/s contains "256.0" and is no token count)
    assert "@ 0K" not in text and "1.0K" not in text
    assert not re.search(r"(?<![\d.])256\.0(?!\d)", text), re.findall(r".{40}(?<![\d.])256\.0(?!\d).{40}", text)
    assert "CPU run. Each phase" in text and "inside one extra CUDA graph" not in text
    assert "this run has no anatomy" not in text and "Not from a CPU run" in text


def test_report_tables_have_no_index_and_whole_numbers(cli_run):
    out, _ = cli_run
    html = (out / "report.html").read_text()
    tables = re.findall(r'<div class="lk-scroll"[^>]*>(.*?)</div>', html, flags=re.S)
    assert len(tables) >= 3                  # targets, the table, prefill
    main = next(t for t in tables if "step_ms_median" in t and "budget" in t)
    first_header = re.search(r"<th[^>]*>([^<]*)</th>", main).group(1)
    assert first_header == "strategy"        # no pandas index column before it
    cells = re.findall(r"<td[^>]*>([^<]*)</td>", main)
    assert "128" in cells and "512" in cells and "128.0" not in cells and "1.0" not in cells


@pytest.mark.browser
def test_wide_table_scrolls_in_the_browser(cli_run):
    """The main table is wider than a laptop's report box: its box scrolls sideways, nothing is out of reach."""
    from browser_util import CHROMIUM, chromium_problem
    if chromium_problem():
        pytest.skip(chromium_problem())
    from playwright.sync_api import sync_playwright
    out, _ = cli_run
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        pg = b.new_page(viewport={"width": 900, "height": 800})
        pg.goto((out / "report.html").resolve().as_uri())
        boxes = pg.evaluate("""() => [...document.querySelectorAll('.lk-scroll')].map(d => ({
            ox: getComputedStyle(d).overflowX, sw: d.scrollWidth, cw: d.clientWidth,
            right: d.getBoundingClientRect().right, table: d.querySelector('table').getBoundingClientRect().width}))""")
        b.close()
    assert boxes and all(x["ox"] == "auto" and x["right"] <= 900 for x in boxes), boxes
    wide = [x for x in boxes if x["table"] > x["cw"]]
    assert wide and all(x["sw"] >= x["table"] - 1 for x in wide), boxes


def test_gpu_run_header_and_targets_keep_the_gpu_facts():
    """The committed H200 decode run: its header names the GPU and PCIe link, its targets label the
    published figures with the system that published them, and nothing says 'CPU run'."""
    from labkit.report import summary as S
    from labkit.results import REPO
    path = REPO / "results/20261129-153810-decode-h200"
    if not path.is_dir():
        pytest.skip("the H200 run folder is not in this checkout")
    run = load_run(path)
    head = S.run_header(run.manifest)
    assert "NVIDIA H200 · PCIe gen 5 x16" in head and "CPU run" not in head and S.what_this_run_is(run.manifest) == ""
    t, _ = S.targets_view(run.metrics, run.manifest)
    assert set(t["result"]) <= {"met", "not met", "not judged"}
    src = " ".join(t["source"])
    assert "published by sparse offload of Qwen3.8-Flash-Next" in src and "seed" not in src and "issue" not in src
