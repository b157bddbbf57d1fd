"""Benchmark the real train step on synthetic tokens: tokens/s, MFU, memory, compile time.

    python -m jaxllmq.bench --model=llama-3.2-1b --batch_size=8 --seq_len=2048 [--json]
    python -m jaxllmq.bench --flagfile=configs/llama-3.2-1b-pretrain.flags --bench_steps=30

Takes the trainer's flags (the same flagfiles work; --train_file is not needed) and builds the
state and step through train_step.build, the code path a training run uses.
"""

import json
import os
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.experimental.profiler import get_profiled_instructions_proto

from jaxllmq import config, profile, train_step, xla_flags
from jaxllmq.data.pipeline import to_global_arrays
from jaxllmq.kernels import parse_kernels
from jaxllmq.log import PEAK_FLOPS_BF16
from jaxllmq.model.architecture import PRESETS, ModelConfig, load_model_config
from jaxllmq.parallel.mesh import TENSOR, MeshError, initialize_distributed, make_mesh
from jaxllmq.plan import plan_for

_bench_steps = flags.DEFINE_integer("bench_steps", 20, "Timed steps.", lower_bound=1)
_bench_warmup = flags.DEFINE_integer(
    "bench_warmup", 3, "Untimed steps after compiling.", lower_bound=1
)
_json = flags.DEFINE_bool("json", False, "Print one JSON object instead of the table.")
_profile_steps = flags.DEFINE_integer(
    "profile_steps",
    0,
    "After timing, trace this many steps and report GPU kernel time by category (jaxllmq.profile).",
    lower_bound=0,
)
_profile_top = flags.DEFINE_integer(
    "profile_top",
    15,
    "With --profile_steps: how many of the longest kernels to list.",
    lower_bound=1,
)
_pgle_steps = flags.DEFINE_integer(
    "pgle_steps",
    0,
    "Profile-guided scheduling: after compiling, trace this many steps and compile again with "
    "their measured kernel and collective times (XLA's profile-guided latency estimator), then "
    "time that program. 0: off.",
    lower_bound=0,
)
_measure_ceiling = flags.DEFINE_bool(
    "measure_matmul_ceiling", True, "On GPU, time an 8192^3 bf16 matmul as the practical peak."
)


def matmul_ceiling(n: int = 8192, reps: int = 10) -> float:
    """Measured bf16 matmul FLOP/s of one device (random data, median of `reps`)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x, y: x @ y)
    mm(a, b).block_until_ready()
    times = []
    for _ in range(3):  # back to back, so per-call dispatch and sync stay out of the rate
        t = time.perf_counter()
        for _ in range(reps):
            c = mm(a, b)
        c.block_until_ready()
        times.append((time.perf_counter() - t) / reps)
    return 2 * n**3 / statistics.median(times)


def synthetic_batch(cfg: ModelConfig, acc: int, rows: int, seq_len: int, seed: int = 0) -> dict:
    """Uniform random tokens [acc, rows, seq_len], every target trained on."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, size=(acc, rows, seq_len + 1), dtype=np.int32)
    return {
        "inputs": tokens[..., :-1],
        "targets": tokens[..., 1:],
        "loss_mask": np.ones((acc, rows, seq_len), bool),
    }


def build_synthetic(
    model_cfg: ModelConfig,
    spec: config.ModelSpec,
    optim,
    mesh,
    *,
    batch_size: int,
    seq_len: int,
    grad_accumulation: int,
    zero_level: int = 1,
    kernels: str = "auto",
    lmhead_chunks: int = 1,
) -> tuple[train_step.ModelOnMesh, dict]:
    """The state and steps as a training run builds them, and a synthetic batch on the mesh.

    batch_size is per data-parallel device; each process supplies its own rows, as the data
    pipeline does.
    """
    plan = plan_for(
        model_cfg,
        spec,
        mesh,
        kernels=kernels,
        lmhead_chunks=lmhead_chunks,
        zero_level=zero_level,
    )
    built = train_step.build(model_cfg, spec, optim, plan, mesh=mesh, total_steps=10_000, seed=0)
    rows = batch_size * (mesh.size // mesh.shape[TENSOR])
    local = synthetic_batch(
        model_cfg, grad_accumulation, rows // jax.process_count(), seq_len, seed=jax.process_index()
    )
    return built, to_global_arrays(local, built.batch_sharding)


def build_from_flags(
    model_cfg: ModelConfig, spec: config.ModelSpec, mesh_cfg: config.MeshConfig
) -> tuple[train_step.ModelOnMesh, dict, jax.sharding.Mesh]:
    """build_synthetic on the flags' mesh with their optimizer, batch shape, ZeRO level, kernels
    and LM-head chunks (for the benchmark tools that take the trainer's flags); and the mesh."""
    F = flags.FLAGS
    mesh = make_mesh(mesh_cfg.gpus, tensor_parallel=mesh_cfg.tensor_parallel)
    built, batch = build_synthetic(
        model_cfg,
        spec,
        config.optim_from_flags(),
        mesh,
        batch_size=F.batch_size,
        seq_len=F.seq_len,
        grad_accumulation=F.grad_accumulation,
        zero_level=mesh_cfg.zero_level,
        kernels=F.kernels,
        lmhead_chunks=F.lmhead_chunks,
    )
    return built, batch, mesh


def start_from_flags(argv: list[str]) -> tuple[config.ModelSpec, ModelConfig, config.MeshConfig]:
    """The benchmark tools' common start: check the command line, set the trainer's XLA flags,
    join the other processes, and read the model and mesh flags."""
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]}")
    F = flags.FLAGS
    if F.model is None:
        sys.exit("error: --model is required (a preset, or an HF directory)")
    F.from_scratch = F.from_scratch or F.model in PRESETS  # a preset has no weights to load
    # Bad flag values (and a bad model directory) end in one line naming them, as in training.
    mesh_cfg = _user_input(config.mesh_from_flags)
    _user_input(config.optim_from_flags)
    _user_input(parse_kernels, F.kernels)
    xla_flags.apply_defaults(deterministic=F.deterministic)
    initialize_distributed(
        mesh_cfg.coordinator_address, mesh_cfg.num_processes, mesh_cfg.process_id
    )
    spec = _user_input(config.model_spec_from_flags)
    return spec, _user_input(load_model_config, spec.model), mesh_cfg


def _user_input(read, *args):
    """read(*args), or exit with its ValueError's message (what the flags or files got wrong)."""
    try:
        return read(*args)
    except ValueError as e:
        sys.exit(f"error: {e}")


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
    spec: config.ModelSpec,
    optim,
    *,
    batch_size: int,
    seq_len: int,
    grad_accumulation: int,
    gpus: int,
    zero_level: int = 1,
    tensor_parallel: int = 1,
    steps: int,
    warmup: int,
    ceiling: bool,
    kernels: str = "auto",
    lmhead_chunks: int = 1,
    profile_steps: int = 0,
    profile_top: int = 15,
    pgle_steps: int = 0,
) -> dict:
    """Compile, warm up and time the train step; returns the measurements."""
    mesh = make_mesh(gpus, tensor_parallel=tensor_parallel)
    n_dev = mesh.size
    rows = batch_size * (n_dev // tensor_parallel)
    t0 = time.perf_counter()
    built, batch = build_synthetic(
        model_cfg,
        spec,
        optim,
        mesh,
        batch_size=batch_size,
        seq_len=seq_len,
        grad_accumulation=grad_accumulation,
        zero_level=zero_level,
        kernels=kernels,
        lmhead_chunks=lmhead_chunks,
    )
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    step = built.train_step.lower(built.state, batch).compile()
    compile_s = time.perf_counter() - t0
    state, losses = built.state, []
    if pgle_steps:
        state, step = profile_guided(built, state, batch, step, pgle_steps)
    for _ in range(warmup):
        state, m = step(state, batch)
    jax.block_until_ready(m)
    # Throughput: steps back to back, as the host loop dispatches them.
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
        with tempfile.TemporaryDirectory() as trace_dir:
            with profile.trace_steps(trace_dir):
                for _ in range(profile_steps):
                    state, m = step(state, batch)
                jax.block_until_ready(m)
            profiled = profile.breakdown(trace_dir, profile_steps, top=profile_top)
    tokens_per_step = grad_accumulation * rows * seq_len
    tokens_per_s = tokens_per_step * steps / total_s
    flops = model_cfg.flops_per_token(seq_len) * tokens_per_s
    on_gpu = jax.default_backend() == "gpu"
    peak = max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.local_devices())
    out = {
        "model": spec.model,
        "params": model_cfg.num_params(),
        "devices": n_dev,
        "processes": jax.process_count(),
        "zero_level": zero_level,
        "tensor_parallel": tensor_parallel,
        "device_kind": jax.devices()[0].device_kind,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "grad_accumulation": grad_accumulation,
        "model_dtype": spec.model_dtype,
        "matmul_dtype": spec.matmul_dtype,
        "linear_dtype": spec.linear_dtype,  # "e4m3": the block linears run in fp8
        "fp8_scaling": spec.fp8_scaling if spec.linear_dtype else None,
        "scan_layers": spec.scan_layers,
        "attention": spec.attention,
        "deterministic": spec.deterministic,
        "recompute": list(spec.recompute.names()) + (["block"] if spec.recompute.block else []),
        "kernels": kernels,
        "kernels_used": built.plan.kernels,  # what ran: auto resolved, fallbacks applied
        "lmhead_chunks": lmhead_chunks,
        "pgle_steps": pgle_steps,
        "tokens_per_s": tokens_per_s,
        "step_ms_mean": 1000 * total_s / steps,
        "step_ms_median": 1000 * statistics.median(per_step),
        "step_ms_stdev": 1000 * statistics.pstdev(per_step),
        "mfu_spec": flops / (PEAK_FLOPS_BF16 * n_dev) if on_gpu else None,
        "peak_memory_gib_per_device": peak / 2**30 or None,
        "compile_s": compile_s,
        "init_s": init_s,
        "losses": [float(x) for x in losses[:: max(1, steps // 10)]],
        "jax_version": jax.__version__,
    }
    if profiled is not None:
        out["profile"] = profiled
    if on_gpu and ceiling:
        peak = matmul_ceiling()
        out["matmul_ceiling_tflops"] = peak / 1e12
        out["mfu_ceiling"] = flops / (peak * n_dev)
    return out


def main(argv: list[str]) -> None:
    spec, model_cfg, mesh_cfg = start_from_flags(argv)
    F = flags.FLAGS
    try:  # --gpus or --tensor_parallel that these devices or this model cannot form
        result = run_bench(
            model_cfg,
            spec,
            config.optim_from_flags(),
            batch_size=F.batch_size,
            seq_len=F.seq_len,
            grad_accumulation=F.grad_accumulation,
            gpus=mesh_cfg.gpus,
            zero_level=mesh_cfg.zero_level,
            tensor_parallel=mesh_cfg.tensor_parallel,
            steps=_bench_steps.value,
            warmup=_bench_warmup.value,
            ceiling=_measure_ceiling.value,
            kernels=F.kernels,
            lmhead_chunks=F.lmhead_chunks,
            profile_steps=_profile_steps.value,
            profile_top=_profile_top.value,
            pgle_steps=_pgle_steps.value,
        )
    except MeshError as e:
        sys.exit(f"error: {e}")
    if jax.process_index() != 0:
        return
    if "profile" in result:
        print(profile.format_breakdown(result["profile"]), file=sys.stderr)
    if _json.value:
        print(json.dumps(result))
        return
    for key, value in result.items():
        shown = f"{value:,.4g}" if isinstance(value, float) else value
        print(f"{key:>22}  {shown}")


if __name__ == "__main__":
    app.run(main, flags_parser=config.parse_argv)
