"""The device mesh and the batch's sharding over it."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA = "data"


def make_mesh(gpus: int = 0) -> Mesh:
    """A 1-D data-parallel mesh over the first `gpus` local devices of each process (0 = all)."""
    local = jax.local_device_count()
    if gpus > local:
        raise ValueError(f"--gpus={gpus}, but this process sees only {local} device(s)")
    n = gpus or local
    if jax.process_count() == 1:
        devices = jax.devices()[:n]
    else:
        devices = [d for d in jax.devices() if d.id % local < n]  # n per process
    return Mesh(np.asarray(devices), (DATA,))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[acc, B, T] batches: rows (axis 1) split over the data axis."""
    return NamedSharding(mesh, PartitionSpec(None, DATA))


def replicated(mesh: Mesh) -> NamedSharding:
    """The same array on every device of the mesh."""
    return NamedSharding(mesh, PartitionSpec())
