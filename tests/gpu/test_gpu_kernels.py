"""On the GPU: each fused kernel through the lowering a run uses (Triton or Mosaic GPU, not
interpret mode) and cuDNN's attention, against their pure-JAX references at the presets' shapes
(one micro-batch of 8 x 2048 tokens); and the kernel in the program is the one asked for.

Tolerances are the CPU tests' (tests/test_kernels_*.py): relative L2 error against the reference
computed in fp32 on the same bf16 values. bf16 outputs and gradients: 1e-2 (one bf16 rounding is
~2e-3; a wrong kernel is off by O(1)). The LM-head loss's fp32 objective and statistics: 1e-5.
The fp8 quantize pass: bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllmq.kernels import is_hopper
from jaxllmq.kernels.fp8_quantize import quantize_both
from jaxllmq.kernels.lm_head_loss import kernel_used, lm_head_loss, lm_head_loss_reference
from jaxllmq.kernels.rms_norm import add_rms_norm, rms_norm, rms_norm_tee
from jaxllmq.model import fp8
from jaxllmq.model.attention import attend, resolve_attention

pytestmark = pytest.mark.gpu

TOKENS = 8 * 2048
BF16_TOL = 1e-2
F32_TOL = 1e-5
# What each kernel is called in the lowered program.
TRITON = "__gpu$xla.gpu.triton"
MOSAIC = "custom_call @mosaic_gpu"
CUDNN_ATTENTION = "__cudnn$fmha"


def _seed() -> int:
    # Fresh inputs every run; the seed is in every failure message to replay it.
    return int(np.random.SeedSequence().entropy % 2**31)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _f32(tree):
    return jax.tree.map(lambda a: a.astype(jnp.float32), tree)


def _lowered(fn, *args) -> str:
    return jax.jit(fn).lower(*args).as_text()


# ---- RMSNorm and its fused variants ----------------------------------------------------------

EPS = 1e-5


def _norm(variant: str, impl: str):
    """The variant as f(x, residual, weight) -> tuple of outputs."""
    if variant == "rms_norm":
        return lambda x, r, w: (rms_norm(x, w, EPS, impl=impl),)
    if variant == "add_rms_norm":
        return lambda x, r, w: add_rms_norm(x, r, w, EPS, impl=impl)
    return lambda x, r, w: rms_norm_tee(x, w, EPS, impl=impl)


def _fwd_bwd(fn):
    def run(x, r, w, cts):
        out, vjp = jax.vjp(fn, x, r, w)
        return out, vjp(tuple(cts[: len(out)]))

    return run


def rms_norm_errors(variant: str, shape: tuple[int, int], seed: int) -> dict[str, float]:
    """Relative errors of the Pallas variant's outputs and gradients against the reference in
    fp32 on the same values."""
    k = jax.random.split(jax.random.key(seed), 5)
    x = (2.0 * jax.random.normal(k[0], shape)).astype(jnp.bfloat16)
    r = jax.random.normal(k[1], shape).astype(jnp.bfloat16)
    w = (1 + 0.2 * jax.random.normal(k[2], shape[-1:])).astype(jnp.bfloat16)
    cts = tuple(jax.random.normal(ki, shape).astype(jnp.bfloat16) for ki in k[3:])
    got = jax.jit(_fwd_bwd(_norm(variant, "pallas")))(x, r, w, cts)
    # The referee: the sum rounded to bf16 as both implementations round it, then fp32.
    x_ref, r_ref = (x + r, jnp.zeros_like(r)) if variant == "add_rms_norm" else (x, r)
    want = jax.jit(_fwd_bwd(_norm(variant, "xla")))(*_f32((x_ref, r_ref, w, cts)))
    names = ["y", "sum" if variant == "add_rms_norm" else "x", "dx", "dresidual", "dw"]
    if variant == "rms_norm":
        names.remove("x")
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert all(g.dtype == jnp.bfloat16 for g in got)
    return {n: _rel(g, r_) for n, g, r_ in zip(names, got, want, strict=True)}


@pytest.mark.parametrize("variant", ["rms_norm", "add_rms_norm", "rms_norm_tee"])
@pytest.mark.parametrize("hidden", [896, 2048, 4096])  # qwen2.5-0.5b; llama-3.2-1b; llama-3.1-8b
def test_rms_norm_kernels_match_the_reference(variant, hidden):
    seed = _seed()
    errors = rms_norm_errors(variant, (TOKENS, hidden), seed)
    assert max(errors.values()) < BF16_TOL, f"{errors} (seed {seed})"
    # The Triton kernels ran: the forward and the backward one.
    x = jax.ShapeDtypeStruct((TOKENS, hidden), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((hidden,), jnp.bfloat16)
    cts = (x, x)
    text = _lowered(_fwd_bwd(_norm(variant, "pallas")), x, x, w, cts)
    assert text.count(TRITON) == 2


# ---- LM head + cross-entropy (+ z-loss) ------------------------------------------------------

Z_LOSS = 1e-4


def _lm_head_inputs(n: int, d: int, v: int, seed: int, far_loss: float = 0.0):
    """far_loss: token 0's logits stretched until its target, the least likely, costs that."""
    k = jax.random.split(jax.random.key(seed), 5)
    h = jax.random.normal(k[0], (n, d)).astype(jnp.bfloat16)
    # Logits of a few units, as a trained head gives: a softmax neither flat nor one-hot.
    w = (jax.random.normal(k[1], (d, v)) * (3.0 / np.sqrt(d))).astype(jnp.bfloat16)
    mask = jax.random.uniform(k[2], (n,)) < 0.75
    targets = jax.random.randint(k[3], (n,), 0, v)
    garbage = jax.random.randint(k[4], (n,), -(2**30), 2**30)  # masked out: never read
    if far_loss:
        logits = h[0].astype(jnp.float32) @ w.astype(jnp.float32)
        h = h.at[0].multiply((far_loss / (logits.max() - logits.min())).astype(h.dtype))
        mask, targets = mask.at[0].set(True), targets.at[0].set(jnp.argmin(logits))
    return h, w, jnp.where(mask, targets, garbage), mask


def _lm_head_value_and_grad(h, w, t, m, **kw):
    def loss(h, w):
        if kw:
            return lm_head_loss(h, w, t, m, z_loss=Z_LOSS, **kw)
        return lm_head_loss_reference(h, w, t, m, z_loss=Z_LOSS)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(h, w)


def lm_head_errors(
    impl: str, n: int, d: int, v: int, seed: int, far_loss: float = 0.0
) -> dict[str, float]:
    """Relative errors of impl's objective, statistics and gradients against the reference in
    fp32 on the same values (fp32 matmuls at full precision: the products of bf16 values are
    exact there); checks that masked-out tokens get no gradient."""
    h, w, t, m = _lm_head_inputs(n, d, v, seed, far_loss)
    (obj, aux), (dh, dw) = _lm_head_value_and_grad(h, w, t, m, impl=impl)
    assert np.all(np.isfinite(np.asarray(dh, np.float32))), f"non-finite dh (seed {seed})"
    with jax.default_matmul_precision("highest"):
        (obj0, aux0), (dh0, dw0) = _lm_head_value_and_grad(*_f32((h, w)), t, m)
    assert obj.dtype == jnp.float32 and dh.dtype == dw.dtype == jnp.bfloat16
    dh_masked = np.asarray(dh, np.float32)[~np.asarray(m)]
    assert np.all(dh_masked == 0), f"masked-out tokens got a gradient (seed {seed})"
    errors = {"objective": _rel(obj, obj0)} | {k: _rel(aux[k], aux0[k]) for k in aux0}
    return errors | {"dh": _rel(dh, dh0), "dw": _rel(dw, dw0)}


def _check_lm_head(errors: dict[str, float], seed: int) -> None:
    forward = {k: e for k, e in errors.items() if k not in ("dh", "dw")}
    assert max(forward.values()) < F32_TOL, f"{errors} (seed {seed})"
    assert max(errors["dh"], errors["dw"]) < BF16_TOL, f"{errors} (seed {seed})"


HEADS = [  # (hidden, vocabulary) of presets, and what impl "mosaic" runs on them
    pytest.param(2048, 128_256, "mosaic", id="llama-3.2-1b"),
    pytest.param(4096, 128_256, "mosaic", id="llama-3.1-8b"),
    # 151,936 = 1,187 x 128: no whole pairs of Mosaic's 128-wide tiles, the Triton kernel runs
    pytest.param(896, 151_936, "pallas", id="qwen2.5-0.5b"),
    pytest.param(2048, 151_936, "pallas", id="qwen3-1.7b"),
]


@pytest.mark.parametrize("d,v,mosaic_runs", HEADS)
def test_lm_head_loss_kernels_match_the_reference(d, v, mosaic_runs):
    # "mosaic" needs a Hopper GPU (wgmma); elsewhere the Triton kernel alone is checked.
    impls = {"pallas": "pallas"} | ({"mosaic": mosaic_runs} if is_hopper() else {})
    seed = _seed()
    for impl, runs in impls.items():
        assert kernel_used(impl, d, v, jnp.bfloat16) == runs  # what the plan reports
        errors = lm_head_errors(impl, TOKENS, d, v, seed)
        _check_lm_head(errors, seed)
        # ... is what the program runs: its kernel once, inside the scan over token chunks (a
        # token past q's range gets its rows again from an XLA matmul, not the kernel).
        h = jax.ShapeDtypeStruct((TOKENS, d), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((d, v), jnp.bfloat16)
        t = jax.ShapeDtypeStruct((TOKENS,), jnp.int32)
        m = jax.ShapeDtypeStruct((TOKENS,), jnp.bool_)
        grad = jax.value_and_grad(
            lambda h, w, t, m, impl=impl: lm_head_loss(h, w, t, m, impl=impl)[0], (0, 1)
        )
        text = _lowered(grad, h, w, t, m)
        calls = {"mosaic": text.count(MOSAIC), "pallas": text.count(TRITON)}
        assert calls == {k: int(k == runs) for k in calls}, (impl, calls)


def test_lm_head_loss_kernels_take_tokens_past_qs_range():
    """A token whose loss (200) is past the range of q relative to its target logit gets its
    rows of q again relative to its logsumexp, and every gradient is still the reference's."""
    seed = _seed()
    for impl in ("pallas", "mosaic") if is_hopper() else ("pallas",):
        _check_lm_head(lm_head_errors(impl, TOKENS, 2048, 128_256, seed, far_loss=200.0), seed)


# ---- fp8 quantize into both layouts ----------------------------------------------------------


def quantize_mismatches(name: str, shape: tuple[int, int], seed: int) -> tuple[int, int]:
    """Bytes of the Pallas pass's (q, q^T) that differ from the reference's; checks that a
    value past the format's range saturates."""
    dtype = fp8.fp8_dtype(name)
    x = 300 * jax.random.normal(jax.random.key(seed), shape).astype(jnp.bfloat16)
    x = x.at[0, 0].set(1e6)
    scale = jnp.float32(2.0**-3)
    got = jax.jit(lambda x, s: quantize_both(x, dtype, s, impl="pallas"))(x, scale)
    want = jax.jit(lambda x, s: quantize_both(x, dtype, s, impl="xla"))(x, scale)
    assert float(got[0][0, 0].astype(jnp.float32)) == float(jnp.finfo(dtype).max)
    as_bytes = lambda a: np.asarray(a).view(np.uint8)  # noqa: E731
    return tuple(int(np.sum(as_bytes(g) != as_bytes(r))) for g, r in zip(got, want, strict=True))


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
@pytest.mark.parametrize("cols", [896, 2048, 8192])  # hidden sizes; the 1B's intermediate
def test_fp8_quantize_writes_the_reference_bytes(name, cols):
    seed = _seed()
    assert quantize_mismatches(name, (TOKENS, cols), seed) == (0, 0), f"seed {seed}"
    x = jax.ShapeDtypeStruct((TOKENS, cols), jnp.bfloat16)
    s = jax.ShapeDtypeStruct((), jnp.float32)
    dtype = fp8.fp8_dtype(name)
    text = _lowered(lambda x, s: quantize_both(x, dtype, s, impl="pallas"), x, s)
    assert text.count(TRITON) == 1


# ---- cuDNN's attention -----------------------------------------------------------------------


def _attention_fwd_bwd(implementation: str):
    def run(q, k, v, do):
        o, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, None, implementation=implementation)[0],
                         q, k, v)  # fmt: skip
        return o, *vjp(do)

    return jax.jit(run)


def attention_errors(impl: str, shape: tuple[int, int, int, int, int], seed: int) -> dict:
    """Relative errors of causal GQA attention's output and gradients through `impl` in bf16, and
    through XLA's in bf16, against XLA's in fp32 on the same values."""
    b, t, n, kv, hd = shape
    k = jax.random.split(jax.random.key(seed), 4)
    # Scores of a few units, so that each query's softmax is neither flat nor one-hot.
    q = (2.0 * jax.random.normal(k[0], (b, t, n, hd))).astype(jnp.bfloat16)
    kk = jax.random.normal(k[1], (b, t, kv, hd)).astype(jnp.bfloat16)
    v = jax.random.normal(k[2], (b, t, kv, hd)).astype(jnp.bfloat16)
    do = jax.random.normal(k[3], (b, t, n, hd)).astype(jnp.bfloat16)
    with jax.default_matmul_precision("highest"):
        want = _attention_fwd_bwd("xla")(*_f32((q, kk, v, do)))
    out = {}
    for name in (impl, "xla-bf16"):
        got = _attention_fwd_bwd(impl if name == impl else "xla")(q, kk, v, do)
        out[name] = {
            part: _rel(g, r) for part, g, r in zip(("o", "dq", "dk", "dv"), got, want, strict=True)
        }
    return out


ATTENTION = [  # (batch, tokens, query heads, kv heads, head dim) at presets' shapes
    pytest.param((2, 2048, 32, 8, 64), id="llama-3.2-1b"),
    pytest.param((2, 2048, 14, 2, 64), id="qwen2.5-0.5b"),
    pytest.param((2, 2048, 16, 8, 128), id="qwen3-1.7b"),
]


@pytest.mark.parametrize("shape", ATTENTION)
def test_cudnn_attention_matches_xla(shape):
    """cuDNN's fused attention (what `--attention=auto` runs in bf16 on a GPU) within BF16_TOL of
    fp32 attention, or at most twice as far from it as XLA's own bf16 attention."""
    assert resolve_attention("auto", jnp.bfloat16) == "cudnn"
    seed = _seed()
    errors = attention_errors("cudnn", shape, seed)
    for part, err in errors["cudnn"].items():
        bound = max(BF16_TOL, 2 * errors["xla-bf16"][part])
        assert err < bound, f"{part}: {errors} (seed {seed})"
    b, t, n, kv, hd = shape
    q = jax.ShapeDtypeStruct((b, t, n, hd), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((b, t, kv, hd), jnp.bfloat16)
    text = _attention_fwd_bwd("cudnn").lower(q, k, k, q).as_text()
    assert CUDNN_ATTENTION in text
