"""Device telemetry for the `gpu` log records: what jax's allocator reports (memory in use, peak,
limit) and, where NVML is importable and initializes (the `gpu` extra: nvidia-ml-py), utilization,
clocks, power, temperature and the reasons clocks are held down.

A field that cannot be read is omitted, never filled with a default: a 0 W or 0% in a log would be
read as a measurement.
"""

import os
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

    def _handle(self, device: Any) -> Any:
        # jax numbers a GPU by its CUDA ordinal among the visible devices; NVML by the physical
        # index, so map through CUDA_VISIBLE_DEVICES (indices or UUIDs) when it is set.
        ordinal = getattr(device, "local_hardware_id", None)
        if ordinal is None:
            ordinal = device.id
        visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
        visible = [v for v in visible if v]
        if visible and ordinal < len(visible):
            v = visible[ordinal]
            if not v.isdigit():
                return self.nvml.nvmlDeviceGetHandleByUUID(v)
            ordinal = int(v)
        return self.nvml.nvmlDeviceGetHandleByIndex(ordinal)

    def fields(self, device: Any) -> dict[str, Any]:
        """Utilization, clocks, power, temperature, throttle reasons of one GPU: those NVML gives."""
        if self.nvml is None or getattr(device, "platform", None) != "gpu":
            return {}
        nv = self.nvml
        try:
            h = self._handle(device)
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
        get_reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
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
