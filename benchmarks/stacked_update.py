"""The AdamW update of one stacked [L, D, F] weight whose gradient arrives layer by layer, as in
the unrolled 1B step, built several ways, each timed alone on this process's first device.

    python3 -m benchmarks.stacked_update          # GPU: the 1B's gate_proj, [16, 2048, 8192]
    python3 -m benchmarks.stacked_update --smoke    # CPU: tiny shapes

The unrolled forward splits each stacked weight once (model/llama.py), so the backward builds
the stacked gradient with one concatenate, which XLA fuses into the update. The profile shows
that fusion below the memory bandwidth. Rows:
  grads concat / grads dus: only the per-layer weight-gradient GEMMs and the stacked gradient,
      built by the split's own transpose (a concatenate) or by a custom VJP that writes each
      layer into a zero buffer with dynamic_update_slice (in place);
  update alone: jaxllmq's optimizer (bf16 moments, clipping, weight decay) on a gradient that
      is already stacked, the floor for the update;
  step concat / step dus: gradients and update together, the stacked weight differentiated;
  step per layer: each layer's slice differentiated and updated on its own (unstack below),
      the updated slices, moments included, stacked back; or written in place (dynamic update
      slices into the donated buffers);
  step unstacked: the weight kept as L arrays, one a layer, with its moments: each layer's
      gradient updates its own arrays, with nothing to stack (the floor for storage by layer).
"""

import functools

import jax
import jax.numpy as jnp
from absl import app, flags

from jaxllmq import optim
from jaxllmq.bench import time_calls
from jaxllmq.cli import flags as cli_flags

_smoke = flags.DEFINE_bool("smoke", False, "CPU: tiny shapes.")
_reps = flags.DEFINE_integer("reps", 20, "Calls per timed batch (the median of 5 batches).")

LAYERS = "layers"  # the params' key whose arrays are stacked over the layers (model/llama.py)


def _under_layers(path) -> bool:
    return any(isinstance(k, jax.tree_util.DictKey) and k.key == LAYERS for k in path)


def unstack(tree, num_layers: int):
    """`tree` with every array under a "layers" key replaced by the list of its L slices."""

    def split(path, x):
        if not _under_layers(path):
            return x
        if x.shape[:1] != (num_layers,):
            raise ValueError(
                f"unstack: {jax.tree_util.keystr(path)} has shape {x.shape}, "
                f"not [{num_layers}, ...]"
            )
        return [p[0] for p in jnp.split(x, num_layers)]

    return jax.tree_util.tree_map_with_path(split, tree)


def restack(tree, into=None):
    """unstack's inverse: every list of per-layer arrays under a "layers" key stacked on axis 0;
    with `into` (the stacked tree, donated) written into its arrays layer by layer, in place."""

    def stack(path, x, *old):
        if not (isinstance(x, list) and _under_layers(path)):
            return x
        if not old:
            return jnp.stack(x)
        out = old[0]
        for i, layer in enumerate(x):
            out = jax.lax.dynamic_update_index_in_dim(out, layer.astype(out.dtype), i, 0)
        return out

    is_list = lambda x: isinstance(x, list)
    if into is None:
        return jax.tree_util.tree_map_with_path(stack, tree, is_leaf=is_list)
    return jax.tree_util.tree_map_with_path(stack, tree, into, is_leaf=is_list)


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


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    layers, d, f, m = (4, 64, 256, 32) if _smoke.value else (16, 2048, 8192, 1024)
    cfg = optim.OptimConfig(
        lr=1e-4, weight_decay=0.1, opt_m_dtype="bfloat16", opt_v_dtype="bfloat16"
    )
    opt = optim.make_optimizer(cfg, 1000, {"layers": {"w": ("layers", "embed", "mlp")}})
    k = jax.random.split(jax.random.key(0), 3)
    w0 = (jax.random.normal(k[0], (layers, d, f)) * 0.02).astype(jnp.bfloat16)
    params = {"layers": {"w": w0}}
    x = jax.random.normal(k[1], (m, d), jnp.bfloat16)
    r = (jax.random.normal(k[2], (layers, m, f)) * 1e-3).astype(jnp.bfloat16)

    # x and r are arguments of every jitted function: closed over, they are constants, and XLA
    # constant-folds the weight gradients (x^T r does not depend on w).
    def grads(params, data, splitter):
        x, r = data

        def loss(params):
            ws = splitter(params["layers"]["w"])
            return sum(jnp.sum((x @ w).astype(jnp.float32) * r[i]) for i, w in enumerate(ws))

        return jax.grad(loss)(params)

    def update(params, state, g):
        u, state = opt.update(g, state, params)
        return jax.tree.map(lambda p, d: (p + d).astype(p.dtype), params, u), state

    def step(params, state, data, splitter):
        return update(params, state, grads(params, data, splitter))

    def step_per_layer(params, state, data, in_place=False):
        x, r = data

        def loss(views):
            ws = views["layers"]["w"]
            return sum(jnp.sum((x @ w).astype(jnp.float32) * r[i]) for i, w in enumerate(ws))

        views = unstack(params, layers)
        old_state = state
        g = jax.grad(loss)(views)
        u, state = opt.update(g, unstack(state, layers), views)
        views = jax.tree.map(lambda p, d: (p + d).astype(p.dtype), views, u)
        if in_place:
            return restack(views, params), restack(state, old_state)
        return restack(views), restack(state)

    def step_unstacked(views, view_state, data):
        x, r = data

        def loss(views):
            ws = views["layers"]["w"]
            return sum(jnp.sum((x @ w).astype(jnp.float32) * r[i]) for i, w in enumerate(ws))

        u, view_state = opt.update(jax.grad(loss)(views), view_state, views)
        return jax.tree.map(lambda p, d: (p + d).astype(p.dtype), views, u), view_state

    def time_ms(f, *operands, donate=()) -> float:
        """Median ms per call (bench.time_calls). Donated operands are fresh copies, replaced by
        the outputs after each call, so the calls still go back to back."""
        fj = jax.jit(f, donate_argnums=donate)
        ops = [jax.tree.map(jnp.copy, a) if i in donate else a for i, a in enumerate(operands)]

        def call():
            out = fj(*ops)
            for i, o in zip(donate, out if donate else (), strict=True):
                ops[i] = o
            return out

        return 1e3 * time_calls(call, calls=_reps.value)

    state = opt.init(params)
    data = (x, r)
    g0 = jax.jit(functools.partial(grads, splitter=split_concat))(params, data)
    rows = [
        ("grads concat", time_ms(functools.partial(grads, splitter=split_concat), params, data)),
        ("grads dus", time_ms(functools.partial(grads, splitter=split_dus), params, data)),
        ("update alone", time_ms(update, params, state, g0, donate=(0, 1))),
        (
            "step concat (jaxllmq)",
            time_ms(
                functools.partial(step, splitter=split_concat), params, state, data, donate=(0, 1)
            ),
        ),
        (
            "step dus",
            time_ms(
                functools.partial(step, splitter=split_dus), params, state, data, donate=(0, 1)
            ),
        ),
        ("step per layer", time_ms(step_per_layer, params, state, data, donate=(0, 1))),
        (
            "step per layer, in place",
            time_ms(
                functools.partial(step_per_layer, in_place=True), params, state, data, donate=(0, 1)
            ),
        ),
        (
            "step unstacked",
            time_ms(
                step_unstacked,
                unstack(params, layers),
                unstack(state, layers),
                data,
                donate=(0, 1),
            ),
        ),
    ]
    # The per-layer step computes what the stacked one does (up to the gradient norm's
    # summation order).
    p1, s1 = jax.jit(functools.partial(step, splitter=split_concat))(params, state, data)
    p2, s2 = jax.jit(functools.partial(step_per_layer, in_place=True))(params, state, data)
    diff = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
    print("per layer vs stacked, largest difference:", max(jax.tree.leaves(
        jax.tree.map(diff, (p1, s1), (p2, s2)))))  # fmt: skip
    gb = layers * d * f * 2 * 7 / 1e9  # bf16 param, m, v read and written, gradient read
    print(f"[{layers}, {d}, {f}] bf16; the update moves {gb:.2f} GB")
    for name, ms in rows:
        print(f"{name:24s} {ms:8.3f} ms")


if __name__ == "__main__":
    app.run(main, flags_parser=cli_flags.parse_argv)
