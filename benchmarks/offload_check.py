"""On the GPU: each host-offload switch trains the tiny preset to the same losses as none.

    python benchmarks/offload_check.py [--model=tiny] [--check_steps=3] [--matmul_dtype=bfloat16]

Prints one JSON line per switch: its losses, whether they equal the no-offload run's bit for bit,
the memory kinds the state comes back in, and how many host-memory buffers (S(5)) the compiled
step has. tests/test_offload.py checks the same on CPU, where the transfers lower to nothing.
"""

import json
import sys

import jax
from absl import app, flags

from jaxllmq import train_step, xla_flags
from jaxllmq.bench import synthetic_batch
from jaxllmq.cli import bench as bench_cli
from jaxllmq.cli import flags as cli_flags
from jaxllmq.model.architecture import load_model_config
from jaxllmq.model.recompute import Recompute
from jaxllmq.offload import Offload
from jaxllmq.parallel.mesh import make_mesh
from jaxllmq.plan import plan_for
from jaxllmq.settings import ModelSpec, OptimConfig

# --model and --matmul_dtype are the trainer's flags (defined by the bench command's define_flags).
_steps = flags.DEFINE_integer("check_steps", 3, "Steps per switch.")

SWITCHES = {
    "none": {},
    "master": dict(offload=Offload(master=True)),
    "opt_m": dict(offload=Offload(opt_m=True)),
    "opt_v": dict(offload=Offload(opt_v=True)),
    "all": dict(offload=Offload(True, True, True)),
    "residual": dict(recompute=Recompute(offload_residual=True)),
}


def main(argv: list[str]) -> None:
    del argv
    xla_flags.apply_defaults()  # the pinned host memory pool's size, before the backend starts
    model, matmul = flags.FLAGS.model or "tiny", flags.FLAGS.matmul_dtype
    cfg = load_model_config(model)
    optim = OptimConfig(lr=3e-3, weight_decay=0.1)
    batch = synthetic_batch(cfg, 2, 4, 128, seed=7)
    base = None
    for name, kw in SWITCHES.items():
        spec = ModelSpec(model=model, from_scratch=True, matmul_dtype=matmul, **kw)
        mesh = make_mesh(1)
        plan = plan_for(cfg, spec, mesh)
        built = train_step.build(cfg, spec, optim, plan, mesh=mesh, total_steps=10, seed=0)
        b = jax.device_put(batch, built.batch_sharding)
        hlo = built.train_step.lower(built.state, b).compile().as_text()
        state, losses = built.state, []
        for _ in range(_steps.value):
            state, m = built.train_step(state, b)
            losses.append(float(m["loss"]))
        base = base or losses
        kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(state)})
        out = dict(switch=name, losses=losses, same=losses == base, kinds=kinds)
        print(json.dumps(dict(out, host_buffers=hlo.count("S(5)"))), flush=True)
        del state, built


if __name__ == "__main__":
    bench_cli.define_flags()
    sys.exit(app.run(main, flags_parser=cli_flags.parse_argv))
