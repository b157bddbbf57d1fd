"""The XLA flag defaults and the train step's compile options never override what the user set."""

import os

from jaxllmq.xla_flags import (
    DEFAULTS,
    HOST_MEMORY_LIMIT,
    apply_defaults,
    step_options,
    with_defaults,
)

DET = "--xla_gpu_deterministic_ops"


def test_defaults_are_added_to_an_empty_environment():
    assert with_defaults("").split() == [f"--{k}={v}" for k, v in DEFAULTS.items()]


def test_a_user_setting_wins_and_other_flags_are_kept():
    out = with_defaults(
        "--xla_force_host_platform_device_count=8 --xla_gpu_enable_triton_gemm=true"
    )
    assert out.split().count("--xla_gpu_enable_triton_gemm=true") == 1
    assert "--xla_gpu_enable_triton_gemm=false" not in out
    assert "--xla_force_host_platform_device_count=8" in out
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in out


def test_host_memory_pool_default_and_user_setting(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.delenv(HOST_MEMORY_LIMIT, raising=False)
    apply_defaults()
    total_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    assert 0 < int(os.environ[HOST_MEMORY_LIMIT]) <= total_gb
    monkeypatch.setenv(HOST_MEMORY_LIMIT, "7")
    apply_defaults()
    assert os.environ[HOST_MEMORY_LIMIT] == "7"


def test_deterministic_adds_xla_deterministic_ops_unless_the_user_set_them(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    apply_defaults()
    assert DET not in os.environ["XLA_FLAGS"]
    apply_defaults(deterministic=True)
    assert f"{DET}=true" in os.environ["XLA_FLAGS"].split()
    monkeypatch.setenv("XLA_FLAGS", f"{DET}=false")
    apply_defaults(deterministic=True)
    assert os.environ["XLA_FLAGS"].split().count(f"{DET}=false") == 1
    assert f"{DET}=true" not in os.environ["XLA_FLAGS"]


def test_a_scanned_step_compiles_without_dynamic_slice_fusions_unless_the_user_says(monkeypatch):
    zeros = "xla_gpu_enable_dus_accumulator_zero_init_elimination"
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    assert step_options(scan_layers=True) == {
        "xla_gpu_enable_dynamic_slice_fusion": False,
        zeros: True,
    }
    assert step_options(scan_layers=False) == {}  # unrolled: XLA's default
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_dynamic_slice_fusion=true")
    assert step_options(scan_layers=True) == {zeros: True}
