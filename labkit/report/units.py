"""How quantities read in figures and tables."""
from __future__ import annotations


def tokens_label(v) -> str:
    """A token count as people write it: 256, 1K, 4K, 64K, 248K, 1M, 1.5K (never 0K or 4.0K)."""
    v = int(v)
    for unit, n in (("M", 1 << 20), ("K", 1 << 10)):
        if v >= n:
            q = v / n
            return f"{q:.0f}{unit}" if q == int(q) else f"{q:.3g}{unit}"
    return str(v)
