"""LM-head loss: chunked XLA and fused Pallas (interpret mode on CPU) against the reference."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllmq.kernels import lm_head_pallas
from jaxllmq.kernels.lm_head_loss import kernel_used, lm_head_loss, lm_head_loss_reference
from jaxllmq.kernels.lm_head_mgpu import MosaicTiles
from jaxllmq.kernels.lm_head_pallas import LmHeadPallasConfig

# Small tiles so that the interpreter runs many of them: ragged vocab and hidden tiles, several
# token groups and chunks.
SMALL = LmHeadPallasConfig(block_m=16, block_v=64, block_k=32, group_m=2, chunk_tokens=48)
# impl "mosaic": the Mosaic GPU kernel where the shapes suit its 64-wide tiles, Triton elsewhere.
MOSAIC = LmHeadPallasConfig(
    block_m=64,
    block_v=64,
    block_k=32,
    chunk_tokens=128,
    mosaic=MosaicTiles(tile_m=64, tile_n=64, tile_k=64, stages=2, ctas=3),
)


def _seed() -> int:
    # Fresh inputs every run; the seed is in every failure message to replay it.
    return int(np.random.SeedSequence().entropy % 2**31)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _inputs(n, d, v, dtype, seed, keep=0.75):
    k = jax.random.split(jax.random.key(seed), 5)
    h = jax.random.normal(k[0], (n, d)).astype(dtype)
    # Logits of a few units, as a trained head gives: a softmax neither flat nor one-hot.
    w = (jax.random.normal(k[1], (d, v)) * (3.0 / np.sqrt(d))).astype(dtype)
    mask = jax.random.uniform(k[2], (n,)) < keep
    targets = jax.random.randint(k[3], (n,), 0, v)
    # Masked-out tokens carry garbage targets (negative, past the vocabulary): they must not matter.
    garbage = jax.random.randint(k[4], (n,), -(2**30), 2**30)
    return h, w, jnp.where(mask, targets, garbage), mask


def _value_and_grad(z_loss, **kw):
    def f(h, w, t, m):
        def loss(h, w):
            return lm_head_loss(h, w, t, m, z_loss=z_loss, **kw)

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h, w)

    return jax.jit(f)


def _referee(h, w, t, m, z_loss):
    """The reference in fp32 on the same values (for fp32 inputs, the reference itself)."""

    def loss(h, w):
        return lm_head_loss_reference(h, w, t, m, z_loss=z_loss)

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    return f(h.astype(jnp.float32), w.astype(jnp.float32))


def _check(got, want, dtype, seed):
    (obj, aux), (dh, dw) = got
    (obj0, aux0), (dh0, dw0) = want
    # fp32: same arithmetic, another summation order. bf16: the forward sees the same bf16
    # values through fp32 logits (tight); the gradient goes through bf16 dlogits (bf16 rounding).
    tol_f = 1e-5
    tol_g = 1e-5 if dtype == jnp.float32 else 1e-2
    assert obj.dtype == jnp.float32 and dh.dtype == dtype and dw.dtype == dtype
    assert set(aux) == {"ce_sum", "lse_max", "lse_sum"}
    for name, a, b in [("objective", obj, obj0)] + [(k, aux[k], aux0[k]) for k in aux0]:
        assert _rel(a, b) < tol_f, f"{name}: {float(a)} vs {float(b)} (seed {seed})"
    assert _rel(dh, dh0) < tol_g, f"dh rel err {_rel(dh, dh0):.2e} (seed {seed})"
    assert _rel(dw, dw0) < tol_g, f"dw rel err {_rel(dw, dw0):.2e} (seed {seed})"


IMPLS = [
    pytest.param(dict(impl="xla", chunks=1), id="xla"),
    pytest.param(dict(impl="xla", chunks=3), id="xla-chunks3"),
    pytest.param(dict(impl="pallas", pallas_config=SMALL), id="pallas"),
    pytest.param(dict(impl="mosaic", pallas_config=MOSAIC), id="mosaic"),
]


@pytest.mark.parametrize("kw", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "n,d,v,z_loss",
    # hidden 896 / prime vocab; prime-ish all; tile-aligned (Mosaic GPU's kernel)
    [(100, 896, 1009, 1e-3), (37, 67, 257, 0.0), (100, 128, 512, 1e-3)],
)
def test_lm_head_loss_matches_reference(kw, dtype, n, d, v, z_loss):
    seed = _seed()
    h, w, t, m = _inputs(n, d, v, dtype, seed)
    got = _value_and_grad(z_loss, **kw)(h, w, t, m)
    _check(got, _referee(h, w, t, m, z_loss), dtype, seed)
    # Masked-out tokens get no gradient and their targets are never read.
    dh = np.asarray(got[1][0], np.float32)
    assert np.all(dh[~np.asarray(m)] == 0), f"seed {seed}"
    assert np.all(np.any(dh[np.asarray(m)] != 0, axis=1)), f"seed {seed}"


@pytest.mark.parametrize("kw", IMPLS[2:])
@pytest.mark.parametrize("loss, far_rows", [(70.0, None), (200.0, None), (200.0, 2)])
def test_tokens_past_qs_range_get_the_exact_gradient(kw, loss, far_rows, monkeypatch):
    """Tokens whose loss is past REFERENCE_RANGE (q relative to the target logit would leave the
    float range; past 88 it is inf) get their rows of q again, exact, relative to their
    logsumexp: the gradient still matches the reference, finite. With FAR_ROWS at 2, the five
    such tokens take three iterations."""
    if far_rows:
        monkeypatch.setattr(lm_head_pallas, "FAR_ROWS", far_rows)
    seed = _seed()
    h, w, t, m = _inputs(100, 128, 512, jnp.bfloat16, seed, keep=1.0)
    logits = h.astype(jnp.float32) @ w.astype(jnp.float32)
    # Tokens 5-9's logits stretched until each one's least likely target costs `loss`.
    for i in range(5, 10):
        spread = logits[i].max() - logits[i].min()
        h = h.at[i].multiply((loss / spread).astype(h.dtype))
        t = t.at[i].set(jnp.argmin(logits[i]))
    got = _value_and_grad(0.0, **kw)(h, w, t, m)
    assert np.all(np.isfinite(np.asarray(got[1][0], np.float32))), seed
    _check(got, _referee(h, w, t, m, 0.0), jnp.bfloat16, seed)


def test_z_loss_enters_objective_and_gradient():
    """z-loss adds z * sum(mask * lse^2) and changes the gradient; every path agrees."""
    z_loss = 1e-2
    seed = _seed()
    h, w, t, m = _inputs(40, 48, 131, jnp.float32, seed)
    want = _referee(h, w, t, m, z_loss)
    for kw in (
        dict(impl="xla"),
        dict(impl="xla", chunks=4),
        dict(impl="pallas", pallas_config=SMALL),
    ):
        _check(_value_and_grad(z_loss, **kw)(h, w, t, m), want, jnp.float32, seed)
    # The reference itself: objective(z) = objective(0) + z * sum(mask * lse^2).
    (obj0, _), (dh0, _) = _referee(h, w, t, m, 0.0)
    lse = jax.nn.logsumexp(jnp.dot(h, w, precision="highest"), axis=-1)
    assert _rel(want[0][0], obj0 + z_loss * jnp.sum(jnp.where(m, lse * lse, 0.0))) < 1e-5
    assert _rel(want[1][0], dh0) > 1e-3


def test_large_vocab_chunked_xla():
    """Qwen2.5's 151,936-entry vocabulary through the chunked XLA path (cheap at few tokens)."""
    seed = _seed()
    h, w, t, m = _inputs(24, 16, 151_936, jnp.float32, seed)
    _check(_value_and_grad(0.0, impl="xla", chunks=5)(h, w, t, m), _referee(h, w, t, m, 0.0),
           jnp.float32, seed)  # fmt: skip


def test_xla_path_runs_its_backward_matmuls_in_bf16():
    """bf16 inputs: every matmul of the XLA loss's gradient takes bf16 operands, at any chunk
    count (the reference's autodiff multiplies fp32 dlogits: TF32 GEMMs on a GPU)."""
    h, w, t, m = _inputs(64, 32, 257, jnp.bfloat16, 0)
    for chunks in (1, 4):
        grad = jax.grad(
            lambda h, w, c=chunks: lm_head_loss(h, w, t, m, impl="xla", chunks=c)[0], (0, 1)
        )
        dots = [
            ln for ln in jax.jit(grad).lower(h, w).as_text().splitlines() if "dot_general" in ln
        ]
        operands = [ln.split(" : (")[1].split(") -> ")[0] for ln in dots]
        assert len(dots) == 3 and all("f32" not in o for o in operands), (chunks, operands)


def test_forward_only_paths_match_reference():
    """Without a gradient Pallas runs one launch over all tokens; chunked XLA a scan."""
    seed = _seed()
    h, w, t, m = _inputs(50, 40, 300, jnp.float32, seed)
    obj0, aux0 = jax.jit(lambda h, w: lm_head_loss_reference(h, w, t, m, z_loss=1e-3))(h, w)
    for kw in (dict(impl="xla", chunks=7), dict(impl="pallas", pallas_config=SMALL)):
        obj, aux = jax.jit(lambda h, w, kw=kw: lm_head_loss(h, w, t, m, z_loss=1e-3, **kw))(h, w)
        assert _rel(obj, obj0) < 1e-5, (kw, seed)
        for k in aux0:
            assert _rel(aux[k], aux0[k]) < 1e-5, (kw, k, seed)
    # The Mosaic GPU kernel without q, on bf16 shapes aligned to its tiles, 3 CTAs looping.
    h, w, t, m = _inputs(100, 128, 512, jnp.bfloat16, seed)
    obj0, aux0 = jax.jit(lambda h, w: lm_head_loss_reference(h, w, t, m, z_loss=1e-3))(h, w)
    loss = lambda h, w: lm_head_loss(h, w, t, m, z_loss=1e-3, impl="mosaic", pallas_config=MOSAIC)
    obj, aux = jax.jit(loss)(h, w)
    assert _rel(obj, obj0) < 1e-5, seed
    for k in aux0:
        assert _rel(aux[k], aux0[k]) < 1e-5, (k, seed)


def test_masked_in_target_outside_vocab_is_nan_everywhere():
    """A masked-in target the vocabulary lacks is a data bug: loud (NaN) on every path."""
    h, w, t, m = _inputs(20, 16, 50, jnp.float32, 0, keep=1.0)
    t = t.at[3].set(50)
    for kw in (
        dict(impl="xla"),
        dict(impl="xla", chunks=2),
        dict(impl="pallas", pallas_config=SMALL),
    ):
        obj, _ = lm_head_loss(h, w, t, m, **kw)
        assert np.isnan(float(obj)), kw
        obj, _ = lm_head_loss(h, w, t, m.at[3].set(False), **kw)
        assert np.isfinite(float(obj)), kw


def test_rejects_bad_arguments():
    h, w, t, m = _inputs(4, 8, 16, jnp.float32, 0)
    with pytest.raises(ValueError, match="unknown impl"):
        lm_head_loss(h, w, t, m, impl="triton")
    with pytest.raises(ValueError, match="chunks"):
        lm_head_loss(h, w, t, m, chunks=0)


@pytest.mark.parametrize("d,v", [(2048, 128_256), (896, 151_936), (3584, 151_936)])
def test_pallas_lowers_to_triton_for_gpu(d, v):
    """The GPU (Triton) lowering accepts the real shapes: power-of-two tiles, ragged vocab."""
    n = 8 * 2048
    h, w = jax.ShapeDtypeStruct((n, d), jnp.bfloat16), jax.ShapeDtypeStruct((d, v), jnp.bfloat16)
    t, m = jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.bool_)

    def step(h, w, t, m):
        def loss(h, w):
            return lm_head_loss(h, w, t, m, z_loss=1e-4, impl="pallas", interpret=False)

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h, w)

    text = jax.jit(step).trace(h, w, t, m).lower(lowering_platforms=("cuda",)).as_text()
    # The kernel inside the scan over chunks, once: tokens past q's range get their rows again
    # from an XLA matmul, not from the kernel.
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize(
    "d,v,kernel",
    [(2048, 128_256, "mosaic"), (4096, 128_256, "mosaic"), (896, 151_936, "triton")],
)
def test_mosaic_lowering_fits_the_gpu_at_real_shapes(d, v, kernel):
    """The Hopper kernel lowers for the GPU (its shared memory within an H200 CTA's) at the
    1B's and 8B's shapes, inside the scan over chunks; a vocabulary its tile pairs do not
    divide (qwen2.5's 151,936 = 1,187 x 128) keeps the Triton kernel."""
    n = 8 * 2048
    h, w = jax.ShapeDtypeStruct((n, d), jnp.bfloat16), jax.ShapeDtypeStruct((d, v), jnp.bfloat16)
    t, m = jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.bool_)

    def step(h, w, t, m):
        def loss(h, w):
            return lm_head_loss(h, w, t, m, impl="mosaic", interpret=False)

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h, w)

    text = jax.jit(step).trace(h, w, t, m).lower(lowering_platforms=("cuda",)).as_text()
    calls = {"mosaic": "custom_call @mosaic_gpu", "triton": "__gpu$xla.gpu.triton"}
    # Once: a chunk's kernel (tokens past q's range get their rows again from an XLA matmul).
    assert {k: text.count(c) for k, c in calls.items()} == {k: int(k == kernel) for k in calls}
    # What a run's plan reports (kernel_used; "pallas" is the Triton kernel) is what lowered.
    used = kernel_used("mosaic", d, v, jnp.bfloat16)
    assert used == ("mosaic" if kernel == "mosaic" else "pallas")


def test_mosaic_tile_options():
    """Warpgroup lowering semantics gives the same tiles (interpret mode); a 2-CTA cluster,
    which the interpreter cannot run, lowers for the GPU with its w tiles multicast; other
    values are refused."""
    from jaxllmq.kernels import lm_head_mgpu

    seed = _seed()
    h, w, _, _ = _inputs(128, 64, 512, jnp.bfloat16, seed)
    r = jax.random.normal(jax.random.key(seed + 1), (128,))  # q's reference, any per token
    lane = MosaicTiles(tile_m=64, tile_n=64, tile_k=64, stages=2, ctas=3)
    want = lm_head_mgpu.lm_head_tiles(h, w, lane, r, True)
    wg = dataclasses.replace(lane, semantics="warpgroup")
    got = lm_head_mgpu.lm_head_tiles(h, w, wg, r, True)
    ref = jax.nn.logsumexp(
        (h.astype(jnp.float32) @ w.astype(jnp.float32)).reshape(128, 8, 64), axis=-1
    ).T
    assert _rel(want[0], ref) < 1e-5, seed
    logits = h.astype(jnp.float32) @ w.astype(jnp.float32)
    assert _rel(want[1], jnp.exp(logits - r[:, None])) < 1e-2, seed
    for a, b in zip(got, want, strict=True):
        assert _rel(a, b) < 1e-6, seed

    n, d, v = 8 * 2048, 2048, 128_256
    hs, ws = jax.ShapeDtypeStruct((n, d), jnp.bfloat16), jax.ShapeDtypeStruct((d, v), jnp.bfloat16)
    pair = MosaicTiles(cluster_m=2)
    rs = jax.ShapeDtypeStruct((n,), jnp.float32)
    text = (
        jax.jit(lambda h, w, r: lm_head_mgpu.lm_head_tiles(h, w, pair, r, False))
        .trace(hs, ws, rs)
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert text.count("custom_call @mosaic_gpu") == 1
    assert lm_head_mgpu.applies(256, 64, 512, jnp.bfloat16, MosaicTiles(64, 64, 64, cluster_m=2))
    assert not lm_head_mgpu.applies(
        192, 64, 512, jnp.bfloat16, MosaicTiles(64, 64, 64, cluster_m=2)
    )
    for bad in (dict(cluster_m=4), dict(semantics="thread")):
        with pytest.raises(ValueError, match="cluster_m must be 1 or 2"):
            dataclasses.replace(lane, **bad)


@pytest.mark.parametrize("v,chunks", [(128_256, 2), (151_936, 2), (262_144, 4)])
def test_gradient_chunks_stay_under_2_31_logits(v, chunks):
    """8 x 2048 tokens: chunks of 8192 (the 1B's and Qwen's vocabularies), of 4096 at Gemma 3's
    262,144, where 8192 tokens would hold 2^31 entries of q."""
    n = 8 * 2048
    h, w = jax.ShapeDtypeStruct((n, 64), jnp.bfloat16), jax.ShapeDtypeStruct((64, v), jnp.bfloat16)
    t, m = jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.bool_)

    def step(h, w, t, m):
        loss = lambda h, w: lm_head_loss(h, w, t, m, impl="pallas", interpret=True)
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h, w)

    # The scan over chunks: the one that carries the weight's fp32 gradient out.
    text = str(jax.make_jaxpr(step)(h, w, t, m))
    lengths = re.findall(rf"f32\[64,{v}\][^=]*= scan\[\s*jaxpr=\w+\s*length=(\d+)", text)
    assert lengths == [str(chunks)]
