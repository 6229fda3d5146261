"""The claims card's correctness contracts on a GPU (run on the device host: `python -m pytest -q -m gpu
tests/test_gpu_claims.py`; skipped without CUDA): FlashOffloading's "the set of attended tokens does not change,
only where it is stored" as the decode rows' `logits_sha` (CUDA graphs, the host pool mapped, the hot cache's side
stream), and the prefetch baseline of PulseInfer's ladder (the hot cache as the guess, taking handovers) giving
per_head's tokens with fewer bytes."""
import pandas as pd
import pytest

from labkit import experiments

pytestmark = pytest.mark.gpu


def test_every_offloaded_strategy_gives_the_resident_logits_on_the_gpu(tmp_path):
    out = tmp_path / "run"
    plan = experiments.plan("decode", {"device": "cuda", "shape": "tiny", "context_lens": "300,1200", "budgets": "64",
                                       "concurrency": "1,2", "strategies": "resident,zero_copy,hot_cache",
                                       "repeats": "1", "steps": "3", "prefill_lens": "", "probe": "false",
                                       "anatomy": "false", "out_dir": str(out)})
    experiments.run(plan, progress_bar=False)
    d = pd.read_parquet(out / "metrics.parquet")
    d = d[d["experiment"] == "decode"]
    assert (d["status"] == "ok").all() and len(d) == 12 and (d["graph_mode"] != "eager").all()
    by_point = d.groupby(["context_len", "concurrency", "logits_after_steps"])["logits_sha"]
    assert (by_point.nunique() == 1).all(), d[["strategy", "context_len", "concurrency", "logits_sha"]]
    assert by_point.first().nunique() == 4


def test_the_prefetch_baseline_gives_per_heads_tokens_with_fewer_bytes_on_the_gpu():
    from labkit.engine.model.hybrid import HybridModel
    from labkit.experiments import trace_replay as R
    from labkit.experiments.pulse_ladder import measure as L
    from labkit.shapes import ModelShape
    plan = experiments.plan("pulse_ladder", {"device": "cuda", "shape": "tiny", "windows": "1", "window_size": "3",
                                             "calibration_windows": "0", "thresholds": "40",
                                             "adaptive_min_tokens": "16", "disaggregated": "true", "max_output": "8",
                                             "length_scale": "0.005", "capacity": "512", "device_kv_tokens": "256",
                                             "host_kv_tokens": "2048", "budget": "32", "page_size": "16",
                                             "prefill_chunk": "64", "warmup": "false", "prefetch": "true"})
    model = HybridModel(ModelShape.from_name(plan.shape), "cuda", seed=plan.seed)
    specs = L.window_requests(plan, 0)
    got = {}
    for rung in ("per_head", "prefetch"):
        how, placement = L.rung_params(rung, plan, 256)
        out = R.replay_policy(placement, how, specs, model)
        got[rung] = (sum(r["h2d_bytes"] for r in out["stats"]["rounds"]),
                     sorted(r["output_sha"] for r in out["stats"]["records"]), out["stats"]["handovers"])
    assert got["prefetch"][1] == got["per_head"][1] and got["prefetch"][2] == got["per_head"][2] == 3
    assert 0 < got["prefetch"][0] < got["per_head"][0]
