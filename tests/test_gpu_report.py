"""The run's GPUs beside its figures: a committed run folder, copied, given the `gpus` section a run on the
reference box writes (three RTX 3090 capped at 220 W of 350 W, power-capped most of the run, no peer access),
drawn by the real renderer, listed by the real index and `labkit runs`."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.report import gpus as G
from labkit.report.index import machine_label, rebuild_index
from labkit.report.notebook import render_report

REPO = Path(__file__).resolve().parent.parent
RUN = REPO / "results" / "20261130-094624-hotdecode-prose-b64-h200"      # a decode run with its executed notebook


def _card(i: int, sm_median: float) -> dict:
    return {"index": i, "name": "NVIDIA GeForce RTX 3090", "nvml_index": i, "power_limit_w": 220.0,
            "default_power_limit_w": 350.0, "power_limit_range_w": [100.0, 400.0], "max_sm_clock_mhz": 2100,
            "max_mem_clock_mhz": 9751, "pcie_max_gen": 4, "pcie_max_width": 16, "nvlink_active_links": None,
            "observed": {"samples": 200, "clock_event_samples": 200, "clocks_over": "180 busy samples",
                         "clock_events": {"sw_power_cap": 0.62, "idle": 0.1, "hw_slowdown": 0.02},
                         "sm_clock_mhz": {"min": 1200.0, "median": sm_median, "max": 1695.0},
                         "mem_clock_mhz": {"min": 9501.0, "median": 9501.0, "max": 9501.0},
                         "power_w": {"min": 150.0, "median": 219.0, "max": 221.0},
                         "temp_c": {"min": 55.0, "median": 71.0, "max": 78.0},
                         "source": "telemetry.parquet (the measured window)"}}


def box() -> dict:
    pair = {"cuda_peer": False, "nvml_read": "chipset not supported", "nvml_write": "chipset not supported",
            "nvml_nvlink": "not supported", "path": "one host bridge"}
    return {"count": 3, "devices": [_card(0, 1410.0), _card(1, 1405.0), _card(2, 1420.0)],
            "peer": [{"a": a, "b": b, **pair} for a, b in ((0, 1), (0, 2), (1, 2))]}


LINE = "RTX 3090 x3 · 220 W of 350 W · SM 1695 MHz max, 1410 median · throttled: sw_power_cap 62%, hw_slowdown 2% · P2P: none"


def _copy(tmp: Path, gpus: dict | None, gpu_name: str = "NVIDIA GeForce RTX 3090") -> Path:
    dst = tmp / "results" / RUN.name
    shutil.copytree(RUN, dst, ignore=shutil.ignore_patterns("report.html", "*.txt"))
    mf = json.loads((dst / "manifest.json").read_text())
    mf["gpu_name"], mf["pcie_gen"], mf["pcie_width"] = gpu_name, 4, 16
    if gpus is not None:
        mf["gpus"] = gpus
    (dst / "manifest.json").write_text(json.dumps(mf, indent=1))
    return dst


def test_the_line_says_the_box_as_its_owners_do():
    mf = {"gpus": box()}
    assert G.gpu_line(mf) == LINE
    assert G.short_machine(mf) == "RTX 3090 x3 220/350 W"
    uncapped = box()
    for d in uncapped["devices"]:
        d["power_limit_w"] = 350.0
        d["observed"]["clock_events"] = {"idle": 0.3}
    uncapped["peer"][0]["cuda_peer"] = True
    line = G.gpu_line({"gpus": uncapped})
    assert "350 W of 350 W" in line and "throttled: none" in line and "P2P: 1 of 3 pairs" in line
    assert G.short_machine({"gpus": uncapped}) == "RTX 3090 x3"
    assert G.gpu_line({"gpus": {"count": 0, "none": "no GPU: torch sees no CUDA device"}}).startswith("no GPU")
    assert G.gpu_line({}) == "" and G.gpu_section({}) == ""            # a manifest from before: nothing added


def test_a_capped_box_is_another_machine_in_the_index():
    mf = {"gpu_name": "NVIDIA GeForce RTX 3090", "pcie_gen": 4, "pcie_width": 16}
    full = {**mf, "gpus": {"count": 1, "devices": [{**_card(0, 1800.0), "power_limit_w": 350.0}]}}
    assert machine_label(mf) == machine_label(full) == "NVIDIA GeForce RTX 3090 · PCIe gen4 x16"
    assert machine_label({**mf, "gpus": box()}) == "NVIDIA GeForce RTX 3090 x3 · 220 W of 350 W · PCIe gen4 x16"


def test_the_report_shows_the_line_under_its_header_and_the_detail_at_the_end(tmp_path):
    run = _copy(tmp_path, box())
    html = render_report(run).read_text()
    body = html[html.index("<body"):]          # the head's plotly.js holds `<` and `>` of its own
    text = re.sub(r"<[^>]+>", "", body).replace("&middot;", "·").replace("&amp;", "&")
    assert LINE in text
    head, gpus_at, section = text.find("Run"), text.find(LINE), text.rfind(G.SECTION_TITLE)
    assert 0 <= head < gpus_at < text.find("Targets (ratios within this run)") < section     # beside the figures
    detail = text[section:]
    assert "220 W (350 W)" in detail and "2,100 MHz" in detail and "1,200 / 1,410 / 1,695 MHz" in detail
    assert "sw_power_cap 62%" in detail and "chipset not supported" in detail and "one host bridge" in detail
    assert detail.count("0–1") + detail.count("0–2") + detail.count("1–2") == 3       # every pair


def test_a_report_of_a_run_from_before_is_unchanged_and_a_cpu_run_says_no_gpu(tmp_path):
    run = _copy(tmp_path / "old", None, gpu_name="NVIDIA H200")
    assert "**GPUs**" not in render_report(run).read_text() and G.SECTION_TITLE not in render_report(run).read_text()
    cpu = _copy(tmp_path / "cpu", {"count": 0, "none": "no GPU: torch 2.11 sees no CUDA device on this machine"})
    html = render_report(cpu).read_text()
    assert "no GPU (no GPU: torch 2.11 sees no CUDA device on this machine)" in html and G.SECTION_TITLE not in html


def test_the_index_and_labkit_runs_show_the_gpus(tmp_path):
    run = _copy(tmp_path, box())
    root = run.parent
    page = rebuild_index(root).read_text()
    assert "NVIDIA GeForce RTX 3090 x3 · 220 W of 350 W · PCIe gen4 x16 · SM 1695 MHz max, 1410 median" in page
    assert "throttled: sw_power_cap 62%, hw_slowdown 2% · P2P: none" in page
    out = subprocess.run([sys.executable, "-m", "labkit", "runs", "--root", str(root)], capture_output=True,
                         text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()[:2]
    assert row[header.index("MACHINE"):].startswith("RTX 3090 x3 220/350 W")
