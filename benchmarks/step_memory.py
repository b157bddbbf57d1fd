"""The train step's memory on H200s, read on a machine without a GPU.

The step is built as the bench builds it (the same flags), from shapes only: no parameter is
made. It is compiled for compile-only H200s (jax's CUDA plugin, as `benchmarks.flash_attention
--spills` does): one, or `--gpus` of one machine on the mesh `--tensor_parallel`,
`--data_parallel` and `--zero_level` ask for. XLA's memory analysis of it gives the bytes per
GPU of the state and batch it takes, of the temporaries it needs, and their sum: the peak the GPU
reaches, the bench's `peak_memory_gib_per_device` (Llama 3.2 3B at 2 x 8192, unrolled, with
jaxllmq's attention before its zero buffers were made layer by layer: 65.41 GiB measured and
compiled alike). One JSON line.

    python3 -m benchmarks.step_memory --model=llama-3.2-3b --batch_size=2 --seq_len=8192 \\
        --noscan_layers --model_dtype=bfloat16 --opt_m_dtype=bfloat16 --opt_v_dtype=bfloat16
    python3 -m benchmarks.step_memory --model=llama-3.1-8b --batch_size=1 --seq_len=8192 \\
        --model_dtype=bfloat16 --gpus=4 --zero_level=3
"""

from __future__ import annotations

import json
import os

import jax
from absl import app

from benchmarks import kernel_code
from jaxllmq import bench
from jaxllmq.cli import bench as cli_bench
from jaxllmq.cli.flags import parse_argv
from jaxllmq.kernels import _pallas
from jaxllmq.parallel.mesh import MeshError, batch_rows, mesh_of

GIB = 2**30


def step_memory(model_cfg, spec, optim, data, zero_level: int, mesh) -> dict:
    """The step's memory analysis in GiB, per device of `mesh` (compile-only H200s)."""
    built = {}

    def state():
        built["steps"] = bench.build_steps(model_cfg, spec, optim, data, mesh, zero_level)
        return built["steps"].state

    shapes = jax.eval_shape(state)
    rows = batch_rows(mesh, data.batch_size)  # --batch_size per data and fsdp device
    batch = bench.local_synthetic_batch(model_cfg, data, rows, seed=0)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    # The abstract mesh names the GPU that Pallas' Triton lowering compiles for.
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), _pallas.lowering_for_gpu():
        lowered = built["steps"].train_step.lower(shapes, batch)
    memory = lowered.compile().memory_analysis()
    args, temp = memory.argument_size_in_bytes, memory.temp_size_in_bytes
    fresh_outputs = memory.output_size_in_bytes - memory.alias_size_in_bytes
    return {
        "attention": built["steps"].plan.attention,
        "arguments_gib": round(args / GIB, 3),
        "temporaries_gib": round(temp / GIB, 3),
        "peak_gib": round((args + temp + fresh_outputs) / GIB, 3),
    }


def main(argv):
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # before jax starts
    spec, model_cfg, optim, data, mesh_cfg = cli_bench.start(argv)
    gpus = mesh_cfg.gpus or 1
    devices = kernel_code.h200_compile_devices(gpus)
    if devices is None:
        raise SystemExit(
            "step_memory: the step is compiled for a compile-only H200; install jax's CUDA "
            f'plugin (pip install "jax-cuda13-plugin[with-cuda]=={jax.__version__}")'
        )
    try:
        mesh = mesh_of(
            devices, tensor_parallel=mesh_cfg.tensor_parallel, data_parallel=mesh_cfg.data_parallel
        )
    except MeshError as e:
        raise SystemExit(f"step_memory: {e}") from None
    row = {"model": spec.model, "batch_size": data.batch_size, "seq_len": data.seq_len}
    row |= {"gpus": gpus, "zero_level": mesh_cfg.zero_level}
    row |= step_memory(model_cfg, spec, optim, data, mesh_cfg.zero_level, mesh)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    cli_bench.define_flags()
    app.run(main, flags_parser=parse_argv)
