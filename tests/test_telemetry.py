"""jaxllm.tools.telemetry: the clock and power readings bench reports beside each timed phase. NVML is
faked here (CI has no GPU): what is checked is which GPU is read, what the summary makes of the
readings, and that a missing or failing NVML leaves the work alone and says why."""

from __future__ import annotations

import sys
import time
import types

import jax
import pytest

from jaxllm.tools import telemetry
from jaxllm.tools.telemetry import Reading, Sampler


def test_summary_gives_median_and_lowest_clock_median_power_and_the_held_down_share():
    readings = iter([Reading(1980, 120.0, 0x1), Reading(1500, 699.0, 0x4)])  # idle; power cap
    # A long interval: one reading as the block starts, one as it ends.
    with Sampler(lambda: next(readings), interval_s=60, power_limit_w=700.0) as s:
        pass
    assert s.summary() == dict(sm_mhz=1740, sm_mhz_min=1500, power_w=409.5, power_capped_pct=50.0,
                               power_limit_w=700.0, samples=2, why=None)


def test_sampler_reads_on_a_thread_while_the_block_runs():
    calls = []

    def read():
        calls.append(time.perf_counter())
        return Reading(1500, 690.0, 0x4 | 0x1)  # power cap and idle bits together

    with Sampler(read, interval_s=0.001) as s:
        deadline = time.perf_counter() + 10
        while len(calls) < 5 and time.perf_counter() < deadline:
            time.sleep(0.005)
    assert len(s.readings) >= 6  # the five seen inside, and one as the block ended
    assert s.summary()["power_capped_pct"] == 100.0


def test_a_failing_reading_ends_the_sampling_not_the_work():
    n = []

    def read():
        n.append(1)
        if len(n) > 1:
            raise RuntimeError("GPU is lost")
        return Reading(1980, 100.0, 0)

    with Sampler(read, interval_s=0.001) as s:
        time.sleep(0.05)
    summary = s.summary()
    assert summary["samples"] == 1 and "GPU is lost" in summary["why"]
    assert len(n) == 2  # no reading after the failure, not even at the block's end


def _fake_pynvml(monkeypatch, power_field_ok=True):
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    field = types.SimpleNamespace(nvmlReturn=0 if power_field_ok else 3,
                                  value=types.SimpleNamespace(uiVal=650_000))
    nvml.NVMLError, nvml.NVML_CLOCK_SM = NVMLError, 1
    nvml.nvmlInit = lambda: None
    nvml.nvmlDeviceGetHandleByIndex = lambda i: ("index", i)
    nvml.nvmlDeviceGetHandleByUUID = lambda u: ("uuid", u)
    nvml.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000
    nvml.nvmlDeviceGetFieldValues = lambda h, ids: [field] if ids == [telemetry.POWER_INSTANT] else []
    nvml.nvmlDeviceGetPowerUsage = lambda h: 640_000  # the one-second average, in mW
    nvml.nvmlDeviceGetClockInfo = lambda h, kind: 1515 if kind == 1 else 0
    nvml.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0x4
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return nvml


@pytest.mark.parametrize("visible, handle", [
    (None, ("index", 1)),                        # CUDA sees every GPU: its ordinal is NVML's index
    ("3,5", ("index", 5)),                       # CUDA's device 1 is the machine's GPU 5
    ("GPU-aaa, GPU-bbb", ("uuid", "GPU-bbb")),   # given by UUID
])
def test_reader_reads_the_gpu_cuda_was_given(monkeypatch, visible, handle):
    _fake_pynvml(monkeypatch)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    seen = []
    sys.modules["pynvml"].nvmlDeviceGetClockInfo = lambda h, kind: seen.append(h) or 1515
    device = types.SimpleNamespace(platform="gpu", local_hardware_id=1, id=1)
    read, limit_w, why = telemetry.reader(device)
    assert why is None and limit_w == 700.0
    assert read() == Reading(1515, 650.0, 0x4)  # the instant power field, in W
    assert seen == [handle]


def test_reader_falls_back_to_the_averaged_power_where_the_instant_field_is_missing(monkeypatch):
    _fake_pynvml(monkeypatch, power_field_ok=False)
    read, _, _ = telemetry.reader(types.SimpleNamespace(platform="gpu", local_hardware_id=0, id=0))
    assert read().power_w == 640.0


def test_without_nvml_the_summary_is_empty_and_says_why(monkeypatch):
    s = telemetry.sample(jax.devices()[0])  # the CPU in CI
    with s:
        pass
    assert s.summary()["sm_mhz"] is None and "not an NVIDIA GPU" in s.summary()["why"]
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml now raises ImportError
    read, _, why = telemetry.reader(types.SimpleNamespace(platform="gpu", local_hardware_id=0, id=0))
    assert read is None and "nvidia-ml-py" in why


def test_devices_in_step_read_as_their_slowest(monkeypatch):
    """A model sharded over several GPUs runs at the pace of the slowest: each reading takes the
    lowest SM clock among them, the highest power and any one's held-down reasons; the power
    limit is the lowest. A device NVML cannot read leaves the summary empty, saying why."""
    nvml = _fake_pynvml(monkeypatch)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    clocks, watts, reasons = {0: 1980, 1: 1515}, {0: 300_000, 1: 690_000}, {0: 0x1, 1: 0x4}
    nvml.nvmlDeviceGetClockInfo = lambda h, kind: clocks[h[1]]
    nvml.nvmlDeviceGetFieldValues = lambda h, ids: [types.SimpleNamespace(
        nvmlReturn=0, value=types.SimpleNamespace(uiVal=watts[h[1]]))]
    nvml.nvmlDeviceGetCurrentClocksEventReasons = lambda h: reasons[h[1]]
    nvml.nvmlDeviceGetEnforcedPowerLimit = lambda h: 700_000 if h[1] == 0 else 650_000
    gpus = [types.SimpleNamespace(platform="gpu", local_hardware_id=i, id=i) for i in (0, 1)]
    with telemetry.sample(gpus, interval_s=60) as s:
        pass
    assert s.readings[0] == Reading(1515, 690.0, 0x4 | 0x1)
    got = s.summary()
    assert (got["sm_mhz"], got["power_capped_pct"], got["power_limit_w"]) == (1515, 100.0, 650.0)
    with telemetry.sample([gpus[0], jax.devices()[0]]) as s:  # the CPU in CI: no NVML there
        pass
    assert s.summary()["sm_mhz"] is None and "not an NVIDIA GPU" in s.summary()["why"]
