"""fp8 quantize into both layouts in one pass: q = x / scale in fp8, and its transpose q^T.

Every fp8 block linear needs its input x and its output gradient g in fp8 twice. Once row-major,
for the forward GEMM (x) and dgrad (g). Once transposed, token-major, for the weight gradient
x^T g: cuBLASLt's fp8 GEMM takes only operands whose contracted dimension is the contiguous one.
XLA writes the two copies in separate passes, and its transpose pass with 1-byte outputs ran well
below the H200's bandwidth (`input_convert_(multiply_)transpose_fusion`, docs/experiments,
kernels). The Pallas kernel reads x once and writes both: each program quantizes one [bm, bn]
tile and stores it twice, the second time transposed.

`quantize_both_reference` is the pure-JAX referee. Both divide by the scale (a power of two, so
exact), clip to the format's range and round once in the cast, so they agree bit for bit.
Like the other kernels, the Pallas call has no SPMD partitioning rule: on a multi-device mesh
`Quantizer` runs it on each device's rows under shard_map.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import Mesh, PartitionSpec

from jaxllmq.kernels import _pallas as P


def quantize(x: jax.Array, dtype, scale: jax.Array) -> jax.Array:
    """x / scale in fp8, saturating: values past the format's max clip to it (e4m3fn has no inf;
    a plain cast would make them NaN)."""
    fmax = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax).astype(dtype)


def quantize_both_reference(x_MxN: jax.Array, dtype, scale: jax.Array):
    """(q [M, N], q^T [N, M]) in pure JAX: XLA chooses how to write the two."""
    q = quantize(x_MxN, dtype, scale)
    return q, q.T


@dataclasses.dataclass(frozen=True)
class Fp8QuantizeConfig:
    """Tile shape and warps of the Pallas kernel; interpret runs it on CPU."""

    # Measured on the H200 (docs/experiments, kernels): 64 x 128 tiles, 4 warps, 2.8-3.3 TB/s.
    block_rows: int = 64
    block_cols: int = 128
    num_warps: int = 4
    interpret: bool = False


def _kernel(x_ref, s_ref, q_ref, qt_ref, *, n_rows, n_cols, block_rows, block_cols, dtype):
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
    cols = pl.program_id(1) * block_cols + jnp.arange(block_cols)
    row_ok = rows < n_rows if n_rows % block_rows else None
    col_ok = cols < n_cols if n_cols % block_cols else None
    mask = P.block_mask(row_ok, col_ok, (block_rows, block_cols))
    scale = P.load(s_ref, (jnp.arange(1),), None)
    q = quantize(P.load(x_ref, (rows[:, None], cols[None, :]), mask), dtype, scale)
    P.store(q_ref, (rows[:, None], cols[None, :]), q, mask)
    P.store(qt_ref, (cols[:, None], rows[None, :]), q.T, None if mask is None else mask.T)


def quantize_both_pallas(x_MxN: jax.Array, dtype, scale: jax.Array, cfg=Fp8QuantizeConfig()):
    """(q [M, N], q^T [N, M]) from one Pallas pass over x."""
    n_rows, n_cols = x_MxN.shape
    bm = min(cfg.block_rows, P.next_pow2(n_rows))
    bn = min(cfg.block_cols, P.next_pow2(n_cols))
    kernel = functools.partial(
        _kernel, n_rows=n_rows, n_cols=n_cols, block_rows=bm, block_cols=bn, dtype=dtype
    )
    out_shape = (
        jax.ShapeDtypeStruct((n_rows, n_cols), dtype),
        jax.ShapeDtypeStruct((n_cols, n_rows), dtype),
    )
    call = P.call(
        kernel,
        out_shape,
        (P.cdiv(n_rows, bm), P.cdiv(n_cols, bn)),
        num_warps=cfg.num_warps,
        interpret=cfg.interpret,
        name="fp8_quantize_both",
    )
    return call(x_MxN, jnp.reshape(scale, (1,)).astype(jnp.float32))


def quantize_both(x_MxN: jax.Array, dtype, scale: jax.Array, *, impl: str = "xla"):
    """x / scale in fp8, row-major and transposed: "xla" (the reference) or "pallas"."""
    if impl == "xla":
        return quantize_both_reference(x_MxN, dtype, scale)
    if impl != "pallas":
        raise ValueError(f"fp8 quantize impl must be 'xla' or 'pallas', got {impl!r}")
    return quantize_both_pallas(
        x_MxN, dtype, scale, Fp8QuantizeConfig(interpret=P.default_interpret())
    )


@dataclasses.dataclass(frozen=True)
class Quantizer:
    """How the fp8 block linears quantize x and g into both layouts (`quantize_both`'s impl).

    With a mesh, the Pallas pass runs under shard_map on each device's rows: the rows (tokens)
    are split over `token_axes` and the columns whole, as data and ZeRO parallelism lay out
    activations (tensor parallelism splits columns: the trainer keeps XLA's pass there).
    """

    impl: str = "xla"
    mesh: Mesh | None = None
    token_axes: tuple[str, ...] = ()

    def __call__(self, x_MxN: jax.Array, dtype, scale: jax.Array):
        """(q [M, N], q^T [N, M]): x / scale in fp8, row-major and transposed."""
        if self.mesh is None:
            return quantize_both(x_MxN, dtype, scale, impl=self.impl)
        rows, cols = PartitionSpec(self.token_axes, None), PartitionSpec(None, self.token_axes)
        return jax.shard_map(
            lambda x, s: quantize_both(x, dtype, s, impl=self.impl),
            mesh=self.mesh,
            in_specs=(rows, PartitionSpec()),
            out_specs=(rows, cols),
            check_vma=False,
        )(x_MxN, scale)


XLA_QUANTIZER = Quantizer()  # the reference pass, on any mesh
