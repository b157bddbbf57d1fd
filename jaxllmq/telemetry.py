"""Device telemetry for the `gpu` log records: what jax's allocator reports (memory in use, peak,
limit) and, where NVML is importable and initializes (the `gpu` extra: nvidia-ml-py), utilization,
clocks, power, temperature and the reasons clocks are held down; and for the benchmarks, the energy,
power and SM clock of a timed region (EnergyMeter).

A field that cannot be read is omitted, never filled with a default: a 0 W or 0% in a log would be
read as a measurement.
"""

import contextlib
import os
import threading
import time
from typing import Any

# NVML's clock-event (throttle) reason bits, from nvml.h (nvmlClocksEventReason*).
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


def memory_fields(device: Any) -> dict[str, float]:
    """GiB in use, peak and limit of one jax device, as far as its allocator reports them."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # some backends raise instead of returning None
        stats = {}
    out = {}
    for key, name in (
        ("bytes_in_use", "memory_in_use_gib"),
        ("peak_bytes_in_use", "memory_peak_gib"),
        ("bytes_limit", "memory_limit_gib"),
    ):
        if key in stats:
            out[name] = stats[key] / 2**30
    return out


def cuda_ordinal(device: Any) -> int:
    """A jax GPU's CUDA ordinal among the visible devices."""
    ordinal = getattr(device, "local_hardware_id", None)
    return device.id if ordinal is None else ordinal


class Nvml:
    """NVML handles for this process's jax GPUs; `fields(device)` is {} where NVML is unavailable."""

    def __init__(self, nvml: Any | None = None):
        self.nvml = None
        try:
            if nvml is None:
                import pynvml as nvml  # nvidia-ml-py
            nvml.nvmlInit()
        except Exception:  # not installed, no driver, or no GPU: no NVML fields
            return
        self.nvml = nvml

    def handle_of(self, ordinal: int) -> Any:
        """The NVML handle of the GPU at this CUDA ordinal among the visible devices."""
        # NVML numbers GPUs by their physical index, so map through CUDA_VISIBLE_DEVICES
        # (indices or UUIDs) when it is set.
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
        visible = [v for v in visible if v]
        if visible and ordinal < len(visible):
            v = visible[ordinal]
            if not v.isdigit():
                return self.nvml.nvmlDeviceGetHandleByUUID(v)
            ordinal = int(v)
        return self.nvml.nvmlDeviceGetHandleByIndex(ordinal)

    def reasons_getter(self) -> Any:
        """NVML's call for the clock-event (throttle) reasons, by its newer or older name."""
        nv = self.nvml
        return getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )

    def fields(self, device: Any) -> dict[str, Any]:
        """Utilization, clocks, power, temperature, throttle reasons of one GPU: those NVML gives."""
        if self.nvml is None or getattr(device, "platform", None) != "gpu":
            return {}
        nv = self.nvml
        try:
            h = self.handle_of(cuda_ordinal(device))
        except Exception:
            return {}
        out: dict[str, Any] = {}

        def read(fn, *args) -> Any:
            try:
                return fn(h, *args)
            except Exception:  # not supported on this GPU or driver: leave the field out
                return None

        util = read(nv.nvmlDeviceGetUtilizationRates)
        if util is not None:
            out["gpu_util_percent"] = util.gpu
            out["memory_util_percent"] = util.memory
        for name, fn, args, scale in (
            ("sm_clock_mhz", nv.nvmlDeviceGetClockInfo, (nv.NVML_CLOCK_SM,), 1),
            ("memory_clock_mhz", nv.nvmlDeviceGetClockInfo, (nv.NVML_CLOCK_MEM,), 1),
            ("max_sm_clock_mhz", nv.nvmlDeviceGetMaxClockInfo, (nv.NVML_CLOCK_SM,), 1),
            ("power_w", nv.nvmlDeviceGetPowerUsage, (), 1e-3),  # NVML reports milliwatts
            ("power_limit_w", nv.nvmlDeviceGetEnforcedPowerLimit, (), 1e-3),
            ("temperature_c", nv.nvmlDeviceGetTemperature, (nv.NVML_TEMPERATURE_GPU,), 1),
        ):
            value = read(fn, *args)
            if value is not None:
                out[name] = value * scale
        get_reasons = self.reasons_getter()
        mask = read(get_reasons) if get_reasons is not None else None
        if mask is not None:
            out["throttle_reasons"] = [n for bit, n in THROTTLE_REASONS.items() if mask & bit]
        return out


def device_records(devices: list[Any], nvml: Nvml | None = None) -> list[dict[str, Any]]:
    """One dict per device: id, kind, platform, then the memory and NVML fields it has."""
    out = []
    for d in devices:
        rec = {"id": d.id, "kind": d.device_kind, "platform": d.platform}
        rec.update(memory_fields(d))
        if nvml is not None:
            rec.update(nvml.fields(d))
        out.append(rec)
    return out


SW_POWER_CAP = next(bit for bit, name in THROTTLE_REASONS.items() if name == "sw_power_cap")


class EnergyMeter:
    """The energy, mean power and SM clock of some GPUs over a timed region, for the benchmarks.

    NVML's energy counter (millijoules since the driver loaded; Volta and later) is read as the
    region starts and ends, so a region should end with its work waited for and last a second or
    more: the counter moves in steps of tens of milliseconds. Between the ends a thread samples
    each GPU's SM clock and whether its power cap holds the clock down, every `interval_s`.
    `with meter:` may be entered several times; `fields(per, unit)` sums over all the regions.
    Where NVML or a reading is unavailable its fields are left out (no meter: `fields` is {}).
    """

    def __init__(self, nvml: Nvml, ordinals: list[int], interval_s: float = 0.05):
        self.nvml, self.interval_s = nvml, interval_s
        self.handles = []
        if nvml.nvml is not None:
            try:
                self.handles = [nvml.handle_of(o) for o in ordinals]
            except Exception:  # a GPU NVML does not know: no meter
                self.handles = []
        self.millijoules: float | None = 0.0
        self.seconds = 0.0
        self.clocks_mhz: list[float] = []
        self.capped: list[bool] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def of_devices(
        cls, devices: list[Any], nvml: Nvml | None = None, interval_s: float = 0.05
    ) -> "EnergyMeter":
        """A meter of these jax devices' GPUs (none of a CPU's)."""
        gpus = [d for d in devices if getattr(d, "platform", None) == "gpu"]
        return cls(nvml or Nvml(), [cuda_ordinal(d) for d in gpus], interval_s)

    def _energy_mj(self) -> float | None:
        try:
            nv = self.nvml.nvml
            return float(sum(nv.nvmlDeviceGetTotalEnergyConsumption(h) for h in self.handles))
        except Exception:  # no energy counter on this GPU or driver
            return None

    def _sample(self) -> None:
        nv, get_reasons = self.nvml.nvml, self.nvml.reasons_getter()
        while not self._stop.wait(self.interval_s):
            for h in self.handles:
                # A reading that fails is left out, not filled in.
                with contextlib.suppress(Exception):
                    self.clocks_mhz.append(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
                if get_reasons is not None:
                    with contextlib.suppress(Exception):
                        self.capped.append(bool(get_reasons(h) & SW_POWER_CAP))

    def __enter__(self) -> "EnergyMeter":
        if self.handles:
            self._start_mj = self._energy_mj()
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        self._start_s = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds += time.perf_counter() - self._start_s
        if not self.handles:
            return
        end_mj = self._energy_mj()
        self._stop.set()
        self._thread.join()
        if self.millijoules is not None and None not in (self._start_mj, end_mj):
            self.millijoules += end_mj - self._start_mj
        else:
            self.millijoules = None

    def fields(self, per: int, unit: str) -> dict[str, float]:
        """Joules per `unit` (the regions held `per` of them), watts (the GPUs' total draw), the SM
        clock's mean and least, and the share of samples in which the power cap held it down."""
        if not self.handles:
            return {}
        out = {}
        if self.millijoules is not None and self.seconds > 0:
            out[f"joules_per_{unit}"] = self.millijoules / 1e3 / per
            out["watts"] = self.millijoules / 1e3 / self.seconds
        if self.clocks_mhz:
            out["sm_clock_mhz_mean"] = sum(self.clocks_mhz) / len(self.clocks_mhz)
            out["sm_clock_mhz_min"] = min(self.clocks_mhz)
        if self.capped:
            out["power_capped_share"] = sum(self.capped) / len(self.capped)
        return out
