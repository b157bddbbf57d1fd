"""Host offload: fp32 master weights and Adam moments kept in pinned host memory.

--offload_master, --offload_opt_m and --offload_opt_v give those parts of the train state the
memory kind `pinned_host` in their shardings (llmq keeps them in pinned host memory too). Inside
the jitted step they are streamed to the device and back one layer at a time (a loop over the
stacked [L, ...] axis), so the device never holds the whole fp32 master or moments:

- before the forward pass, `compute_params` streams the master into a device copy in the compute
  dtype (bf16), the weights the forward and backward passes use (a lax.map);
- after the backward pass, `update` applies the optimizer layer by layer: each layer's master and
  moments come to the device, are updated there, and go back into their slot of the host arrays
  (a fori_loop carrying them, so they are updated in place). The non-layer parameters
  (embedding, final norm, LM head) are one more piece.

On the H200 the step is bound by the host link: the host-to-device and device-to-host copies run
one after the other, not at once (docs/PERFORMANCE.md, "Host offload").

The arithmetic is the on-device step's, element for element, so losses match bit for bit. On CPU
(jax 0.10) `pinned_host` exists and the jitted step's arguments carry it, but a device_put inside
jit lowers to nothing there: the streaming is exercised, the transfers are not.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxllmq.optim import apply_updates
from jaxllmq.setting import Settings, setting

HOST, DEVICE = "pinned_host", "device"
LAYERS = "layers"  # the params' key for the per-layer weights, stacked on a leading [L] axis


@dataclasses.dataclass(frozen=True)
class Offload(Settings):
    """Which parts of the train state live in pinned host memory."""

    master: bool = setting(
        False,
        "Keep the master weights in pinned host memory, streamed in layer by layer.",
        flag="offload_master",
    )
    opt_m: bool = setting(
        False,
        "Keep AdamW's first moment in pinned host memory, streamed for the update.",
        flag="offload_opt_m",
    )
    opt_v: bool = setting(
        False,
        "Keep AdamW's second moment in pinned host memory, streamed for the update.",
        flag="offload_opt_v",
    )

    @property
    def any(self) -> bool:
        return self.master or self.opt_m or self.opt_v

    def flags(self) -> list[str]:
        """The flags set, e.g. ['--offload_master']."""
        return [f"--offload_{f.name}" for f in dataclasses.fields(self) if getattr(self, f.name)]


class OffloadError(ValueError):
    """Offload asked for on a device that cannot hold host-memory arrays (one line)."""


def check_supported(mesh: jax.sharding.Mesh, offload: Offload) -> None:
    """Refuse offload on a device without pinned host memory, naming the flags."""
    device = mesh.devices.flat[0]
    kinds = {m.kind for m in device.addressable_memories()}
    if offload.any and HOST not in kinds:
        raise OffloadError(
            f"{', '.join(offload.flags())}: {device.platform} device {device} has no "
            f"{HOST} memory (it has {', '.join(sorted(kinds))})"
        )


def _on_host(tree, on: bool):
    return jax.tree.map(lambda s: s.with_memory_kind(HOST), tree) if on else tree


def place_params(shardings: dict, offload: Offload) -> dict:
    """The parameters' shardings, in host memory under --offload_master."""
    return _on_host(shardings, offload.master)


def place_opt(shardings, offload: Offload):
    """The optimizer state's shardings, Adam's moments in host memory as asked."""

    def place(node):
        if not isinstance(node, optax.ScaleByAdamState):
            return node
        return node._replace(
            mu=_on_host(node.mu, offload.opt_m), nu=_on_host(node.nu, offload.opt_v)
        )

    return jax.tree.map(place, shardings, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))


def _slice_sharding(s: NamedSharding, kind: str) -> NamedSharding:
    """One layer's sharding (the stacked [L] axis dropped) in memory `kind`."""
    return NamedSharding(s.mesh, PartitionSpec(*s.spec[1:]), memory_kind=kind)


def _empty(x: jax.Array) -> jax.Array:
    # Stands in for a leaf outside the piece being updated: elementwise work on it costs nothing.
    return jnp.zeros((0, *x.shape[1:]), x.dtype)


def _is_layer(params: dict) -> dict:
    # The stacked matrices [L, in, out] stream layer by layer. The stacked norm weights [L, D]
    # are tiny: they go with the non-layer parameters, where XLA compiles their update as it
    # does on the device (sliced per layer, its fusion rounds a few of them differently).
    return {
        k: jax.tree.map(lambda x, layer=k == LAYERS: layer and x.ndim > 2, v)
        for k, v in params.items()
    }


@dataclasses.dataclass(frozen=True)
class Streams:
    """The offloaded step's two streams: the compute copy in, the optimizer update through."""

    optimizer: optax.GradientTransformationExtraArgs
    param_shardings: dict  # with their memory kinds (place_params)
    opt_shardings: object  # shaped like the optimizer state (place_opt)
    compute_dtype: jnp.dtype  # the matmul dtype: what the forward pass casts the weights to

    def _to_device(self, x: jax.Array, s: NamedSharding, layer: bool) -> jax.Array:
        if s.memory_kind != HOST:
            return x
        return jax.device_put(
            x, _slice_sharding(s, DEVICE) if layer else s.with_memory_kind(DEVICE)
        )

    def _to_home(self, x: jax.Array, s: NamedSharding, layer: bool) -> jax.Array:
        if s.memory_kind != HOST:
            return x
        return jax.device_put(x, _slice_sharding(s, HOST) if layer else s)

    def _dtype(self, name: str, x: jax.Array) -> jnp.dtype:
        # The embedding stays in its master dtype: its gradient is a scatter-add of every
        # occurrence of a token, which the on-device step sums in fp32. Others are cast to the
        # compute dtype, as the forward pass does, when that is the narrower one.
        narrower = jnp.finfo(self.compute_dtype).bits < jnp.finfo(x.dtype).bits
        return self.compute_dtype if narrower and name != "embed_tokens" else x.dtype

    def compute_params(self, params: dict) -> dict:
        """The weights for the forward and backward passes: a device copy in the compute dtype,
        streamed from host memory one layer at a time (the master itself when on the device)."""
        if not any(s.memory_kind == HOST for s in jax.tree.leaves(self.param_shardings)):
            return params
        out = {}
        for name, x in params.items():
            s = self.param_shardings[name]
            if name == LAYERS:
                out[name] = jax.lax.map(
                    lambda i, x=x, s=s: {
                        k: self._to_device(x[k][i], s[k], True).astype(self._dtype(k, x[k]))
                        for k in x
                    },
                    jnp.arange(next(iter(x.values())).shape[0]),
                )
            else:
                out[name] = self._to_device(x, s, False).astype(self._dtype(name, x))
        return out

    def _flags(self, opt_state, params: dict):
        # Per optimizer-state leaf: True/False for a per-layer/other parameter-shaped leaf, and
        # "state" for the rest (counts), which every piece's update computes alike.
        return optax.tree_map_params(
            self.optimizer,
            lambda _, layer: layer,
            opt_state,
            _is_layer(params),
            transform_non_params=lambda _: "state",
        )

    def update(
        self, grad_sums: dict, denom: jax.Array, opt_state, params: dict
    ) -> tuple[dict, optax.OptState, jax.Array]:
        """(params, opt_state, grad norm) after one optimizer step on grad_sums / denom, applied
        one layer at a time."""
        grads = jax.tree.map(lambda g: g / denom, grad_sums)
        norm = optax.tree.norm(grads)
        param_flags, state_flags = _is_layer(params), self._flags(opt_state, params)

        def piece(pick, params, opt_state):
            # The optimizer over one piece (a layer, or the non-layer parameters), with the whole
            # gradients' norm (which also decides whether the step is skipped): the same
            # arithmetic as one update of all of it.
            p = jax.tree.map(pick, params, param_flags, self.param_shardings)
            st = jax.tree.map(pick, opt_state, state_flags, self.opt_shardings)
            # Divided here, not before the loop: XLA folds the division into the clip's as it
            # does on the device, and the update's arithmetic stays the same, bit for bit.
            g = jax.tree.map(lambda x, f: pick(x, f, None) / denom, grad_sums, param_flags)
            u, st = self.optimizer.update(g, st, p, grad_norm=norm)
            return apply_updates(p, u, st), st

        def home(tree, flags, shardings, layer: bool):
            send = lambda x, f, s: self._to_home(x, s, layer) if f is layer else x
            return jax.tree.map(send, tree, flags, shardings)

        def layer(i, carry):
            # The stacked master and moments are the loop's carry, each layer written back into
            # its slot: updated in place, in the (donated) buffers they came in. A lax.map's fresh
            # stacked outputs cost a whole host-to-host copy of each after the loop (measured
            # 1.06 s of a 1.6 s 1B step on the H200).
            stacked_p, stacked_st = carry

            def pick(x, f, s):
                if f == "state":
                    return x
                if not f:
                    return _empty(x)
                return x[i] if s is None else self._to_device(x[i], s, True)

            p, st = piece(pick, stacked_p, stacked_st)
            p = home(p, param_flags, self.param_shardings, True)
            st = home(st, state_flags, self.opt_shardings, True)
            put = lambda full, new, f: (
                jax.lax.dynamic_update_index_in_dim(full, new, i, 0) if f is True else full
            )
            return jax.tree.map(put, stacked_p, p, param_flags), jax.tree.map(
                put, stacked_st, st, state_flags
            )

        def rest(x, f, s):
            if f == "state":
                return x
            if f:
                return _empty(x)
            return x if s is None else self._to_device(x, s, False)

        L = next(iter(params[LAYERS].values())).shape[0]
        # The non-layer parameters stay out of the loop (zero-size stand-ins in its carry).
        carry = lambda tree, flags: jax.tree.map(
            lambda x, f: _empty(x) if f is False else x, tree, flags
        )
        layer_p, layer_st = jax.lax.fori_loop(
            0, L, layer, (carry(params, param_flags), carry(opt_state, state_flags))
        )
        rest_p, rest_st = piece(rest, params, opt_state)
        rest_p = home(rest_p, param_flags, self.param_shardings, False)
        rest_st = home(rest_st, state_flags, self.opt_shardings, False)
        join = lambda stacked, other, f: stacked if f is True else other
        return (
            jax.tree.map(join, layer_p, rest_p, param_flags),
            jax.tree.map(join, layer_st, rest_st, state_flags),
            norm,
        )
