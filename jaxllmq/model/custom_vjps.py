"""Operations whose custom VJP keeps less for the backward pass than autodiff would, with
autodiff's own arithmetic in the backward (the same gradients, bit for bit). Between unrolled
layers XLA fuses away what autodiff keeps beyond these; a scan over layers stacks it for every
layer."""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gated_activation(act: Callable, gate_BxTxF: jax.Array, up_BxTxF: jax.Array) -> jax.Array:
    """act(gate) * up, the MLP's gated activation. Its backward keeps only gate and up and
    recomputes act from gate: autodiff of silu keeps three more [B, T, F] arrays, which XLA
    fuses away between unrolled layers but a scan over layers must stack for every layer (the
    1B at 8 x 2048: 4 GiB each)."""
    return act(gate_BxTxF) * up_BxTxF


def _gated_activation_forward(act, gate_BxTxF, up_BxTxF):
    return act(gate_BxTxF) * up_BxTxF, (gate_BxTxF, up_BxTxF)


def _gated_activation_backward(act, saved, g_BxTxF):
    gate_BxTxF, up_BxTxF = saved
    act_BxTxF, act_vjp = jax.vjp(act, gate_BxTxF)
    (d_gate_BxTxF,) = act_vjp(g_BxTxF * up_BxTxF)
    return d_gate_BxTxF, act_BxTxF * g_BxTxF


gated_activation.defvjp(_gated_activation_forward, _gated_activation_backward)


@jax.custom_vjp
def matmul_heads(o_BxTxNxH: jax.Array, w_NHxD: jax.Array) -> jax.Array:
    """o's heads side by side @ w: the o projection. Its backward keeps o as the attention
    gave it, the array the attention's own backward keeps, where autodiff would keep the
    side-by-side reshape: under a scan over layers that is a second copy of o stacked for every
    layer (the 1B at 8 x 2048: 1 GiB)."""
    B, T, N, H = o_BxTxNxH.shape
    return o_BxTxNxH.reshape(B, T, N * H) @ w_NHxD


def _matmul_heads_forward(o_BxTxNxH, w_NHxD):
    return matmul_heads(o_BxTxNxH, w_NHxD), (o_BxTxNxH, w_NHxD)


def _matmul_heads_backward(saved, g_BxTxD):
    o_BxTxNxH, w_NHxD = saved
    B, T, N, H = o_BxTxNxH.shape
    _, matmul_vjp = jax.vjp(jnp.matmul, o_BxTxNxH.reshape(B, T, N * H), w_NHxD)
    d_o_BxTxNH, d_w_NHxD = matmul_vjp(g_BxTxD)
    return d_o_BxTxNH.reshape(B, T, N, H), d_w_NHxD


matmul_heads.defvjp(_matmul_heads_forward, _matmul_heads_backward)
