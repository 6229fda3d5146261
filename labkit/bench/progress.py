"""Progress bars that look right in a terminal and in JupyterLab (tqdm.auto picks the widget there)."""
from __future__ import annotations

import sys


def progress(total: int, desc: str, disable: bool = False):
    try:
        from tqdm.auto import tqdm
    except Exception:  # pragma: no cover
        from tqdm import tqdm
    return tqdm(total=total, desc=desc, disable=disable, file=sys.stderr, dynamic_ncols=True)
