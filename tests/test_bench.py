"""The benchmark runs the real train step and reports consistent numbers."""

import dataclasses
import json
import subprocess
import sys
import types

import numpy as np
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
    assert "joules_per_step" not in out and "sm_clock_mhz_mean" not in out  # no GPU to meter


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


def test_time_calls_in_turn_takes_each_calls_batches_in_turn(monkeypatch):
    """A batch of each call, then the next round; each call's median over its own batches."""
    events, clock = [], iter(range(100))
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))

    def call(name):
        return lambda: events.append(name) or name

    seconds = bench.time_calls_in_turn(
        {"a": call("a"), "b": call("b")},
        calls=2,
        batches=3,
        warmup=1,
        wait=lambda out: events.append(f"wait {out}"),
    )
    warmups = ["a", "wait a", "b", "wait b"]
    assert events == warmups + ["a", "a", "wait a", "b", "b", "wait b"] * 3
    assert seconds == {"a": 0.5, "b": 0.5}  # a batch of two calls spans one tick of the clock


class FakeMeter:
    """A meter that reads 6 J and a 1,500 MHz clock per region, or nothing (no GPU)."""

    def __init__(self, reads: bool, events: list):
        self.reads, self.events, self.regions, self.seconds = reads, events, 0, 0.0

    def __enter__(self):
        self.events.append("enter")

    def __exit__(self, *exc):
        self.events.append("exit")
        self.regions += 1
        self.seconds += 0.5

    def fields(self, per, unit):
        if not self.reads:
            return {}
        return {f"joules_per_{unit}": 6.0 * self.regions / per, "sm_clock_mhz_mean": 1500.0}


def test_energy_in_turn_runs_each_call_for_its_seconds_in_turn_and_meters_it(monkeypatch):
    """Each round runs each call back to back for about `seconds` (by its time per call) inside
    its own meter, waited for once; each call's fields add its ms per call over the regions."""
    events = []
    meters = iter([FakeMeter(True, events), FakeMeter(False, events)])
    monkeypatch.setattr(
        bench.telemetry.EnergyMeter, "of_devices", lambda devices, nvml: next(meters)
    )

    def call(name):
        return lambda: events.append(name) or name

    energy = bench.energy_in_turn(
        {"a": call("a"), "b": call("b")},
        {"a": 0.5, "b": 0.25},
        seconds=1.0,
        rounds=2,
        wait=lambda out: events.append(f"wait {out}"),
    )
    one_round = ["enter", "a", "a", "wait a", "exit", "enter"] + ["b"] * 4 + ["wait b", "exit"]
    assert events == one_round * 2
    # a: 2 regions of 6 J over 4 calls, 0.5 s a region; b's meter read nothing: no fields.
    assert energy == {
        "a": {"joules_per_call": 3.0, "sm_clock_mhz_mean": 1500.0, "sustained_ms": 250.0},
        "b": {},
    }


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


def test_a_model_directory_without_weights_ends_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset("tiny").to_hf_dict()))
    run = subprocess.run(
        [sys.executable, "-m", "jaxllmq.bench", f"--model={tmp_path}", "--bench_steps=1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert (
        last.startswith(f"error: {tmp_path}: neither model.safetensors")
        and "Traceback" not in run.stderr
    )


def test_synthetic_documents_have_a_realistic_length_mix():
    cfg = dataclasses.replace(preset("tiny"), vocab_size=64)
    batch = bench.with_documents(bench.synthetic_batch(cfg, 2, 4, 2047), eos_id=5, per_window=31)
    assert {k: v.shape for k, v in batch.items()} == dict.fromkeys(
        ["inputs", "targets", "loss_mask", "segment_ids", "positions"], (2, 4, 2047)
    )
    inputs, targets = batch["inputs"].reshape(8, -1), batch["targets"].reshape(8, -1)
    tokens = np.concatenate([inputs, targets[:, -1:]], axis=1).ravel()  # the stream cut
    lengths = np.diff(np.flatnonzero(tokens == 5))  # whole documents: EOS to EOS
    assert 400 < np.median(lengths) < 900 and lengths.min() < 200 < 2000 < lengths.max()
    # The pipeline's documents: the target after an EOS untrained, positions from 0 after it.
    np.testing.assert_array_equal(batch["loss_mask"], batch["inputs"] != 5)
    after = np.flatnonzero(inputs[:, :-1].ravel() == 5)
    assert (batch["positions"].reshape(8, -1)[:, 1:].ravel()[after] == 0).all()
    same = bench.with_documents(bench.synthetic_batch(cfg, 2, 4, 2047), eos_id=5, per_window=31)
    assert all(np.array_equal(batch[k], same[k]) for k in batch)  # a fixed seed


def test_bench_with_document_masking_times_masked_documents(monkeypatch):
    built = {}

    def build_synthetic(*args, **kwargs):  # the real one, its step and batch kept
        built["step"], built["batch"] = bench_build(*args, **kwargs)
        return built["step"], built["batch"]

    bench_build = bench.build_synthetic
    monkeypatch.setattr(bench, "build_synthetic", build_synthetic)
    cfg = dataclasses.replace(preset("tiny"), num_hidden_layers=1)
    spec = ModelSpec(model="tiny", from_scratch=True, matmul_dtype="float32")
    data = DataConfig(batch_size=1, seq_len=32, document_masking=True)
    out = bench.run_bench(
        cfg, spec, OptimConfig(), data, MeshConfig(gpus=0), bench.BenchConfig(bench_steps=1)
    )
    assert out["document_masking"] and out["attention_used"] == "xla"
    assert built["step"].plan.documents_per_window == out["documents_per_window"] == 32
    assert {"segment_ids", "positions"} <= set(built["batch"])


def test_document_segment_ids_follow_the_length_mix():
    seg = bench.document_segment_ids(8, 2048, seed=3)
    assert seg.shape == (8, 2048) and seg.dtype == np.int32
    assert (seg[:, 0] == 0).all() and set(np.unique(np.diff(seg, axis=1))) <= {0, 1}
    lengths = np.concatenate([np.bincount(row)[:-1] for row in seg])  # each row's last is cut
    assert 300 < np.median(lengths) < 1200  # around the median of 600
    np.testing.assert_array_equal(seg, bench.document_segment_ids(8, 2048, seed=3))
