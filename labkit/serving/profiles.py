"""Launch profiles (`profiles/*.toml`): which model, which `vllm serve` arguments, which environment.

A profile is a template: `{context_len}`, `{max_num_seqs}`, `{offload_gib}`, `{tensor_parallel}`, ... are
filled per server start (`Profile.command`). The profile README (`profiles/README.md`) lists the keys.
Errors the user can fix (unknown profile, missing model, a GPU profile on a CPU machine) are `BadInput`,
one line, before anything starts.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:      # Python 3.10
    import tomli as tomllib

from labkit.params import BadInput
from labkit.results import REPO
from labkit.models.loader import PRESETS, ModelNotFound, checkpoint_path, resolve

PROFILES = REPO / "profiles"
KEYS = {"description", "model", "platform", "startup_timeout_s", "warmup_requests", "offload_backend", "args", "env",
        "tensor_parallel", "pipeline_parallel", "gpu_memory_utilization", "num_gpu_blocks", "offload_args"}
PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")
OFFLOAD_BACKENDS = ("labkit", "native")
CONNECTOR = "LabkitHostConnector"
CONNECTOR_MODULE = "labkit.serving.vllm_connector"


@dataclass
class Profile:
    name: str
    path: Path
    model: str
    platform: str = "cpu"
    description: str = ""
    startup_timeout_s: float = 300.0
    warmup_requests: int = 1
    offload_backend: str = "labkit"
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    values: dict = field(default_factory=dict)      # defaults for placeholders (tensor_parallel, ...)

    def model_path(self, override: str = "") -> Path:
        """The checkpoint folder: a local path, or a labkit preset converted once into the cache."""
        name = override or self.model
        if name.lower() in PRESETS:
            try:
                return checkpoint_path(name)
            except ModelNotFound as ex:
                raise BadInput(str(ex)) from None
        p = Path(name).expanduser()
        if not (p / "config.json").is_file():
            raise BadInput(f"model path {p} does not exist or holds no config.json (profile {self.name}; "
                           f"override with -p model=/path/to/checkpoint)")
        return p.resolve()

    def check_model(self, override: str = "") -> None:
        """Fail early, without converting anything: does the model resolve?"""
        name = override or self.model
        if name.lower() in PRESETS:
            try:
                resolve(name)
            except ModelNotFound as ex:
                raise BadInput(str(ex)) from None
        elif not (Path(name).expanduser() / "config.json").is_file():
            raise BadInput(f"model path {name} does not exist or holds no config.json (profile {self.name}; "
                           f"override with -p model=/path/to/checkpoint)")

    def fill(self, text: str, values: dict) -> str:
        def sub(m):
            if m.group(1) not in values:
                raise BadInput(f"profile {self.name}: unknown placeholder {{{m.group(1)}}}; known: {', '.join(sorted(values))}")
            return str(values[m.group(1)])
        return PLACEHOLDER.sub(sub, text)

    def placeholder_values(self, model: Path | str, context_len: int, max_num_seqs: int, offload_gib: float) -> dict:
        v = {"tensor_parallel": 1, "pipeline_parallel": 1, "gpu_memory_utilization": 0.9, "num_gpu_blocks": 0}
        v.update(self.values)
        v.update(model=str(model), context_len=int(context_len), max_num_seqs=max(1, int(max_num_seqs)),
                 offload_gib=_num(offload_gib))
        return v

    def serve_args(self, model: Path | str, context_len: int, max_num_seqs: int, offload_gib: float = 0,
                   offload_backend: str = "", connector_extra: dict | None = None) -> list[str]:
        """`vllm serve MODEL ARGS...` arguments (without host/port), offload switched on when offload_gib > 0."""
        values = self.placeholder_values(model, context_len, max_num_seqs, offload_gib)
        args = [str(model)] + [self.fill(a, values) for a in self.args]
        backend = offload_backend or self.offload_backend
        if backend not in OFFLOAD_BACKENDS:
            raise BadInput(f"offload_backend must be one of {', '.join(OFFLOAD_BACKENDS)}, got {backend!r}")
        if offload_gib and offload_gib > 0:
            if backend == "native":
                args += ["--kv-offloading-backend", "native", "--kv-offloading-size", _num(offload_gib)]
            else:
                args += ["--kv-transfer-config", json.dumps(connector_config(offload_gib, connector_extra or {}))]
        return args

    def server_env(self, values: dict | None = None) -> dict[str, str]:
        values = values or self.placeholder_values("", 0, 1, 0)
        return {k: self.fill(str(v), values) for k, v in self.env.items()}


def connector_config(offload_gib: float, extra: dict) -> dict:
    """vLLM's --kv-transfer-config for labkit's host-RAM connector."""
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_both",
            "kv_connector_extra_config": {"host_gib": float(offload_gib), **extra}}


def _num(x) -> str:
    x = float(x)
    return str(int(x)) if x == int(x) else str(x)


def available() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.toml"))


def load_profile(name: str) -> Profile:
    """A profile by name (`profiles/NAME.toml`) or path to a .toml file; BadInput if unknown or malformed."""
    path = Path(name)
    if not (path.suffix == ".toml" and path.is_file()):
        path = PROFILES / f"{name}.toml"
    if not path.is_file():
        raise BadInput(f"unknown profile {name!r}: choose from {', '.join(available())} (or a path to a .toml file)")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as ex:
        raise BadInput(f"profile {path}: not valid TOML ({ex})") from None
    unknown = sorted(set(raw) - KEYS)
    if unknown:
        raise BadInput(f"profile {path.name}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(KEYS))}")
    if "model" not in raw:
        raise BadInput(f"profile {path.name}: no model")
    if not isinstance(raw.get("args", []), list) or not all(isinstance(a, str) for a in raw.get("args", [])):
        raise BadInput(f"profile {path.name}: args must be a list of strings")
    bad = [a for a in raw.get("args", []) if a.split("=")[0] in ("--host", "--port")]
    if bad:
        raise BadInput(f"profile {path.name}: labkit sets --host/--port itself; remove {bad[0]}")
    values = {k: raw[k] for k in ("tensor_parallel", "pipeline_parallel", "gpu_memory_utilization", "num_gpu_blocks") if k in raw}
    prof = Profile(name=path.stem, path=path, model=str(raw["model"]), platform=raw.get("platform", "cpu"),
                   description=raw.get("description", ""), startup_timeout_s=float(raw.get("startup_timeout_s", 300)),
                   warmup_requests=int(raw.get("warmup_requests", 1)), offload_backend=raw.get("offload_backend", "labkit"),
                   args=list(raw.get("args", [])), env={k: str(v) for k, v in raw.get("env", {}).items()}, values=values)
    if prof.platform not in ("cpu", "cuda"):
        raise BadInput(f"profile {path.name}: platform must be cpu or cuda, got {prof.platform!r}")
    if prof.offload_backend not in OFFLOAD_BACKENDS:
        raise BadInput(f"profile {path.name}: offload_backend must be one of {', '.join(OFFLOAD_BACKENDS)}")
    return prof


def server_base_env(project_cache: Path) -> dict[str, str]:
    """Environment every server gets: caches and sockets inside the project, offline model loading."""
    tmp = project_cache / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return {"VLLM_CACHE_ROOT": str(project_cache / "vllm"), "TMPDIR": str(tmp), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "PYTHONUNBUFFERED": "1", "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "INFO")}
