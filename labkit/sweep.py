"""The sweep core every experiment measures through: the grid of points, the run folder, the failed-row
rule, the progress bar, the two timers and the closing summary lines. It sits below the experiments (it
imports params, results, progress, stops and stats only), so quality, cross-model and serving use it too.

- `grid(**axes)`: every combination of the axes as dicts, the last axis varying fastest (nested loops'
  order, so the rows come out as the hand-written loops made them).
- `open_run(p, experiment)`: the run folder (`p["out_dir"]`, or `results/<run id>` when empty).
- `failed_row(ex, head, **tail)` / `attempt(fn, head, **tail)` / `with point(run, head, **tail)`: an exception
  at one point becomes a `status=failed` row with the error in one line, and the sweep goes on.
- `bar(total, desc, enabled)`: the progress bar (plain text to stderr under `labkit run`, streamed to the CLI).
- `event_ms(fn, n, dev)`: GPU time per call from CUDA events (wall time on a CPU); `wall_ms(fn, n, dev)`: host
  wall time per call between two synchronizes; `sync(dev)`; `timed(...)`: a timer's samples as a `Spread`.
- `headline(lines, enabled)`: the few lines of what a run measured, printed before the CLI prints the
  report's path.
- `Estimate`, `estimate_line(experiment, est)`, `from_history(experiment, params)`: how long a run is expected to
  take on this machine, said before it starts when that is over LONG_RUN_S, with the ways to shrink it.
- `machine_busy(manifest, spreads)`: why a run's timings say more about the machine's other work than about what
  it measured (empty when nothing says so): the one rule behind the report's `busy` marks, the closing lines'
  caveat and the run index's regression check.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from . import lazy
from .params import one_line
from .progress import progress
from .stops import duration

# Every experiment's SPEC imports this module to declare its parameters, and the command line reads the SPECs:
# torch, pandas (results) and numpy (stats) load when a sweep measures, not when a command line is parsed.
results = lazy.module(".results", __package__)
stats = lazy.module(".stats", __package__)
torch = lazy.module("torch")


# ---------------------------------------------------------------------------------------------- points
def grid(**axes) -> list[dict]:
    """The product of the axes (name -> values), in nested-loop order: `grid(a=[1, 2], b="xy")` ->
    a=1 b=x, a=1 b=y, a=2 b=x, a=2 b=y."""
    names = list(axes)
    return [dict(zip(names, values)) for values in itertools.product(*(axes[n] for n in names))]


_OPENED: list = []     # the run this process opened last: its bar writes where the sweep is into its manifest


def open_run(p: dict, experiment: str, params: dict | None = None):
    """The run folder of checked parameters `p`: `p["out_dir"]`, or `results/<run id>` when it is empty;
    `params`: what the manifest records, when not `p` itself."""
    run = results.Run.create(p.get("out_dir") or None, experiment, dict(p if params is None else params))
    _OPENED[:] = [run]
    return run


def failed_row(ex: BaseException, head: dict | None = None, **tail) -> dict:
    """The row of a point that raised `ex`: `head`, then status=failed and the error in one line, then `tail`
    (the point's coordinates), in that order (the columns of a table follow its rows' key order)."""
    return {**(head or {}), "status": "failed", "error": one_line(ex), **tail}


def fail_run(run, ex: BaseException, head: dict | None = None) -> None:
    """A run that cannot go on: `ex`'s failed row kept beside what was measured, the run closed as failed."""
    run.add(failed_row(ex, head))
    run.finish(error=ex)


def attempt(fn: Callable[[], dict], head: dict | None = None, *, on_fail: Callable[[BaseException], Any] | None = None,
            **tail) -> dict:
    """`fn()`'s row, or the failed row of the exception it raised (`on_fail(ex)` first: free memory, say).
    Only `Exception`: Ctrl-C still ends the sweep."""
    try:
        return fn()
    except Exception as ex:  # one failed point is a row; the sweep goes on
        if on_fail is not None:
            on_fail(ex)
        return failed_row(ex, head, **tail)


@contextlib.contextmanager
def point(run, head: dict | None = None, **tail) -> Iterator[None]:
    """`with point(run, head, **coords): ...measure and run.add...`: an exception inside adds the point's
    failed row to `run` and the sweep goes on."""
    try:
        yield
    except Exception as ex:  # one failed point is a row; the sweep goes on
        run.add(failed_row(ex, head, **tail))


class _Silent:
    """A bar that shows nothing (progress off): the same methods."""
    n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def set_description(self, desc: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class _Recorded:
    """A bar that also writes where the sweep is into its run's manifest (`progress`: points done, of how many,
    the point being measured) each time a point starts, so a run stopped part-way can say where it stopped."""

    def __init__(self, bar, run, total: int):
        self.bar, self.run, self.total = bar, run, total

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.bar.set_postfix_str(s, refresh)
        if self.run.manifest.get("status") != "running":      # a run finished earlier in this process: not ours
            return
        try:
            self.run.update_manifest(progress={"done": int(self.bar.n), "total": int(self.total), "at": s})
        except OSError:        # a full disk: the bar goes on; the manifest's last word stays what it was
            pass

    def __getattr__(self, name):
        return getattr(self.bar, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


def bar(total: int, desc: str, enabled: bool = True):
    """The sweep's progress bar over `total` points (a context manager; `update()` per point,
    `set_postfix_str()` for the point being measured), its clock moving while a point measures; the point being
    measured is written into the manifest of the run this process opened last. `enabled=False`: nothing is
    printed."""
    if enabled:
        shown = progress(total=total, desc=desc)
    else:
        shown = _Silent()
    return _Recorded(shown, _OPENED[0], total) if _OPENED else shown


def headline(lines: list[str], enabled: bool = True, name: str = "") -> None:
    """Print what a run measured, a few lines (`name: ...`), after its points and before the CLI names the
    report. A summary that cannot be drawn (every point failed) says so instead of raising."""
    if not enabled:
        return
    sys.stderr.flush()          # the bar's last line first
    for line in lines or ["nothing measured"]:
        print(f"{name}: {line}" if name else line, flush=True)


BUSY_SPREAD = 3.0     # a point whose slowest step took more than this times its fastest measured other work
BUSY_SHARE = 0.5      # other processes using at least this share of the cores when a run started or ended


def machine_busy(manifest: dict, spreads=()) -> str:
    """Why a run's machine was busy, in words, or "" when nothing says so. `spreads`: each measured point's slowest
    over fastest step. A run is busy when a point's spread exceeds BUSY_SPREAD, when other processes used at least
    BUSY_SHARE of the cores as it started or ended, or when the 1-minute load average at its start reached the core
    count (its own start-up counts for less than one core)."""
    why = []
    spreads = [float(s) for s in spreads if s == s]
    wide = [s for s in spreads if s > BUSY_SPREAD]
    if wide:
        why.append(f"{len(wide)} of {len(spreads)} points' slowest step took more than {BUSY_SPREAD:g}x their fastest")
    cores = manifest.get("cpu_count") or 0
    for when in ("before", "after"):
        load = manifest.get(f"machine_load_{when}") or {}
        used = sum(float(p.get("cpu_percent") or 0) for p in load.get("busy_processes") or []) / 100
        if cores and used >= BUSY_SHARE * cores:
            why.append(f"other processes used {used:.1f} of {cores} cores at the {'start' if when == 'before' else 'end'}")
        la = load.get("load_avg")
        if when == "before" and cores and la and la[0] >= cores:
            why.append(f"the 1-min load average was {la[0]:.1f} on {cores} cores at the start")
    return "; ".join(why)


def summary_lines(fn: Callable[[], list[str]]) -> list[str]:
    """`fn()`'s lines; a summary that raises (a column missing because every point failed) is one line."""
    try:
        return list(fn())
    except Exception as ex:
        return [f"no summary ({one_line(ex)})"]


# ---------------------------------------------------------------------------------------------- estimates
LONG_RUN_S = 600      # a run expected to take longer than this says so before it starts


@dataclass(frozen=True)
class Estimate:
    """How long a run is expected to take here: `seconds`, `basis` (how that was found, in words: a timing of this
    machine now, or earlier runs of the same parameters), `heaviest` (which points take most of it), `shrink`
    (parameters that make it shorter, each with its own estimate)."""
    seconds: float
    basis: str
    heaviest: str = ""
    shrink: list = field(default_factory=list)      # [(the -p arguments, their seconds)]


def estimate_line(experiment: str, est: Estimate) -> str:
    """The line printed before a long run: how long, on what basis, and the ways to shrink it."""
    line = f"labkit: this {experiment} run is expected to take about {duration(est.seconds)} on this machine"
    line += f" ({est.basis}" + (f"; {est.heaviest}" if est.heaviest else "") + ")."
    if est.shrink:
        line += " To shrink it: " + "; or ".join(f"{args} (about {duration(t)})" for args, t in est.shrink) + "."
    return line + " Ctrl-C stops it and keeps what was measured."


def from_history(experiment: str, params: dict, roots=()) -> Estimate | None:
    """Earlier finished runs of `experiment` with the same parameters on this machine (same GPU, else the same CPU
    model and cores) under `roots`: their median wall time. None when there are none."""
    here = results.machine_info()
    same = ("gpu_name",) if here.get("gpu_name") else ("gpu_name", "cpu_model", "cpu_count")
    want = {k: v for k, v in params.items() if k not in ("out_dir",)}
    walls = []
    for root in roots:
        for mf_path in results.run_manifests(root) if os.path.isdir(root) else []:
            try:
                mf = results.manifest_object(mf_path)      # a FIFO, a huge file or a JSON list: passed over
            except (OSError, ValueError):
                continue
            p = {k: v for k, v in (mf.get("parameters") or {}).items() if k not in ("out_dir",)}
            if mf.get("experiment") == experiment and mf.get("status") == "ok" and p == want \
                    and isinstance(mf.get("wall_s"), (int, float)) and all(mf.get(k) == here.get(k) for k in same):
                walls.append(float(mf["wall_s"]))
    if not walls:
        return None
    return Estimate(statistics.median(walls), f"the median of {len(walls)} earlier run{'s' if len(walls) > 1 else ''} "
                    "of these parameters on this machine")


# ---------------------------------------------------------------------------------------------- timers
def sync(dev) -> None:
    """Wait for the device's queued work (nothing on a CPU)."""
    if getattr(dev, "type", str(dev).split(":")[0]) == "cuda":
        torch.cuda.synchronize(dev)


def wall_ms(fn: Callable[[], Any], n: int, dev, warmup: int = 0) -> list[float]:
    """Host wall time of each of `n` calls, in ms, between a synchronize before and after the call (what a
    host-driven step costs, launches and waits included). `warmup` untimed calls first, timed the same way."""
    for _ in range(warmup):
        sync(dev)
        fn()
        sync(dev)
    out = []
    for _ in range(n):
        sync(dev)
        t = time.perf_counter()
        fn()
        sync(dev)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def event_ms(fn: Callable[[], Any], n: int, dev, warmup: int = 0, mode: str = "isolated",
             before: Callable[[], Any] | None = None) -> list[float]:
    """GPU time of each of `n` calls, in ms, from CUDA events (on a CPU: wall time of each call).

    `mode`: "isolated" (a synchronize before each call, its end awaited: one call alone on the device),
    "queued" (event pairs around calls issued back to back, one synchronize at the end; `before()` runs
    ahead of each call outside its events, e.g. an L2 flush) or "chained" (one event between consecutive
    calls: the steps of a decode loop, no gap left out). `warmup` untimed calls first."""
    if mode not in ("isolated", "queued", "chained"):
        raise ValueError(f"event_ms mode {mode!r}: isolated, queued or chained")
    for _ in range(warmup):
        fn()
    if getattr(dev, "type", None) != "cuda":
        out = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
        return out
    if mode == "isolated":
        out = []
        for _ in range(n):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b))
        return out
    if mode == "queued":
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for s, e in ev:
            if before is not None:
                before()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(dev)
        return [s.elapsed_time(e) for s, e in ev]
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]      # chained
    ev[0].record()
    for i in range(n):
        fn()
        ev[i + 1].record()
    torch.cuda.synchronize()
    return [ev[i].elapsed_time(ev[i + 1]) for i in range(n)]


def timed(fn: Callable[[], Any], n: int, dev, warmup: int = 1, timer: str = "event", **options):
    """`n` timed calls after `warmup` as a `labkit.stats.Spread` (median, min, max, n) in ms; `timer`:
    "event" (`event_ms`) or "wall" (`wall_ms`)."""
    if timer == "wall":
        return stats.spread(wall_ms(fn, n, dev, warmup))
    return stats.spread(event_ms(fn, n, dev, warmup, **options))
