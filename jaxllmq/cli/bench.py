"""python -m jaxllmq.bench [--flagfile=configs/X.flags] [--flag=value ...]: time the train step
on synthetic tokens (jaxllmq/bench.py). Takes the trainer's flags and the benchmark's own."""

import json
import sys

import jax
from absl import app

from jaxllmq import bench, profile, xla_flags
from jaxllmq.cli import flags
from jaxllmq.model import CheckpointFormatError, ModelConfigError
from jaxllmq.model.architecture import PRESETS, ModelConfig, load_model_config
from jaxllmq.parallel.mesh import MeshError, initialize_distributed, make_mesh
from jaxllmq.settings import DataConfig, MeshConfig, ModelSpec, OptimConfig, TrainConfig


def define_flags() -> None:
    """The trainer's flags (its flagfiles work here too) and the benchmark's."""
    flags.define(TrainConfig)
    flags.define(bench.BenchConfig)


def start(argv: list[str]) -> tuple[ModelSpec, ModelConfig, OptimConfig, DataConfig, MeshConfig]:
    """The benchmark tools' common start: check the command line, read the settings they use (a
    bad one ends in one line naming it), set the trainer's XLA flags, join the other processes."""
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]}")
    model = flags.FLAGS.model
    # A preset has no weights to load: the benchmark starts it from scratch without being told.
    spec = flags.build_or_exit(ModelSpec, from_scratch=flags.FLAGS.from_scratch or model in PRESETS)
    optim = flags.build_or_exit(OptimConfig)
    data = flags.build_or_exit(DataConfig, train_files=(), eval_files=())
    mesh_cfg = flags.build_or_exit(MeshConfig)
    xla_flags.apply_defaults(deterministic=spec.deterministic)
    initialize_distributed(
        mesh_cfg.coordinator_address, mesh_cfg.num_processes, mesh_cfg.process_id
    )
    try:
        model_cfg = load_model_config(spec.model)
    except ValueError as e:
        sys.exit(f"error: {e}")
    return spec, model_cfg, optim, data, mesh_cfg


def build_from_flags(argv: list[str]):
    """`start`, then bench.build_synthetic on the flags' mesh: (built, batch, mesh, model_cfg, spec)
    for the benchmark scripts that time parts of the step."""
    spec, model_cfg, optim, data, mesh_cfg = start(argv)
    mesh = make_mesh(mesh_cfg.gpus, tensor_parallel=mesh_cfg.tensor_parallel)
    built, batch = bench.build_synthetic(model_cfg, spec, optim, data, mesh, mesh_cfg.zero_level)
    return built, batch, mesh, model_cfg, spec


def run(argv: list[str]) -> None:
    spec, model_cfg, optim, data, mesh_cfg = start(argv)
    options = flags.build_or_exit(bench.BenchConfig)
    # --gpus or --tensor_parallel that these devices or this model cannot form; a model directory
    # without weights (and no --from_scratch); a setting this model refuses (--attention).
    try:
        result = bench.run_bench(model_cfg, spec, optim, data, mesh_cfg, options)
    except (MeshError, CheckpointFormatError, ModelConfigError) as e:
        sys.exit(f"error: {e}")
    if jax.process_index() != 0:
        return
    if "profile" in result:
        print(profile.format_breakdown(result["profile"]), file=sys.stderr)
    if options.json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        shown = f"{value:,.4g}" if isinstance(value, float) else value
        print(f"{key:>22}  {shown}")


def main() -> None:
    define_flags()
    app.run(run, flags_parser=flags.parse_argv)
