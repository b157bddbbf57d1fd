"""Gemma 3's pieces of the decoder (model/llama.py runs them where ModelConfig.is_gemma)."""

import functools
import math

import jax
import jax.numpy as jnp

from jaxllmq.kernels.rms_norm import keeping_inputs

# The layers' norms beyond Llama's two, and the final norm: all of (1 + w), initialized to 0.
EXTRA_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm, x / rms(x) * (1 + w), all in float32 as transformers computes it, the
    result in x's dtype. Always XLA's: the Pallas kernel multiplies by its weight in x's dtype,
    which would round (1 + w) before the product. Its backward keeps only x and w."""
    return keeping_inputs(functools.partial(_rms_norm, eps=eps), x, w)


def _rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * inv * (1.0 + w.astype(jnp.float32))).astype(x.dtype)


def scale_embeddings(x_BxTxD: jax.Array) -> jax.Array:
    """The embeddings times sqrt(D), the factor rounded to their dtype (the table's) first, as
    transformers does."""
    return x_BxTxD * jnp.asarray(math.sqrt(x_BxTxD.shape[-1]), x_BxTxD.dtype)


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GeGLU's gate: GELU by its tanh approximation (transformers' gelu_pytorch_tanh)."""
    return jax.nn.gelu(x, approximate=True)
