"""The Mosaic GPU flash attention on the GPU: forward and backward against the float32 reference
within twice cuDNN's own error at the same shape, causal, over packed documents and with a
sliding window, at head dims 64, 128 and 256, by default (dQ added up in the dK/dV kernel)
and deterministic, and with the dK/dV kernel's other orders; the same results on each of
several calls (a race between warpgroups shows as a call that differs; dQ added up in any
order: each call's within the bound); and the same results through the model's per-device
path (shard_map) as from the plain call (deterministic: bit for bit)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jaxllmq import bench
from jaxllmq.kernels import flash_attention as fa
from jaxllmq.model import attention
from jaxllmq.parallel.mesh import make_mesh

pytestmark = pytest.mark.gpu

B, T, HQ, HKV = 4, 2048, 16, 4


def _inputs(d):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, T, HQ, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, T, HKV, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, T, HKV, d), jnp.bfloat16)
    do = jax.random.normal(keys[3], (B, T, HQ, d), jnp.bfloat16)
    return q, k, v, do


def _outputs(attend, q, k, v, do):
    o, vjp = jax.vjp(attend, q, k, v)
    return (o, *vjp(do))


@pytest.mark.parametrize(
    "head_dim, blocks",
    [
        (64, None),
        (128, None),
        (64, fa.default_blocks(64, deterministic=True)),
        (64, fa.FlashBlocks(dkv_block_q=128, dq_block_kv=128)),
        (64, fa.FlashBlocks(dq_in_dkv=True, dkv_overlap=True)),
        (96, None),
        (64, dataclasses.replace(fa.default_blocks(64, deterministic=True), block_kv=64)),
        (64, fa.default_blocks(64, causal_len=fa.WIDE_KEY_TILES_FROM)),
        (128, fa.default_blocks(128, deterministic=True, causal_len=T)),
        # An H200's causal tiles, also an H100's (tests/test_kernels_flash_attention.py).
        (128, fa.default_blocks(128, causal_len=T, device_kind="NVIDIA H200")),
        (128, fa.FlashBlocks(dq_in_dkv=True, per_warpgroup_code=True)),
        (64, dataclasses.replace(fa.default_blocks(64), per_warpgroup_code=True)),
        (64, dataclasses.replace(fa.default_blocks(64), fwd_overlap=True)),
        (128, fa.FlashBlocks(fwd_overlap=True)),
        (256, None),
    ],
    ids=[
        "64",
        "128",
        "64-deterministic",
        "64-dkv-in-order-128-row-steps",
        "64-dq-in-dkv-overlap",
        "96-padded",
        "64-forward-64-key-tiles",
        "64-forward-256-key-tiles",
        "128-deterministic",
        "128-causal-tiles",
        "128-dq-in-dkv-in-order",
        "64-per-warpgroup-code",
        "64-forward-overlap",
        "128-forward-overlap",
        "256",
    ],
)
@pytest.mark.parametrize("visibility", ["causal", "documents", "window"])
def test_matches_the_reference_as_closely_as_cudnn(head_dim, blocks, visibility):
    q, k, v, do = _inputs(head_dim)
    scale = head_dim**-0.5
    seg = jnp.asarray(bench.document_segment_ids(B, T, 300)) if visibility == "documents" else None
    window = 700 if visibility == "window" else None
    first, _ = fa.key_bounds(T, seg, window, B)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    want = _outputs(lambda q, k, v: fa.reference_attention(q, k, v, scale, first), *f32)
    cudnn = _outputs(
        lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation="cudnn"
        ),
        q,
        k,
        v,
        do,
    )
    causal_ref = _outputs(lambda q, k, v: fa.reference_attention(q, k, v, scale), *f32)
    ours = jax.jit(
        lambda q, k, v, do: _outputs(
            lambda q, k, v: fa.flash_attention(
                q, k, v, scale=scale, segment_ids_BxT=seg, window=window, blocks=blocks
            ),
            q,
            k,
            v,
            do,
        )
    )
    names = ("o", "dq", "dk", "dv")
    cudnn_errs = [
        float(jnp.max(jnp.abs(c.astype(jnp.float32) - r)))
        for c, r in zip(cudnn, causal_ref, strict=True)
    ]

    def check(outputs):
        for name, g, w, cudnn_err in zip(names, outputs, want, cudnn_errs, strict=True):
            err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)))
            assert err <= 2 * cudnn_err, f"{name}: {err} against cuDNN's {cudnn_err}"

    got = ours(q, k, v, do)
    check(got)
    # dQ added up in the dK/dV kernel lands in whatever order the CTAs reach it: every call's
    # within the bound, the rest bit for bit the first call's.
    plain_causal_len = T if visibility == "causal" else 0
    adds_in_any_order = (
        blocks or fa.default_blocks(head_dim, causal_len=plain_causal_len)
    ).dq_in_dkv
    for _ in range(5):
        call = ours(q, k, v, do)
        for name, g, a in zip(names, got, call, strict=True):
            if not (adds_in_any_order and name == "dq"):
                assert bool(jnp.array_equal(g, a)), f"a call's {name} differs from the first"
        if adds_in_any_order:
            check(call)


def test_the_model_path_under_shard_map_gives_the_plain_calls_results():
    """On several devices the model calls the kernel per device under shard_map; a mesh of this
    one GPU runs that path, whose output and gradients must be the plain call's, bit for bit
    (deterministic)."""
    q, k, v, do = _inputs(64)
    documents = attention.documents_for("mosaic", jnp.asarray(bench.document_segment_ids(B, T)), 32)

    def run(mesh):
        def attend(q, k, v):
            o, _ = attention.attend(
                q,
                k,
                v,
                None,
                implementation="mosaic",
                documents=documents,
                mesh=mesh,
                deterministic=True,
            )
            return o

        return jax.jit(lambda q, k, v, do: _outputs(attend, q, k, v, do))(q, k, v, do)

    per_device, plain = run(make_mesh(gpus=1)), run(None)
    for name, got, want in zip(("o", "dq", "dk", "dv"), per_device, plain, strict=True):
        assert bool(jnp.array_equal(got, want)), f"{name} differs under shard_map"
