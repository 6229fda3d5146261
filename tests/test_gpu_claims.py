"""The claims card's correctness contracts on a GPU (run on the device host: `python -m pytest -q -m gpu
tests/test_gpu_claims.py`; skipped without CUDA), the CPU tests' checks with CUDA graphs, the host pool mapped and
the hot cache's side stream: FlashOffloading's "the set of attended tokens does not change, only where it is
stored" as the decode rows' `logits_sha`, and the prefetch baseline of PulseInfer's ladder (the hot cache as the
guess, taking handovers) giving per_head's tokens with fewer bytes."""
import pytest

from labkit import experiments
from test_hot_cache import strategies_logits
from test_pulse_ladder import SMALL, prefetch_against_per_head

pytestmark = pytest.mark.gpu


def test_every_offloaded_strategy_gives_the_resident_logits_on_the_gpu(tmp_path):
    d = strategies_logits(tmp_path / "run", "cuda", "300,1200")
    assert (d["graph_mode"] != "eager").all()


def test_the_prefetch_baseline_gives_per_heads_tokens_with_fewer_bytes_on_the_gpu():
    plan = experiments.plan("pulse_ladder", {**SMALL, "device": "cuda", "windows": "1", "window_size": "3",
                                             "disaggregated": "true", "max_output": "8", "device_kv_tokens": "256",
                                             "host_kv_tokens": "2048", "budget": "32", "page_size": "16",
                                             "capacity": "512", "length_scale": "0.005", "prefill_chunk": "64"})
    got = prefetch_against_per_head(plan, "cuda")
    assert got["prefetch"][2] == 3                  # every request handed over, its KV placed in the pool
