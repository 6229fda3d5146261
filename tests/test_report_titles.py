"""A report says what it is in its title: a nightly entry's folder is the plan's entry name, so its report is
titled with the night, the experiment and the entry, not the entry name alone. A one-cell notebook rendered
(a second or two)."""
from __future__ import annotations

import json
import re

import nbformat

from labkit.report.notebook import render_report


def _entry(folder, manifest: dict | None, entry: dict | None):
    folder.mkdir(parents=True)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Decode sweep")])
    nbformat.write(nb, folder / "decode_sweep.ipynb")
    if manifest is not None:
        (folder / "manifest.json").write_text(json.dumps(manifest))
    if entry is not None:
        (folder / "nightly-entry.json").write_text(json.dumps(entry))


def _title(html: str) -> str:
    head = html.split("</head>", 1)[0]
    return re.findall(r"<title>([^<]*)</title>", head)[-1]      # the page's: plotly.js before it has an SVG title


def test_nightly_entry_report_names_night_experiment_and_entry(tmp_path):
    run = tmp_path / "nightly-2026-11-29" / "decode-small"
    _entry(run, {"run_id": "decode-small", "experiment": "decode", "status": "ok"},
           {"name": "decode-small", "experiment": "decode", "status": "ok"})
    html = render_report(run, standalone=False).read_text()
    assert _title(html) == "labkit nightly 2026-11-29: decode, entry decode-small"
    assert "Nightly run of 2026-11-29, entry" in html and "decode-small" in html


def test_failed_entry_without_manifest_still_names_its_experiment(tmp_path):
    run = tmp_path / "nightly-2026-11-29" / "deliberately-fails"
    _entry(run, None, {"name": "deliberately-fails", "experiment": "decode", "status": "failed"})
    assert _title(render_report(run).read_text()) == "labkit nightly 2026-11-29: decode, entry deliberately-fails"


def test_other_runs_keep_their_folder_name(tmp_path):
    run = tmp_path / "20261129-153810-decode-h200"
    _entry(run, {"run_id": run.name, "experiment": "decode", "status": "ok"}, None)
    assert _title(render_report(run).read_text()) == "labkit report 20261129-153810-decode-h200"
