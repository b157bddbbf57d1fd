"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * weight, statistics in fp32.

Two implementations behind one interface: "xla" (the pure-JAX reference, fused by XLA, its
backward keeping only its inputs: keeping_inputs) and "pallas" (one forward and one backward
kernel, wrapped in a custom_vjp). The Pallas forward reads
x once and writes y once; the backward reads x and dy once, writes dx once, and recomputes the
row statistics instead of saving them (a reduction over a row already in registers is free next
to the memory traffic). `add_rms_norm` fuses the residual add that precedes every norm in the
model, so the sum is written once and never re-read for the statistics. `rms_norm_tee` also
returns its input, whose other uses' gradient its backward kernel adds into dx (the residual
stream's gradient, which XLA would otherwise add in a pass of its own).

A Pallas call has no SPMD partitioning rule: under a multi-device mesh call it inside shard_map
(rows are independent), or use "xla" (what resolve_impl's auto does there).
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxllmq.kernels import _pallas as P


def rms_norm_reference(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Pure-JAX RMSNorm over the last axis; fp32 statistics, output in x's dtype."""
    # Statistics in fp32: bf16 mean-of-squares loses ~3 digits at hidden 4096.
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    # As transformers does: normalize in fp32, cast to the input dtype, then scale by the weight.
    return (x32 * inv).astype(x.dtype) * weight.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def keeping_inputs(norm: Callable, x: jax.Array, weight: jax.Array) -> jax.Array:
    """norm(x, weight), an XLA RMSNorm, whose backward keeps only x and weight and runs autodiff
    of `norm` on them (the same arithmetic): autodiff alone keeps the norm's fp32 rows, which
    XLA fuses away between unrolled layers but a scan over layers stacks for every layer."""
    return norm(x, weight)


def _keeping_inputs_forward(norm, x, weight):
    return norm(x, weight), (x, weight)


def _keeping_inputs_backward(norm, saved, g):
    return jax.vjp(norm, *saved)[1](g)


keeping_inputs.defvjp(_keeping_inputs_forward, _keeping_inputs_backward)


def add_rms_norm_reference(
    x: jax.Array, residual: jax.Array, weight: jax.Array, eps: float
) -> tuple[jax.Array, jax.Array]:
    """Residual add in x's dtype, then RMSNorm of the sum. Returns (normed, sum)."""
    s = x + residual
    return rms_norm_reference(s, weight, eps), s


@dataclasses.dataclass(frozen=True)
class RmsNormConfig:
    """Launch shape: rows per program, warps; interpret runs the kernels on CPU."""

    block_rows: int | None = None  # None: about 2048 elements per program
    num_warps: int | None = None
    bwd_programs: int = 512  # backward programs; each writes one fp32 partial of dweight
    interpret: bool = False


def _launch(n_rows: int, n_cols: int, cfg: RmsNormConfig) -> tuple[int, int, int]:
    block_cols = P.next_pow2(n_cols)
    # Measured on H200 (docs/experiments, kernels): about 2048 elements per program; 8 warps for a
    # 2048-wide row, 4 warps for two 1024-wide rows (hidden 896) beat larger blocks.
    block_rows = cfg.block_rows or max(1, 2048 // block_cols)
    block_rows = min(P.next_pow2(block_rows), P.next_pow2(n_rows))
    num_warps = cfg.num_warps or (8 if block_cols >= 2048 else 4)
    return block_rows, block_cols, num_warps


def _fwd_kernel(*refs, eps, n_rows, n_cols, block_rows, block_cols, has_residual):
    if has_residual:
        x_ref, r_ref, w_ref, y_ref, s_ref = refs
    else:
        x_ref, w_ref, y_ref = refs
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows)
    cols = jnp.arange(block_cols)
    col_ok = cols < n_cols if n_cols != block_cols else None
    row_ok = rows < n_rows if n_rows % block_rows else None
    mask = P.block_mask(row_ok, col_ok, (block_rows, block_cols))
    idx = (rows[:, None], cols[None, :])
    x = P.load(x_ref, idx, mask)
    if has_residual:
        x = x + P.load(r_ref, idx, mask)  # the sum in the input dtype, as the reference adds
        P.store(s_ref, idx, x, mask)
    x32 = x.astype(jnp.float32)
    # Masked columns load as 0, so the sum is over the real row; divide by the real width.
    inv = lax.rsqrt(jnp.sum(x32 * x32, axis=1) / n_cols + eps)
    w = P.load(w_ref, (cols,), col_ok).astype(x.dtype)
    y = (x32 * inv[:, None]).astype(x.dtype) * w[None, :]
    P.store(y_ref, idx, y, mask)


def _bwd_kernel(*refs, eps, n_rows, n_cols, block_rows, block_cols, steps, has_ds):
    if has_ds:
        x_ref, w_ref, dy_ref, ds_ref, dx_ref, dw_ref = refs
    else:
        x_ref, w_ref, dy_ref, dx_ref, dw_ref = refs
    g = pl.program_id(0)
    cols = jnp.arange(block_cols)
    col_ok = cols < n_cols if n_cols != block_cols else None
    w = P.load(w_ref, (cols,), col_ok)
    ragged_rows = n_rows % (block_rows * steps) != 0

    def body(k, dw_acc):
        rows = (g * steps + k) * block_rows + jnp.arange(block_rows)
        row_ok = rows < n_rows if ragged_rows else None
        mask = P.block_mask(row_ok, col_ok, (block_rows, block_cols))
        idx = (rows[:, None], cols[None, :])
        x = P.load(x_ref, idx, mask)
        dy = P.load(dy_ref, idx, mask)
        x32 = x.astype(jnp.float32)
        inv = lax.rsqrt(jnp.sum(x32 * x32, axis=1) / n_cols + eps)
        xhat = x32 * inv[:, None]
        # dweight sees the normed value rounded to x's dtype, as the forward multiplied it.
        normed = xhat.astype(x.dtype).astype(jnp.float32)
        # fp32 accumulation: bf16 loses the small per-row contributions over 16k rows.
        dw_acc = dw_acc + dy.astype(jnp.float32) * normed
        gn = (dy * w.astype(dy.dtype)[None, :]).astype(jnp.float32)
        c = jnp.sum(gn * xhat, axis=1) / n_cols
        dx = (gn - xhat * c[:, None]) * inv[:, None]
        if has_ds:
            dx = dx + P.load(ds_ref, idx, mask).astype(jnp.float32)
        P.store(dx_ref, idx, dx.astype(dx_ref.dtype), mask)
        return dw_acc

    dw_acc = lax.fori_loop(0, steps, body, jnp.zeros((block_rows, block_cols), jnp.float32))
    P.store(dw_ref, (g, cols), jnp.sum(dw_acc, axis=0), col_ok)


def _fwd(x2, r2, w, eps, cfg):
    n_rows, n_cols = x2.shape
    block_rows, block_cols, num_warps = _launch(n_rows, n_cols, cfg)
    has_residual = r2 is not None
    kernel = functools.partial(
        _fwd_kernel,
        eps=eps,
        n_rows=n_rows,
        n_cols=n_cols,
        block_rows=block_rows,
        block_cols=block_cols,
        has_residual=has_residual,
    )
    out = jax.ShapeDtypeStruct(x2.shape, x2.dtype)
    outs = (out, out) if has_residual else out
    args = (x2, r2, w) if has_residual else (x2, w)
    return P.call(
        kernel,
        outs,
        (P.cdiv(n_rows, block_rows),),
        num_warps=num_warps,
        interpret=cfg.interpret,
        name="add_rms_norm_fwd" if has_residual else "rms_norm_fwd",
    )(*args)


def _bwd(s2, w, dy, ds, eps, cfg):
    n_rows, n_cols = s2.shape
    block_rows, block_cols, num_warps = _launch(n_rows, n_cols, cfg)
    steps = max(1, P.cdiv(P.cdiv(n_rows, block_rows), cfg.bwd_programs))
    programs = P.cdiv(n_rows, block_rows * steps)
    has_ds = ds is not None
    kernel = functools.partial(
        _bwd_kernel,
        eps=eps,
        n_rows=n_rows,
        n_cols=n_cols,
        block_rows=block_rows,
        block_cols=block_cols,
        steps=steps,
        has_ds=has_ds,
    )
    dx, dw_parts = P.call(
        kernel,
        (
            jax.ShapeDtypeStruct(s2.shape, s2.dtype),
            jax.ShapeDtypeStruct((programs, n_cols), jnp.float32),
        ),
        (programs,),
        num_warps=num_warps,
        interpret=cfg.interpret,
        name="rms_norm_bwd",
    )(*((s2, w, dy, ds) if has_ds else (s2, w, dy)))
    return dx, jnp.sum(dw_parts, axis=0).astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm_pallas(x2, w, eps, cfg):
    return _fwd(x2, None, w, eps, cfg)


def _rms_norm_pallas_fwd(x2, w, eps, cfg):
    return _fwd(x2, None, w, eps, cfg), (x2, w)


def _rms_norm_pallas_bwd(eps, cfg, res, dy):
    x2, w = res
    return _bwd(x2, w, dy, None, eps, cfg)


_rms_norm_pallas.defvjp(_rms_norm_pallas_fwd, _rms_norm_pallas_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _add_rms_norm_pallas(x2, r2, w, eps, cfg):
    return _fwd(x2, r2, w, eps, cfg)


def _add_rms_norm_pallas_fwd(x2, r2, w, eps, cfg):
    y, s = _fwd(x2, r2, w, eps, cfg)
    return (y, s), (s, w)


def _add_rms_norm_pallas_bwd(eps, cfg, res, cts):
    s, w = res
    dy, ds = cts
    dx, dw = _bwd(s, w, dy, ds, eps, cfg)
    return dx, dx, dw  # d(x + residual) flows to both summands unchanged


_add_rms_norm_pallas.defvjp(_add_rms_norm_pallas_fwd, _add_rms_norm_pallas_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _rms_norm_tee_pallas(x2, w, eps, cfg):
    return _fwd(x2, None, w, eps, cfg), x2


def _rms_norm_tee_pallas_fwd(x2, w, eps, cfg):
    return (_fwd(x2, None, w, eps, cfg), x2), (x2, w)


def _rms_norm_tee_pallas_bwd(eps, cfg, res, cts):
    x2, w = res
    dy, dx_through = cts
    return _bwd(x2, w, dy, dx_through, eps, cfg)  # the kernel adds dx_through into dx


_rms_norm_tee_pallas.defvjp(_rms_norm_tee_pallas_fwd, _rms_norm_tee_pallas_bwd)


def _config(cfg: RmsNormConfig | None, interpret: bool | None) -> RmsNormConfig:
    cfg = cfg or RmsNormConfig()
    return dataclasses.replace(
        cfg, interpret=P.default_interpret() if interpret is None else interpret
    )


def rms_norm(
    x: jax.Array,
    weight: jax.Array,
    eps: float,
    *,
    impl: str = "xla",
    config: RmsNormConfig | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """RMSNorm through the chosen implementation ("xla" or "pallas")."""
    if impl == "xla":
        return keeping_inputs(functools.partial(rms_norm_reference, eps=eps), x, weight)
    if impl == "pallas":
        x2 = x.reshape(-1, x.shape[-1])
        y2 = _rms_norm_pallas(x2, weight, float(eps), _config(config, interpret))
        return y2.reshape(x.shape)
    raise ValueError(f"rms_norm: unknown impl {impl!r} (expected 'xla' or 'pallas')")


def rms_norm_tee(
    x: jax.Array,
    weight: jax.Array,
    eps: float,
    *,
    impl: str = "xla",
    config: RmsNormConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(rms_norm(x), x): use the second for x's other uses (the residual stream), so that under
    "pallas" their gradient is added in the norm's backward kernel."""
    if impl == "xla":
        return rms_norm(x, weight, eps), x
    if impl == "pallas":
        d = x.shape[-1]
        y2, x2 = _rms_norm_tee_pallas(
            x.reshape(-1, d), weight, float(eps), _config(config, interpret)
        )
        return y2.reshape(x.shape), x2.reshape(x.shape)
    raise ValueError(f"rms_norm_tee: unknown impl {impl!r} (expected 'xla' or 'pallas')")


def add_rms_norm(
    x: jax.Array,
    residual: jax.Array,
    weight: jax.Array,
    eps: float,
    *,
    impl: str = "xla",
    config: RmsNormConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(rms_norm(x + residual), x + residual) through the chosen implementation."""
    if impl == "xla":
        s = x + residual
        return rms_norm(s, weight, eps), s
    if impl == "pallas":
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"add_rms_norm: residual {residual.shape} {residual.dtype} must match "
                f"x {x.shape} {x.dtype}"
            )
        d = x.shape[-1]
        y2, s2 = _add_rms_norm_pallas(
            x.reshape(-1, d),
            residual.reshape(-1, d),
            weight,
            float(eps),
            _config(config, interpret),
        )
        return y2.reshape(x.shape), s2.reshape(x.shape)
    raise ValueError(f"add_rms_norm: unknown impl {impl!r} (expected 'xla' or 'pallas')")
