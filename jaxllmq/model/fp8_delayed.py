"""Delayed fp8 scaling (--fp8_scaling=delayed): each operand's scale from an amax history.

Shape letters: L layers, A amax-history length; M, K, N as in fp8.py.

Current scaling (fp8.py) must finish a full abs-max reduction of a tensor before it can quantize
it, so the quantize is a second pass over every activation, weight and gradient and cannot fuse
into the op that produces the tensor. Delayed scaling (Transformer Engine's default recipe)
scales with the largest abs-max seen over the last A steps, known before the step starts, so
the quantize can fuse into the producer. This step's abs-max is still taken, for the history,
but nothing waits on it.

State: TrainState.fp8 = {"x": {input: [L, A]}, "w": {linear: [L, A]}, "g": {linear: [L, A]}},
float32, newest first, replicated: the abs-maxes of the block linears' inputs, weights and
output gradients. q/k/v read one input (input_layernorm's output) and gate/up another, so "x" is
keyed by the input (INPUTS) and one scale quantizes it once for all its readers: the same
expression, which XLA's CSE merges, as it does with current scaling.

How the amaxes get out: the train step hands the model each operand's reference amax (the max of
its history: `reference`, [L] per entry) as an input of `dense`'s custom_vjp, and reads this
step's amaxes back as that input's gradient: x's and w's measured in the forward, g's in the
backward, where g first exists. Flax's fp8_ops (Fp8DotGeneralOp) do the same with the scales and
histories they keep as variables whose "gradient" overwrites them. An input read by several
linears gets the sum of their gradients, so only its first reader reports it (the others 0:
amax + 0 is exact). Over micro-batches the train step keeps the max; `record` shifts it in.

Numbers: the scale is fp8.scale_for(reference * 2^MARGIN), a power of two as with current
scaling, so quantizing rounds only in the fp8 cast. A tensor that outgrows its history by more
than the margin saturates (clips to the fp8 max) for a step. An empty history gives scale 1: the
first step's activations and gradients (`init_history` can measure the weights). A non-finite
amax is recorded as 0, so one overflowing step does not pin a scale for A steps. Evaluation
and generation pass no references and quantize with current scaling.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxllmq.kernels.fp8_quantize import XLA_QUANTIZER, Quantizer
from jaxllmq.model.fp8 import abs_max, fp8_dtype, gemm, quantize, scale_for, wgrad

# Each block linear's input, named by what produces it; the first linear named reports its amax.
INPUTS = {
    "q_proj": "input_layernorm",
    "k_proj": "input_layernorm",
    "v_proj": "input_layernorm",
    "o_proj": "attention",
    "gate_proj": "post_attention_layernorm",
    "up_proj": "post_attention_layernorm",
    "down_proj": "swiglu",
}
REPORTS_X = frozenset(next(n for n in INPUTS if INPUTS[n] == x) for x in set(INPUTS.values()))
# One binade of headroom above the history's max: the power-of-two rounding alone leaves none
# when an amax sits exactly on max * 2^k, and activations grow during training.
MARGIN = 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _dense(x_MxK, w_KxN, ref_x, ref_w, ref_g, dtype_name, grad_name, report_x, quantizer):
    return _dense_fwd(
        x_MxK, w_KxN, ref_x, ref_w, ref_g, dtype_name, grad_name, report_x, quantizer
    )[0]


def _dense_fwd(x_MxK, w_KxN, ref_x, ref_w, ref_g, dtype_name, grad_name, report_x, quantizer):
    dtype, headroom = fp8_dtype(dtype_name), 2.0**MARGIN
    sx, sw = scale_for(ref_x * headroom, dtype), scale_for(ref_w * headroom, dtype)
    sg = scale_for(ref_g * headroom, fp8_dtype(grad_name))
    qx_MxK, qxt_KxM = quantizer(x_MxK, dtype, sx)
    qw_KxN = quantize(w_KxN, dtype, sw)
    y_MxN = gemm(qx_MxK, qw_KxN, ((1,), (0,)), sx * sw, x_MxK.dtype, lax.Precision.DEFAULT)
    amax_x = abs_max(x_MxK) if report_x else jnp.zeros((), jnp.float32)
    # As fp8.dense: fp8 copies for backward; w's dtype rides along as an empty array.
    res = (qxt_KxM, sx, qw_KxN, sw, sg, amax_x, abs_max(w_KxN), jnp.zeros((0,), w_KxN.dtype))
    return y_MxN, res


def _dense_bwd(dtype_name, grad_name, report_x, quantizer, res, g_MxN):
    qxt_KxM, sx, qw_KxN, sw, sg, amax_x, amax_w, w_dtype = res
    qg_MxN, qgt_NxM = quantizer(g_MxN, fp8_dtype(grad_name), sg)
    high = lax.Precision.HIGHEST  # no fast accumulation for gradients
    dx_MxK = gemm(qg_MxN, qw_KxN, ((1,), (1,)), sg * sw, g_MxN.dtype, high)
    dw_KxN = wgrad(qxt_KxM, qgt_NxM, sx * sg, w_dtype.dtype)
    # The references' "gradients": this step's amaxes (see the module docstring).
    return dx_MxK, dw_KxN, amax_x, amax_w, abs_max(g_MxN)


_dense.defvjp(_dense_fwd, _dense_bwd)


def dense(
    x: jax.Array,
    w_KxN: jax.Array,
    ref: tuple[jax.Array, jax.Array, jax.Array],
    dtype: str = "e4m3",
    grad_dtype: str = "e4m3",
    report_x: bool = True,
    quantizer: Quantizer = XLA_QUANTIZER,
) -> jax.Array:
    """x [..., K] @ w [K, N] in fp8, scaled from the reference amaxes (x, w, g); their gradients
    are this call's amaxes (x's only with report_x). x and g quantized as in fp8.dense."""
    *lead, K = x.shape
    y_MxN = _dense(x.reshape(-1, K), w_KxN, *ref, dtype, grad_dtype, report_x, quantizer)
    return y_MxN.reshape(*lead, w_KxN.shape[1])


def linear_fn(
    linear_dtype: str, gradient_dtype: str | None, ref: dict, quantizer: Quantizer = XLA_QUANTIZER
) -> Callable[[jax.Array, jax.Array, str], jax.Array]:
    """One layer's `linear(x, w, name)` with delayed scaling; `ref` is `reference()` of a layer."""
    if linear_dtype is None:
        raise ValueError("delayed fp8 scaling needs fp8 block linears (linear_dtype)")
    grad = gradient_dtype or linear_dtype

    def linear(x: jax.Array, w: jax.Array, name: str) -> jax.Array:
        refs = (ref["x"][INPUTS[name]], ref["w"][name], ref["g"][name])
        report_x = name in REPORTS_X
        return dense(x, w, refs, linear_dtype, grad, report_x, quantizer)

    return linear


def init_history(
    num_layers: int, length: int, layers: dict | None = None, dtype=jnp.bfloat16
) -> dict:
    """Empty histories; given `layers` (the stacked params), the weights' amaxes in `dtype`."""
    if length < 1:
        raise ValueError(f"the amax history needs at least one step, got {length}")
    zeros = lambda: jnp.zeros((num_layers, length), jnp.float32)
    history = {
        "x": {name: zeros() for name in sorted(set(INPUTS.values()))},
        "w": {name: zeros() for name in INPUTS},
        "g": {name: zeros() for name in INPUTS},
    }
    if layers is not None:
        w_amax = lambda w: jnp.max(jnp.abs(w.astype(dtype)), axis=(1, 2)).astype(jnp.float32)
        history["w"] = {
            name: h.at[:, 0].set(w_amax(layers[name])) for name, h in history["w"].items()
        }
    return history


def reference(history: dict) -> dict:
    """Each operand's reference amax [L]: the max over its history."""
    return jax.tree.map(lambda h_LxA: jnp.max(h_LxA, axis=1), history)


def record(history: dict, amax: dict) -> dict:
    """The histories with this step's amaxes [L] shifted in (newest first; non-finite as 0)."""

    def push(h_LxA, a_L):
        a_L = jnp.where(jnp.isfinite(a_L), a_L, 0.0).astype(h_LxA.dtype)
        return jnp.concatenate([a_L[:, None], h_LxA[:, :-1]], axis=1)

    return jax.tree.map(push, history, amax)
