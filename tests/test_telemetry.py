"""`gpu` record fields: only what the allocator and NVML really report, nothing faked."""

import time
import types

import jax

from jaxllmq import telemetry

BASE = {"id", "kind", "platform"}


def test_cpu_records_have_only_real_fields():
    # On CPU jax reports no memory stats and NVML does not initialize (no driver): base fields only.
    nvml = telemetry.Nvml()
    records = telemetry.device_records(jax.local_devices(), nvml)
    assert len(records) == jax.local_device_count()
    memory = {"memory_in_use_gib", "memory_peak_gib", "memory_limit_gib"}
    for r, d in zip(records, jax.local_devices(), strict=True):
        assert {k: r[k] for k in BASE} == {"id": d.id, "kind": d.device_kind, "platform": "cpu"}
        # Memory fields only if the CPU allocator reports stats (it does not today); never NVML's.
        assert set(r) - BASE <= (memory if d.memory_stats() else set())


class FakeDevice:
    def __init__(self, stats, platform="gpu"):
        self.id, self.local_hardware_id, self.device_kind, self.platform = (
            0,
            0,
            "NVIDIA H200",
            platform,
        )
        self._stats = stats

    def memory_stats(self):
        return self._stats


def test_memory_fields_only_those_reported():
    d = FakeDevice({"bytes_in_use": 2**30, "peak_bytes_in_use": 3 * 2**30})
    assert telemetry.memory_fields(d) == {"memory_in_use_gib": 1.0, "memory_peak_gib": 3.0}
    assert telemetry.memory_fields(FakeDevice(None)) == {}


class FakeNvmlError(Exception):
    pass


def fake_pynvml(init_fails=False, unsupported=()):
    """A stand-in for pynvml: fixed readings; the calls named in `unsupported` raise."""

    def call(name, value):
        def fn(*args):
            if name in unsupported:
                raise FakeNvmlError(name)
            return value(*args) if callable(value) else value

        return fn

    def init():
        if init_fails:
            raise FakeNvmlError("NVML Shared Library Not Found")

    ns = types.SimpleNamespace(
        nvmlInit=init,
        NVML_CLOCK_SM=1,
        NVML_CLOCK_MEM=2,
        NVML_TEMPERATURE_GPU=0,
        nvmlDeviceGetHandleByIndex=lambda i: ("handle", i),
        nvmlDeviceGetHandleByUUID=lambda u: ("handle", u),
    )
    for name, value in {
        "nvmlDeviceGetUtilizationRates": types.SimpleNamespace(gpu=97, memory=40),
        "nvmlDeviceGetClockInfo": lambda h, c: {1: 1980, 2: 2619}[c],
        "nvmlDeviceGetMaxClockInfo": 1980,
        "nvmlDeviceGetPowerUsage": 650_000,
        "nvmlDeviceGetEnforcedPowerLimit": 700_000,
        "nvmlDeviceGetTemperature": 61,
        "nvmlDeviceGetCurrentClocksEventReasons": 0x4 | 0x20,
    }.items():
        setattr(ns, name, call(name, value))
    return ns


def test_nvml_fields_as_reported_and_omitted_when_unsupported(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = telemetry.Nvml(fake_pynvml())
    (rec,) = telemetry.device_records([FakeDevice({"bytes_limit": 2**31})], nvml)
    assert rec == {
        "id": 0,
        "kind": "NVIDIA H200",
        "platform": "gpu",
        "memory_limit_gib": 2.0,
        "gpu_util_percent": 97,
        "memory_util_percent": 40,
        "sm_clock_mhz": 1980,
        "memory_clock_mhz": 2619,
        "max_sm_clock_mhz": 1980,
        "power_w": 650.0,
        "power_limit_w": 700.0,
        "temperature_c": 61,
        "throttle_reasons": ["sw_power_cap", "sw_thermal_slowdown"],
    }
    partial = telemetry.Nvml(
        fake_pynvml(unsupported={"nvmlDeviceGetPowerUsage", "nvmlDeviceGetUtilizationRates"})
    )
    fields = partial.fields(FakeDevice(None))
    assert not {"power_w", "gpu_util_percent", "memory_util_percent"} & fields.keys()
    assert fields["temperature_c"] == 61
    # NVML that does not initialize, or a device that is not a GPU: no NVML fields at all.
    assert telemetry.Nvml(fake_pynvml(init_fails=True)).fields(FakeDevice(None)) == {}
    assert nvml.fields(FakeDevice(None, platform="cpu")) == {}


def test_nvml_handle_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    nvml = telemetry.Nvml(fake_pynvml())
    d = FakeDevice(None)
    d.local_hardware_id = 1
    assert nvml.handle_of(telemetry.cuda_ordinal(d)) == ("handle", 5)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc")
    d.local_hardware_id = 0
    assert nvml.handle_of(telemetry.cuda_ordinal(d)) == ("handle", "GPU-abc")


def metered_pynvml(clocks_mhz, capped, unsupported=()):
    """fake_pynvml whose energy counter rises 700 mJ a read and whose SM clock walks `clocks_mhz`
    and power-cap bit `capped`, one step a read (holding the last)."""
    nv = fake_pynvml(unsupported=unsupported)
    reads = {"energy": 0, "clock": 0, "reasons": 0}

    def energy(h):
        if "nvmlDeviceGetTotalEnergyConsumption" in unsupported:
            raise FakeNvmlError("not supported")
        reads["energy"] += 1
        return 10_000_000 + 700 * reads["energy"]

    def walk(name, values):
        def fn(h, *args):
            i = min(reads[name], len(values) - 1)
            reads[name] += 1
            return values[i]

        return fn

    nv.nvmlDeviceGetTotalEnergyConsumption = energy
    nv.nvmlDeviceGetClockInfo = walk("clock", clocks_mhz)
    nv.nvmlDeviceGetCurrentClocksEventReasons = walk("reasons", [0x4 if c else 0 for c in capped])
    return nv


def test_energy_meter_sums_its_regions_and_samples_clock_and_power_cap(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nv = metered_pynvml([1980, 1500], [False, True])
    meter = telemetry.EnergyMeter.of_devices([FakeDevice(None)], telemetry.Nvml(nv), 0.001)
    for _ in range(2):
        with meter:
            time.sleep(0.05)
    fields = meter.fields(per=4, unit="call")
    # Two regions of 700 mJ each (one counter step between a region's two reads) over 4 calls.
    assert fields["joules_per_call"] == 1.4 / 4
    assert fields["watts"] == 1.4 / meter.seconds
    assert 0.1 <= meter.seconds < 1
    assert fields["sm_clock_mhz_min"] == 1500
    assert 1500 < fields["sm_clock_mhz_mean"] < 1980  # the first sample 1980, the rest 1500
    assert 0 < fields["power_capped_share"] < 1


def test_energy_meter_leaves_out_what_it_cannot_read(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    no_counter = metered_pynvml([1700], [True], {"nvmlDeviceGetTotalEnergyConsumption"})
    meter = telemetry.EnergyMeter.of_devices([FakeDevice(None)], telemetry.Nvml(no_counter), 0.001)
    with meter:
        time.sleep(0.02)
    assert meter.fields(per=1, unit="step") == {
        "sm_clock_mhz_mean": 1700,
        "sm_clock_mhz_min": 1700,
        "power_capped_share": 1.0,
    }
    # No NVML, or no GPU among the devices: no meter and no fields, the region still runs.
    for meter in (
        telemetry.EnergyMeter.of_devices([FakeDevice(None)], telemetry.Nvml(fake_pynvml(True))),
        telemetry.EnergyMeter.of_devices(jax.local_devices(), telemetry.Nvml(fake_pynvml())),
    ):
        with meter:
            pass
        assert meter.fields(per=1, unit="step") == {}
