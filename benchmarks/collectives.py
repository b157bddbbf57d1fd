"""Bus bandwidth of the collectives the ZeRO levels use, on this process's devices, alone.

    python3 -m benchmarks.collectives                 # GPU: 16 MiB .. 1 GiB, bf16
    python3 -m benchmarks.collectives --smoke           # CPU: 8 fake devices, tiny sizes

Times all-reduce (ZeRO-1's gradient reduction), reduce-scatter (ZeRO-2/3's) and all-gather (the
parameters after a ZeRO-1/2 update, ZeRO-3's per-layer gathers) under shard_map, with nothing
else running, and prints NCCL-tests' bus bandwidth: bytes x 2(n-1)/n / time for all-reduce and
bytes x (n-1)/n / time for the other two. The profile of the 1B step on 2 H200s showed its
per-layer all-reduces at about 100 GB/s; this says whether that is what the links give or what
is left of them beside the GEMMs. NCCL settings pass through the environment (NCCL_PROTO, ...).
"""

import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from absl import app, flags
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllmq import xla_flags
from jaxllmq.bench import time_calls
from jaxllmq.cli import flags as cli_flags

_smoke = flags.DEFINE_bool("smoke", False, "CPU: 8 fake devices, tiny sizes.")
_reps = flags.DEFINE_integer("reps", 10, "Calls per timed batch (the median of 5 batches).")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if _smoke.value:  # before the backend starts
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        os.environ["JAX_PLATFORMS"] = "cpu"
    xla_flags.apply_defaults()
    devices = jax.devices()
    n = len(devices)
    if n < 2:
        sys.exit("collectives.py: needs at least 2 devices")
    mesh = Mesh(devices, ("d",))
    smap = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)
    ops = {
        # on each device's row of an [n, m] array (in and out sharded over "d"); the factor
        # that turns bytes / time into bus bandwidth
        "all_reduce": (lambda x: jax.lax.psum(x, "d"), 2 * (n - 1) / n),
        "reduce_scatter": (
            lambda x: jax.lax.psum_scatter(x, "d", scatter_dimension=1, tiled=True),
            (n - 1) / n,
        ),
        "all_gather": (lambda x: jax.lax.all_gather(x, "d", axis=1, tiled=True), (n - 1) / n),
    }
    sizes = [2**k for k in (range(10, 14) if _smoke.value else range(24, 31, 2))]  # bytes
    rows = []
    rows_of = NamedSharding(mesh, P("d"))
    for name, (fn, factor) in ops.items():
        for size in sizes:
            elems = size // 2  # bf16; the full buffer each device holds (all-gather: its output)
            width = elems // n if name == "all_gather" else elems
            x = jax.device_put(jnp.ones((n, width), jnp.bfloat16), rows_of)
            f = jax.jit(smap(fn, in_specs=P("d"), out_specs=P("d")))
            s = time_calls(lambda f=f, x=x: f(x), calls=_reps.value)
            rows.append(
                dict(op=name, devices=n, bytes=size, ms=1e3 * s, bus_gbs=size * factor / s / 1e9)
            )
            print(json.dumps(rows[-1]), flush=True)
    print(f"{'op':>15} {'MiB':>7} {'ms':>8} {'bus GB/s':>9}  ({n} {devices[0].platform} devices)")
    for r in rows:
        print(f"{r['op']:>15} {r['bytes'] / 2**20:>7.0f} {r['ms']:>8.3f} {r['bus_gbs']:>9.1f}")


if __name__ == "__main__":
    app.run(main, flags_parser=cli_flags.parse_argv)
