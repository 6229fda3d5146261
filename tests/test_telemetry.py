"""Telemetry without a GPU: the sampler is a clean no-op with a reason. The 32-bit unwrap is checked
with a stand-in NVML (a test double: real NVML counters need the GPU host, see test_gpu.py)."""
from types import SimpleNamespace

import pytest

from labkit import telemetry
from labkit.telemetry import WRAP, Sampler


def test_no_nvml_is_a_clean_noop():
    s = Sampler()
    if s.enabled:
        pytest.skip("NVML works on this host: the no-op path is not reachable here")
    assert s.reason
    with s:
        a = s.mark(); b = s.mark()
    assert s.rx_bytes(a, b) is None
    df = s.frame()
    assert df.empty and df.attrs["reason"] == s.reason


class FakeNVML:
    """Stands in for pynvml: a 32-bit RX counter that advances `step` bytes per read."""
    NVML_FI_DEV_PCIE_COUNT_RX_BYTES, NVML_FI_DEV_PCIE_COUNT_TX_BYTES = 1, 2

    def __init__(self, step):
        self.total, self.step = 0, step

    def nvmlDeviceGetCount(self):
        return 0

    def nvmlDeviceGetFieldValues(self, h, ids):
        self.total += self.step
        v = self.total % WRAP
        mk = lambda x: SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(ullVal=x))
        return [mk(v), mk(0)]


def test_unwrap_counts_across_32bit_wraps(monkeypatch):
    fake = FakeNVML(step=3_000_000_000)          # > 2^31 per read: wraps every other read
    monkeypatch.setattr(telemetry, "_nvml", lambda: (fake, None))
    s = Sampler.__new__(Sampler)
    Sampler.__init__(s, gpus=[])                 # no real handles: add one by hand
    s.handles = [(0, None)]; s.enabled = True; s.counters_ok = True
    s._unwrapped = {0: [0, 0]}
    a = s.mark()
    for _ in range(10):
        s._read_counters()
    b = s.mark()
    assert s.rx_bytes(a, b) == 11 * 3_000_000_000
