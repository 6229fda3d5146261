"""The targets a decode run is judged against, in one table, and the published figures beside them.

Each target is a ratio (or a time) computed within one run, a threshold, and which side of it passes.
`report.summary.targets(metrics)` evaluates them; reports and the README show the result. The published
figures of sparse offload of Qwen3.8-Flash-Next were measured on another machine and engine (3x RTX 3090,
PCIe 4.0, vLLM): they appear only in a column of their own, labelled with who published them, never as
if measured here, and never in a CPU run's report.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    key: str
    what: str
    threshold: float
    higher_is_better: bool
    source: str          # where the threshold comes from

    def met(self, value: float | None) -> bool | None:
        if value is None or value != value:
            return None
        return value >= self.threshold if self.higher_is_better else value <= self.threshold


# Where a threshold comes from: labkit's own goal for the engine, or a figure a system published.
LABKIT = "labkit goal"
SPARSE_OFFLOAD = "published by sparse offload of Qwen3.8-Flash-Next (3x RTX 3090, vLLM)"

TARGETS: dict[str, Target] = {t.key: t for t in [
    Target("gather_over_link", "zero_copy gather GB/s / contiguous pinned H2D GB/s", 0.90, True, LABKIT),
    Target("zero_copy_1m_over_64k", "zero_copy step at the largest context / at 64K (c=1)", 1.15, False, LABKIT),
    Target("zero_copy_over_resident", "zero_copy tok/s / resident tok/s at the largest context (c=1)", 0.75, True,
           f"{SPARSE_OFFLOAD}: ~60 / ~80 tok/s"),
    Target("concurrency_scaling", "zero_copy aggregate tok/s at the highest / lowest concurrency (largest context)",
           2.5, True, LABKIT),
    Target("nvml_vs_engine", "max |NVML PCIe RX / engine-counted H2D - 1| over offloaded points", 0.15, False,
           LABKIT),
    Target("resident_roofline", "resident step at 64K (c=1) / (step weight bytes / HBM read GB/s of this run)", 1.6,
           False, LABKIT),
    Target("resident_1m_over_64k", "resident step at the largest context / at 64K (c=1)", 1.15, False, LABKIT),
    Target("selection_1m_ms", "score + select of one QSA layer at 1M, batch 1 (ms)", 0.1, False, LABKIT),
    Target("anatomy_closure", "max |anatomy phases / measured step - 1| over points", 0.05, False, LABKIT),
    Target("cost_model_error", "max |cost model prediction / measured step - 1| (fit on one point per strategy)", 0.15,
           False, LABKIT),
    Target("probe_agreement", "max |labkit probe / shared probe - 1| per path, run back to back", 0.05, False,
           LABKIT),
]}

# The figures sparse offload of Qwen3.8-Flash-Next published (3x RTX 3090, PCIe 4.0 x16, vLLM): another
# machine and engine.
PUBLISHED = {
    "decode tok/s past the budget (c=1)": "~60 (from ~80 below 2048 tokens), flat to 1M",
    "aggregate decode tok/s at 4 concurrent requests": "~150",
    "prefill tok/s at 248K tokens": "3,701",
    "H2D per step": "48 MiB (12 x 2048 x 2048 B), ~3.9 GB/s at 80 tok/s",
}
