"""The optimizer: schedule values, weight-decay mask, AdamW numerics, moment dtypes, NaN skipping."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jaxprs import equations

from jaxllmq import optim
from jaxllmq.settings import OptimConfig

AXES = {
    "embed_tokens": ("vocab", "embed"),
    "layers": {
        "q_proj": ("layers", "embed", "q_heads"),
        "q_bias": ("layers", "q_heads"),
        "input_layernorm": ("layers", "norm"),
        "down_proj": ("layers", "mlp", "embed"),
    },
    "norm": ("norm",),
    "lm_head": ("embed", "vocab"),
}
SHAPES = {
    "embed_tokens": (16, 8),
    "layers": {
        "q_proj": (2, 8, 4),
        "q_bias": (2, 4),
        "input_layernorm": (2, 8),
        "down_proj": (2, 6, 8),
    },
    "norm": (8,),
    "lm_head": (8, 16),
}


def _tree(seed: int, scale: float = 1.0) -> dict:
    shapes, treedef = jax.tree.flatten(SHAPES, is_leaf=lambda x: isinstance(x, tuple))
    rng = np.random.default_rng(seed)
    leaves = [jnp.asarray(scale * rng.standard_normal(s), jnp.float32) for s in shapes]
    return jax.tree.unflatten(treedef, leaves)


def _jit_step(opt: optax.GradientTransformation, donate: bool = False):
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates, state), state

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())


# --- schedule ---------------------------------------------------------------------------------

N, W, C, LR, FRAC = 1000, 100, 200, 1e-3, 0.1
END = LR * FRAC
T0 = N - C


def _base(kind: str, t: float) -> float:
    p = min(max((t - W) / (N - W), 0.0), 1.0)
    if kind == "cosine":
        return END + (LR - END) * 0.5 * (1 + math.cos(math.pi * p))
    if kind == "linear":
        return LR + (END - LR) * p
    return LR


@pytest.mark.parametrize("kind", ["cosine", "linear", "wsd"])
def test_schedule_values(kind):
    cfg = OptimConfig(lr=LR, warmup=W, cooldown=C, final_lr_fraction=FRAC, lr_schedule=kind)
    sched = jax.jit(optim.lr_schedule(cfg, N))
    b0 = _base(kind, T0)
    t_mid = (W + T0) // 2  # inside the decay, before the cooldown
    t_cool = T0 + C // 4  # a quarter into the cooldown: sqrt(1/4) = 1/2 of the way
    expected = {
        0: 0.0,
        W // 2: LR / 2,
        W: LR,
        t_mid: _base(kind, t_mid),
        T0: b0,
        t_cool: b0 * 0.5 + END * 0.5,
        N: END,
        N + 50: END,
    }
    for t, want in expected.items():
        assert float(sched(t)) == pytest.approx(want, rel=1e-5, abs=1e-12), (kind, t)
    # And as a traced int32 step, as the train step calls it.
    assert float(sched(jnp.int32(W))) == pytest.approx(LR, rel=1e-6)
    if kind == "wsd":
        assert float(sched(T0 - 1)) == pytest.approx(LR)
    else:
        assert END < float(sched(t_mid)) < LR


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_schedule_without_cooldown_ends_at_fraction(kind):
    cfg = OptimConfig(lr=LR, warmup=W, final_lr_fraction=FRAC, lr_schedule=kind)
    sched = optim.lr_schedule(cfg, N)
    assert float(sched(N)) == pytest.approx(END, rel=1e-5)
    assert float(sched(W + (N - W) // 2)) == pytest.approx((LR + END) / 2, rel=1e-5)


def test_schedule_is_monotone_after_warmup():
    cfg = OptimConfig(lr=LR, warmup=W, cooldown=C, final_lr_fraction=FRAC)
    lrs = np.asarray(jax.jit(jax.vmap(optim.lr_schedule(cfg, N)))(jnp.arange(N + 1)))
    assert np.all(np.diff(lrs[: W + 1]) > 0)
    assert np.all(np.diff(lrs[W:]) <= 1e-12)


def test_schedule_rejects_too_short_run():
    cfg = OptimConfig(warmup=600, cooldown=500)
    with pytest.raises(ValueError, match="--warmup.*--cooldown"):
        optim.lr_schedule(cfg, 1000)


# --- config validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value",
    [
        ("lr", 0.0),
        ("lr", float("nan")),
        ("warmup", -1),
        ("cooldown", -5),
        ("final_lr_fraction", 1.5),
        ("lr_schedule", "step"),
        ("beta_1", 1.0),
        ("beta_2", -0.1),
        ("adam_epsilon", 0.0),
        ("weight_decay", -0.1),
        ("grad_clip", -1.0),
        ("opt_m_dtype", "float16"),
        ("opt_v_dtype", "fp8"),
        ("max_nonfinite", 0),
    ],
)
def test_bad_config_names_the_flag(field, value):
    with pytest.raises(ValueError, match=f"--{field}"):
        OptimConfig(**{field: value})


def test_wsd_fraction_needs_cooldown():
    with pytest.raises(ValueError, match="--cooldown"):
        OptimConfig(lr_schedule="wsd", final_lr_fraction=0.1)


# --- weight-decay mask ------------------------------------------------------------------------


def test_decay_mask():
    want = {
        "embed_tokens": False,
        "layers": {"q_proj": True, "q_bias": False, "input_layernorm": False, "down_proj": True},
        "norm": False,
        "lm_head": True,
    }
    assert optim.decay_mask(AXES) == want
    assert optim.decay_mask(AXES, decay_embeddings=True) == {**want, "embed_tokens": True}


# --- AdamW numerics ---------------------------------------------------------------------------


def _numpy_adamw(params, grads_seq, cfg, lrs, mask):
    """Hand-written AdamW (PyTorch's form) with global-norm clipping, on flat numpy leaves."""
    p = [np.asarray(x, np.float64) for x in params]
    m = [np.zeros_like(x) for x in p]
    v = [np.zeros_like(x) for x in p]
    for k, (grads, lr) in enumerate(zip(grads_seq, lrs, strict=True), start=1):
        g = [np.asarray(x, np.float64) for x in grads]
        norm = math.sqrt(sum(float(np.sum(x * x)) for x in g))
        if cfg.grad_clip and norm > cfg.grad_clip:
            g = [x * cfg.grad_clip / norm for x in g]
        for i in range(len(p)):
            m[i] = cfg.beta_1 * m[i] + (1 - cfg.beta_1) * g[i]
            v[i] = cfg.beta_2 * v[i] + (1 - cfg.beta_2) * g[i] ** 2
            mhat = m[i] / (1 - cfg.beta_1**k)
            vhat = v[i] / (1 - cfg.beta_2**k)
            u = mhat / (np.sqrt(vhat) + cfg.adam_epsilon)
            if mask[i]:
                u = u + cfg.weight_decay * p[i]
            p[i] = p[i] - lr * u
    return p


def test_adamw_matches_numpy():
    cfg = OptimConfig(lr=1e-2, warmup=2, weight_decay=0.1, grad_clip=1.0, beta_2=0.99)
    total = 10
    opt = optim.make_optimizer(cfg, total, AXES)
    params = _tree(0)
    # Large first gradients (norm >> 1, clipped), a small third one (norm < 1, not clipped).
    grads_seq = [_tree(1, 3.0), _tree(2, 3.0), _tree(3, 0.01)]

    step = _jit_step(opt)
    state = opt.init(params)
    p = params
    for g in grads_seq:
        p, state = step(p, state, g)
    sched = optim.lr_schedule(cfg, total)
    lrs = [float(sched(i)) for i in range(len(grads_seq))]
    assert lrs[0] == 0.0 and lrs[1] > 0
    mask = jax.tree.leaves(optim.decay_mask(AXES))
    want = _numpy_adamw(
        jax.tree.leaves(params), [jax.tree.leaves(g) for g in grads_seq], cfg, lrs, mask
    )
    for got, w in zip(jax.tree.leaves(p), want, strict=True):
        np.testing.assert_allclose(np.asarray(got), w, rtol=1e-5, atol=1e-6)
    assert int(state.count) == 3 and int(state.inner[1].count) == 3
    # Decay reached only the masked leaves: an unmasked leaf changed only by the Adam step.
    assert not np.allclose(np.asarray(p["lm_head"]), np.asarray(params["lm_head"]))


def test_no_clip_no_decay_chain():
    cfg = OptimConfig(lr=1e-3, grad_clip=0.0, weight_decay=0.0)
    opt = optim.make_optimizer(cfg, 5, AXES)
    params = _tree(0)
    grads = _tree(1, 100.0)
    updates, _ = jax.jit(opt.update)(grads, opt.init(params))  # no params needed without decay
    # First Adam step: |update| = lr * |g| / (|g| + eps) ~= lr, the size of g does not matter.
    for u in jax.tree.leaves(updates):
        np.testing.assert_allclose(np.abs(np.asarray(u)), 1e-3, rtol=1e-4)


def test_bf16_moments_track_fp32():
    base = OptimConfig(lr=1e-2, weight_decay=0.1)
    low = dataclasses.replace(base, opt_m_dtype="bfloat16", opt_v_dtype="bfloat16")
    params = _tree(0)
    results = []
    for cfg in (base, low):
        opt = optim.make_optimizer(cfg, 20, AXES)
        step = _jit_step(opt)
        p, s = params, opt.init(params)
        for i in range(10):
            p, s = step(p, s, _tree(10 + i, 0.1))
        results.append((p, s))
    (p32, s32), (p16, s16) = results
    adam32, adam16 = s32.inner[1], s16.inner[1]
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves((adam16.mu, adam16.nu)))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves((adam32.mu, adam32.nu)))
    for a, b in zip(jax.tree.leaves(adam32.mu), jax.tree.leaves(adam16.mu), strict=True):
        np.testing.assert_allclose(np.asarray(b, np.float32), a, rtol=2e-2, atol=1e-4)
    for a, b in zip(jax.tree.leaves(p32), jax.tree.leaves(p16), strict=True):
        # Ten steps of lr 1e-2 move each weight by ~0.1; bf16 moments stay within a few 1e-3.
        np.testing.assert_allclose(np.asarray(b), a, atol=5e-3)


def test_mixed_moment_dtypes():
    cfg = OptimConfig(opt_m_dtype="bfloat16", opt_v_dtype="float32")
    state = optim.make_optimizer(cfg, 5, AXES).init(_tree(0))
    adam = state.inner[1]
    assert {x.dtype for x in jax.tree.leaves(adam.mu)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(adam.nu)} == {jnp.dtype(jnp.float32)}


# --- non-finite steps -------------------------------------------------------------------------


def test_nonfinite_step_is_skipped_and_counted():
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, max_nonfinite=3)
    opt = optim.make_optimizer(cfg, 10, AXES)

    # Donated, as the train step does: the skip must not depend on the old buffers surviving.
    step = _jit_step(opt, donate=True)

    p, s = step(_tree(0), opt.init(_tree(0)), _tree(1))  # one good step: moments non-zero
    before = jax.tree.map(np.asarray, (p, s))
    bad = _tree(2)
    bad["layers"]["q_proj"] = bad["layers"]["q_proj"].at[1, 2, 3].set(jnp.nan)
    for k in (1, 2):
        p, s = step(p, s, bad)
        assert tuple(int(x) for x in optim.nonfinite_counts(s)) == (k, k)
        jax.tree.map(np.testing.assert_array_equal, (p, s.inner), (before[0], before[1].inner))
        assert int(s.count) == 1 + k  # the schedule's step still advances
    optim.check_nonfinite(cfg, 3, 2, 2)  # two in a row, below --max_nonfinite=3: go on
    with pytest.raises(optim.NonFiniteError, match="--max_nonfinite=3"):
        optim.check_nonfinite(cfg, 4, 3, 3)

    inf = _tree(3)
    inf["norm"] = inf["norm"].at[0].set(jnp.inf)
    p, s = step(p, s, inf)
    assert tuple(int(x) for x in optim.nonfinite_counts(s)) == (3, 3)
    p, s = step(p, s, _tree(4))  # a finite step resets the streak and updates again
    assert tuple(int(x) for x in optim.nonfinite_counts(s)) == (0, 3)
    assert int(s.inner[1].count) == 2
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves((p, s)))
    assert not np.allclose(np.asarray(p["lm_head"]), before[0]["lm_head"])


def test_the_step_makes_no_zero_updates():
    """A skipped step keeps the parameters by a select on them (apply_updates), not by zeroed
    updates. A zero array of a parameter's shape in the update is what XLA merged with the
    scanned backward's zeroed gradient stacks, which then had to be written in full."""
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    opt = optim.make_optimizer(cfg, 10, AXES)
    params = _tree(0)

    def step(p, s, g, norm):  # the norm given, as the train step gives it
        updates, s = opt.update(g, s, p, grad_norm=norm)
        return optim.apply_updates(p, updates, s), s

    jaxpr = jax.make_jaxpr(step)(params, opt.init(params), _tree(1), jnp.float32(2.0)).jaxpr
    shapes = {tuple(x.shape) for x in jax.tree.leaves(params)}
    zeros = [
        e
        for e in equations(jaxpr)
        if e.primitive.name == "broadcast_in_dim"
        and tuple(e.params["shape"]) in shapes
        and getattr(e.invars[0], "val", None) == 0
    ]
    assert not zeros, zeros
