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
    # every figure cell rendered a plotly div with data
    n_divs = len(re.findall(r'class="plotly-graph-div"', html))
    assert n_divs == 9, n_divs          # the notebook's nine figures, anatomy included (CPU: NVML/probe ones say why empty)
    assert html.count("Plotly.newPlot(") >= 9
    assert "def " not in html.split("<body", 1)[1][:200000] or "run_sweep(" not in html   # code cells hidden
    assert "Decode speed vs context length" in html and "link bound" in html


def test_report_command_rerenders(cli_run, tmp_path):
    out, _ = cli_run
    (out / "report.html").unlink()
    p = subprocess.run([sys.executable, "-m", "labkit", "report", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and (out / "report.html").is_file(), p.stderr[-2000:]
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
