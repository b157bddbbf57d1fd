"""The keys and values cache of decoding (generate.py), one array per kind stacked over layers."""

import dataclasses

import jax
import jax.numpy as jnp

from jaxllmq.model.architecture import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """The keys and values of the tokens so far, for decoding a few tokens at a time.

    k, v [L, B, S, K, H] in the compute dtype, S the most tokens it holds; length [L] int32, the
    positions filled (the same in every layer), so the next tokens are at length, length + 1, ...
    Indexed or scanned over L like the stacked layers: one layer's has k, v [B, S, K, H] and a
    scalar length. Slots from length on are never read before tokens write them.
    """

    k: jax.Array
    v: jax.Array
    length: jax.Array

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, max_len: int, dtype) -> "KVCache":
        """A cache for `batch` sequences of up to `max_len` tokens, none yet."""
        L = cfg.num_hidden_layers
        zeros = jnp.zeros((L, batch, max_len, cfg.num_key_value_heads, cfg.dim_per_head), dtype)
        return cls(zeros, zeros, jnp.zeros((L,), jnp.int32))

    def truncate(self, length: jax.Array | int) -> "KVCache":
        """The cache of the first `length` tokens only (the next ones overwrite the rest)."""
        return dataclasses.replace(self, length=jnp.full_like(self.length, length))

    def append(self, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array) -> "KVCache":
        """One layer's cache with T more tokens' keys and values, written at `length`."""
        start = (0, self.length, 0, 0)
        return KVCache(
            jax.lax.dynamic_update_slice(self.k, k_BxTxKxH.astype(self.k.dtype), start),
            jax.lax.dynamic_update_slice(self.v, v_BxTxKxH.astype(self.v.dtype), start),
            self.length + k_BxTxKxH.shape[1],
        )
