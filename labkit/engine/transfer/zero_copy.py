"""`zero_copy`: the gather kernel's GPU threads read the selected rows straight from mapped pinned host
memory over PCIe (no staging, no host thread); the step stays one CUDA graph."""
from __future__ import annotations

from .base import KernelGather, register


@register
class ZeroCopy(KernelGather):
    name, medium = "zero_copy", "host"
    summary = "a GPU kernel reads the selected rows from mapped pinned host memory (sparse offload at 1M context)"
