"""RMSNorm: the Pallas kernels (interpret mode on CPU) against the pure-JAX reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllmq.kernels import resolve_impl
from jaxllmq.kernels.rms_norm import (
    RmsNormConfig,
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
    rms_norm_tee,
)
from jaxllmq.model import gemma


def _seed() -> int:
    # Fresh inputs every run; the seed is in every failure message to replay it.
    return int(np.random.SeedSequence().entropy % 2**31)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _f32(a):
    return a.astype(jnp.float32)


# fp32: the kernels do the reference's arithmetic in another order; bf16: against the fp32
# computation on the same bf16 values, one bf16 rounding of the outputs is ~2e-3.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}

# (shape, eps, x scale, config): hidden 896 and a prime hidden; row counts no block divides;
# a large eps with small x so that eps matters; a config forcing several backward steps per
# program with a ragged last one.
CASES = [
    ((2, 19, 896), 1e-6, 3.0, None),
    ((37, 67), 1e-5, 1.0, None),
    ((37, 67), 0.5, 0.3, RmsNormConfig(block_rows=4, bwd_programs=3)),
    ((45, 128), 1e-6, 2.0, RmsNormConfig(block_rows=2, num_warps=2, bwd_programs=4)),
]


def _inputs(shape, scale, dtype, seed):
    k = jax.random.split(jax.random.key(seed), 4)
    x = (scale * jax.random.normal(k[0], shape)).astype(dtype)
    w = (1 + 0.2 * jax.random.normal(k[1], shape[-1:])).astype(dtype)
    dy = jax.random.normal(k[2], shape).astype(dtype)
    r = jax.random.normal(k[3], shape).astype(dtype)
    return x, w, dy, r


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape,eps,scale,config", CASES)
def test_rms_norm_pallas_matches_reference(dtype, shape, eps, scale, config):
    seed = _seed()
    x, w, dy, _ = _inputs(shape, scale, dtype, seed)

    def fwd_bwd(fn, x, w, dy):
        y, vjp = jax.vjp(fn, x, w)
        return (y, *vjp(dy))

    pallas = jax.jit(
        lambda x, w, dy: fwd_bwd(
            lambda x, w: rms_norm(x, w, eps, impl="pallas", config=config), x, w, dy
        )
    )
    got = pallas(x, w, dy)
    # The referee: the reference in fp32 on the same values (for fp32 inputs, the reference).
    reference = jax.jit(
        lambda x, w, dy: fwd_bwd(lambda x, w: rms_norm_reference(x, w, eps), x, w, dy)
    )
    want = reference(_f32(x), _f32(w), _f32(dy))
    assert got[0].dtype == dtype and got[0].shape == x.shape
    assert got[1].dtype == dtype and got[2].dtype == dtype and got[2].shape == w.shape
    for name, g, r in zip(("y", "dx", "dw"), got, want, strict=True):
        err = _rel(g, r)
        assert err < TOL[dtype], f"{name}: rel err {err:.2e} (seed {seed})"
    if dtype == jnp.float32:  # the xla path is the reference itself
        np.testing.assert_array_equal(jax.jit(rms_norm, static_argnums=2)(x, w, eps), want[0])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape,eps,scale,config", CASES[:3])
def test_add_rms_norm_pallas_matches_reference(dtype, shape, eps, scale, config):
    seed = _seed()
    x, w, dy, r = _inputs(shape, scale, dtype, seed)
    ds = (0.5 * jax.random.normal(jax.random.key(seed + 1), shape)).astype(dtype)

    def fwd_bwd(fn, x, r, w):
        out, vjp = jax.vjp(fn, x, r, w)
        return (*out, *vjp((dy.astype(x.dtype), ds.astype(x.dtype))))

    got = jax.jit(
        lambda x, r, w: fwd_bwd(
            lambda x, r, w: add_rms_norm(x, r, w, eps, impl="pallas", config=config), x, r, w
        )
    )(x, r, w)

    # Referee: the sum rounded to the input dtype (as both implementations round it), then fp32.
    @jax.jit
    def reference(x, r, w, dy, ds):
        s = x + r
        y, vjp = jax.vjp(lambda s, w: rms_norm_reference(s, w, eps), _f32(s), _f32(w))
        ds_total, dw = vjp(_f32(dy))
        ds_total = ds_total + _f32(ds)
        return y, s, ds_total, ds_total, dw

    want = reference(x, r, w, dy, ds)
    for name, g, w_ in zip(("y", "sum", "dx", "dresidual", "dw"), got, want, strict=True):
        err = _rel(g, w_)
        assert err < TOL[dtype], f"{name}: rel err {err:.2e} (seed {seed})"
    y_xla, s_xla = jax.jit(add_rms_norm, static_argnums=3)(x, r, w, eps)
    y_ref, s_ref = jax.jit(add_rms_norm_reference, static_argnums=3)(x, r, w, eps)
    np.testing.assert_array_equal(s_xla, s_ref)
    np.testing.assert_array_equal(y_xla, y_ref)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape,eps,scale,config", CASES[1:3])
def test_rms_norm_tee_adds_the_input_gradient(dtype, shape, eps, scale, config):
    # (norm, x) with the passed-through x's gradient added into dx by the backward kernel.
    seed = _seed()
    x, w, dy, dx_through = _inputs(shape, scale, dtype, seed)

    def fwd_bwd(fn, x, w):
        out, vjp = jax.vjp(fn, x, w)
        return (*out, *vjp((dy.astype(x.dtype), dx_through.astype(x.dtype))))

    tee = lambda impl: lambda x, w: rms_norm_tee(x, w, eps, impl=impl, config=config)  # noqa: E731
    got = jax.jit(lambda x, w: fwd_bwd(tee("pallas"), x, w))(x, w)
    want = jax.jit(lambda x, w: fwd_bwd(tee("xla"), x, w))(_f32(x), _f32(w))
    np.testing.assert_array_equal(got[1], x)
    for name, g, r in zip(("y", "x", "dx", "dw"), got, want, strict=True):
        err = _rel(g, r)
        assert err < TOL[dtype], f"{name}: rel err {err:.2e} (seed {seed})"
    # Without the passed-through gradient dx would be the norm's alone: far off.
    dx_norm = jax.vjp(lambda x: rms_norm_reference(x, _f32(w), eps), _f32(x))[1](_f32(dy))[0]
    assert _rel(got[2], dx_norm) > 10 * TOL[dtype]


def test_rms_norm_is_not_the_identity_of_a_wrong_kernel():
    """The tolerance separates a right kernel from a slightly wrong one (eps ignored)."""
    seed = _seed()
    x, w, _, _ = _inputs((37, 67), 0.3, jnp.float32, seed)
    got = rms_norm(x, w, 0.5, impl="pallas")
    assert _rel(got, rms_norm_reference(x, w, 0.5)) < TOL[jnp.float32]
    assert _rel(got, rms_norm_reference(x, w, 0.0)) > 100 * TOL[jnp.float32]


@pytest.mark.parametrize("hidden", [896, 2048, 3584])
def test_rms_norm_pallas_lowers_to_triton_for_gpu(hidden):
    """The GPU (Triton) lowering accepts the model's shapes: power-of-two blocks, masks."""
    x = jax.ShapeDtypeStruct((8, 2048, hidden), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((hidden,), jnp.bfloat16)

    def fwd_bwd(x, w):  # interpret=False: the GPU lowering, not the CPU interpreter
        fn = lambda x, w: add_rms_norm(x, x, w, 1e-5, impl="pallas", interpret=False)  # noqa: E731
        out, vjp = jax.vjp(fn, x, w)
        return out, vjp(out)

    text = jax.jit(fwd_bwd).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2  # the forward and the backward kernel


def test_resolve_impl():
    assert resolve_impl("xla", "rms_norm") == "xla"
    assert resolve_impl("pallas", "lm_head_loss") == "pallas"
    assert resolve_impl("auto", "rms_norm", platform="cpu") == "xla"
    assert resolve_impl("auto", "lm_head_loss", platform="cpu") == "xla"
    for kernel in ("rms_norm", "lm_head_loss", "fp8_quantize"):
        # measured faster
        assert resolve_impl("auto", kernel, platform="gpu", hopper=False) == "pallas"
        # On several GPUs the RMSNorm stays XLA (its call is not per device); the others run
        # per device as on one GPU, but not under tensor parallelism.
        expect = "xla" if kernel == "rms_norm" else "pallas"
        assert resolve_impl("auto", kernel, platform="gpu", num_devices=8, hopper=False) == expect
        tp = resolve_impl("auto", kernel, platform="gpu", num_devices=8, tensor_parallel=2)
        assert tp == "xla"
    with pytest.raises(ValueError, match="auto, pallas or xla"):
        resolve_impl("triton", "rms_norm")
    # Per kernel: the one named is as asked, the other auto.
    mixed = "rms_norm=pallas,lm_head_loss=xla"
    assert resolve_impl(mixed, "rms_norm", platform="cpu") == "pallas"
    assert resolve_impl(mixed, "lm_head_loss", platform="gpu") == "xla"
    assert resolve_impl("lm_head_loss=pallas", "rms_norm", platform="cpu") == "xla"
    with pytest.raises(ValueError, match="kernel=impl"):
        resolve_impl("rms_norm=cuda", "rms_norm")
    # Mosaic GPU is a choice for the LM-head loss only; auto picks it on one Hopper GPU.
    assert resolve_impl("lm_head_loss=mosaic", "lm_head_loss", platform="gpu") == "mosaic"
    assert resolve_impl("auto", "lm_head_loss", platform="gpu", hopper=True) == "mosaic"
    assert resolve_impl("auto", "rms_norm", platform="gpu", hopper=True) == "pallas"
    assert resolve_impl("auto", "lm_head_loss", platform="gpu", num_devices=2, hopper=True) == (
        "mosaic"
    )
    assert resolve_impl("lm_head_loss=pallas", "lm_head_loss", tensor_parallel=2) == "pallas"
    with pytest.raises(ValueError, match="lm_head_loss also mosaic"):
        resolve_impl("rms_norm=mosaic", "rms_norm")
    with pytest.raises(ValueError, match="auto, pallas or xla"):
        resolve_impl("mosaic", "lm_head_loss")
    with pytest.raises(ValueError, match="unknown kernel"):
        resolve_impl("auto", "softmax")
    with pytest.raises(ValueError, match="unknown impl"):
        rms_norm(jnp.ones((2, 4)), jnp.ones(4), 1e-6, impl="cuda")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_xlas_norms_keep_only_their_inputs_with_autodiffs_gradients(dtype):
    # "xla" and Gemma's norm run autodiff of the reference again in their backward (which keeps
    # only x and the weight): the same bits as autodiff of it.
    keys = jax.random.split(jax.random.key(0), 3)
    x, g = (jax.random.normal(k, (4, 64), jnp.float32).astype(dtype) for k in keys[:2])
    w = (1 + 0.1 * jax.random.normal(keys[2], (64,), jnp.float32)).astype(dtype)
    for ours, theirs in [
        (
            lambda x, w: rms_norm(x, w, 1e-6, impl="xla"),
            lambda x, w: rms_norm_reference(x, w, 1e-6),
        ),
        (lambda x, w: gemma.rms_norm(x, w, 1e-6), lambda x, w: gemma._rms_norm(x, w, 1e-6)),
    ]:
        (y0, vjp0), (y1, vjp1) = jax.vjp(ours, x, w), jax.vjp(theirs, x, w)
        np.testing.assert_array_equal(y0, y1)
        for a, b in zip(vjp0(g), vjp1(g), strict=True):
            np.testing.assert_array_equal(a, b)
