"""Our flash attention on several devices: the plan runs it per device (--attention=mosaic), and
the model calls it under shard_map on each device's rows and heads. Checked on 8 fake CPU devices
with the kernel replaced by its pure-JAX reference (the kernel itself runs on a Hopper GPU only):
each call must see one device's share, and the model's loss and gradients must be the unsharded
model's. test_kernels_flash_attention.py lowers the real kernel inside the shard_map."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllmq.kernels import flash_attention as fa
from jaxllmq.model.architecture import preset
from jaxllmq.model.llama import Llama
from jaxllmq.parallel.mesh import make_mesh
from jaxllmq.plan import make_plan
from jaxllmq.settings import ModelSpec

H200 = dict(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0")
CFG = dataclasses.replace(
    preset("tiny"), num_hidden_layers=2, vocab_size=256, head_dim=64,
    num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip
B, T = 8, 64


@pytest.mark.parametrize("mesh, per_device", [((1, 1, 1), False), ((2, 2, 2), True)])
def test_the_plan_runs_mosaic_attention_per_device_on_several(mesh, per_device):
    spec = ModelSpec(model="llama-3.2-1b", from_scratch=True, matmul_dtype="bfloat16")
    spec = dataclasses.replace(spec, attention="mosaic")
    shape = dict(zip(("data", "fsdp", "tensor"), mesh, strict=True))
    plan = make_plan(preset("llama-3.2-1b"), spec, mesh_shape=shape, **H200)
    assert plan.attention == "mosaic"
    assert plan.attention_per_device == per_device
    assert ("mosaic per device" in plan.describe()) == per_device


def _reference_kernel(shares: list):
    """The kernel's pure-JAX stand-in: records the shapes each call sees, and whether it was
    asked for deterministic gradients."""

    def run(q, k, v, *, scale, segment_ids_BxT=None, window=None, deterministic=False, **_):
        shares.append((q.shape, k.shape, deterministic))
        first_key = None
        if segment_ids_BxT is not None or window is not None:
            first_key, _ = fa.key_bounds(q.shape[1], segment_ids_BxT, window, q.shape[0])
        return fa.reference_attention(q, k, v, scale, first_key).astype(q.dtype)

    return run


def _loss_and_grads(attention, mesh, tokens, segments):
    model = Llama(
        CFG,
        rngs=nnx.Rngs(0),
        attention=attention,
        attention_mesh=mesh,
        scan_layers=False,
        deterministic_attention=True,
    )
    graphdef, params = nnx.split(model)

    def loss(params):
        hidden = nnx.merge(graphdef, params)(tokens, segment_ids_BxT=segments)
        return jnp.mean(jnp.square(hidden))

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("documents", [False, True])
def test_the_model_runs_it_per_device_as_one_call_would(monkeypatch, documents):
    shares = []
    monkeypatch.setattr(fa, "flash_attention", _reference_kernel(shares))
    mesh = make_mesh(tensor_parallel=2, data_parallel=2)  # data 2, fsdp 2, tensor 2
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, CFG.vocab_size)
    segments = jnp.cumsum(jnp.zeros((B, T), jnp.int32).at[:, ::24].set(1), axis=1)
    segments = segments if documents else None
    loss, grads = _loss_and_grads("mosaic", mesh, tokens, segments)
    want_loss, want_grads = _loss_and_grads("xla", None, tokens, segments)
    # Each call took one device's rows (8 over data x fsdp = 4) and heads (over tensor = 2), and
    # the model's deterministic_attention.
    assert shares and set(shares) == {((2, T, 2, 64), (2, T, 1, 64), True)}
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
