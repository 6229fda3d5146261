"""How quantities read in figures and tables."""
from __future__ import annotations

from ..params import tokens_label  # noqa: F401 - sizes are labelled once, beside their parsing

import pandas as pd


def ratio_cell(v) -> str:
    """A ratio to two decimals, "-" where there is none."""
    return "-" if pd.isna(v) else f"{v:.2f}"


def window_range(ws) -> str:
    """Window numbers as a range: "2–9", "3", or "none"."""
    return f"{min(ws)}–{max(ws)}" if len(ws) > 1 else str(ws[0]) if ws else "none"
