"""One layer's weights at their point of use: gathered in the compute dtype, reduced per layer.

Forward: the layer's slice of each stacked parameter is cast to the compute dtype and given its
compute sharding (tensor-parallel only), so ZeRO-3's all-gather moves bf16, not fp32 master bytes.
Backward: the slice's gradient is cast back to the parameter's dtype and given the gradient
sharding right there, inside the layer. XLA then all-reduces (ZeRO-1) or reduce-scatters
(ZeRO-2/3) each layer's gradients as soon as that layer's backward is done, and the latency-hiding
scheduler overlaps the transfer with the backward of the layers below, instead of reducing the
stacked [L, ...] gradients after the whole backward pass. The reduction stays in the parameter's
dtype, as it was when it happened after the stack.
"""

from collections.abc import Callable

import jax
from jax.sharding import NamedSharding


def layer_weights_hook(
    compute: dict[str, NamedSharding], grads: dict[str, NamedSharding], dtype
) -> Callable[[dict[str, jax.Array]], dict[str, jax.Array]]:
    """The model's `gather_layer` hook from per-name compute and gradient shardings of one layer."""

    def one(name: str, w: jax.Array) -> jax.Array:
        param_dtype = w.dtype

        @jax.custom_vjp
        def use(w):
            return jax.lax.with_sharding_constraint(w.astype(dtype), compute[name])

        def bwd(_, ct):
            return (jax.lax.with_sharding_constraint(ct.astype(param_dtype), grads[name]),)

        use.defvjp(lambda w: (use(w), None), bwd)
        return use(w)

    return lambda p: {name: one(name, w) for name, w in p.items()}
