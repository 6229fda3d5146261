"""`resident`: the KV pool in device memory, the selected rows gathered by the Triton kernel. The
no-offload baseline every other strategy is measured against."""
from __future__ import annotations

from .base import KernelGather, register


@register
class Resident(KernelGather):
    name, medium = "resident", "device"
    summary = "KV in device memory, rows indexed there: the no-offload baseline"
