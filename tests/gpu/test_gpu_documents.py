"""Packed documents on the GPU: cuDNN's packed layout (each document a segment) against the
float32 XLA reference of the document mask, and the train step's loss with documents against the
same step with XLA's masked attention (cuDNN's segments, and jaxllmq's flash attention, which
`auto` runs over documents on one Hopper GPU)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllmq import bench
from jaxllmq.model import attention

pytestmark = pytest.mark.gpu


def _grads(attend, q, k, v, do):
    loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * do)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("median", [600, 40])
def test_cudnn_segments_match_the_masked_reference(head_dim, median):
    B, T, N, K = 4, 2048, 16, 4
    seg = jnp.asarray(bench.document_segment_ids(B, T, median))
    per_window = int(seg.max()) + 1  # every document its own segment
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(B, T, N, head_dim), (B, T, K, head_dim), (B, T, K, head_dim), (B, T, N, head_dim)]
    q, k, v, do = (
        jax.random.normal(kk, s, jnp.float32) for kk, s in zip(keys, shapes, strict=True)
    )
    mask = attention.documents_for("xla", seg, per_window)
    spans = attention.documents_for("cudnn", seg, per_window)
    ref = _grads(lambda q, k, v: attention.attend_documents(q, k, v, mask), q, k, v, do)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    got = _grads(lambda q, k, v: attention.attend_documents(q, k, v, spans), *bf, do)
    xla_bf16 = _grads(lambda q, k, v: attention.attend_documents(q, k, v, mask), *bf, do)
    for name, g, r, x in zip("qkv", got[1], ref[1], xla_bf16[1], strict=True):
        err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - r)))
        bound = 2 * float(jnp.max(jnp.abs(x.astype(jnp.float32) - r)))  # bf16's own error, x2
        assert err <= max(bound, 0.05), (name, err, bound)


def _train_with_documents(attention_impl: str, head_dim: int = 32) -> tuple[list[float], str]:
    """5 steps of the tiny preset (at `head_dim`) in bf16 on one batch of packed documents; the
    losses and the attention the plan chose."""
    from jaxllmq import train_step
    from jaxllmq.data.pipeline import documents
    from jaxllmq.model.architecture import load_model_config
    from jaxllmq.parallel.mesh import make_mesh
    from jaxllmq.plan import plan_for
    from jaxllmq.settings import ModelSpec, OptimConfig

    cfg = dataclasses.replace(load_model_config("tiny"), head_dim=head_dim)
    spec = ModelSpec(
        model="tiny", from_scratch=True, matmul_dtype="bfloat16", attention=attention_impl
    )
    mesh = make_mesh(1)
    plan = plan_for(cfg, spec, mesh, documents_per_window=32)
    built = train_step.build(
        cfg, spec, OptimConfig(lr=3e-3), plan, mesh=mesh, total_steps=100, seed=0
    )
    eos = 3
    rng = np.random.default_rng(0)
    windows = rng.integers(eos + 1, cfg.vocab_size, (4, 513)).astype(np.int32)
    ends = np.minimum(rng.lognormal(np.log(60), 1.0, (4, 20)).astype(int).cumsum(1), 512)
    for row, cut in zip(windows, ends, strict=True):
        row[cut] = eos
    inputs, targets = windows[:, :-1], windows[:, 1:]
    segment_ids, positions, trained = documents(inputs, eos, 32)
    batch = {
        "inputs": inputs,
        "targets": targets,
        "loss_mask": trained,
        "segment_ids": segment_ids,
        "positions": positions,
    }
    batch = jax.device_put({k: v[None] for k, v in batch.items()}, built.batch_sharding)
    state, losses = built.state, []
    for _ in range(5):
        state, metrics = built.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, plan.attention


def test_the_train_step_takes_documents_as_cudnn_segments():
    cudnn, chosen = _train_with_documents("cudnn")
    assert chosen == "cudnn"
    xla, _ = _train_with_documents("xla")
    assert cudnn[-1] < cudnn[0] - 0.05, cudnn
    np.testing.assert_allclose(cudnn, xla, rtol=5e-3)


@pytest.mark.parametrize("head_dim", [64, 32])
def test_the_train_step_takes_documents_in_our_flash_attention(head_dim):
    """`auto` runs ours over documents, at 32 padded to 64."""
    ours, chosen = _train_with_documents("auto", head_dim=head_dim)
    assert chosen == "mosaic"
    xla, _ = _train_with_documents("xla", head_dim=head_dim)
    assert ours[-1] < ours[0] - 0.05, ours
    np.testing.assert_allclose(ours, xla, rtol=5e-3)
