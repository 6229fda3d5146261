"""The lab's one place for how a figure's uncertainty is stated.

- `spread(samples)`: repeated timings -> median (mean of the two middle values for an even count, as
  `statistics.median`), min and max. Used for repeats inside one process and across processes alike.
- `bootstrap(values, stat)`: a 95% percentile-bootstrap interval of a statistic over independent units
  (sequences, windows), resampled with a recorded seed so the same data give the same interval.
- `ratio_interval(num, den)`: the interval of a pooled ratio sum(num) / sum(den) over paired units (each
  unit contributes to both sums: a sequence's NLL under two policies, a window's throughput under two
  policies), resampling units, not tokens, because tokens of one sequence are not independent.
- `across_runs(frame, by, value)`: one value measured in several processes -> median, min, max, n per
  group, and whether the figure is across processes (n >= 2) or a single process's.

`Interval.text()` is how every report prints one: `1.046 [1.031, 1.062]`.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np

from .. import lazy

pd = lazy.module("pandas")      # `across_runs` only, whose caller has a frame; the rest needs numpy alone

BOOT_SEED = 20261201      # recorded: the intervals of a committed run are reproducible
N_BOOT = 2000
LEVEL = 0.95


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


@dataclass(frozen=True)
class Interval:
    """A point estimate and its interval; `n` independent units behind it, `level` the coverage."""
    value: float
    lo: float
    hi: float
    n: int
    level: float = LEVEL

    def text(self, digits: int = 3) -> str:
        if self.n < 2 or math.isnan(self.lo):
            return f"{self.value:.{digits}f} (n={self.n})"
        return f"{self.value:.{digits}f} [{self.lo:.{digits}f}, {self.hi:.{digits}f}]"

    def as_dict(self, prefix: str) -> dict[str, float]:
        """Columns for a metrics table: `{prefix}`, `{prefix}_lo`, `{prefix}_hi`, `{prefix}_n`."""
        return {prefix: self.value, f"{prefix}_lo": self.lo, f"{prefix}_hi": self.hi, f"{prefix}_n": self.n}


def _quantiles(boot: np.ndarray, level: float) -> tuple[float, float]:
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(boot, [a, 1.0 - a])
    return float(lo), float(hi)


def _indices(n: int, n_boot: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def bootstrap(values, stat=np.mean, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = BOOT_SEED) -> Interval:
    """Percentile bootstrap of `stat` over independent units `values` (1-D). One unit: no interval
    (lo = hi = nan), never a fake one of zero width."""
    v = np.asarray(list(values), dtype=float)
    if v.size == 0:
        raise ValueError("no units to bootstrap")
    point = float(stat(v))
    if v.size < 2:
        return Interval(point, math.nan, math.nan, int(v.size), level)
    boot = np.array([stat(v[ix]) for ix in _indices(v.size, n_boot, seed)])
    return Interval(point, *_quantiles(boot, level), int(v.size), level)


def ratio_interval(num, den, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = BOOT_SEED,
                   transform=None) -> Interval:
    """Interval of sum(num) / sum(den) over paired units (unit i gives num[i] and den[i]), resampling
    units. `transform` maps the ratio of sums before it is reported (identity by default); for
    perplexities use `perplexity_ratio`, which pools NLLs, not ratios."""
    a, b = np.asarray(list(num), dtype=float), np.asarray(list(den), dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired units needed: num {a.shape} vs den {b.shape}")
    if a.size == 0:
        raise ValueError("no units to bootstrap")
    f = transform or (lambda r: r)
    point = float(f(a.sum() / b.sum()))
    if a.size < 2:
        return Interval(point, math.nan, math.nan, int(a.size), level)
    ix = _indices(a.size, n_boot, seed)
    boot = f(a[ix].sum(1) / b[ix].sum(1))
    return Interval(point, *_quantiles(boot, level), int(a.size), level)


def perplexity_ratio(nll_policy, nll_base, tokens, n_boot: int = N_BOOT, level: float = LEVEL,
                     seed: int = BOOT_SEED) -> Interval:
    """Pooled perplexity ratio exp((sum NLL_policy - sum NLL_base) / sum tokens) over sequences, with the
    sequences (not tokens) resampled. Inputs per sequence: summed NLLs and the scored token count."""
    p, q, t = (np.asarray(list(x), dtype=float) for x in (nll_policy, nll_base, tokens))
    if not (p.shape == q.shape == t.shape) or p.ndim != 1 or p.size == 0:
        raise ValueError("one summed NLL under each policy and one token count per sequence needed")
    point = float(np.exp((p.sum() - q.sum()) / t.sum()))
    if p.size < 2:
        return Interval(point, math.nan, math.nan, int(p.size), level)
    ix = _indices(p.size, n_boot, seed)
    boot = np.exp((p[ix].sum(1) - q[ix].sum(1)) / t[ix].sum(1))
    return Interval(point, *_quantiles(boot, level), int(p.size), level)


def across_runs(frame, by: list[str], value: str):
    """One figure measured in several processes (rows of `frame`, one per process and group) -> a frame
    per group with `median, min, max, n` and `scope` ('across N processes' or 'one process')."""
    rows = []
    for key, g in frame.groupby(by, sort=False, dropna=False):
        s = spread(g[value].dropna())
        key = key if isinstance(key, tuple) else (key,)
        rows.append({**dict(zip(by, key)), "median": s.median, "min": s.min, "max": s.max, "n": s.n,
                     "scope": f"across {s.n} processes" if s.n >= 2 else "one process"})
    return pd.DataFrame(rows)
