"""The optimizer: an optax chain (clip -> Adam with chosen moment dtypes -> masked decoupled weight
decay -> scheduled lr), the lr schedule with llmq's 1-sqrt cooldown, and non-finite step skipping.

The chain's state is an `OptState` whose `count` is the number of update calls so far, skipped ones
included, so the schedule follows the training step even after a skip; Adam's own count (its bias
correction) advances only on applied updates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxllmq.dtypes import DTYPES

if TYPE_CHECKING:  # annotations only: settings imports offload's section, and offload this
    from jaxllmq.settings import OptimConfig


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """The lr at each step, a pure jnp function of the step (it runs inside jit).

    With W = warmup, C = cooldown, N = total_steps, lr = peak, end = lr * final_lr_fraction:

    - warmup, t < W:        lr(t) = lr * t / W                     (0 at step 0)
    - base decay, p = clip((t - W) / (N - W), 0, 1):
        cosine:             base(t) = end + (lr - end) * (1 + cos(pi * p)) / 2
        linear:             base(t) = lr + (end - lr) * p
        wsd:                base(t) = lr
    - cooldown, t >= t0 = N - C (when C > 0), s = clip((t - t0) / C, 0, 1):
                            lr(t) = end + (base(t0) - end) * (1 - sqrt(s))
      i.e. base(t0) * (1 - sqrt(s)) blended with end * sqrt(s): base(t0) at t0, end at N.
    - otherwise             lr(t) = base(t)

    So lr(N) = end for every schedule (wsd reaches it only through the cooldown); steps past N
    stay at end.
    """
    if total_steps < 1:
        raise ValueError(f"the run needs at least one step (--steps), got {total_steps}")
    if cfg.warmup + cfg.cooldown > total_steps:
        raise ValueError(
            f"--warmup ({cfg.warmup}) + --cooldown ({cfg.cooldown}) must not exceed the "
            f"run's {total_steps} steps"
        )
    peak, end = cfg.lr, cfg.lr * cfg.final_lr_fraction
    warmup, cooldown, kind = cfg.warmup, cfg.cooldown, cfg.lr_schedule
    decay_steps = max(total_steps - warmup, 1)

    def base(t: jax.Array) -> jax.Array:
        p = jnp.clip((t - warmup) / decay_steps, 0.0, 1.0)
        if kind == "cosine":
            return end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * p))
        if kind == "linear":
            return peak + (end - peak) * p
        return jnp.full_like(t, peak)

    def schedule(step) -> jax.Array:
        # fp32 steps are exact up to 2**24, far past any run's length.
        t = jnp.asarray(step, jnp.float32)
        lr = base(t)
        if cooldown > 0:
            t0 = float(total_steps - cooldown)
            s = jnp.clip((t - t0) / cooldown, 0.0, 1.0)
            cool = end + (base(jnp.float32(t0)) - end) * (1.0 - jnp.sqrt(s))
            lr = jnp.where(t >= t0, cool, lr)
        if warmup > 0:
            lr = jnp.where(t < warmup, peak * t / warmup, lr)
        return lr

    return schedule


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def decay_mask(logical_axes: dict, decay_embeddings: bool = False) -> dict:
    """Which parameters get weight decay: matrices (two or more axes besides "layers"), i.e. not
    norms or biases, and not the embedding table (`embed_tokens`) unless `decay_embeddings`."""

    def decays(path, axes) -> bool:
        # Per-layer weights are stacked on "layers", so ndim alone cannot tell a matrix.
        if len([a for a in axes if a != "layers"]) < 2:
            return False
        names = {getattr(k, "key", None) for k in path}
        return decay_embeddings or "embed_tokens" not in names

    return jax.tree_util.tree_map_with_path(decays, logical_axes, is_leaf=_is_axes)


def scale_by_adam(
    b1: float, b2: float, eps: float, mu_dtype=jnp.float32, nu_dtype=jnp.float32
) -> optax.GradientTransformation:
    """Adam's scaling with first and second moments stored in their own dtypes (optax's has
    mu_dtype only). The arithmetic is fp32; the moments are rounded only when stored, and the
    update uses the unrounded fp32 moments."""

    def init(params):
        return optax.ScaleByAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree.map(lambda p: jnp.zeros_like(p, dtype=mu_dtype), params),
            nu=jax.tree.map(lambda p: jnp.zeros_like(p, dtype=nu_dtype), params),
        )

    def update(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        f32 = lambda x: x.astype(jnp.float32)
        mu = jax.tree.map(lambda g, m: b1 * f32(m) + (1.0 - b1) * f32(g), updates, state.mu)
        nu = jax.tree.map(
            lambda g, v: b2 * f32(v) + (1.0 - b2) * jnp.square(f32(g)), updates, state.nu
        )
        c1 = 1.0 - b1 ** count.astype(jnp.float32)
        c2 = 1.0 - b2 ** count.astype(jnp.float32)
        out = jax.tree.map(lambda m, v: (m / c1) / (jnp.sqrt(v / c2) + eps), mu, nu)
        mu = jax.tree.map(lambda m: m.astype(mu_dtype), mu)
        nu = jax.tree.map(lambda v: v.astype(nu_dtype), nu)
        return out, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """optax.clip_by_global_norm's arithmetic, with the norm given as `grad_norm` when known.

    optax's computes the norm of the updates it is given; the host-offloaded update (offload.py)
    applies the chain to one layer at a time and must clip by the norm of all the gradients.
    """

    def update(updates, state, params=None, *, grad_norm=None, **extra):
        del params, extra
        norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
        keep = jnp.squeeze(norm < max_norm)
        clip = lambda t: jax.lax.select(keep, t, (t / norm.astype(t.dtype)) * max_norm)
        return jax.tree.map(clip, updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update)


class OptState(NamedTuple):
    """The optimizer state: step count, non-finite-step counters, and the inner chain's state."""

    count: jax.Array  # update calls so far, skipped ones included: the schedule's step
    nonfinite_consecutive: jax.Array  # non-finite-gradient steps in a row, up to the latest
    nonfinite_total: jax.Array  # non-finite-gradient steps in the whole run
    inner: optax.OptState  # clip -> Adam -> weight decay


def make_optimizer(
    cfg: OptimConfig, total_steps: int, logical_axes: dict
) -> optax.GradientTransformation:
    """AdamW: global-norm clip, Adam with `opt_m_dtype`/`opt_v_dtype` moments,
    decoupled weight decay on matrices, scaled by -lr_schedule(count); a step whose gradients
    hold a NaN or Inf is skipped (params, moments and Adam's count unchanged) and counted. Its
    updates are then not zeros: apply them with `apply_updates`, which keeps the parameters.

    Its `update` needs `params` when weight_decay > 0. The lr the next update applies is
    `lr_schedule(cfg, total_steps)(opt_state.count)`. Given part of the gradients (one layer),
    `update` takes the whole gradients' `grad_norm` as a keyword (it decides the skip too).
    """
    schedule = lr_schedule(cfg, total_steps)
    parts = []
    if cfg.grad_clip > 0:
        parts.append(clip_by_global_norm(cfg.grad_clip))
    parts.append(
        scale_by_adam(
            cfg.beta_1,
            cfg.beta_2,
            cfg.adam_epsilon,
            DTYPES[cfg.opt_m_dtype],
            DTYPES[cfg.opt_v_dtype],
        )
    )
    if cfg.weight_decay > 0:
        mask = decay_mask(logical_axes, cfg.decay_embeddings)
        parts.append(optax.add_decayed_weights(cfg.weight_decay, mask=mask))
    inner = optax.chain(*parts)

    def init(params):
        # Three separate buffers, not one shared zero: a donated state must not alias itself.
        zero = lambda: jnp.zeros([], jnp.int32)
        return OptState(
            count=zero(),
            nonfinite_consecutive=zero(),
            nonfinite_total=zero(),
            inner=inner.init(params),
        )

    def update(grads, state: OptState, params=None, *, grad_norm=None):
        if grad_norm is None:
            grad_norm = optax.tree.norm(grads)
        # A NaN or Inf anywhere makes the norm non-finite: one reduction over the gradients
        # serves the clip and this test. (So does a norm that overflows, where the step could
        # not be taken anyway.)
        finite = jnp.isfinite(grad_norm)
        updates, new_inner = inner.update(grads, state.inner, params, grad_norm=grad_norm)
        # A select rather than lax.cond: it fuses into the elementwise Adam update, keeps the
        # donated buffers aliased, and never lets a NaN through (jnp.where does not propagate
        # the unselected branch).
        keep = lambda new, old: jnp.where(finite, new, old)
        new_inner = jax.tree.map(keep, new_inner, state.inner)
        lr = schedule(state.count)
        updates = jax.tree.map(lambda u: -lr * u, updates)
        bad = jnp.logical_not(finite).astype(jnp.int32)
        return updates, OptState(
            count=optax.safe_increment(state.count),
            nonfinite_consecutive=jnp.where(
                finite, 0, optax.safe_increment(state.nonfinite_consecutive)
            ),
            nonfinite_total=state.nonfinite_total + bad,
            inner=new_inner,
        )

    return optax.GradientTransformationExtraArgs(init, update)


def apply_updates(params, updates, opt_state: OptState):
    """The parameters after `updates`, from the `update` call that returned `opt_state`; where
    that step was skipped, the parameters as they were. A select on the parameters, not zeroed
    updates: XLA merged a zero array of each parameter's shape with the scanned backward's zeroed
    gradient stacks, which then had to be written (the 1B's default step: 2.3 GiB more at its
    peak, and 6 GiB of zeros that XLA's zero-init elimination could no longer drop)."""
    taken = opt_state.nonfinite_consecutive == 0
    new = lambda p, u: jnp.where(taken, (p + u).astype(p.dtype), p)
    return jax.tree.map(new, params, updates)


def nonfinite_counts(opt_state: OptState) -> tuple[jax.Array, jax.Array]:
    """(consecutive, total) steps skipped for non-finite gradients."""
    return opt_state.nonfinite_consecutive, opt_state.nonfinite_total


class NonFiniteError(RuntimeError):
    """Too many non-finite-gradient steps in a row: the run is diverging."""


def check_nonfinite(cfg: OptimConfig, step: int, consecutive: int, total: int) -> None:
    """Raise NonFiniteError once `consecutive` reaches --max_nonfinite (the host loop's check)."""
    if consecutive >= cfg.max_nonfinite:
        raise NonFiniteError(
            f"step {step}: {consecutive} steps in a row had non-finite gradients ({total} in the "
            f"run), reaching --max_nonfinite={cfg.max_nonfinite}; stopping. The skipped steps "
            "left the parameters untouched: resume from a checkpoint with a lower --lr, a longer "
            "--warmup or tighter --grad_clip, or check the data."
        )
