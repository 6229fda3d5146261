"""The interval helpers: coverage on data with a known answer, pairing, reproducibility, and no fake
intervals from one unit."""
import math

import numpy as np
import pandas as pd

from labkit import stats


def test_bootstrap_covers_the_true_mean_about_95_percent():
    rng = np.random.default_rng(0)
    hits = 0
    for trial in range(200):
        x = rng.normal(1.0, 0.5, size=24)
        iv = stats.bootstrap(x, n_boot=400, seed=trial)
        hits += iv.lo <= 1.0 <= iv.hi
    assert 0.85 <= hits / 200 <= 0.99, hits


def test_one_unit_gives_no_interval_and_same_seed_same_interval():
    iv = stats.bootstrap([2.0])
    assert iv.value == 2.0 and math.isnan(iv.lo) and iv.n == 1 and "n=1" in iv.text()
    x = np.arange(10.0)
    assert stats.bootstrap(x) == stats.bootstrap(x)
    assert stats.bootstrap(x, seed=1) != stats.bootstrap(x, seed=2)


def test_ratio_interval_resamples_pairs_not_columns():
    # num = 2 * den exactly per unit: any paired resample gives 2; an unpaired one would not
    den = np.random.default_rng(1).uniform(1, 100, size=30)
    iv = stats.ratio_interval(2 * den, den)
    assert iv.value == iv.lo == iv.hi == 2.0


def test_perplexity_ratio_pools_nll_over_tokens():
    tokens = np.array([100, 300])
    base = np.array([200.0, 600.0])
    pol = base + np.array([10.0, 30.0])          # +0.1 nat per token in both
    iv = stats.perplexity_ratio(pol, base, tokens)
    assert abs(iv.value - math.exp(0.1)) < 1e-12
    assert abs(iv.lo - math.exp(0.1)) < 1e-12 and abs(iv.hi - math.exp(0.1)) < 1e-12
    wide = stats.perplexity_ratio(base + np.array([0.0, 60.0]), base, tokens)
    assert wide.lo < wide.value < wide.hi


def test_across_runs_marks_scope():
    f = pd.DataFrame({"ratio": [1.0, 1.2, 1.1, 3.0], "what": ["a", "a", "a", "b"]})
    t = stats.across_runs(f, ["what"], "ratio").set_index("what")
    assert t.loc["a", "median"] == 1.1 and t.loc["a", "min"] == 1.0 and t.loc["a", "n"] == 3
    assert t.loc["a", "scope"] == "across 3 processes" and t.loc["b", "scope"] == "one process"
