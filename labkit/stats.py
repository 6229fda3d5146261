"""The one convention for summarising repeated timings: median (mean of the two middle values for an
even count, as `statistics.median`), min and max."""
from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Spread:
    median: float
    min: float
    max: float
    n: int


def spread(samples) -> Spread:
    xs = list(samples)
    if not xs:
        raise ValueError("no samples to summarise")
    return Spread(statistics.median(xs), min(xs), max(xs), len(xs))
