"""Telemetry: a background NVML sampler (PCIe bytes, utilization, memory, power, clocks, link) and host RAM.

NVML's cumulative PCIe byte counters (`NVML_FI_DEV_PCIE_COUNT_{RX,TX}_BYTES`) are 32-bit on the H200
host and wrap every ~78 ms at 55 GB/s, so the sampler reads them every `counter_period` (10 ms) and
unwraps; the slower metrics (utilization, power, clocks, memory) share the thread at `slow_period`.
`nvmlDeviceGetPcieThroughput` blocks ~21 ms per call, so it is read only at the slow rate.

    with Sampler() as tel:                 # a clean no-op with `tel.reason` where NVML is missing
        a = tel.mark(); ...work...; b = tel.mark()
        tel.rx_bytes(a, b)                  # PCIe bytes received by GPU 0 between the marks
    tel.frame()                            # tidy time series for telemetry.parquet
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pandas as pd
import psutil

WRAP = 1 << 32


def _nvml():
    try:
        import pynvml as nv
        nv.nvmlInit()
        return nv, None
    except Exception as ex:  # library missing, no driver, no GPU
        return None, f"NVML unavailable: {type(ex).__name__}: {ex}".strip()


@dataclass
class Mark:
    t: float
    rx: list[int]      # unwrapped cumulative RX bytes per GPU at t
    tx: list[int]


class Sampler:
    def __init__(self, gpus: list[int] | None = None, counter_period: float = 0.01, slow_period: float = 0.25):
        self.nv, self.reason = _nvml()
        self.counter_period, self.slow_period = counter_period, slow_period
        self.handles = []
        if self.nv is not None:
            n = self.nv.nvmlDeviceGetCount()
            ids = list(range(n)) if gpus is None else gpus
            self.handles = [(i, self.nv.nvmlDeviceGetHandleByIndex(i)) for i in ids]
            if not self.handles:
                self.reason = "NVML found no GPU"
        self.enabled = bool(self.handles)
        self.rows: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_raw: dict[int, tuple[int, int]] = {}
        self._unwrapped: dict[int, list[int]] = {i: [0, 0] for i, _ in self.handles}
        self.counters_ok = self.enabled
        self.max_gap_s = 0.0
        self._last_t = None

    # ---------------------------------------------------------------- reads
    def _read_counters(self) -> float:
        nv = self.nv
        now = time.perf_counter()
        for i, h in self.handles:
            try:
                fv = nv.nvmlDeviceGetFieldValues(h, [nv.NVML_FI_DEV_PCIE_COUNT_RX_BYTES, nv.NVML_FI_DEV_PCIE_COUNT_TX_BYTES])
                if fv[0].nvmlReturn != 0 or fv[1].nvmlReturn != 0:
                    raise RuntimeError(f"field value return codes {fv[0].nvmlReturn}, {fv[1].nvmlReturn}")
                raw = (int(fv[0].value.ullVal), int(fv[1].value.ullVal))
            except Exception as ex:
                self.counters_ok = False
                self.reason = f"PCIe byte counters unreadable: {ex}"
                return now
            last = self._last_raw.get(i)
            if last is not None:
                for k in (0, 1):
                    d = raw[k] - last[k]
                    if d < 0:     # 32-bit wrap (or a 64-bit counter: then no wrap ever happens)
                        d += WRAP
                    self._unwrapped[i][k] += d
            self._last_raw[i] = raw
        if self._last_t is not None:
            self.max_gap_s = max(self.max_gap_s, now - self._last_t)
        self._last_t = now
        return now

    def _read_slow(self, now: float, counters: dict) -> None:
        """Slow metrics, read outside the lock (a throughput sample blocks ~21 ms) but between two
        counter reads well inside one 78 ms wrap period."""
        nv = self.nv
        for i, h in self.handles:
            row = {"timestamp": time.time(), "t": now, "gpu": i,
                   "pcie_rx_bytes": counters[i][0], "pcie_tx_bytes": counters[i][1]}
            for key, kind in (("pcie_rx_sample_gbps", "NVML_PCIE_UTIL_RX_BYTES"), ("pcie_tx_sample_gbps", "NVML_PCIE_UTIL_TX_BYTES")):
                try:   # KB/s averaged over ~20 ms: a sample, kept beside the exact counters
                    row[key] = nv.nvmlDeviceGetPcieThroughput(h, getattr(nv, kind)) * 1e3 / 1e9
                except Exception:
                    row[key] = None
            for key, fn in (("util_gpu", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu),
                            ("util_mem", lambda: nv.nvmlDeviceGetUtilizationRates(h).memory),
                            ("mem_used_bytes", lambda: nv.nvmlDeviceGetMemoryInfo(h).used),
                            ("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
                            ("sm_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
                            ("mem_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)),
                            ("pcie_gen", lambda: nv.nvmlDeviceGetCurrPcieLinkGeneration(h)),
                            ("pcie_width", lambda: nv.nvmlDeviceGetCurrPcieLinkWidth(h))):
                try:
                    row[key] = fn()
                except Exception:
                    row[key] = None
            vm = psutil.virtual_memory()
            row["host_mem_used_bytes"], row["host_mem_available_bytes"] = vm.total - vm.available, vm.available
            with self._lock:
                self.rows.append(row)

    def _run(self) -> None:
        next_slow = 0.0
        while not self._stop.is_set():
            with self._lock:
                now = self._read_counters()
                counters = {i: list(v) for i, v in self._unwrapped.items()}
            if now >= next_slow:
                self._read_slow(now, counters)
                next_slow = now + self.slow_period
            self._stop.wait(self.counter_period)

    # ---------------------------------------------------------------- API
    def start(self) -> "Sampler":
        if self.enabled and self._thread is None:
            with self._lock:
                self._read_counters()
            self._thread = threading.Thread(target=self._run, name="labkit-nvml", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def mark(self) -> Mark:
        """Read the counters now (from the caller's thread) and return the unwrapped totals."""
        if not self.enabled:
            return Mark(time.perf_counter(), [], [])
        with self._lock:
            now = self._read_counters()
            return Mark(now, [v[0] for v in self._unwrapped.values()], [v[1] for v in self._unwrapped.values()])

    def rx_bytes(self, a: Mark, b: Mark, gpu_pos: int = 0) -> float | None:
        """PCIe bytes the GPU received between two marks; None where the counters are unusable."""
        if not (self.enabled and self.counters_ok) or not a.rx:
            return None
        return float(b.rx[gpu_pos] - a.rx[gpu_pos])

    def tx_bytes(self, a: Mark, b: Mark, gpu_pos: int = 0) -> float | None:
        if not (self.enabled and self.counters_ok) or not a.tx:
            return None
        return float(b.tx[gpu_pos] - a.tx[gpu_pos])

    def frame(self) -> pd.DataFrame:
        """The time series with per-interval PCIe GB/s; an empty frame with a `reason` attr when disabled."""
        with self._lock:
            df = pd.DataFrame(self.rows)
        if df.empty:
            df = pd.DataFrame(columns=["timestamp", "gpu", "pcie_rx_bytes", "pcie_tx_bytes", "pcie_rx_gbps", "pcie_tx_gbps"])
        else:
            df = df.sort_values(["gpu", "t"])
            dt = df.groupby("gpu")["t"].diff()
            df["pcie_rx_gbps"] = df.groupby("gpu")["pcie_rx_bytes"].diff() / dt / 1e9
            df["pcie_tx_gbps"] = df.groupby("gpu")["pcie_tx_bytes"].diff() / dt / 1e9
        df.attrs["reason"] = self.reason
        return df


def host_memory() -> dict:
    vm = psutil.virtual_memory()
    return {"host_mem_total_bytes": vm.total, "host_mem_available_bytes": vm.available}


def link_info(index: int = 0) -> dict:
    """GPU name, driver, PCIe link generation/width (current and max) via NVML; empty where NVML is absent."""
    nv, reason = _nvml()
    if nv is None:
        return {"nvml": reason}
    try:
        h = nv.nvmlDeviceGetHandleByIndex(index)
        name = nv.nvmlDeviceGetName(h)
        return {"gpu_name": name.decode() if isinstance(name, bytes) else name,
                "driver": nv.nvmlSystemGetDriverVersion(),
                "pcie_gen": nv.nvmlDeviceGetCurrPcieLinkGeneration(h),
                "pcie_width": nv.nvmlDeviceGetCurrPcieLinkWidth(h),
                "pcie_max_gen": nv.nvmlDeviceGetMaxPcieLinkGeneration(h),
                "pcie_max_width": nv.nvmlDeviceGetMaxPcieLinkWidth(h)}
    except Exception as ex:
        return {"nvml": f"NVML error: {ex}"}


def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo, else platform): with the core count and RAM it tells machines
    apart whose host name says nothing (every VM called `vm`)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or None


def machine_load(top: int = 5, interval: float = 0.2) -> dict:
    """How busy the machine is right now: the 1/5/15-minute load averages, the core count they compare
    with, and the `top` other processes by CPU share over `interval` seconds (name, pid, % of one core).
    Recorded at a run's start and end: a point whose slowest step is many times its fastest on a loaded
    machine measured the neighbours, not the strategy."""
    import os
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:       # not on this platform
        load = None
    me = os.getpid()
    procs = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if p.pid != me:
                p.cpu_percent(None)        # the first call starts the window
                procs.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    time.sleep(interval)
    busy = []
    for p in procs:
        try:
            pct = p.cpu_percent(None)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if pct >= 1.0:
            busy.append({"name": p.info["name"], "pid": p.pid, "cpu_percent": round(pct, 1)})
    busy.sort(key=lambda r: -r["cpu_percent"])
    return {"at": round(time.time(), 1), "load_avg": load, "cpu_count": os.cpu_count(), "busy_processes": busy[:top]}
