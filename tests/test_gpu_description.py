"""What a run records about its GPUs: the manifest's `gpus` section (power limits, clocks, clock-event reasons,
peer access), its decoding of NVML's clock-event bits, and the CPU case, where it says there is no GPU and
gives no number. The GPU tests read the real card through NVML on the device host."""
from __future__ import annotations

import json
import time

import pandas as pd
import pynvml
import pytest
import torch

from labkit.results import Run, run_gpus
from labkit.telemetry import Sampler, clock_event_bits, clock_event_names, describe_gpus, observed

HAS_CUDA = torch.cuda.is_available()


# ---------------------------------------------------------------------------------------- without a GPU
@pytest.mark.skipif(HAS_CUDA, reason="a machine without CUDA: the CPU case")
def test_a_cpu_run_says_it_has_no_gpu_and_gives_no_number(tmp_path):
    run = Run.create(tmp_path / "r", "decode", {"device": "auto", "shape": "tiny"})
    g = run.manifest["gpus"]
    assert g["count"] == 0 and "no GPU" in g["none"] and "devices" not in g
    run.add({"status": "ok"})
    assert run.finish() == "ok"
    on_disk = json.loads((tmp_path / "r" / "manifest.json").read_text())["gpus"]
    assert on_disk == g                                 # finishing adds no observed numbers to a CPU run
    assert run.gpu_watch is None
    assert run_gpus({"device": "cuda:1"}) == [] and describe_gpus([0])["count"] == 0


def test_a_cpu_device_on_any_machine_names_no_gpu(tmp_path):
    assert run_gpus({"device": "cpu"}) == [] and run_gpus({"devices": "cpu,cpu"}) == []
    g = Run.create(tmp_path / "r", "probe", {"device": "cpu"}).manifest["gpus"]
    assert g["count"] == 0 and g["none"].startswith("no GPU")


# ------------------------------------------------------------------ NVML's clock-event bits, decoded
def test_every_clock_event_bit_of_pynvml_decodes_to_its_name():
    expect = {"nvmlClocksThrottleReasonGpuIdle": "idle", "nvmlClocksThrottleReasonSwPowerCap": "sw_power_cap",
              "nvmlClocksThrottleReasonHwSlowdown": "hw_slowdown", "nvmlClocksThrottleReasonSyncBoost": "sync_boost",
              "nvmlClocksThrottleReasonSwThermalSlowdown": "sw_thermal",
              "nvmlClocksThrottleReasonHwThermalSlowdown": "hw_thermal",
              "nvmlClocksThrottleReasonHwPowerBrakeSlowdown": "power_brake",
              "nvmlClocksThrottleReasonApplicationsClocksSetting": "app_clocks"}
    for const, name in expect.items():
        assert clock_event_names(getattr(pynvml, const)) == [name], const
        new = const.replace("ClocksThrottleReason", "ClocksEventReason")     # the newer spelling, same bit
        if hasattr(pynvml, new):
            assert clock_event_names(getattr(pynvml, new)) == [name], new
    both = pynvml.nvmlClocksThrottleReasonSwPowerCap | pynvml.nvmlClocksThrottleReasonHwSlowdown
    assert clock_event_names(both) == ["sw_power_cap", "hw_slowdown"]
    assert clock_event_names(pynvml.nvmlClocksThrottleReasonNone) == []
    every = clock_event_names(pynvml.nvmlClocksThrottleReasonAll)
    assert len(every) == len(set(every)) == bin(pynvml.nvmlClocksThrottleReasonAll).count("1")
    assert not any(n.startswith("bit_") for n in every)          # every bit pynvml defines has a name
    assert clock_event_names(1 << 40 | pynvml.nvmlClocksThrottleReasonSwPowerCap) == ["sw_power_cap", "bit_0x10000000000"]
    assert clock_event_names(None) == [] and clock_event_names(float("nan")) == []
    assert set(clock_event_bits()) >= {1, 4, 8, 0x20, 0x40, 0x80}


def _series(masks: list[int], sm: list[int], gpu: int = 0) -> pd.DataFrame:
    n = len(masks)
    return pd.DataFrame({"gpu": [gpu] * n, "t": range(n), "sm_clock_mhz": sm, "mem_clock_mhz": [9751] * n,
                         "power_w": [219.0] * n, "temp_c": [70] * n, "throttle_reasons": masks})


def test_observed_shares_and_busy_clocks_from_a_series_of_nvml_masks():
    idle, cap = pynvml.nvmlClocksThrottleReasonGpuIdle, pynvml.nvmlClocksThrottleReasonSwPowerCap
    hot = pynvml.nvmlClocksThrottleReasonSwThermalSlowdown
    # 2 idle samples at 210 MHz, 5 power-capped at 1400-1500, 1 capped and hot at 1350, 2 free at 1695
    masks = [idle, idle] + [cap] * 5 + [cap | hot] + [0, 0]
    sm = [210, 210, 1400, 1410, 1420, 1450, 1500, 1350, 1695, 1695]
    o = observed(_series(masks, sm), 0)
    assert o["samples"] == 10 and o["clock_event_samples"] == 10
    assert o["clock_events"] == {"sw_power_cap": 0.6, "idle": 0.2, "sw_thermal": 0.1}
    assert list(o["clock_events"])[0] == "sw_power_cap"        # most frequent first
    assert o["sm_clock_mhz"] == {"min": 1350.0, "median": 1435.0, "max": 1695.0}   # the busy samples only
    assert o["clocks_over"] == "8 busy samples"
    assert o["power_w"]["max"] == 219.0
    assert observed(_series(masks, sm), 1) == {"samples": 0}     # another GPU's rows are not this one's
    assert observed(pd.DataFrame(), 0) == {"samples": 0}


def test_a_series_without_clock_events_uses_utilization_for_busy():
    df = _series([None] * 4, [210, 1800, 1900, 210]).drop(columns="throttle_reasons").assign(util_gpu=[0, 90, 95, 0])
    o = observed(df, 0)
    assert "clock_events" not in o and o["sm_clock_mhz"]["min"] == 1800.0


# ------------------------------------------------------------------------------------------ on a GPU
@pytest.mark.gpu
def test_a_gpu_run_records_limits_clocks_and_what_it_did(tmp_path):
    run = Run.create(tmp_path / "r", "decode", {"device": "cuda:0"})
    g = run.manifest["gpus"]
    assert g["count"] == 1 and g["peer"] == []
    d = g["devices"][0]
    assert d["name"] == torch.cuda.get_device_name(0) and d["index"] == 0
    assert 0 < d["power_limit_w"] <= d["power_limit_range_w"][1] and d["default_power_limit_w"] > 0
    assert d["max_sm_clock_mhz"] > 500 and d["max_mem_clock_mhz"] > 500
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t = time.time()
    while time.time() - t < 2.0:                  # busy for four watch periods
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
    run.add({"status": "ok"})
    run.finish()
    o = json.loads((tmp_path / "r" / "manifest.json").read_text())["gpus"]["devices"][0]["observed"]
    assert o["samples"] >= 3 and o["source"].startswith("the run's NVML watch")
    assert 0 < o["sm_clock_mhz"]["max"] <= d["max_sm_clock_mhz"]
    assert o["clock_event_samples"] == o["samples"]
    assert all(0 < share <= 1 for share in o["clock_events"].values())


@pytest.mark.gpu
def test_telemetry_carries_the_clock_event_mask_and_nvml_finds_the_cuda_device():
    with Sampler(gpus=[0], slow_period=0.05) as tel:
        time.sleep(0.3)
    df = tel.frame()
    assert "throttle_reasons" in df and df["throttle_reasons"].notna().all() and "temp_c" in df
    nv = pynvml
    nv.nvmlInit()
    uuid = nv.nvmlDeviceGetUUID(tel.handles[0][1])
    assert str(torch.cuda.get_device_properties(0).uuid) in (uuid.decode() if isinstance(uuid, bytes) else uuid)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_every_pair_of_gpus_says_whether_it_copies_peer_to_peer():
    n = torch.cuda.device_count()
    g = describe_gpus(list(range(n)))
    assert len(g["peer"]) == n * (n - 1) // 2
    for p in g["peer"]:
        assert p["cuda_peer"] == torch.cuda.can_device_access_peer(p["a"], p["b"])
        assert p["nvml_read"] is not None and p["path"] is not None


@pytest.mark.gpu
def test_a_decode_sweep_takes_its_gpu_story_from_its_own_telemetry(tmp_path):
    """A real (tiny) decode sweep: its telemetry carries the clock-event mask, and the manifest's observed
    clocks come from that measured window; the report's line is drawn from it."""
    from labkit import experiments
    from labkit.report.gpus import gpu_line
    r = experiments.measure("decode", dict(device="cuda:0", shape="tiny", context_lens="300", budgets="64",
                                           concurrency="1", repeats=1, steps=2, prefill_lens="", probe=False,
                                           per_row_steps=1, out_dir=str(tmp_path / "r")), progress_bar=False)
    mf = json.loads((r.path / "manifest.json").read_text())
    o = mf["gpus"]["devices"][0]["observed"]
    assert o["source"].startswith("telemetry.parquet") and o["samples"] >= 1
    tel = pd.read_parquet(r.path / "telemetry.parquet")
    assert o["samples"] == int((tel["gpu"] == 0).sum()) and tel["throttle_reasons"].notna().all()
    line = gpu_line(mf)
    assert line.startswith(mf["gpus"]["devices"][0]["name"].replace("NVIDIA ", "")) and " W of " in line and "SM " in line
    print(line)
