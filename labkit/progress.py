"""Progress bars that look right in a terminal and in JupyterLab (tqdm.auto picks the widget there)."""
from __future__ import annotations

from . import envs
import sys


def progress(total: int, desc: str, disable: bool = False):
    try:
        from tqdm.auto import tqdm
    except Exception:  # pragma: no cover
        from tqdm import tqdm
    if envs.get("LABKIT_PLAIN_PROGRESS"):   # under papermill: text to stderr, streamed to the CLI
        from tqdm import tqdm as plain
        return plain(total=total, desc=desc, disable=disable, file=sys.stderr, mininterval=2.0, ascii=True)
    return tqdm(total=total, desc=desc, disable=disable, file=sys.stderr, dynamic_ncols=True)
