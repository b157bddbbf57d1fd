"""Test setup: 8 fake CPU devices and XLA flags that compile fast, set before jax is imported
anywhere (test modules import it at collection, after this hook), and a persistent compilation
cache for the session's process and the training runs it starts, so that the many runs of the
same tiny model compile each program once. `pytest -m gpu tests/gpu` keeps the machine's GPU
instead."""

import os
import shutil
import tempfile
from importlib import metadata


def gpu_run(config) -> bool:
    """Whether this session selects the GPU tests (`-m gpu`), which need the real devices."""
    expr = config.getoption("markexpr") or ""
    return "gpu" in expr.split() and "not gpu" not in expr


def pytest_configure(config):
    if gpu_run(config):
        return
    # Compiling dominates the suite's tiny programs: LLVM at -O0 compiles them in about half the
    # time (a test whose steps dominate compiles them at -O1 itself: test_fp8), and XLA's older
    # elemental IR emitters instead of its MLIR fusion emitters in a third to a quarter of that
    # (a tiny model's train step 10-12 s -> 3 s, its fp8 step 14-17 s -> 5 s; the steps run as
    # fast; jax 0.11's XLA has only the fusion emitters, and stops on the flag). Eigen on one
    # thread per op: two test processes, each with 8 fake devices, share 2 cores. XLA_FLAGS
    # already set come after these, and win.
    jaxlib = tuple(int(part) for part in metadata.version("jaxlib").split(".")[:2])
    elemental = ["--xla_cpu_use_fusion_emitters=false"] if jaxlib < (0, 11) else []
    os.environ["XLA_FLAGS"] = " ".join(
        [
            "--xla_backend_optimization_level=0",
            *elemental,
            "--xla_cpu_multi_thread_eigen=false",
            os.environ.get("XLA_FLAGS", ""),
            "--xla_force_host_platform_device_count=8",
        ]
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # One cache per test process (each xdist worker's own: no two writers share a file).
    config.jaxllmq_cache = tempfile.mkdtemp(prefix="jaxllmq-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = config.jaxllmq_cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"


def pytest_unconfigure(config):
    cache = getattr(config, "jaxllmq_cache", None)
    if cache:
        shutil.rmtree(cache, ignore_errors=True)
