"""fp8 linear layers: `dense(x, w)` runs forward, dgrad and wgrad as fp8 GEMMs (llmq's e4m3 mode).

Shape letters: M rows (all leading dims of x flattened), K in features, N out features.

Scaling is per tensor and *current*: each step, each operand's scale comes from its own abs-max
(x, w and the output gradient g alike). Nothing is carried between steps, so the train state,
its checkpoints and the bit-exact resume are untouched, and the first step is as well scaled as
the thousandth. The alternative, *delayed* scaling (Transformer Engine's default, flax's
fp8_ops), scales with the max of an amax history from earlier steps: it skips one reduction per
tensor but makes the history part of the train state and lets a sudden outlier saturate until
the history catches up. One abs-max is a read of a tensor the quantize pass reads anyway (XLA
fuses the two when it can), so current scaling is the default; delayed scaling is
model/fp8_delayed.py (--fp8_scaling=delayed), there to be measured against it. Under data or
tensor parallelism the abs-max of a sharded tensor is a scalar all-reduce, which keeps the
scale, and so the numbers, independent of the device count.

Scales are powers of two (as in the MX formats' E8M0 scales): dividing by one and multiplying
back are exact in any float dtype, so quantization's only rounding is the cast to fp8 itself,
and the CPU (which emulates the fp8 dot) and cuBLASLt compute the same thing. The cost is at
most one binade of the fp8 range: the abs-max lands in (max/2, max] instead of on max.

How XLA's GPU compiler sees it: the GEMMs are `lax.dot_general` with float8 operands and
`preferred_element_type` = the compute dtype (bf16), followed by a multiply by the product of the
two scalar scales. GemmRewriter (xla/service/gpu/transforms/gemm_rewriter.cc) rewrites a dot
whose operands are fp8 (directly, or `convert(fp8) * broadcast(scalar)`, the dequantize pattern)
into one `__cublas$lt$matmul$f8` custom call, as long as one operand is e4m3 (cuBLASLt has no
e5m2 x e5m2), each operand has one contracting and one non-contracting dimension (so x is
flattened to [M, K] here) and the GPU is Ada/Hopper or newer. The direct form is the one chosen:
with nothing but the dot in it, XLA's Triton GEMM fusion pass finds a "pure matmul" it leaves to
cuBLAS, where a dequantize prologue would invite a Triton fusion instead. cuBLASLt accumulates fp8
products in fp32 and rounds once to bf16 on output (the CPU path does the same: fp32 dot, one
rounding); the scale multiply afterwards is exact (a power of two) and fuses into the consumer.
Precision DEFAULT lets XLA turn on cuBLASLt's fast fp8 accumulation for the forward GEMM;
HIGHEST keeps full fp32 accumulation for dgrad and wgrad (XLA asks for fast accumulation only
below HIGHEST; Transformer Engine, too, accumulates the gradients' fp8 GEMMs in full).
benchmarks/fp8_check.py counts the custom calls in the compiled 1B step.

Layouts: cuBLASLt's fp8 GEMM wants both operands' contracted dimension contiguous, so the weight
gradient x^T g needs x and g token-major, while the forward GEMM and dgrad read them row-major.
x and g are therefore quantized into both layouts at once (kernels/fp8_quantize.py: one Pallas
pass on one GPU, 1.5x faster than XLA's separate quantize and transpose; the reference in XLA
elsewhere), and x's token-major copy is what the backward keeps.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxllmq.dtypes import FP8_DTYPES
from jaxllmq.kernels.fp8_quantize import XLA_QUANTIZER, Quantizer, quantize


def fp8_dtype(name: str):
    """The float8 dtype for llmq's name ("e4m3" or "e5m2")."""
    if name not in FP8_DTYPES:
        raise ValueError(f"fp8 dtype must be one of {tuple(FP8_DTYPES)}, got {name!r}")
    return FP8_DTYPES[name]


def abs_max(x: jax.Array) -> jax.Array:
    """max |x| as an fp32 scalar."""
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def scale_of(x: jax.Array, dtype) -> jax.Array:
    """Per-tensor power-of-two scale s (fp32 scalar) with abs-max(x) / s in (max/2, max] of dtype."""
    return scale_for(abs_max(x), dtype)


def scale_for(amax: jax.Array, dtype) -> jax.Array:
    """The power-of-two scale s with amax / s in (max/2, max] of dtype (1 for 0 or non-finite)."""
    amax = jnp.asarray(amax, jnp.float32)
    # frexp: amax / max = m * 2^e with m in [0.5, 1); the smallest 2^k >= amax / max is 2^e, or
    # 2^(e-1) when m is exactly 0.5. Exact, unlike ceil(log2(.)) near powers of two.
    m, e = jnp.frexp(amax / float(jnp.finfo(dtype).max))
    scale = jnp.ldexp(jnp.float32(1.0), jnp.where(m == 0.5, e - 1, e))
    # An all-zero (or non-finite) tensor: scale 1, so zeros stay zeros and NaN stays visible.
    return jnp.where((amax > 0) & jnp.isfinite(amax), scale, jnp.float32(1.0))


def gemm(a, b, contract, scale, out_dtype, precision) -> jax.Array:
    """fp8 a x b contracted over `contract`, fp32 accumulation, times scale, in out_dtype."""
    out = lax.dot_general(
        a, b, (contract, ((), ())), precision=precision, preferred_element_type=out_dtype
    )
    return out * scale.astype(out_dtype)


def wgrad(qxt_KxM, qgt_NxM, scale, out_dtype) -> jax.Array:
    """The weight gradient x^T g [K, N] from fp8 x^T and g^T (both token-major, the layout
    cuBLASLt's fp8 GEMM takes), summed over the M rows in fp32."""
    return gemm(qxt_KxM, qgt_NxM, ((1,), (1,)), scale, out_dtype, lax.Precision.HIGHEST)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _dense(x_MxK, w_KxN, dtype_name: str, grad_name: str, quantizer: Quantizer) -> jax.Array:
    return _dense_fwd(x_MxK, w_KxN, dtype_name, grad_name, quantizer)[0]


def _dense_fwd(x_MxK, w_KxN, dtype_name, grad_name, quantizer):
    dtype = fp8_dtype(dtype_name)
    sx, sw = scale_of(x_MxK, dtype), scale_of(w_KxN, dtype)
    qx_MxK, qxt_KxM = quantizer(x_MxK, dtype, sx)
    qw_KxN = quantize(w_KxN, dtype, sw)
    y_MxN = gemm(qx_MxK, qw_KxN, ((1,), (0,)), sx * sw, x_MxK.dtype, lax.Precision.DEFAULT)
    # Keep x's token-major fp8 copy for the weight gradient (half the bytes of bf16); w's dtype
    # rides along as an empty array so its gradient can be returned in it.
    return y_MxN, (qxt_KxM, sx, qw_KxN, sw, jnp.zeros((0,), w_KxN.dtype))


def _dense_bwd(dtype_name, grad_name, quantizer, res, g_MxN):
    qxt_KxM, sx, qw_KxN, sw, w_dtype = res
    gdtype = fp8_dtype(grad_name)
    sg = scale_of(g_MxN, gdtype)
    qg_MxN, qgt_NxM = quantizer(g_MxN, gdtype, sg)
    high = lax.Precision.HIGHEST  # no fast accumulation for gradients
    dx_MxK = gemm(qg_MxN, qw_KxN, ((1,), (1,)), sg * sw, g_MxN.dtype, high)
    dw_KxN = wgrad(qxt_KxM, qgt_NxM, sx * sg, w_dtype.dtype)
    return dx_MxK, dw_KxN


_dense.defvjp(_dense_fwd, _dense_bwd)


def dense(
    x: jax.Array,
    w_KxN: jax.Array,
    dtype: str = "e4m3",
    grad_dtype: str = "e4m3",
    quantizer: Quantizer = XLA_QUANTIZER,
) -> jax.Array:
    """x [..., K] @ w [K, N] with fp8 GEMMs (forward in `dtype`, gradients in `grad_dtype`);
    x and the output gradient quantized into both layouts by `quantizer`."""
    *lead, K = x.shape
    y_MxN = _dense(x.reshape(-1, K), w_KxN, dtype, grad_dtype, quantizer)
    return y_MxN.reshape(*lead, w_KxN.shape[1])


def matmul(x: jax.Array, w: jax.Array, name: str = "") -> jax.Array:
    """x @ w in their dtype: a block linear without fp8 (`name`, the weight's, is not needed)."""
    return x @ w


def linear_fn(
    linear_dtype: str | None,
    gradient_dtype: str | None = None,
    quantizer: Quantizer = XLA_QUANTIZER,
) -> Callable[..., jax.Array]:
    """The block linears' `linear(x, w, name)`: `x @ w` in the compute dtype (None), or fp8
    `dense` with current scaling."""
    if linear_dtype is None:
        return matmul
    fp8_dtype(linear_dtype)
    grad = gradient_dtype or linear_dtype
    fp8_dtype(grad)
    return lambda x, w, name="": dense(x, w, linear_dtype, grad, quantizer)
