"""What the GPU the engine runs on can do, and the `arch` switch that forces the portable path anywhere.

The lab names three architectures: Ampere (sm_80 A100, sm_86 RTX 3090: the reference box), Ada (sm_89) and
Hopper (sm_90: the device host). Features some of them lack, and the portable form each has here:

| feature | native on | portable form (same results) |
|---|---|---|
| loading fp8 e4m3 index keys (`fp8e4nv` in Triton) | sm_89+ | the key bytes loaded as uint8, decoded in the kernel (`fp8.e4m3_to_f32`) |
| programmatic dependent launch (GEMV, DeltaNet mixer) | sm_90+ | ordinary launches |
| inline PTX stores in sparse prefill's collect pass | sm_90 (measured there) | `tl.store` |
| cuDNN's fused attention for dense prefill ("split") | sm_90 (measured there) | SDPA per KV head |

`arch = auto` takes each feature where the GPU has it; `portable` takes the portable form of every feature on
any GPU (so the H200 runs the path an RTX 3090 takes, and tests compare the two); `native` asks for every
native feature and is refused, before any work, on a GPU that lacks one. Wgmma tiles need no switch: Triton
lowers `tl.dot` to mma.sync below sm_90, and the compile test checks each kernel's shared memory against each
architecture's limit.
"""
from __future__ import annotations

import contextlib
import os

import torch

from ... import envs
from ...params import BadInput
from . import interpreter

try:  # Triton is optional: CPU-only installs without it fall back to the kernels' torch references
    import triton  # noqa: F401 (only whether it imports)
    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAVE_TRITON = False

MODE = envs.owner_value("LABKIT_ARCH")          # auto | native | portable

# the largest shared memory a block may ask for (opt-in), from the CUDA programming guide's table
SMEM_PER_BLOCK = {(8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024, (8, 9): 99 * 1024,
                  (9, 0): 227 * 1024}

# the first compute capability with each feature natively
NATIVE_FROM = {"fp8_load": (8, 9), "pdl": (9, 0), "ptx_store": (9, 0), "cudnn_split": (9, 0)}


_PRETEND: tuple[int, int] | None = None


@contextlib.contextmanager
def pretend(cc: tuple[int, int]):
    """Within the block every device reports capability `cc`: the kernels' compile check runs the engine's
    wrappers on a machine without a GPU as they would run on that one."""
    global _PRETEND
    saved, _PRETEND = _PRETEND, tuple(cc)
    try:
        yield
    finally:
        _PRETEND = saved


def capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device; None elsewhere (the interpreter and CPU tensors)."""
    if _PRETEND is not None:
        return _PRETEND
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def smem_per_block(device: torch.device) -> int:
    """Shared memory a kernel's block may take on `device` (the H200's where there is no GPU: the
    interpreter's tiles are the H200's)."""
    cc = capability(device)
    if cc is None:
        return SMEM_PER_BLOCK[(9, 0)]
    return SMEM_PER_BLOCK.get(cc, 99 * 1024 if cc < (9, 0) else 227 * 1024)


def native(feature: str, device: torch.device) -> bool:
    """Whether the engine takes `feature`'s native form on `device` under the switch in force."""
    cc = capability(device)
    return MODE != "portable" and cc is not None and cc >= NATIVE_FROM[feature]


def portable(device: torch.device) -> bool:
    """True where at least one feature takes its portable form on `device` (CPU: always)."""
    return not all(native(f, device) for f in NATIVE_FROM)


def check(device: torch.device) -> None:
    """`arch=native` on a GPU without every native feature: one BadInput line naming what it lacks."""
    cc = capability(device)
    if MODE != "native" or cc is None:
        return
    lacks = [f for f, need in NATIVE_FROM.items() if cc < need]
    if lacks:
        raise BadInput(f"arch=native: this GPU (sm_{cc[0]}{cc[1]}) has no native {', '.join(lacks)}; "
                       "use arch=auto or arch=portable")


def describe(device: torch.device) -> dict:
    """Per feature, "native" or "portable" on `device`: recorded with a run's engine switches."""
    return {f: ("native" if native(f, device) else "portable") for f in NATIVE_FROM}


_SMS: dict = {}


# arrival counters of the split kernels (the GEMV's and W4A16's): one int32 a (group,) column tile, zero between
# launches (the last split to arrive zeroes its own); products run on one stream per device, as the engine's step
# does, so the kernels share them
COUNTER_SLOTS = 8192
_COUNTERS: dict = {}


def arrival_counters(device: torch.device) -> torch.Tensor:
    """The device's COUNTER_SLOTS arrival counters, made once."""
    key = (device.type, device.index if device.index is not None or device.type != "cuda"
           else torch.cuda.current_device())
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; the H200's 132 elsewhere (the interpreter and the compile
    check size their launches as the H200's)."""
    if device.type != "cuda":
        return 132
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SMS[key]


def interpret_mode() -> bool:
    """Triton's interpreter runs the kernels on CPU tensors (the tests' way of checking them without a GPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_run(*tensors: torch.Tensor) -> bool:
    """Whether the engine's Triton kernels take these tensors: on CUDA, or on CPU under the interpreter, or on
    any device inside `pretend` (the compile check, where nothing is launched)."""
    if not HAVE_TRITON:
        return False
    if _PRETEND is not None:
        return True
    if interpret_mode():
        return all(t.device.type == "cpu" for t in tensors)
    return any(t.device.type == "cuda" for t in tensors)


if HAVE_TRITON and interpret_mode():     # helper calls inside kernels patch Triton once a launch (interpreter.py)
    interpreter.fast_device_calls()
