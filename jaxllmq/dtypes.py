"""dtype names as flags and configs spell them, and the jnp dtypes they stand for."""

import jax.numpy as jnp

# Master weights, AdamW moments, activations and matmuls.
DTYPES = {"float32": jnp.dtype(jnp.float32), "bfloat16": jnp.dtype(jnp.bfloat16)}
# fp8 formats (llmq's names) of the block linears' GEMM operands and their gradients.
FP8_DTYPES = {"e4m3": jnp.dtype(jnp.float8_e4m3fn), "e5m2": jnp.dtype(jnp.float8_e5m2)}
