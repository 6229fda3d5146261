"""How the lab says that a signal stopped a command: one line in the same words for every command (`labkit run`,
`labkit nightly`, the rest), and the shell's exit status 128 + the signal's number (130 for Ctrl-C, 143 for
SIGTERM). A stopped run says where it stopped (the point being measured, of how many: the sweep core writes it into
the manifest as each point starts) and what it kept; the report's banner says the same.

    print(stop_line("decode run", signal.SIGINT, where_stopped(manifest), kept), file=sys.stderr)
    return exit_code(signal.SIGINT)
"""
from __future__ import annotations

import signal

NOT_POINTS = ("probe", "link_probe")      # rows a sweep measures for its bounds, not points of its grid


def signal_words(signum: int | None) -> str:
    """`SIGINT (Ctrl-C)`, `SIGTERM`, ...; a signal nobody recorded is `a signal`."""
    if signum is None:
        return "a signal"
    name = signal.Signals(int(signum)).name
    return {"SIGINT": "SIGINT (Ctrl-C)", "SIGHUP": "SIGHUP (its terminal closed)"}.get(name, name)


def exit_code(signum: int | None) -> int:
    """The shell's convention: 128 + the signal's number; Ctrl-C when nobody recorded which."""
    return 128 + int(signum if signum is not None else signal.SIGINT)


def stop_line(what: str, signum: int | None, where: str = "", then: str = "") -> str:
    """`labkit: WHAT stopped by SIGNAL[ WHERE][; THEN]`: the one stop message."""
    return f"labkit: {what} stopped by {signal_words(signum)}" + (f" {where}" if where else "") + (f"; {then}" if then else "")


def duration(seconds: float) -> str:
    """`48 s`, `9 min 12 s`, `1 h 42 min`."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def measured_points(metrics, experiment: str = "") -> int:
    """The points of the sweep measured (status ok); the rows a probe adds for another experiment's bounds are not
    its points (a probe run's rows are)."""
    if metrics is None or not len(metrics) or "status" not in metrics:
        return 0
    ok = metrics["status"] == "ok"
    if "experiment" in metrics and experiment not in NOT_POINTS:
        ok &= ~metrics["experiment"].isin(NOT_POINTS)
    return int(ok.sum())


def where_stopped(manifest: dict) -> str:
    """`after 9 min 12 s, while measuring point 4 of 17 (zero_copy ctx=4096 c=1 b=64)`, as far as the manifest
    knows it (a run whose bar never started: the time alone)."""
    parts = []
    if isinstance(manifest.get("wall_s"), (int, float)):
        parts.append(f"after {duration(manifest['wall_s'])}")
    pr = manifest.get("progress") or {}
    if pr.get("total"):
        done, total, at = int(pr.get("done") or 0), int(pr["total"]), str(pr.get("at") or "")
        point = f"point {min(done + 1, total)} of {total}"
        parts.append(f"while measuring {point}" + (f" ({at})" if at else ""))
    return ", ".join(parts)


def measured_words(n: int, manifest: dict) -> str:
    """`3 of 17 points measured` (of how many where the manifest knows), or `nothing measured`."""
    total = (manifest.get("progress") or {}).get("total")
    if not n:
        return "nothing measured"
    return f"{n} of {total} points measured" if total else f"{n} point{'s' if n != 1 else ''} measured"
