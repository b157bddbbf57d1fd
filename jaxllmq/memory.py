"""Memory floors: a model too large for the machine is refused before anything is read or allocated.

The bytes counted are a floor, computed from ModelConfig.num_params() alone (no allocation, no
tracing): a run that passes may still run out of memory (activations, XLA's buffers), but one
refused here could not have run.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxllmq.dtypes import DTYPES
from jaxllmq.model.architecture import ModelConfig, ModelConfigError
from jaxllmq.xla_flags import host_memory_bytes

GIB = 1024**3
GRADIENT_DTYPE = "float32"  # the train step accumulates gradients in float32 (train_step.py)


def device_memory_bytes(devices: Sequence[jax.Device]) -> int | None:
    """What `devices` can hold together: CPU devices share their process's host memory; others
    have their allocator's bytes_limit (another process's devices counted as this one's). None
    where the platform does not say."""
    devices = list(devices)
    if devices[0].platform == "cpu":
        return host_memory_bytes() * len({d.process_index for d in devices})
    local = [d for d in devices if d.process_index == jax.process_index()]
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in local]
    if not limits or None in limits:
        return None
    return sum(limits) * len(devices) // len(local)


def check_training_fits(
    cfg: ModelConfig,
    source: str,
    *,
    model_dtype: str,
    opt_m_dtype: str,
    opt_v_dtype: str,
    offload: bool,
    devices: Sequence[jax.Device],
) -> None:
    """Refuse training a model whose master weights, gradients and AdamW moments alone exceed
    the memory of `devices`, plus the hosts' when `offload` keeps part of the state there."""
    have = device_memory_bytes(devices)
    if have is None:
        return
    params = cfg.num_params()
    dtypes = (model_dtype, GRADIENT_DTYPE, opt_m_dtype, opt_v_dtype)
    need = params * sum(DTYPES[d].itemsize for d in dtypes)
    platform = devices[0].platform
    where = f"{len(devices)} {platform} device{'s' if len(devices) > 1 else ''}"
    if platform == "cpu":
        where += " (host memory)"
    elif offload:
        have += host_memory_bytes() * len({d.process_index for d in devices})
        where += " and host memory (--offload_*)"
    if need > have:
        raise ModelConfigError(
            f"{source}: {params:,} parameters need at least {need / GIB:,.1f} GiB to train "
            f"(master weights {model_dtype}, gradients {GRADIENT_DTYPE}, AdamW moments "
            f"{opt_m_dtype}/{opt_v_dtype}), more than the {have / GIB:,.1f} GiB of {where}"
        )


def check_loadable(cfg: ModelConfig, source: str, dtype, device: jax.Device) -> None:
    """Refuse loading a model whose parameters in `dtype` alone exceed `device`'s memory."""
    have = device_memory_bytes([device])
    params = cfg.num_params()
    need = params * jnp.dtype(dtype).itemsize
    if have is not None and need > have:
        raise ModelConfigError(
            f"{source}: {params:,} parameters need {need / GIB:,.1f} GiB in "
            f"{jnp.dtype(dtype).name}, more than the {have / GIB:,.1f} GiB of {device.platform} "
            f"device {device.id}{' (host memory)' if device.platform == 'cpu' else ''}"
        )
