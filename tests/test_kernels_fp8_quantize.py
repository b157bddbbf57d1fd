"""kernels/fp8_quantize.py: the Pallas pass (interpreted on CPU) writes the same fp8 bytes as the
pure-JAX reference in both layouts, and fp8 block linears give the same outputs and gradients
with either implementation (current and delayed scaling; on 8 devices, per device)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxllmq.kernels.fp8_quantize import (
    Fp8QuantizeConfig,
    Quantizer,
    quantize_both,
    quantize_both_pallas,
    quantize_both_reference,
)
from jaxllmq.model import fp8, fp8_delayed
from jaxllmq.parallel.mesh import BATCH_AXES, make_mesh


def _bytes(a: jax.Array) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize("shape", [(128, 64), (200, 96), (1, 5)])
@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_pallas_writes_the_reference_bytes_in_both_layouts(shape, name):
    dtype = fp8.fp8_dtype(name)
    x = 300 * jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(jnp.bfloat16)
    x = x.at[0, 0].set(1e6)  # saturates: clipped to the format's max, not inf or NaN
    scale = jnp.float32(2.0**-3)
    want_q, want_qt = quantize_both_reference(x, dtype, scale)
    cfg = Fp8QuantizeConfig(block_rows=64, block_cols=32, interpret=True)  # ragged tiles too
    q, qt = quantize_both_pallas(x, dtype, scale, cfg)
    assert q.shape == shape and qt.shape == shape[::-1] and q.dtype == qt.dtype == dtype
    np.testing.assert_array_equal(_bytes(q), _bytes(want_q))
    np.testing.assert_array_equal(_bytes(qt), _bytes(want_qt))
    assert float(q[0, 0].astype(jnp.float32)) == float(jnp.finfo(dtype).max)


def test_unknown_impl_is_refused():
    with pytest.raises(ValueError, match="'xla' or 'pallas'"):
        quantize_both(jnp.ones((4, 4)), jnp.float8_e4m3fn, jnp.float32(1), impl="triton")


@pytest.mark.parametrize("delayed", [False, True])
def test_dense_is_the_same_with_either_quantize(delayed):
    kx, kw, kt = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(kx, (2, 40, 64), jnp.float32).astype(jnp.bfloat16)
    w = (0.02 * jax.random.normal(kw, (64, 48), jnp.float32)).astype(jnp.bfloat16)
    t = jax.random.normal(kt, (2, 40, 48), jnp.float32)
    ref = (jnp.float32(4.0), jnp.float32(0.1), jnp.float32(2.0))  # delayed: reference amaxes

    def loss(x, w, quantizer):
        if delayed:
            y = fp8_delayed.dense(x, w, ref, "e4m3", "e5m2", quantizer=quantizer)
        else:
            y = fp8.dense(x, w, "e4m3", "e5m2", quantizer=quantizer)
        return jnp.sum(y.astype(jnp.float32) * t)

    grads = {
        impl: jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)(
            x, w, Quantizer(impl)
        )
        for impl in ("xla", "pallas")
    }
    pallas, xla = jax.tree.leaves(grads["pallas"]), jax.tree.leaves(grads["xla"])
    for got, want in zip(pallas, xla, strict=True):
        np.testing.assert_array_equal(np.float32(got), np.float32(want))


def test_on_a_mesh_the_pallas_pass_runs_per_device_with_the_same_results():
    # 8 devices, tokens split over the batch axes as the trainer lays them out (ZeRO).
    mesh = make_mesh(8)
    per_device = Quantizer("pallas", mesh, BATCH_AXES)
    rows = NamedSharding(mesh, PartitionSpec(BATCH_AXES, None))
    kx, kw, kt = jax.random.split(jax.random.key(2), 3)
    x = jax.device_put(jax.random.normal(kx, (64, 32), jnp.float32).astype(jnp.bfloat16), rows)
    w = (0.05 * jax.random.normal(kw, (32, 16), jnp.float32)).astype(jnp.bfloat16)
    t = jax.device_put(jax.random.normal(kt, (64, 16), jnp.float32), rows)

    def loss(x, w, quantizer):
        return jnp.sum(fp8.dense(x, w, quantizer=quantizer).astype(jnp.float32) * t)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
    assert "manual_computation" in step.lower(x, w, per_device).as_text()  # shard_map
    got, want = step(x, w, per_device), step(x, w, Quantizer("xla"))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.float32(a), np.float32(b))
