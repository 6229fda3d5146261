"""Adding a transfer mechanism is one file plus its registration: a toy strategy written here, in a file of
its own that no labkit module names, runs through the CPU decode sweep under papermill (`labkit run decode`),
its report and the cost model, and its rows equal `resident`'s tokens byte for byte."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[1]

TOY = textwrap.dedent('''
    """A toy mechanism: the rows gathered with torch's index_select from a host pool, one call per load."""
    import torch

    from labkit.engine.transfer import Setting, TransferStrategy, register


    @register
    class Toy(TransferStrategy):
        name, medium, graphable = "toy_gather", "host", False
        summary = "torch index_select from the host pool, then one copy (a test's toy)"
        SETTINGS = (Setting("toy_chunks", "int", 1, "toy: copies per load", "chunks"),)

        def __init__(self, chunks: int = 1):
            if chunks < 1:
                raise ValueError(f"toy_gather: toy_chunks must be >= 1, got {chunks}")
            self.chunks = chunks

        def load(self, pool, layer, rows, out):
            got = torch.index_select(pool.data[layer], 0, rows.to(pool.data.device))
            for part, dst in zip(got.chunk(self.chunks), out.chunk(self.chunks)):
                dst.copy_(part)
            return self._moved(pool, rows)
''')


def test_a_toy_strategy_in_one_file_runs_the_sweep_report_and_cost_model(tmp_path):
    toy = tmp_path / "toy_gather.py"
    toy.write_text(TOY)
    env = {**os.environ, "LABKIT_STRATEGIES": str(toy), "PYTHONWARNINGS": "ignore"}
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "labkit", "run", "decode", "-p", "device=cpu", "-p", "shape=tiny",
                        "-p", "strategies=resident,toy_gather", "-p", "context_lens=256", "-p", "budgets=32",
                        "-p", "concurrency=1", "-p", "repeats=1", "-p", "steps=2", "-p", "prefill_lens=",
                        "-p", "probe=false", "-p", "toy_chunks=2", "--out", str(out)],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    m = pd.read_parquet(out / "metrics.parquet")
    d = m[m["experiment"] == "decode"].set_index("strategy")
    assert set(d.index) == {"resident", "toy_gather"} and (d["status"] == "ok").all(), d["error"].tolist()
    assert d.loc["toy_gather", "toy_chunks"] == 2                       # its setting reached it, recorded per row
    row_bytes = json.loads((out / "manifest.json").read_text())["shape_info"]["row_bytes"]
    assert d.loc["toy_gather", "h2d_bytes_per_step"] == d.loc["toy_gather", "selected_rows_per_step"] * row_bytes
    assert d.loc["resident", "h2d_bytes_per_step"] == 0
    html = (out / "report.html").read_text()
    assert "toy_gather" in html and "Traceback" not in html
    # the cost model predicts the toy from its declared capabilities (no name in the model)
    from labkit import costmodel as C
    from labkit.shapes import ModelShape
    from labkit.results import load_run
    run = load_run(out)
    pred = C.predict_table(run.metrics, ModelShape.from_name("tiny"), C.gpu("h200"), C.gpu("rtx3090"), 1)
    assert set(pred["strategy"]) >= {"resident", "toy_gather"}
    toy_row = pred[pred["strategy"] == "toy_gather"].iloc[0]
    assert toy_row["predicted_step_ms"] > 0
    # and nothing in the repository names it: one file plus its registration
    named = subprocess.run(["git", "grep", "-l", "toy_gather", "--", "labkit", "notebooks"], cwd=REPO,
                           capture_output=True, text=True)
    assert named.stdout.strip() == ""
