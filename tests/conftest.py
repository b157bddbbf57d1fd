"""Test setup: 8 fake CPU devices, set before jax is imported anywhere (test modules import it at
collection, after this hook). `pytest -m gpu tests/gpu` keeps the machine's GPU instead."""

import os


def gpu_run(config) -> bool:
    """Whether this session selects the GPU tests (`-m gpu`), which need the real devices."""
    expr = config.getoption("markexpr") or ""
    return "gpu" in expr.split() and "not gpu" not in expr


def pytest_configure(config):
    if gpu_run(config):
        return
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
