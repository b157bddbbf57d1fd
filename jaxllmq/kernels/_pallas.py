"""Shared Pallas plumbing: the Triton lowering, interpret mode on CPU, masked block access.

The kernels use Pallas' Triton lowering on GPU. jax 0.11 made Mosaic GPU the default GPU lowering
and deprecated Triton, but Mosaic GPU wants `plgpu.kernel` with warpgroup-level code; Triton
lowering is still chosen explicitly by passing `pallas.triton.CompilerParams`, on jax 0.10 and 0.11
alike, and it runs the same kernel source in interpret mode on CPU (the tests).
Block shapes in the Triton lowering must be powers of two, so ragged edges (hidden 896, a prime
vocabulary) are handled with masked loads and stores rather than BlockSpecs.
"""

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_LOWERING_FOR_GPU = contextvars.ContextVar("lowering_for_gpu", default=False)


def default_interpret() -> bool:
    """Interpret Pallas kernels where no GPU lowering exists (the CPU test machines), except
    under `lowering_for_gpu`."""
    return jax.default_backend() == "cpu" and not _LOWERING_FOR_GPU.get()


@contextlib.contextmanager
def lowering_for_gpu() -> Iterator[None]:
    """Lower the kernels for a GPU though jax runs on the CPU: for a compile-only GPU (jax's
    CUDA plugin on a machine without one)."""
    token = _LOWERING_FOR_GPU.set(True)
    try:
        yield
    finally:
        _LOWERING_FOR_GPU.reset(token)


def call(
    kernel: Callable[..., None],
    out_shape: Any,
    grid: Sequence[int],
    *,
    num_warps: int,
    num_stages: int | None = None,
    interpret: bool,
    name: str,
) -> Callable[..., Any]:
    """pallas_call on the Triton lowering; whole arrays are passed, kernels index by hand."""
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=tuple(grid),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=name,
    )


def load(ref: Any, idx: tuple[Any, ...], mask: jax.Array | None, other: float = 0.0) -> jax.Array:
    """Gather-style block load; `mask` (or None when statically in bounds) guards ragged edges."""
    if mask is None:
        return plt.load(ref.at[idx])
    return plt.load(ref.at[idx], mask=mask, other=other)


def store(ref: Any, idx: tuple[Any, ...], value: jax.Array, mask: jax.Array | None) -> None:
    """Block store; masked-off positions are left untouched."""
    if mask is None:
        plt.store(ref.at[idx], value)
    else:
        plt.store(ref.at[idx], value, mask=mask)


def and_masks(*masks: jax.Array | None) -> jax.Array | None:
    """Combine optional masks (None means all true), broadcasting as jnp does."""
    out = None
    for m in masks:
        if m is not None:
            out = m if out is None else out & m
    return out


def bcast(mask: jax.Array | None, shape: tuple[int, ...]) -> jax.Array | None:
    return None if mask is None else jnp.broadcast_to(mask, shape)


def block_mask(row_ok, col_ok, shape: tuple[int, int]) -> jax.Array | None:
    """[rows, cols] mask of a block from per-row and per-column masks (None: all in bounds)."""
    mask = and_masks(
        None if row_ok is None else row_ok[:, None], None if col_ok is None else col_ok[None, :]
    )
    return bcast(mask, shape)
