"""Pooled perplexity ratios of mapped against true caches, with their 95% intervals over sequences.

Every quality figure of the cross-model experiment is a ratio pooled over sequences, exp((Σ NLL_mapped − Σ NLL_true) / Σ
tokens), with the interval of `labkit.stats.perplexity_ratio` (sequences resampled, not tokens: tokens of
one sequence are not independent) and the spread of the per-sequence ratios (min, max): one bad sequence
shows there even where the pooled figure hides it. Top-1 agreement is a mean over sequences with
`labkit.stats.bootstrap`'s interval.

Columns (`ratio_columns(rows, "ppl_ratio")`): `ppl_ratio`, `ppl_ratio_lo`, `ppl_ratio_hi`, `ppl_ratio_n`,
`ppl_ratio_seq_min`, `ppl_ratio_seq_max`; per corpus the same with the corpus in the prefix
(`ppl_ratio_code_lo`, ...). `text(row, prefix)` prints one as the reports do: `1.340 [1.271, 1.413]`.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from . import Interval, bootstrap, perplexity_ratio


def ratio_columns(rows: pd.DataFrame, prefix: str = "ppl_ratio", nll: str = "nll_sum", base: str = "nll_true",
                  tokens: str = "n_tokens") -> dict:
    """One sequence per row: summed NLL under the mapped cache (`nll`), under the true cache (`base`), scored
    tokens. -> the pooled ratio with its interval and n, and the per-sequence min and max."""
    if rows.empty:
        raise ValueError("no sequences to pool")
    iv = perplexity_ratio(rows[nll], rows[base], rows[tokens])
    per = np.exp((rows[nll].to_numpy(float) - rows[base].to_numpy(float)) / rows[tokens].to_numpy(float))
    return {**iv.as_dict(prefix), f"{prefix}_seq_min": float(per.min()), f"{prefix}_seq_max": float(per.max())}


def agree_columns(rows: pd.DataFrame, prefix: str = "top1_agree", col: str = "top1_agree") -> dict:
    return bootstrap(rows[col]).as_dict(prefix)


def pooled(rows: pd.DataFrame, by: str = "corpus") -> dict:
    """Pooled over every row and per `by` value (`ppl_ratio_<value>...`, `top1_agree_<value>...`)."""
    out = {**ratio_columns(rows), **agree_columns(rows)}
    for key, g in rows.groupby(by, sort=True):
        out |= ratio_columns(g, f"ppl_ratio_{key}") | agree_columns(g, f"top1_agree_{key}")
    return out


def paired(rows: pd.DataFrame, mode_col: str = "mode", true_mode: str = "true",
           keys=("corpus", "document")) -> pd.DataFrame:
    """Rows of one sequence per mode (an xfer run's quality rows) -> the non-true rows with `nll_true`, the
    same sequence's NLL on the true cache, beside them."""
    keys = [k for k in keys if k in rows]
    t = rows[rows[mode_col] == true_mode][[*keys, "nll_sum"]].rename(columns={"nll_sum": "nll_true"})
    if t.duplicated(keys).any():
        raise ValueError(f"more than one true-cache row per sequence ({', '.join(keys)})")
    return rows[rows[mode_col] != true_mode].merge(t, on=keys, how="inner", validate="many_to_one")


def interval(row, prefix: str) -> Interval:
    """The Interval a table row holds under `prefix` (columns from `ratio_columns` / `Interval.as_dict`)."""
    get = row.get if hasattr(row, "get") else (lambda k, d=None: getattr(row, k, d))
    lo, hi, n = get(f"{prefix}_lo"), get(f"{prefix}_hi"), get(f"{prefix}_n")
    return Interval(float(get(prefix)), float("nan") if lo is None else float(lo),
                    float("nan") if hi is None else float(hi), 0 if n is None or pd.isna(n) else int(n))


def text(row, prefix: str, digits: int = 3) -> str:
    """`value [lo, hi]` (`Interval.text`), or the bare value where the row has no interval columns."""
    get = row.get if hasattr(row, "get") else (lambda k, d=None: getattr(row, k, d))
    n = get(f"{prefix}_n")
    if get(f"{prefix}_lo") is None or n is None or pd.isna(n):   # no interval measured (the reference itself)
        return f"{float(get(prefix)):.{digits}f}"
    return interval(row, prefix).text(digits)


def display_frame(df: pd.DataFrame, keep, prefixes, digits: int = 3) -> pd.DataFrame:
    """A frame for reading: the `keep` columns as they are, each prefix present as one `value [lo, hi]`
    column (`{prefix}_n` beside the first ratio, as `n`)."""
    out = df[[c for c in keep if c in df]].copy()
    for p in prefixes:
        if p in df:
            out[f"{p} [95%]"] = [text(r, p, digits) for _, r in df.iterrows()]
    n = next((f"{p}_n" for p in prefixes if f"{p}_n" in df), None)
    if n:
        out["n sequences"] = df[n].astype("Int64")
    return out
