"""The Mosaic GPU flash attention on CPU: which keys each query sees (key_bounds) against the
masks the model builds, its reference against XLA's attention, its refusals, and that every
variant lowers to Mosaic GPU for a GPU (jax.export for cuda needs no GPU). Mosaic GPU's
interpreter lacks what the kernel is built from (transposed wgmma operands, P from registers,
accumulators kept across calls), so its numerics are checked on the GPU (tests/gpu)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxllmq.kernels import flash_attention_mgpu as fa
from jaxllmq.model import attention


def _segments(rows: int, t: int, starts: list[int]) -> jax.Array:
    marks = jnp.zeros((rows, t), jnp.int32).at[:, jnp.array(starts)].set(1)
    return jnp.cumsum(marks, axis=1)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("documents", [False, True])
def test_key_bounds_are_the_models_masks(window, documents):
    t = 40
    seg = _segments(2, t, [7, 8, 23]) if documents else None
    first, last = fa.key_bounds(t, seg, window, 2)
    pos = np.arange(t)
    sees = pos[None, :] <= pos[:, None]  # [query, key]
    if documents:
        sees = sees[None] & np.asarray(attention.same_document(seg))[:, 0]
    else:
        sees = np.broadcast_to(sees, (2, t, t))
    if window is not None:
        sees = sees & np.asarray(attention.keys_within(t, window))
    from_first = pos[None, None, :] >= np.asarray(first)[:, :, None]
    until_last = pos[None, :, None] <= np.asarray(last)[:, None, :]
    causal = pos[None, :] <= pos[:, None]
    np.testing.assert_array_equal(sees, causal & from_first)
    np.testing.assert_array_equal(sees, causal & until_last)


def test_reference_is_xla_attention_over_documents_and_a_window():
    keys = jax.random.split(jax.random.key(0), 3)
    b, t, hq, hkv, d = 2, 32, 4, 2, 16
    q = jax.random.normal(keys[0], (b, t, hq, d))
    k = jax.random.normal(keys[1], (b, t, hkv, d))
    v = jax.random.normal(keys[2], (b, t, hkv, d))
    seg = _segments(b, t, [5, 20])
    first, _ = fa.key_bounds(t, seg, 6, b)
    mask = attention.same_document(seg) & attention.keys_within(t, 6)
    want = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, scale=0.3)
    got = fa.reference_attention(q, k, v, 0.3, first)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_refuses_what_it_does_not_take_in_one_line():
    assert fa.fits(64, 8, 2, jnp.bfloat16) is None
    assert fa.fits(80, 8, 2, jnp.bfloat16) == "head dim 80 (it takes 64 or 128)"
    assert fa.fits(128, 8, 2, jnp.float32) == "float32 (it takes bfloat16 or float16)"
    assert fa.fits(64, 8, 3, jnp.bfloat16) == "8 query heads over 3 key heads"
    with pytest.raises(ValueError, match="does not take head dim 96"):
        x = jnp.zeros((1, 256, 2, 96), jnp.bfloat16)
        fa.flash_attention(x, x, x, scale=1.0)


@pytest.mark.parametrize(
    "t, d, documents, window, fused",
    [(256, 64, False, None, False), (256, 128, True, 100, False), (200, 64, True, None, True)],
    ids=["causal-64", "bounded-128", "padded-documents-fused-dq-64"],
)
def test_forward_and_backward_lower_to_mosaic_gpu(t, d, documents, window, fused):
    b, hq, hkv = 1, 4, 2
    q = jax.ShapeDtypeStruct((b, t, hq, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, hkv, d), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def loss(q, k, v, seg):
        o = fa.flash_attention(
            q,
            k,
            v,
            scale=d**-0.5,
            segment_ids_BxT=seg if documents else None,
            window=window,
            blocks=fa.FlashBlocks(fused_dq=fused),
        )
        return jnp.sum(o.astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    module = export.export(grads, platforms=["cuda"])(q, kv, kv, seg).mlir_module()
    # The forward and the backward's kernels (dK/dV, and dQ unless fused), Mosaic GPU calls.
    assert len(re.findall(r"custom_call @mosaic_gpu", module)) == (2 if fused else 3)
