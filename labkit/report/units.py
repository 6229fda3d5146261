"""How quantities read in figures and tables."""
from __future__ import annotations

from ..params import tokens_label  # noqa: F401 - sizes are labelled once, beside their parsing
