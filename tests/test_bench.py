"""The benchmark runs the real train step and reports consistent numbers."""

import dataclasses
import subprocess
import sys

import pytest

from jaxllmq import bench
from jaxllmq.kernels import KERNELS
from jaxllmq.model.architecture import preset
from jaxllmq.settings import DataConfig, MeshConfig, ModelSpec, OptimConfig


def test_bench_reports_throughput_and_a_falling_loss():
    cfg = dataclasses.replace(preset("tiny"), num_hidden_layers=2)
    spec = ModelSpec(model="tiny", from_scratch=True, matmul_dtype="float32")
    out = bench.run_bench(
        cfg,
        spec,
        OptimConfig(lr=1e-2),
        DataConfig(batch_size=1, seq_len=32, grad_accumulation=2),
        MeshConfig(gpus=0),
        # pgle: traced, then compiled again with the (on CPU: empty) measured times
        bench.BenchConfig(bench_steps=4, bench_warmup=1, profile_steps=1, pgle_steps=1),
    )
    assert out["devices"] == 8 and out["pgle_steps"] == 1  # the test's fake CPU devices
    tokens_per_step = 2 * 1 * 8 * 32
    assert (
        abs(out["tokens_per_s"] * out["step_ms_mean"] / 1000 - tokens_per_step)
        < 1e-6 * tokens_per_step
    )
    assert out["losses"][-1] < out["losses"][0]  # the same batch, so it must be learned
    assert out["compile_s"] > 0 and out["mfu_spec"] is None and out["mfu_spec_fp8"] is None
    assert out["profile"]["device_ms_per_step"] == 0  # the trace ran; a CPU has no GPU streams
    assert out["kernels_used"] == dict.fromkeys(KERNELS, "xla")  # auto on CPU


def test_time_calls_waits_once_per_batch():
    """Calls go back to back; the wait comes once per batch (and after each warm-up call)."""
    events = []
    seconds = bench.time_calls(
        lambda: events.append("call") or len(events),
        calls=4,
        batches=3,
        warmup=1,
        wait=lambda out: events.append("wait"),
    )
    assert events == ["call", "wait"] + (["call"] * 4 + ["wait"]) * 3
    assert seconds > 0


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--kernels=bogus", "error: --kernels must be auto, pallas"),
        ("--gpus=16", "error: --gpus=16, but this process sees only 8 device(s)"),
    ],
)
def test_a_bad_flag_value_ends_in_one_line_naming_it(flag, message):
    run = subprocess.run(
        [sys.executable, "-m", "jaxllmq.bench", "--model=tiny", flag],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1].startswith(message)
    assert "Traceback" not in run.stderr
