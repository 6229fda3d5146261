"""Telemetry: a background NVML sampler (PCIe bytes, utilization, memory, power, clocks, temperature, the
reasons the clocks were held down, link) and host RAM; what each GPU a run uses is set to (power limits,
clocks, peer access between cards) and what it did over the run (`describe_gpus`, `observed`).

NVML's cumulative PCIe byte counters (`NVML_FI_DEV_PCIE_COUNT_{RX,TX}_BYTES`) are 32-bit on the H200
host and wrap every ~78 ms at 55 GB/s, so the sampler reads them every `counter_period` (10 ms) and
unwraps; the slower metrics (utilization, power, clocks, memory) share the thread at `slow_period`.
`nvmlDeviceGetPcieThroughput` blocks ~21 ms per call, so it is read only at the slow rate.

    with Sampler() as tel:                 # a clean no-op with `tel.reason` where NVML is missing
        a = tel.mark(); ...work...; b = tel.mark()
        tel.rx_bytes(a, b)                  # PCIe bytes received by GPU 0 between the marks
    tel.frame()                            # tidy time series for telemetry.parquet

`Sampler(gpus, counters=False)` samples only the slow metrics (clocks, power, temperature, clock-event
reasons): the light watch a run keeps over its GPUs when its experiment samples no telemetry of its own.
GPUs are named by their CUDA index (what torch calls them) and found in NVML by UUID, so a run under
`CUDA_VISIBLE_DEVICES` reads the cards it ran on.
"""
from __future__ import annotations

import os
import platform
import threading
import time
from dataclasses import dataclass

import pandas as pd
import psutil
import pynvml as nv

from . import lazy
from .params import one_line

torch = lazy.module("torch")        # results imports this module, and reading runs never needs torch
WRAP = 1 << 32


def _nvml():
    try:
        nv.nvmlInit()
        return nv, None
    except Exception as ex:  # library missing, no driver, no GPU
        return None, f"NVML unavailable: {one_line(ex)}"


@dataclass
class Mark:
    t: float
    rx: list[int]      # unwrapped cumulative RX bytes per GPU at t
    tx: list[int]


class Background:
    """A sampling thread (`_run`, which stops when `_stop` is set) started by `start` or `with`, joined by
    `stop`: what the NVML sampler and the server-metrics scraper share."""
    _thread: threading.Thread | None = None

    def _launch(self, name: str) -> None:
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class Sampler(Background):
    """`gpus`: CUDA indices (None: every GPU NVML sees, by NVML index). `counters=False`: the slow metrics
    alone, no PCIe byte counters or throughput samples (a light watch over clocks and power)."""

    def __init__(self, gpus: list[int] | None = None, counter_period: float = 0.01, slow_period: float = 0.25,
                 counters: bool = True):
        self.nv, self.reason = _nvml()
        self.counter_period, self.slow_period = counter_period, slow_period
        self.counters = counters
        self.handles = []
        if self.nv is not None:
            if gpus is None:
                self.handles = [(i, self.nv.nvmlDeviceGetHandleByIndex(i)) for i in range(self.nv.nvmlDeviceGetCount())]
            else:
                self.handles = [(i, nvml_handle(self.nv, i)) for i in gpus]
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
            row = {"timestamp": time.time(), "t": now, "gpu": i}
            if self.counters:
                row["pcie_rx_bytes"], row["pcie_tx_bytes"] = counters[i][0], counters[i][1]
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
                            ("temp_c", lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                            ("throttle_reasons", lambda: clock_event_reasons(nv, h)),
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
            if not self.counters:
                self._read_slow(time.perf_counter(), {})
                self._stop.wait(self.slow_period)
                continue
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
            if self.counters:
                with self._lock:
                    self._read_counters()
            self._launch("labkit-nvml")
        return self

    def mark(self) -> Mark:
        """Read the counters now (from the caller's thread) and return the unwrapped totals."""
        if not (self.enabled and self.counters):
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
        elif not self.counters:
            df = df.sort_values(["gpu", "t"])
        else:
            df = df.sort_values(["gpu", "t"])
            dt = df.groupby("gpu")["t"].diff()
            df["pcie_rx_gbps"] = df.groupby("gpu")["pcie_rx_bytes"].diff() / dt / 1e9
            df["pcie_tx_gbps"] = df.groupby("gpu")["pcie_tx_bytes"].diff() / dt / 1e9
        df.attrs["reason"] = self.reason
        return df


# ------------------------------------------------------------------------------------- the GPUs of a run
# Why the clocks were below their maximum, as NVML reports it (`nvmlDeviceGetCurrentClocksEventReasons`, called
# `...ClocksThrottleReasons` before driver 535): a bit mask, each bit named by pynvml's constant. The names are
# the ones nvidia-smi's "Clocks Event Reasons" section uses, shortened.
CLOCK_EVENT_NAMES = {"GpuIdle": "idle", "ApplicationsClocksSetting": "app_clocks", "SwPowerCap": "sw_power_cap",
                     "HwSlowdown": "hw_slowdown", "SyncBoost": "sync_boost", "SwThermalSlowdown": "sw_thermal",
                     "HwThermalSlowdown": "hw_thermal", "HwPowerBrakeSlowdown": "power_brake",
                     "DisplayClockSetting": "display_clocks", "BoardLimit": "board_limit", "Reliability": "reliability"}
NOT_A_LIMIT = ("idle",)        # a clock held low because nothing runs: no limit the owner set or the card hit


def clock_event_bits() -> dict[int, str]:
    """NVML's clock-event bit -> its name here, from pynvml's own constants (the newer `ClocksEventReason`
    spelling where it exists, else the older `ClocksThrottleReason`)."""
    out = {}
    for attr, name in CLOCK_EVENT_NAMES.items():
        bit = getattr(nv, f"nvmlClocksEventReason{attr}", None) or getattr(nv, f"nvmlClocksThrottleReason{attr}", None)
        if bit:
            out[int(bit)] = name
    return out


def clock_event_names(mask: int | None) -> list[str]:
    """The names of the reasons set in an NVML clock-event mask; a bit pynvml does not name is kept as
    `bit_0x...` (a newer driver's reason is still counted, not dropped)."""
    if mask is None or mask != mask:       # no reading (None or NaN from a table)
        return []
    mask, bits = int(mask), clock_event_bits()
    names = [name for bit, name in sorted(bits.items()) if mask & bit]
    rest = mask & ~sum(bits)
    names += [f"bit_{1 << k:#x}" for k in range(rest.bit_length()) if rest >> k & 1]
    return names


def clock_event_reasons(nv, handle) -> int | None:
    """The current clock-event mask of one GPU; None where the driver has neither call."""
    for fn in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
        if hasattr(nv, fn):
            try:
                return int(getattr(nv, fn)(handle))
            except Exception:  # not found in this driver, or not supported on this card: try the other name
                continue
    return None


def nvml_handle(nv, cuda_index: int):
    """NVML's handle of the GPU torch calls `cuda:<cuda_index>`: matched by UUID, since NVML counts every GPU
    of the machine in PCI order while CUDA counts the visible ones (`CUDA_VISIBLE_DEVICES`) fastest first.
    Falls back to the same index where torch cannot say (no CUDA in this process)."""
    try:
        if torch.cuda.is_available() and cuda_index < torch.cuda.device_count():
            uuid = str(torch.cuda.get_device_properties(cuda_index).uuid)
            return nv.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
    except Exception:  # an old torch without `uuid`, or a UUID NVML does not know: the index below
        pass
    return nv.nvmlDeviceGetHandleByIndex(cuda_index)


_TOPOLOGY = {0: "same board", 10: "one PCIe switch", 20: "several PCIe switches", 30: "one host bridge",
             40: "one CPU socket (across host bridges)", 50: "across CPU sockets"}
_P2P_STATUS = {0: "ok", 1: "chipset not supported", 2: "GPU not supported", 3: "IOH topology not supported",
               4: "disabled by registry key", 5: "not supported", 6: "unknown"}


def _first(v) -> int:
    return int(v[0] if isinstance(v, tuple) else v)     # pynvml spells one P2P index as a 1-tuple


def _read(fn, *args, scale: float = 1.0):
    try:
        v = fn(*args)
        return round(v * scale, 1) if scale != 1.0 else v
    except Exception:  # not supported on this card or driver: recorded as not read, never guessed
        return None


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _one_gpu(nv, cuda_index: int) -> dict:
    d: dict = {"index": cuda_index, "name": torch.cuda.get_device_name(cuda_index)}
    if nv is None:
        return d
    try:
        h = nvml_handle(nv, cuda_index)
    except Exception as ex:  # NVML does not know the card (a driver/library mismatch): say so, read nothing
        d["nvml"] = f"NVML has no handle for it: {one_line(ex)}"
        return d
    d.update({"nvml_index": _read(nv.nvmlDeviceGetIndex, h), "uuid": _read(lambda: _text(nv.nvmlDeviceGetUUID(h))),
              "pci_bus_id": _read(lambda: _text(nv.nvmlDeviceGetPciInfo(h).busId)),
              # the limit the driver enforces now (nvidia-smi -pl, or the board's own) against the card's default
              "power_limit_w": _read(nv.nvmlDeviceGetEnforcedPowerLimit, h, scale=1e-3),
              "default_power_limit_w": _read(nv.nvmlDeviceGetPowerManagementDefaultLimit, h, scale=1e-3),
              "power_limit_range_w": _read(lambda: [round(x / 1e3, 1) for x in nv.nvmlDeviceGetPowerManagementLimitConstraints(h)]),
              "max_sm_clock_mhz": _read(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM),
              "max_mem_clock_mhz": _read(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_MEM),
              "pcie_max_gen": _read(nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
              "pcie_max_width": _read(nv.nvmlDeviceGetMaxPcieLinkWidth, h),
              "nvlink_active_links": _nvlinks(nv, h)})
    return d


def _nvlinks(nv, h) -> int | None:
    """Active NVLink links; None where the card has no NVLink (a GeForce without the bridge: NotSupported)."""
    n, seen = 0, False
    for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            n += int(nv.nvmlDeviceGetNvLinkState(h, link) == 1)
            seen = True
        except Exception:  # no such link on this card
            continue
    return n if seen else None


def _pair(nv, a: int, b: int) -> dict:
    """Whether copies between two GPUs go peer to peer: CUDA's answer each way, and NVML's reasons."""
    p = {"a": a, "b": b, "cuda_peer": bool(torch.cuda.can_device_access_peer(a, b) and torch.cuda.can_device_access_peer(b, a))}
    try:
        ha, hb = (nvml_handle(nv, a), nvml_handle(nv, b)) if nv is not None else (None, None)
    except Exception:  # no NVML handle: CUDA's answer alone
        ha = hb = None
    if ha is not None:
        for key, idx in (("nvml_read", "NVML_P2P_CAPS_INDEX_READ"), ("nvml_write", "NVML_P2P_CAPS_INDEX_WRITE"),
                         ("nvml_nvlink", "NVML_P2P_CAPS_INDEX_NVLINK")):
            st = _read(nv.nvmlDeviceGetP2PStatus, ha, hb, _first(getattr(nv, idx)))
            p[key] = None if st is None else _P2P_STATUS.get(int(st), f"status {st}")
        topo = _read(nv.nvmlDeviceGetTopologyCommonAncestor, ha, hb)
        p["path"] = None if topo is None else _TOPOLOGY.get(int(topo), f"level {topo}")
    return p


def describe_gpus(cuda_indices: list[int]) -> dict:
    """What the GPUs a run uses are set to, read now: per GPU its power limit (enforced and default, W), the
    clocks it may reach, its link; with several, whether each pair copies peer to peer. Without a GPU, a
    `none` that says why (no numbers); where NVML is missing, the names alone and NVML's reason."""
    if not torch.cuda.is_available():
        return {"count": 0, "none": f"no GPU: torch {torch.__version__} sees no CUDA device on this machine"}
    if not cuda_indices:
        return {"count": 0, "none": "no GPU: this run computed on the CPU"}
    nv, reason = _nvml()
    out: dict = {"count": len(cuda_indices), "devices": [_one_gpu(nv, i) for i in cuda_indices]}
    if nv is None:
        out["nvml"] = reason
    out["peer"] = [_pair(nv, a, b) for k, a in enumerate(cuda_indices) for b in cuda_indices[k + 1:]]
    return out


def _spread(v: pd.Series) -> dict | None:
    v = pd.to_numeric(v, errors="coerce").dropna()
    return None if v.empty else {"min": round(float(v.min()), 1), "median": round(float(v.median()), 1),
                                 "max": round(float(v.max()), 1)}


def observed(series: pd.DataFrame, gpu: int) -> dict:
    """One GPU over a run, from its NVML samples (telemetry rows with `gpu == gpu`): SM and memory clocks
    (min/median/max over the samples where the GPU was busy: idle samples say what an idle card clocks
    at), power and temperature, and each clock-event reason's share of all samples."""
    if series is None or series.empty or "gpu" not in series or "sm_clock_mhz" not in series:
        return {"samples": 0}
    g = series[pd.to_numeric(series["gpu"], errors="coerce") == gpu]
    g = g[pd.to_numeric(g["sm_clock_mhz"], errors="coerce").notna()]
    if g.empty:
        return {"samples": 0}
    out: dict = {"samples": int(len(g))}
    masks = pd.to_numeric(g["throttle_reasons"], errors="coerce") if "throttle_reasons" in g else pd.Series(dtype=float)
    read = masks.dropna().astype("int64")
    idle_bit = next((b for b, n in clock_event_bits().items() if n == "idle"), 0)
    if len(read):
        busy = g.loc[read.index[(read & idle_bit) == 0]]
        out["clock_event_samples"] = int(len(read))
        counts: dict[str, int] = {}
        for m in read:
            for name in clock_event_names(m):
                counts[name] = counts.get(name, 0) + 1
        out["clock_events"] = {n: round(c / len(read), 3) for n, c in sorted(counts.items(), key=lambda kv: -kv[1])}
    elif "util_gpu" in g:
        busy = g[pd.to_numeric(g["util_gpu"], errors="coerce") > 0]
    else:
        busy = g.iloc[0:0]
    src = busy if len(busy) else g
    out["clocks_over"] = f"{len(busy)} busy samples" if len(busy) else "all samples (none busy)"
    out["sm_clock_mhz"], out["mem_clock_mhz"] = _spread(src["sm_clock_mhz"]), _spread(src.get("mem_clock_mhz", pd.Series(dtype=float)))
    for key in ("power_w", "temp_c"):
        if key in src:
            out[key] = _spread(src[key])
    return out


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
    return platform.processor() or None


def machine_load(top: int = 5, interval: float = 0.2) -> dict:
    """How busy the machine is right now: the 1/5/15-minute load averages, the core count they compare
    with, and the `top` other processes by CPU share over `interval` seconds (name, pid, % of one core).
    Recorded at a run's start and end: a point whose slowest step is many times its fastest on a loaded
    machine measured the neighbours, not the strategy."""
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
