"""What a GPU's clock and power did while a block of work ran: NVML samples, through nvidia-ml-py.

A large model's steps on a GPU run at the board's power limit, its clocks held below their
maximum (figures: docs/tracing.md#clocks-and-power-is-the-gpu-at-its-power-limit), so a speed
means little without the clock it ran at, and a rate compared with another should be measured
under the same load. `scripts/bench.py` records this for each phase it times.

    with telemetry.sample() as s:   # jax.devices()[0] unless a device (or a list) is given
        work()
    s.summary()  # {"sm_mhz": 1515, "sm_mhz_min": 1410, "power_w": 697.4, "power_capped_pct": 85.0, ...}

Where NVML cannot be read (a CPU, no driver, nvidia-ml-py not installed), the summary's figures
are None and `why` says what was missing.
"""

from __future__ import annotations

import os
import statistics
import threading
from typing import Callable, NamedTuple

# NVML clock event reasons that mean the clocks are held down: software power cap, hardware
# slowdown, software and hardware thermal slowdown, hardware power brake.
HELD_DOWN = 0x4 | 0x8 | 0x20 | 0x40 | 0x80
POWER_INSTANT = 186  # NVML_FI_DEV_POWER_INSTANT: the power now, where GetPowerUsage averages a second


class Reading(NamedTuple):
    sm_mhz: float
    power_w: float
    reasons: int  # NVML clock event reason bits


def _nvml_device(device):
    """(pynvml, handle, power limit in W) for a JAX GPU device, or a string saying why not."""
    if getattr(device, "platform", None) != "gpu":
        return f"not an NVIDIA GPU ({getattr(device, 'platform', device)})"
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py is not installed (pip install jaxllm[cuda13] brings it)"
    try:
        pynvml.nvmlInit()
        # CUDA numbers the devices it was given; NVML numbers them all, or takes their UUIDs.
        ordinal = getattr(device, "local_hardware_id", None)
        ordinal = device.id if ordinal is None else ordinal
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
        entry = visible[ordinal] if ordinal < len(visible) else str(ordinal)
        handle = (pynvml.nvmlDeviceGetHandleByIndex(int(entry)) if entry.isdigit()
                  else pynvml.nvmlDeviceGetHandleByUUID(entry))
        limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3
    except Exception as e:  # pynvml.NVMLError and its many subclasses: no driver, no library
        return f"NVML cannot be read: {e}"
    return pynvml, handle, limit_w


def reader(device=None) -> tuple[Callable[[], Reading] | None, float | None, str | None]:
    """(a function reading the device's clock and power now, its power limit in W, None), or
    (None, None, why) where NVML cannot be read."""
    if device is None:
        import jax
        device = jax.devices()[0]
    found = _nvml_device(device)
    if isinstance(found, str):
        return None, None, found
    pynvml, handle, limit_w = found
    reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        pynvml.nvmlDeviceGetCurrentClocksThrottleReasons

    def instant_w():
        field = pynvml.nvmlDeviceGetFieldValues(handle, [POWER_INSTANT])[0]
        if field.nvmlReturn != 0:
            raise pynvml.NVMLError(field.nvmlReturn)
        return field.value.uiVal / 1e3

    try:
        instant_w()
        power_w = instant_w
    except Exception:  # an older driver: the one-second average
        def power_w():
            return pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3

    def read() -> Reading:
        return Reading(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM), power_w(),
                       int(reasons(handle)))
    return read, limit_w, None


class Sampler:
    """Reads the clock and power every `interval_s` on a thread while the `with` block runs."""

    def __init__(self, read: Callable[[], Reading] | None, interval_s: float = 0.02,
                 power_limit_w: float | None = None, why: str | None = None):
        self.read, self.interval_s, self.power_limit_w, self.why = read, interval_s, power_limit_w, why
        self.readings: list[Reading] = []
        self._stop = threading.Event()
        self._thread = None

    def _run(self):
        while self.read is not None:
            self._take()
            if self._stop.wait(self.interval_s):
                return

    def _take(self):
        try:
            self.readings.append(self.read())
        except Exception as e:  # a reading that fails ends the sampling, not the work it watches
            self.why, self.read = f"NVML failed while sampling: {e}", None

    def __enter__(self) -> "Sampler":
        if self.read is not None:
            self._thread = threading.Thread(target=self._run, name="jaxllm-telemetry", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            if self.read is not None:
                self._take()  # the block's end, so a block shorter than the interval has two

    def summary(self) -> dict:
        """Median and lowest SM clock, median power, and the share of readings whose clocks were
        held down (`HELD_DOWN`: power cap, thermal or hardware slowdown), in percent."""
        r = self.readings
        if not r:
            return dict(sm_mhz=None, sm_mhz_min=None, power_w=None, power_capped_pct=None,
                        power_limit_w=self.power_limit_w, samples=0, why=self.why or "no readings")
        return dict(sm_mhz=statistics.median(x.sm_mhz for x in r), sm_mhz_min=min(x.sm_mhz for x in r),
                    power_w=round(statistics.median(x.power_w for x in r), 1),
                    power_capped_pct=round(100 * sum(1 for x in r if x.reasons & HELD_DOWN) / len(r), 1),
                    power_limit_w=self.power_limit_w, samples=len(r), why=self.why)


def slowest(reads: list[Callable[[], Reading]]) -> Callable[[], Reading]:
    """One reading of several GPUs that work in step (a model sharded over them, each step waiting
    for the slowest): the lowest SM clock among them, the highest power, and every GPU's
    held-down reasons together."""
    def read() -> Reading:
        readings = [r() for r in reads]
        reasons = 0
        for x in readings:
            reasons |= x.reasons
        return Reading(min(x.sm_mhz for x in readings), max(x.power_w for x in readings), reasons)
    return read


def sample(device=None, interval_s: float = 0.02) -> Sampler:
    """A `Sampler` for a `with` block of `device` (default: JAX's first device), or of a list of
    devices that work in step (`slowest`): its power limit is then the lowest of theirs."""
    if not isinstance(device, (list, tuple)):
        read, limit_w, why = reader(device)
        return Sampler(read, interval_s, limit_w, why)
    found = [reader(d) for d in device]
    why = next((w for _, _, w in found if w is not None), None if found else "no devices given")
    if why is not None:
        return Sampler(None, interval_s, None, why)
    return Sampler(slowest([r for r, _, _ in found]), interval_s, min(lim for _, lim, _ in found))

