"""Host RAM bandwidth, STREAM-style: read, write, copy and triad over arrays larger than the last-level cache, on
one core and on all of them. It bounds every CPU-staged offload (`host_gather`, `coalesced`: host threads gather
rows into a pinned staging buffer before one DMA) as the link bounds the zero-copy gather.

    measure(array_mib=1024, repeats=10)     # {"read_1t_gbps": ..., "copy_all_gbps": ..., "threads_all": 16, ...}
    for_manifest()                          # this host's record: from the cache, else a quick measurement cached

Counting follows STREAM: read and write move one array's bytes, copy two (`b[:] = a`), triad three
(`a = b + s * c`); write-allocate traffic is not counted, and each kernel reports its best of `repeats` (STREAM's
"best rate") beside the median. The kernels are torch's on CPU (their elementwise and reduction loops spread over
the intra-op threads set for the measurement: 1, then every core).

Measured once per host: `labkit run probe` measures it in full (rows `host_read`, `host_write`, `host_copy`,
`host_triad`) and keeps the result; a run on a host without one makes a quick measurement first (smaller arrays,
fewer repeats, marked `quick`). Every run's manifest records it as `host_memory_bandwidth`. The cache is
`$LABKIT_CACHE/host/memory-bandwidth.json` (default `~/.cache/labkit/host/`), keyed by host name, CPU model, cores
and RAM: another machine, or the same VM resized, measures afresh.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import socket
import statistics
import time
from pathlib import Path

import psutil

from . import envs, lazy
from .atomic import write_text
from .params import one_line, parse_size
from .telemetry import cpu_model

torch = lazy.module("torch")        # every run's manifest reads the kept figure; only measuring needs torch

KERNELS = ("read", "write", "copy", "triad")
WORDS = {"read": 1, "write": 1, "copy": 2, "triad": 3}      # arrays' bytes each kernel moves, as STREAM counts
QUICK_MIB, QUICK_REPEATS = 192, 3         # a run's first measurement: seconds, arrays at most QUICK_MIB
FULL_MIB, FULL_REPEATS = 1024, 10


def cache_path() -> Path:
    root = envs.get("LABKIT_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "labkit") / "host" / "memory-bandwidth.json"


def host_key() -> str:
    """What makes two measurements the same machine's: host name, CPU model, cores, RAM."""
    ident = [socket.gethostname(), cpu_model() or "", os.cpu_count() or 0, psutil.virtual_memory().total]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache Linux reports (L3 on most machines), so arrays can be sized past it."""
    best = None
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            n = parse_size(f.read_text())          # "32K", "36608K": binary units, as sizes are given here
        except (OSError, ValueError):
            continue
        best = max(best or 0, n)
    return best


def array_mib(wanted: int, cap: int | None = None) -> int:
    """`wanted` MiB per array, at least twice the last-level cache (up to `cap`), at most an eighth of the free RAM."""
    llc = last_level_cache_bytes() or 0
    mib = min(max(wanted, 2 * llc >> 20), cap or 1 << 30)
    return int(max(16, min(mib, psutil.virtual_memory().available // 8 >> 20)))


def _kernels(n: int):
    a, b, c = (torch.ones(n, dtype=torch.float32) for _ in range(3))
    return {"read": lambda: a.sum(), "write": lambda: a.fill_(2.0), "copy": lambda: b.copy_(a),
            "triad": lambda: torch.add(b, c, alpha=3.0, out=a)}


def measure(array_mib_wanted: int = FULL_MIB, repeats: int = FULL_REPEATS, threads: list[int] | None = None,
            cap_mib: int | None = None) -> dict:
    """Best and median GB/s of each kernel at each thread count (1 and all cores by default)."""
    mib = array_mib(array_mib_wanted, cap_mib)
    n = (mib << 20) // 4
    all_cores = os.cpu_count() or 1
    threads = threads or sorted({1, all_cores})
    saved = torch.get_num_threads()
    out: dict = {"array_mib": mib, "threads_all": all_cores, "repeats": repeats,
                 "last_level_cache_mib": (last_level_cache_bytes() or 0) >> 20}
    ks = _kernels(n)
    times: dict = {}
    out["_times"] = times             # (threads, bytes moved, seconds per call) per kernel: the probe's rows
    try:
        for th in threads:
            torch.set_num_threads(th)
            tag = "1t" if th == 1 else ("all" if th == all_cores else f"{th}t")
            for name in KERNELS:
                ks[name]()                            # first touch and warm-up, untimed
                ts = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    ks[name]()
                    ts.append(time.perf_counter() - t0)
                moved = WORDS[name] * n * 4
                times[f"{name}_{tag}"] = (th, moved, ts)
                out[f"{name}_{tag}_gbps"] = round(moved / min(ts) / 1e9, 2)
                out[f"{name}_{tag}_gbps_median"] = round(moved / statistics.median(ts) / 1e9, 2)
    finally:
        torch.set_num_threads(saved)
        del ks
    if all_cores == 1:                  # one core is all of them
        out.update({k.replace("_1t_", "_all_"): v for k, v in list(out.items()) if "_1t_" in k})
    return out


def _stamp(rec: dict, how: str) -> dict:
    return {**rec, "how": how, "host_key": host_key(),
            "measured": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "cache": "host/memory-bandwidth.json "
            "under the labkit cache ($LABKIT_CACHE, default ~/.cache/labkit)"}


def cached() -> dict | None:
    """This host's kept record, or None (none kept, another machine's, unreadable)."""
    try:
        rec = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("host_key") == host_key() else None


def keep(rec: dict, how: str) -> dict:
    """Stamp and keep a measurement as this host's (whole or absent on disk); returns the stamped record."""
    rec = _stamp({k: v for k, v in rec.items() if not k.startswith("_")}, how)
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, json.dumps(rec, indent=1))
    except OSError:          # a read-only home: the run still records what was measured
        pass
    return rec


def for_manifest() -> dict:
    """What a run's manifest records: the kept measurement, else a quick one (kept for the next runs)."""
    rec = cached()
    if rec is not None:
        return rec
    try:
        return keep(measure(QUICK_MIB, QUICK_REPEATS, cap_mib=QUICK_MIB), "quick: measured at the first run on this host "
                    "(labkit run probe measures it in full)")
    except Exception as ex:           # never a reason for a run not to start
        return {"how": f"not measured: {one_line(ex)}"}


def line(rec: dict) -> str:
    """One line for a summary: copy and triad on one core and on all, the median of the repeats (what the probe's
    chart draws), labelled; a record kept before medians were (best repeats only) says "best" instead."""
    if "copy_1t_gbps" not in rec:
        return f"host RAM: {rec.get('how', 'not measured')}"
    median = "copy_1t_gbps_median" in rec
    sfx, how = ("_median", f"median of {rec.get('repeats', '?')} repeats") if median else ("", "best repeat")

    def g(key):
        return rec.get(key + sfx, rec.get(key, float("nan")))
    return (f"host RAM copy {g('copy_1t_gbps'):.1f} GB/s on 1 core, {g('copy_all_gbps'):.1f} on "
            f"{rec['threads_all']}; triad {g('triad_1t_gbps'):.1f} / {g('triad_all_gbps'):.1f} "
            f"({rec['array_mib']} MiB arrays, {how})")
