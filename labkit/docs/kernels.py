"""A decode step's kernels by what they do, from their names (a profile of `scripts/profile_step.py`):
the same grouping for the script's own summary and for the generated docs."""
from __future__ import annotations

# first match wins: the lab's own kernels by name, then cuBLAS/CUTLASS, then inductor's fused kernels
GROUPS = (("DeltaNet mixer (lab kernels)", ("_mix_recur", "_mix_out", "_delta_step")),
          ("weight GEMV (lab kernel)", ("_gemv_kernel",)),
          ("weight GEMM (cuBLAS)", ("gemm", "cutlass", "nvjet", "cublas", "splitk", "gemvx")),
          ("selection and index score", ("_hist_kernel", "_find_kernel", "_count_kernel", "_write_kernel",
                                         "_index_score", "topk", "radix", "sort")),
          ("attention", ("attn", "flash", "sdpa", "attention", "softmax")),
          ("KV rows (gather, write)", ("_gather_rows", "_scatter_rows", "index_copy", "index_elementwise")),
          ("inductor fused (norms, RoPE, gates)", ("triton_",)),
          ("copies and fills", ("memcpy", "memset", "fill", "copy")))
OTHER = "other"


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k in low for k in keys):
            return group
    return OTHER


def grouped(kernels: list[dict]) -> dict[str, dict[str, float]]:
    """Kernels of a profile point ({name, per_step, us_per_step}) -> {group: {kernels, ms}} per step."""
    out: dict[str, dict[str, float]] = {}
    for k in kernels:
        g = out.setdefault(group_of(k["name"]), {"kernels": 0.0, "ms": 0.0})
        g["kernels"] += k["per_step"]
        g["ms"] += k["us_per_step"] / 1e3
    return out
