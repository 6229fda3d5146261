"""A link you can set: the paced zero-copy gather moves the same rows (any program count), and a decode run with
`link_gbps` calibrates every load size, runs zero_copy once per rate after the native pass, and predicts each
emulated step from the cost model. Timings on a CPU mean nothing; the structure and the rows are what is checked."""
from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest

from labkit import experiments

INTERPRETED = r"""
import os; os.environ["TRITON_INTERPRET"] = "1"
import torch
from labkit.engine.model import gather
src = torch.randint(-2**40, 2**40, (300, 40), dtype=torch.int64)
rows = torch.randperm(300)[:37]
for programs in (1, 3, 7, 37, 100):
    out = torch.zeros(37, 40, dtype=torch.int64)
    gather.gather_rows_paced(src, rows, out, programs)
    assert torch.equal(out, src[rows]), programs
print("ok")
"""


def test_the_paced_gather_moves_the_selected_rows_under_the_interpreter():
    pytest.importorskip("triton")
    r = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_a_paced_zero_copy_load_equals_resident():
    import torch
    from labkit.engine.model.kv import KVPool
    from labkit.engine.transfer import Resident, ZeroCopy
    pool = KVPool("host", 2, 4, 16, 256, torch.device("cpu"))
    pool.fill_random_(0)
    rows = torch.randperm(64)[:20]
    a, b = torch.empty(20, 32, dtype=torch.int64), torch.empty(20, 32, dtype=torch.int64)
    ZeroCopy(programs=3).load(pool, 1, rows, a)
    Resident().load(pool, 1, rows, b)
    assert torch.equal(a, b)


def test_a_link_rate_run_calibrates_and_predicts(tmp_path):
    out = tmp_path / "run"
    plan = experiments.plan("decode", {"device": "cpu", "shape": "tiny", "context_lens": "256", "budgets": "32,64",
                                       "concurrency": "1,2", "strategies": "resident,zero_copy", "repeats": "1",
                                       "steps": "2", "prefill_lens": "", "probe": "false", "link_gbps": "5,9",
                                       "out_dir": str(out)})
    experiments.run(plan, progress_bar=False)
    m = pd.read_parquet(out / "metrics.parquet")
    probe = m[m["experiment"] == "link_probe"]
    assert set(probe["rows_per_load"]) == {32, 64}              # every load size of the grid: b x c = 32, 64, 64
    dec = m[m["experiment"] == "decode"]
    native, emulated = dec[dec["link"] == "native"], dec[dec["link"] == "emulated"]
    assert set(native["strategy"]) == {"resident", "zero_copy"} and len(native) == 6
    assert set(emulated["strategy"]) == {"zero_copy"} and sorted(set(emulated["link_gbps"])) == [5.0, 9.0]
    assert len(emulated) == 6 and (emulated["gather_programs"] > 0).all()
    assert emulated["predicted_step_ms"].notna().all() and (emulated["predicted_step_ms"] > 0).all()
    err = emulated["predicted_step_ms"] / emulated["step_ms_median"] - 1
    assert (err - emulated["predicted_error"]).abs().max() < 1e-9


def test_link_gbps_needs_zero_copy_and_positive_rates():
    from labkit.params import BadInput
    with pytest.raises(BadInput, match="zero_copy"):
        experiments.plan("decode", {"device": "cpu", "strategies": "resident", "link_gbps": "25"})
    with pytest.raises(BadInput, match="link_gbps"):
        experiments.plan("decode", {"device": "cpu", "link_gbps": "-3"})
