"""q, k and v from one input: their input gradient as one GEMM (llama.py, fuse_qkv_grads)."""

import jax
import jax.numpy as jnp


@jax.custom_vjp
def shared_input_matmuls(x: jax.Array, ws: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """(x @ w for w in ws), whose input gradient is one GEMM over the concatenated weights.

    Differentiated one by one, q, k and v each give x a gradient of their own (at K=512 for the
    1B's k and v, where cuBLAS runs at 440-540 TFLOP/s against 740), summed by separate adds.
    Here the backward concatenates the outputs' gradients (a copy XLA fuses into the RoPE
    backward that writes them) and the weights (a few MiB), and runs one GEMM with K the total
    width; the weights' gradients are one GEMM too, split by columns. The forward is unchanged:
    XLA already runs the three products as one GEMM.
    """
    return tuple(x @ w for w in ws)


def _shared_input_matmuls_fwd(x, ws):
    return shared_input_matmuls(x, ws), (x, ws)


def _shared_input_matmuls_bwd(res, cts):
    x, ws = res
    d_all = jnp.concatenate(cts, axis=-1)
    dx = d_all @ jnp.concatenate(ws, axis=1).T
    batch = tuple(range(x.ndim - 1))
    dw_all = jax.lax.dot_general(x, d_all, ((batch, batch), ((), ())))
    ends = [w.shape[1] for w in ws]
    splits = [sum(ends[: i + 1]) for i in range(len(ws) - 1)]
    return dx.astype(x.dtype), tuple(jnp.split(dw_all.astype(ws[0].dtype), splits, axis=1))


shared_input_matmuls.defvjp(_shared_input_matmuls_fwd, _shared_input_matmuls_bwd)


def can_fuse_qkv_grads(linear_dtype: str | None) -> bool:
    """Whether q/k/v's input gradient can be one GEMM (shared_input_matmuls): with plain
    matmuls, not fp8 block linears."""
    return linear_dtype is None
