"""The device mesh (data x fsdp x tensor), the batch's sharding over it, multi-host start-up."""

import math
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA, FSDP, TENSOR = "data", "fsdp", "tensor"
MESH_AXES = (DATA, FSDP, TENSOR)  # the mesh's axes, major first
BATCH_AXES = (DATA, FSDP)  # the batch is split over every non-tensor device


class MeshError(ValueError):
    """The flags ask for a mesh these devices or this model cannot form; the message names them."""


def make_mesh(gpus: int = 0, *, tensor_parallel: int = 1, data_parallel: int = 1) -> Mesh:
    """Mesh over the first `gpus` local devices of every process (0 = all).

    Shape (data, fsdp, tensor): `tensor_parallel` devices per model replica shard heads and MLP
    (kept within one process, next to each other), `data_parallel` groups hold full replicas
    (for hybrid sharding across hosts), and ZeRO shards over the fsdp devices of each group.
    """
    local = jax.local_device_count()
    if gpus > local:
        raise MeshError(f"--gpus={gpus}, but this process sees only {local} device(s)")
    per_process = gpus or local
    if per_process % tensor_parallel:
        raise MeshError(
            f"--tensor_parallel={tensor_parallel} must divide the devices per process "
            f"({per_process}); change --tensor_parallel or --gpus"
        )
    # Process-major order: process p's devices hold a contiguous block of the batch, the layout
    # jax.make_array_from_process_local_data expects.
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    chosen = []
    for p in range(jax.process_count()):
        chosen += [d for d in devices if d.process_index == p][:per_process]
    return mesh_of(chosen, tensor_parallel=tensor_parallel, data_parallel=data_parallel)


def mesh_of(devices: list, *, tensor_parallel: int = 1, data_parallel: int = 1) -> Mesh:
    """make_mesh's mesh over these `devices`, in their order."""
    n = len(devices)
    if n % (tensor_parallel * data_parallel):
        raise MeshError(
            f"{n} devices cannot be split into --data_parallel={data_parallel} x "
            f"--tensor_parallel={tensor_parallel} groups"
        )
    shape = (data_parallel, n // (tensor_parallel * data_parallel), tensor_parallel)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[acc, B, T] batches: rows (axis 1) split over the data and fsdp axes."""
    return NamedSharding(mesh, PartitionSpec(None, BATCH_AXES))


def batch_devices(mesh: Mesh) -> int:
    """Devices the batch's rows are split over (data x fsdp); a tensor-parallel group shares its
    rows."""
    return math.prod(mesh.shape[axis] for axis in BATCH_AXES)


def batch_rows(mesh: Mesh, batch_size: int) -> int:
    """Rows (sequences) of a global micro-batch: `batch_size` per batch device."""
    return batch_size * batch_devices(mesh)


def replicated(mesh: Mesh) -> NamedSharding:
    """The same array on every device of the mesh."""
    return NamedSharding(mesh, PartitionSpec())


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """jax.distributed.initialize when several processes run; True if it did.

    Explicit flags win; otherwise SLURM (more than one task), Open MPI and Kubernetes (JobSet
    with JAX's coordinator variables) are detected from the environment, and jax's own cluster
    detection fills in the rest.
    """
    explicit = coordinator_address is not None or num_processes is not None
    env = os.environ
    detected = (
        int(env.get("SLURM_NTASKS", "1")) > 1
        or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
        or "JAX_COORDINATOR_ADDRESS" in env
    )
    if not explicit and not detected:
        return False
    kwargs = {}
    if explicit:
        kwargs = dict(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
        )
    if env.get("JAX_PLATFORMS", "").startswith("cpu"):  # asking jax would start its backend
        # Collectives between CPU processes (tests, launch/local.sh on a laptop) go over gloo.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)
    return True
