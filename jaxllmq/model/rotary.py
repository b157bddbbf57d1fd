"""RoPE applied: cos and sin tables of positions, and the rotation of q and k by them."""

import jax
import jax.numpy as jnp

from jaxllmq.model.architecture import ModelConfig, rope_inv_freq


def rope_cos_sin(
    cfg: ModelConfig, positions: jax.Array, local: bool = False
) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables [..., H] for the given integer positions, fp32 (HF's half-split layout);
    `local`: Gemma 3's sliding layers' (rope_local_base_freq)."""
    inv_freq = jnp.asarray(rope_inv_freq(cfg, local), jnp.float32)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_BxTxNxH: jax.Array, cos_BxTxH: jax.Array, sin_BxTxH: jax.Array) -> jax.Array:
    """Rotate pairs (i, i + H/2) by the position's angle; fp32 math, result in x's dtype."""
    x = x_BxTxNxH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos_BxTxH[:, :, None, :], sin_BxTxH[:, :, None, :]
    return (x * cos + rotated * sin).astype(x_BxTxNxH.dtype)
