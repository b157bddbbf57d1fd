"""The AdamW update of one stacked [L, D, F] weight whose gradient arrives layer by layer, as in
the unrolled 1B step, built three ways, each timed alone on this process's first device.

    python3 benchmarks/stacked_update.py            # GPU: the 1B's gate_proj, [16, 2048, 8192]
    python3 benchmarks/stacked_update.py --smoke    # CPU: tiny shapes

The unrolled forward splits each stacked weight once (model/llama.py), so the backward builds
the stacked gradient with one concatenate, which XLA fuses into the update. The profile shows
that fusion below the memory bandwidth. Rows:
  grads concat / grads dus: only the per-layer weight-gradient GEMMs and the stacked gradient,
      built by the split's own transpose (a concatenate) or by a custom VJP that writes each
      layer into a zero buffer with dynamic_update_slice (in place);
  update alone: jaxllmq's optimizer (bf16 moments, clipping, weight decay) on a gradient that
      is already stacked, the floor for the update;
  step concat / step dus: gradients and update together, the way the train step runs them.
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp

from jaxllmq import optim


def split_concat(w: jax.Array) -> list[jax.Array]:
    return [p[0] for p in jnp.split(w, w.shape[0])]


@jax.custom_vjp
def split_dus(w: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(split_concat(w))


def _split_dus_fwd(w):
    return split_dus(w), None


def _split_dus_bwd(_, cts):
    g = jnp.zeros((len(cts), *cts[0].shape), cts[0].dtype)
    for i, c in enumerate(cts):
        g = jax.lax.dynamic_update_slice_in_dim(g, c[None], i, 0)
    return (g,)


split_dus.defvjp(_split_dus_fwd, _split_dus_bwd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    layers, d, f, m = (4, 64, 256, 32) if args.smoke else (16, 2048, 8192, 1024)
    cfg = optim.OptimConfig(
        lr=1e-4, weight_decay=0.1, opt_m_dtype="bfloat16", opt_v_dtype="bfloat16"
    )
    opt = optim.make_optimizer(cfg, 1000, {"w": ("layers", "embed", "mlp")})
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w": (jax.random.normal(k[0], (layers, d, f)) * 0.02).astype(jnp.bfloat16)}
    x = jax.random.normal(k[1], (m, d), jnp.bfloat16)
    r = (jax.random.normal(k[2], (layers, m, f)) * 1e-3).astype(jnp.bfloat16)

    def grads(params, splitter):
        def loss(params):
            ws = splitter(params["w"])
            return sum(jnp.sum((x @ w).astype(jnp.float32) * r[i]) for i, w in enumerate(ws))

        return jax.grad(loss)(params)

    def update(params, state, g):
        u, state = opt.update(g, state, params)
        return jax.tree.map(lambda p, d: (p + d).astype(p.dtype), params, u), state

    def step(params, state, splitter):
        return update(params, state, grads(params, splitter))

    def time_ms(f, *operands, donate=()) -> float:
        """Median ms of args.reps calls after two warm-up calls. Donated operands are fresh
        copies, replaced by the outputs after each call."""
        fj = jax.jit(f, donate_argnums=donate)
        ops = [jax.tree.map(jnp.copy, a) if i in donate else a for i, a in enumerate(operands)]
        times = []
        for rep in range(2 + args.reps):
            t = time.perf_counter()
            out = jax.block_until_ready(fj(*ops))
            if rep >= 2:
                times.append(time.perf_counter() - t)
            for i, o in zip(donate, out if donate else (), strict=True):
                ops[i] = o
        return 1e3 * sorted(times)[len(times) // 2]

    state = opt.init(params)
    g0 = jax.jit(functools.partial(grads, splitter=split_concat))(params)
    rows = [
        ("grads concat", time_ms(functools.partial(grads, splitter=split_concat), params)),
        ("grads dus", time_ms(functools.partial(grads, splitter=split_dus), params)),
        ("update alone", time_ms(update, params, state, g0, donate=(0, 1))),
        (
            "step concat (jaxllmq)",
            time_ms(functools.partial(step, splitter=split_concat), params, state, donate=(0, 1)),
        ),
        (
            "step dus",
            time_ms(functools.partial(step, splitter=split_dus), params, state, donate=(0, 1)),
        ),
    ]
    gb = layers * d * f * 2 * 7 / 1e9  # bf16 param, m, v read and written, gradient read
    print(f"[{layers}, {d}, {f}] bf16; the update moves {gb:.2f} GB; median of {args.reps} calls")
    for name, ms in rows:
        print(f"{name:24s} {ms:8.3f} ms")


if __name__ == "__main__":
    main()
