"""A device-memory cap: a run measures as if its card had `mem_cap_gib` (the reference box's 24 GiB on a bigger GPU),
the caching allocator refusing what would not fit such a card (an out-of-memory as that card would raise). The prefill,
prefill-throughput and capacity runs take it as a parameter: `check_cap` when they are planned, `apply_cap` when they
start measuring."""
from __future__ import annotations

import torch

from ..params import BadInput, gib
from ..shapes import ModelShape


def least_weight_bytes(shape: ModelShape, weights_dtype: str = "bf16", expert_banks: int = 0) -> int:
    """The fewest bytes the weights can take on a device as the model parameters hold them: `auto` as W4A16 for an
    MoE shape (what `HybridModel` picks where bf16 does not fit), and with `expert_banks` 0 one bank of routed
    experts shared by every layer (as many as fit is at least one)."""
    dtype = weights_dtype if weights_dtype != "auto" else ("w4a16" if shape.moe else "bf16")
    total = shape.weight_bytes(dtype)
    if not shape.moe:
        return total
    bank = shape.step_weight_bytes(1, dtype, experts_read=shape.experts)["experts"] / shape.layers
    return int(total - bank * (shape.layers - min(shape.layers, expert_banks or 1)))


def check_cap(cap_gib: float, shape: ModelShape, dev: torch.device, weights_dtype: str = "bf16",
              expert_banks: int = 0) -> None:
    """A cap must be > 0 (or 0: none), hold the weights (as `weights_dtype` and `expert_banks` hold them), and not
    exceed the device."""
    if cap_gib == 0:
        return
    if cap_gib < 0:
        raise BadInput(f"mem_cap_gib must be > 0 (or 0 for no cap), got {cap_gib}")
    cap = cap_gib * 2**30
    least = least_weight_bytes(shape, weights_dtype, expert_banks)
    if cap <= least:
        raise BadInput(f"mem_cap_gib={cap_gib:g} is below the {gib(least)} the weights of {shape.name} need "
                       f"({weights_dtype})")
    if dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
        if cap > total:
            raise BadInput(f"mem_cap_gib={cap_gib:g} exceeds the device's {gib(total)}")


def apply_cap(cap_gib: float, dev: torch.device) -> None:
    """Make the caching allocator refuse what would not fit a card of `cap_gib` (CUDA; a no-op on CPU)."""
    if cap_gib and dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()   # it wants an index
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(float(min(1.0, cap_gib * 2**30 / total)), index)
