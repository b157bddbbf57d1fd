"""Benchmark the real train step on synthetic tokens: tokens/s, MFU, memory, compile time.

    python -m jaxllmq.bench --model=llama-3.2-1b --batch_size=8 --seq_len=2048 [--json]
    python -m jaxllmq.bench --flagfile=configs/llama-3.2-1b-pretrain.flags --bench_steps=30

Takes the trainer's flags (the same flagfiles work; --train_file is not needed; the command is
jaxllmq/cli/bench.py) and builds the state and step through train_step.build, the code path a
training run uses. With --document_masking the windows hold documents of a realistic length mix
(see DOC_MEDIAN), masked apart as in training.
"""

import dataclasses
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.profiler import get_profiled_instructions_proto

from jaxllmq import peaks, profile, telemetry, train_step
from jaxllmq.data.pipeline import documents, to_global_arrays
from jaxllmq.model.architecture import ModelConfig
from jaxllmq.parallel.mesh import batch_rows, make_mesh
from jaxllmq.plan import plan_for
from jaxllmq.setting import Settings, setting
from jaxllmq.settings import DataConfig, MeshConfig, ModelSpec, OptimConfig


@dataclasses.dataclass(frozen=True)
class BenchConfig(Settings):
    """Benchmark: how long to time the step, and what else to measure."""

    bench_steps: int = setting(20, "Timed steps.", lower=1)
    bench_warmup: int = setting(3, "Untimed steps after compiling.", lower=1)
    json: bool = setting(False, "Print one JSON object instead of the table.")
    profile_steps: int = setting(
        0,
        "After timing, trace this many steps and report GPU kernel time by category "
        "(jaxllmq.profile).",
        lower=0,
    )
    profile_top: int = setting(
        15, "With --profile_steps: how many of the longest kernels to list.", lower=1
    )
    pgle_steps: int = setting(
        0,
        "Profile-guided scheduling: after compiling, trace this many steps and compile again "
        "with their measured kernel and collective times (XLA's profile-guided latency "
        "estimator), then time that program. 0: off.",
        lower=0,
    )
    measure_matmul_ceiling: bool = setting(
        True, "On GPU, time an 8192^3 bf16 matmul as the practical peak."
    )


def time_calls(
    call: Callable[[], Any],
    *,
    calls: int = 10,
    batches: int = 5,
    warmup: int = 2,
    wait: Callable[[Any], Any] = jax.block_until_ready,
) -> float:
    """Seconds per call of `call()`: the median over `batches` batches of `calls` calls issued
    back to back and waited for once, after `warmup` calls. One wait per call would time the
    dispatch and the synchronization too, which dominate a kernel of tens of microseconds.
    `wait` blocks on a call's result (another framework's: torch.cuda.synchronize)."""
    seconds = time_calls_in_turn({"": call}, calls=calls, batches=batches, warmup=warmup, wait=wait)
    return seconds[""]


def time_calls_in_turn(
    calls_by_name: dict[str, Callable[[], Any]],
    *,
    calls: int = 10,
    batches: int = 5,
    warmup: int = 2,
    wait: Callable[[Any], Any] = jax.block_until_ready,
) -> dict[str, float]:
    """Seconds per call of each named call, as time_calls times one, with the batches taken in
    turn: a batch of each call, then the next round. Variants compared this way share whatever
    drift the device has over the run (its clock falling as it heats, under its power limit),
    where timed one after the other the last would take all of it."""
    for call in calls_by_name.values():
        for _ in range(warmup):
            wait(call())
    times = {name: [] for name in calls_by_name}
    for _ in range(batches):
        for name, call in calls_by_name.items():
            t = time.perf_counter()
            for _ in range(calls):
                out = call()
            wait(out)
            times[name].append((time.perf_counter() - t) / calls)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def energy_in_turn(
    calls_by_name: dict[str, Callable[[], Any]],
    seconds_per_call: dict[str, float],
    *,
    seconds: float = 1.0,
    rounds: int = 3,
    devices: list[Any] | None = None,
    wait: Callable[[Any], Any] = jax.block_until_ready,
) -> dict[str, dict[str, float]]:
    """Each named call's energy under sustained load: `rounds` rounds in which each call, in
    turn, runs back to back for about `seconds` (by its `seconds_per_call`) and is waited for
    once, metered (telemetry.EnergyMeter: joules per call, watts, the SM clock's mean and least,
    the share of time the power cap held it down) on `devices` (default: the first local one),
    with its ms per call over those regions ("sustained_ms"), which a power cap can lengthen
    past the timed batches' few calls. A call's fields are {} where no GPU meter reads."""
    devices, nvml = devices or jax.local_devices()[:1], telemetry.Nvml()
    meters = {name: telemetry.EnergyMeter.of_devices(devices, nvml) for name in calls_by_name}
    counts = {name: max(1, round(seconds / seconds_per_call[name])) for name in calls_by_name}
    for _ in range(rounds):
        for name, call in calls_by_name.items():
            with meters[name]:
                for _ in range(counts[name]):
                    out = call()
                wait(out)
    fields_by_name = {}
    for name, meter in meters.items():
        calls = rounds * counts[name]
        fields = meter.fields(per=calls, unit="call")
        if fields:
            fields["sustained_ms"] = 1e3 * meter.seconds / calls
        fields_by_name[name] = fields
    return fields_by_name


def matmul_ceiling(n: int = 8192) -> float:
    """Measured bf16 matmul FLOP/s of one device (random data)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x, y: x @ y)
    return 2 * n**3 / time_calls(lambda: mm(a, b), calls=10, batches=3)


def synthetic_batch(cfg: ModelConfig, acc: int, rows: int, seq_len: int, seed: int = 0) -> dict:
    """Uniform random tokens [acc, rows, seq_len], every target trained on."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, size=(acc, rows, seq_len + 1), dtype=np.int32)
    return {
        "inputs": tokens[..., :-1],
        "targets": tokens[..., 1:],
        "loss_mask": np.ones((acc, rows, seq_len), bool),
    }


# With --document_masking the synthetic windows hold documents of log-normal lengths (median
# DOC_MEDIAN tokens, log standard deviation DOC_SIGMA, a fixed seed), each ending with EOS, as a
# corpus's documents fall into windows: so the step timed masks what a user's run masks.
DOC_MEDIAN, DOC_SIGMA = 600, 1.0


def with_documents(batch: dict, eos_id: int, per_window: int, seed: int = 0) -> dict:
    """synthetic_batch's windows, read as one token stream, cut into documents ending with
    `eos_id` (no EOS elsewhere), with the pipeline's segment_ids, positions and loss mask
    (`per_window` documents a window kept apart)."""
    rng = np.random.default_rng([seed, eos_id])
    acc, rows, seq_len = batch["inputs"].shape
    windows = np.concatenate([batch["inputs"], batch["targets"][..., -1:]], axis=-1)
    stream = windows.reshape(-1).copy()
    stream[stream == eos_id] = 0 if eos_id else 1
    lengths = rng.lognormal(math.log(DOC_MEDIAN), DOC_SIGMA, size=len(stream))
    ends = np.cumsum(np.maximum(1, np.round(lengths)).astype(np.int64)) - 1
    stream[ends[ends < len(stream)]] = eos_id
    windows = stream.reshape(-1, seq_len + 1)
    segment_ids, positions, trained = documents(windows[:, :-1], eos_id, per_window)
    out = {"inputs": windows[:, :-1], "targets": windows[:, 1:], "loss_mask": trained,
           "segment_ids": segment_ids, "positions": positions}  # fmt: skip
    return {k: v.reshape(acc, rows, seq_len) for k, v in out.items()}


def document_segment_ids(
    rows: int, seq_len: int, median: float = DOC_MEDIAN, seed: int = 0
) -> np.ndarray:
    """int32[rows, seq_len]: each token's document in windows of documents of with_documents'
    length mix (log-normal around `median`), each row starting with a document's first token."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        lengths = []
        while sum(lengths) < seq_len:
            lengths.append(max(1, int(rng.lognormal(math.log(median), DOC_SIGMA))))
        out.append(np.repeat(np.arange(len(lengths)), lengths)[:seq_len])
    return np.stack(out).astype(np.int32)


def bench_eos_id(model_cfg: ModelConfig, data: DataConfig) -> int:
    """The EOS id of the synthetic documents: --eos_id, else the model's first eos_token_id,
    else 0."""
    if data.eos_id is not None:
        return data.eos_id
    eos = model_cfg.eos_token_id
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return eos if isinstance(eos, int) and 0 <= eos < model_cfg.vocab_size else 0


def build_synthetic(
    model_cfg: ModelConfig,
    spec: ModelSpec,
    optim: OptimConfig,
    data: DataConfig,
    mesh: jax.sharding.Mesh,
    zero_level: int = 1,
) -> tuple[train_step.ModelOnMesh, dict]:
    """The state and steps as a training run builds them, and a synthetic batch on the mesh.

    data.batch_size is per data-parallel device; each process supplies its own rows, as the data
    pipeline does.
    """
    built = build_steps(model_cfg, spec, optim, data, mesh, zero_level)
    rows = batch_rows(mesh, data.batch_size) // jax.process_count()
    local = local_synthetic_batch(model_cfg, data, rows, seed=jax.process_index())
    return built, to_global_arrays(local, built.batch_sharding)


def build_steps(
    model_cfg: ModelConfig,
    spec: ModelSpec,
    optim: OptimConfig,
    data: DataConfig,
    mesh: jax.sharding.Mesh,
    zero_level: int = 1,
) -> train_step.ModelOnMesh:
    """The state and steps as a training run builds them, from the plan for this mesh."""
    plan = plan_for(
        model_cfg, spec, mesh, zero_level=zero_level, documents_per_window=data.documents_per_window
    )
    return train_step.build(model_cfg, spec, optim, plan, mesh=mesh, total_steps=10_000, seed=0)


def local_synthetic_batch(model_cfg: ModelConfig, data: DataConfig, rows: int, seed: int) -> dict:
    """This process's `rows` synthetic windows (with --document_masking, documents in them)."""
    local = synthetic_batch(model_cfg, data.grad_accumulation, rows, data.seq_len, seed=seed)
    if data.document_masking:
        eos_id, per_window = bench_eos_id(model_cfg, data), data.documents_per_window
        local = with_documents(local, eos_id, per_window, seed=seed)
    return local


def profile_guided(built: train_step.ModelOnMesh, state, batch, step, steps: int):
    """(state, step compiled again with `steps` traced steps' measured op times as XLA's
    latency estimates). The latency-hiding scheduler otherwise estimates collectives from link
    speeds alone, which misses how much slower they run beside GEMMs."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with profile.trace_steps(trace_dir):
            for _ in range(steps):
                state, m = step(state, batch)
            jax.block_until_ready(m)
        path = os.path.join(trace_dir, "pgle.pb")
        with open(path, "wb") as f:
            f.write(get_profiled_instructions_proto(trace_dir))
        options = {"xla_gpu_pgle_profile_file_or_directory_path": path}
        return state, built.train_step.lower(state, batch).compile(options)


def run_bench(
    model_cfg: ModelConfig,
    spec: ModelSpec,
    optim: OptimConfig,
    data: DataConfig,
    mesh_cfg: MeshConfig,
    bench: BenchConfig,
) -> dict:
    """Compile, warm up and time the train step; returns the measurements."""
    mesh = make_mesh(mesh_cfg.gpus, tensor_parallel=mesh_cfg.tensor_parallel)
    n_dev = mesh.size
    rows = batch_rows(mesh, data.batch_size)
    seq_len, grad_accumulation = data.seq_len, data.grad_accumulation
    steps, pgle_steps, profile_steps = bench.bench_steps, bench.pgle_steps, bench.profile_steps
    t0 = time.perf_counter()
    built, batch = build_synthetic(model_cfg, spec, optim, data, mesh, mesh_cfg.zero_level)
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    step = built.train_step.lower(built.state, batch).compile()
    compile_s = time.perf_counter() - t0
    state, losses = built.state, []
    if pgle_steps:
        state, step = profile_guided(built, state, batch, step, pgle_steps)
    for _ in range(bench.bench_warmup):
        state, m = step(state, batch)
    jax.block_until_ready(m)
    # Throughput: steps back to back, as the host loop dispatches them; on GPUs also their
    # energy and clock, which a power cap holds down (telemetry.EnergyMeter).
    with telemetry.EnergyMeter.of_devices(mesh.local_devices) as meter:
        t0 = time.perf_counter()
        for _ in range(steps):
            state, m = step(state, batch)
            losses.append(m["loss"])
        jax.block_until_ready(m)
        total_s = time.perf_counter() - t0
    # Per-step times (synchronized) for the median and the spread.
    per_step = []
    for _ in range(min(steps, 10)):
        t = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        per_step.append(time.perf_counter() - t)
    profiled = None
    if profile_steps:

        def profiled_steps(state):
            for _ in range(profile_steps):
                state, m = step(state, batch)
            return m

        profiled = profile.breakdown_of(
            lambda: profiled_steps(state), profile_steps, top=bench.profile_top
        )
    tokens_per_step = grad_accumulation * rows * seq_len
    tokens_per_s = tokens_per_step * steps / total_s
    flops = model_cfg.flops_per_token(seq_len) * tokens_per_s
    on_gpu = jax.default_backend() == "gpu"
    kind = mesh.devices.flat[0].device_kind
    # MFU against the spec-sheet dense peak of the device that ran (None where unknown); an fp8
    # run against both its bf16 and its fp8 peak.
    peak_bf16, peak_fp8 = peaks.peak_flops(kind), peaks.peak_flops(kind, "fp8")
    if not spec.linear_dtype:
        peak_fp8 = None
    peak = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.local_devices())
    out = {
        "model": spec.model,
        "params": model_cfg.num_params(),
        "devices": n_dev,
        "processes": jax.process_count(),
        "zero_level": mesh_cfg.zero_level,
        "tensor_parallel": mesh_cfg.tensor_parallel,
        "device_kind": kind,
        "batch_size": data.batch_size,
        "seq_len": seq_len,
        "grad_accumulation": grad_accumulation,
        "model_dtype": spec.model_dtype,
        "matmul_dtype": spec.compute_dtype,
        "linear_dtype": spec.linear_dtype,  # "e4m3": the block linears run in fp8
        "fp8_scaling": spec.fp8_scaling if spec.linear_dtype else None,
        "scan_layers": spec.scan_layers,
        "attention": spec.attention,
        "attention_used": built.plan.attention,  # what ran: auto resolved, documents' choice
        "document_masking": data.document_masking,
        "documents_per_window": built.plan.documents_per_window,
        "deterministic": spec.deterministic,
        "recompute": built.plan.recompute.labels(),  # what ran: a scan recomputes more
        "kernels": spec.kernels,
        "kernels_used": built.plan.kernels,  # what ran: auto resolved, fallbacks applied
        "lmhead_chunks": spec.lmhead_chunks,
        "pgle_steps": pgle_steps,
        "tokens_per_s": tokens_per_s,
        "step_ms_mean": 1000 * total_s / steps,
        "step_ms_median": 1000 * statistics.median(per_step),
        "step_ms_stdev": 1000 * statistics.pstdev(per_step),
        "mfu_spec": flops / (peak_bf16 * n_dev) if peak_bf16 else None,
        "mfu_spec_fp8": flops / (peak_fp8 * n_dev) if peak_fp8 else None,
        "peak_memory_gib_per_device": peak / 2**30 or None,
        "compile_s": compile_s,
        "init_s": init_s,
        "losses": [float(x) for x in losses[:: max(1, steps // 10)]],
        "jax_version": jax.__version__,
    }
    out.update(meter.fields(per=steps, unit="step"))
    if profiled is not None:
        out["profile"] = profiled
    if on_gpu and bench.measure_matmul_ceiling:
        peak = matmul_ceiling()
        out["matmul_ceiling_tflops"] = peak / 1e12
        out["mfu_ceiling"] = flops / (peak * n_dev)
    return out


if __name__ == "__main__":
    from jaxllmq.cli.bench import main

    main()
