"""Test setup: 8 fake CPU devices, set before jax is imported anywhere (test modules import it at
collection, after this hook). `pytest -m gpu tests/gpu` keeps the machine's GPU instead."""

import os

import pytest


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


# The modules that take longest under `pytest -n 2` (seconds of their tests on 2 cores, from
# `--durations`), longest first. Under -n a worker takes one whole module at a time, in this
# order (pytest_xdist_make_scheduler below): each module's fixtures (a reference run, a built
# model) are made once instead of once a worker, and the long modules start first, the short
# ones filling in at the end instead of one long test leaving the other core idle.
SLOWEST_FIRST = [
    "test_parallel.py",  # 260
    "test_offload.py",  # 240
    "test_checkpoint.py",  # 190
    "test_launch.py",  # 170, one test
    "test_documents.py",  # 170
    "test_fp8.py",  # 140
    "test_train_step.py",  # 120
    "test_qwen3.py",  # 80
    "test_readme.py",  # 75
    "test_generate.py",  # 60
    "test_main.py",  # 60
]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest as found


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """-n's default distribution (load) by whole modules, as --dist=loadfile does, in collection
    order (not reordered by their numbers of tests)."""
    if config.getoption("dist") == "load":
        from xdist.scheduler import LoadFileScheduling

        config.option.loadscopereorder = False
        return LoadFileScheduling(config, log)
    return None
