"""LM head + softmax cross-entropy (+ z-loss) over [tokens, vocab], with logsumexp statistics."""

import jax
import jax.numpy as jnp


def lm_head_loss_reference(
    h_NxD: jax.Array,
    w_DxV: jax.Array,
    targets_N: jax.Array,
    mask_N: jax.Array,
    *,
    z_loss: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Materializes the logits. Returns (objective sum, aux) over the masked-in tokens.

    objective = sum(mask * (ce + z_loss * lse^2)), differentiable, fp32.
    aux = {ce_sum, lse_max, lse_sum}: fp32 statistics for the log, without gradients.
    """
    # fp32 logits: the softmax over 128k entries in bf16 loses the small probabilities.
    logits_NxV = jnp.dot(h_NxD, w_DxV, preferred_element_type=jnp.float32)
    lse_N = jax.nn.logsumexp(logits_NxV, axis=-1)
    target_logit_N = jnp.take_along_axis(logits_NxV, targets_N[:, None], axis=-1)[:, 0]
    m = mask_N.astype(jnp.float32)
    ce_N = lse_N - target_logit_N
    objective = jnp.sum(m * (ce_N + z_loss * lse_N * lse_N))
    aux = {
        "ce_sum": jnp.sum(m * ce_N),
        "lse_max": jnp.max(jnp.where(mask_N, lse_N, -jnp.inf)),
        "lse_sum": jnp.sum(m * lse_N),
    }
    return objective, jax.tree.map(jax.lax.stop_gradient, aux)


def lm_head_loss(
    h_NxD: jax.Array,
    w_DxV: jax.Array,
    targets_N: jax.Array,
    mask_N: jax.Array,
    *,
    z_loss: float = 0.0,
    impl: str = "xla",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """LM-head loss through the chosen implementation; see lm_head_loss_reference."""
    if impl == "xla":
        return lm_head_loss_reference(h_NxD, w_DxV, targets_N, mask_N, z_loss=z_loss)
    raise ValueError(f"lm_head_loss: unknown impl {impl!r} (expected 'xla')")
