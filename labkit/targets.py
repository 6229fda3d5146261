"""The targets a decode run is judged against, in one table, and the seed's own figures beside them.

Each target is a ratio (or a time) computed within one run, a threshold, and which side of it passes.
`report.summary.targets(metrics)` evaluates them; reports and the README show the result. The seed's
figures were measured on another machine (3x RTX 3090, PCIe 4.0): they appear only in a column of
their own, labelled, never as if measured here.
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


TARGETS: dict[str, Target] = {t.key: t for t in [
    Target("gather_over_link", "zero_copy gather GB/s / contiguous pinned H2D GB/s", 0.90, True, "foundation issue"),
    Target("zero_copy_1m_over_64k", "zero_copy step at the largest context / at 64K (c=1)", 1.15, False, "foundation issue"),
    Target("zero_copy_over_resident", "zero_copy tok/s / resident tok/s at the largest context (c=1)", 0.75, True,
           "seed 000: ~60 / ~80 tok/s"),
    Target("concurrency_scaling", "zero_copy aggregate tok/s at the highest / lowest concurrency (largest context)",
           2.5, True, "foundation issue"),
    Target("nvml_vs_engine", "max |NVML PCIe RX / engine-counted H2D - 1| over offloaded points", 0.15, False,
           "foundation issue"),
    Target("resident_roofline", "resident step at 64K (c=1) / (step weight bytes / HBM read GB/s of this run)", 1.6,
           False, "roofline issue"),
    Target("resident_1m_over_64k", "resident step at the largest context / at 64K (c=1)", 1.15, False, "roofline issue"),
    Target("selection_1m_ms", "score + select of one QSA layer at 1M, batch 1 (ms)", 0.1, False, "roofline issue"),
    Target("anatomy_closure", "max |anatomy phases / measured step - 1| over points", 0.05, False, "roofline issue"),
    Target("cost_model_error", "max |cost model prediction / measured step - 1| (fit on one point per strategy)", 0.15,
           False, "roofline issue"),
    Target("probe_agreement", "max |labkit probe / shared probe - 1| per path, run back to back", 0.05, False,
           "roofline issue"),
]}

# Seed 000's figures (3x RTX 3090, PCIe 4.0 x16, vLLM, Qwen3.8-Flash-Next): another machine and engine.
SEED_000 = {
    "decode tok/s past the budget (c=1)": "~60 (from ~80 below 2048 tokens), flat to 1M",
    "aggregate decode tok/s at 4 concurrent requests": "~150",
    "prefill tok/s at 248K tokens": "3,701",
    "H2D per step": "48 MiB (12 x 2048 x 2048 B), ~3.9 GB/s at 80 tok/s",
}
