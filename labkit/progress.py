"""Progress bars that look right in a terminal and in JupyterLab (tqdm.auto picks the widget there), with a clock
that keeps moving while a point measures: tqdm redraws only when told, so a point of six minutes would freeze
its elapsed time for six minutes and read as a hang. A daemon thread redraws the bar every few seconds (more
rarely in plain text under papermill, where every redraw is a line in the log)."""
from __future__ import annotations

import sys
import threading

from . import envs

TICK_S = 1.0          # a terminal or a notebook widget: redrawn in place
PLAIN_TICK_S = 10.0   # plain text streamed to the CLI and into log files: one line a redraw


class Ticking:
    """A tqdm bar whose elapsed time and rate are redrawn every `every` seconds between updates. Used as the bar
    itself: `update`, `set_postfix_str`, `set_description`, `close`, `n`, `total`, and a context manager."""

    def __init__(self, bar, every: float):
        self.bar, self._stop = bar, threading.Event()
        self._thread = threading.Thread(target=self._tick, args=(every,), name="labkit-progress-clock", daemon=True)
        self._thread.start()

    def _tick(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self.bar.refresh()
            except Exception:       # a closed stream (the kernel going away): the clock stops, the run goes on
                return

    def __getattr__(self, name):
        return getattr(self.bar, name)

    def close(self) -> None:
        self._stop.set()
        self.bar.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress(total: int, desc: str, disable: bool = False) -> Ticking:
    # tqdm (and its notebook front end) loads with the first bar: every experiment's SPEC imports this module
    # through the sweep, and the command line reads the SPECs
    try:
        from tqdm.auto import tqdm
    except Exception:  # pragma: no cover
        from tqdm import tqdm
    if envs.get("LABKIT_PLAIN_PROGRESS"):   # under papermill: text to stderr, streamed to the CLI
        from tqdm import tqdm as plain
        bar = plain(total=total, desc=desc, disable=disable, file=sys.stderr, mininterval=2.0, ascii=True)
        return Ticking(bar, PLAIN_TICK_S)
    return Ticking(tqdm(total=total, desc=desc, disable=disable, file=sys.stderr, dynamic_ncols=True), TICK_S)
