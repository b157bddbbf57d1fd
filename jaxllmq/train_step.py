"""TrainState, the jitted train and eval steps, and build(): the state born sharded on the mesh.

The host loop that drives them is trainer.py."""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.experimental.layout import Layout, with_layout_constraint
from jax.sharding import NamedSharding, PartitionSpec

from jaxllmq import xla_flags
from jaxllmq.dtypes import DTYPES
from jaxllmq.kernels.fp8_quantize import Quantizer
from jaxllmq.kernels.lm_head_loss import lm_head_loss, lm_head_loss_sharded
from jaxllmq.model import fp8_delayed, hf
from jaxllmq.model.architecture import ModelConfig
from jaxllmq.model.llama import Llama, abstract_model, params_of
from jaxllmq.offload import Streams, check_supported, place_opt, place_params
from jaxllmq.optim import (
    apply_updates,
    lr_schedule,
    make_optimizer,
    nonfinite_counts,
)
from jaxllmq.parallel import rules
from jaxllmq.parallel.mesh import BATCH_AXES, batch_sharding, replicated
from jaxllmq.plan import Plan
from jaxllmq.settings import ModelSpec, OptimConfig


@flax.struct.dataclass
class TrainState:
    """Everything the step updates: a pytree, donated to each step."""

    step: jax.Array
    params: dict
    opt_state: Any
    # --fp8_scaling=delayed: the block linears' amax histories (model/fp8_delayed.py), stacked
    # [L, A] like the params, replicated; empty otherwise.
    fp8: dict = flax.struct.field(default_factory=dict)


# inputs, targets: int32 [acc, B, T]; loss_mask: bool [acc, B, T]; with --document_masking
# also segment_ids, positions: int32 [acc, B, T].
Batch = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class LmHeadLoss:
    """How the step computes the LM head and its loss: the kernel (`--kernels`'s lm_head_loss,
    resolved), `--lmhead_chunks`, and the mesh to run it per device under shard_map on (the
    Pallas loss on several devices; None: the whole batch in one call)."""

    impl: str = "xla"
    chunks: int = 1
    mesh: jax.sharding.Mesh | None = None

    def __call__(self, h_NxD, head_w, targets_N, mask_N, *, z_loss: float):
        """(summed objective, statistics) of lm_head_loss over the N tokens."""
        loss = lm_head_loss
        if self.mesh is not None:
            loss = functools.partial(lm_head_loss_sharded, mesh=self.mesh, token_axes=BATCH_AXES)
        return loss(
            h_NxD, head_w, targets_N, mask_N, z_loss=z_loss, impl=self.impl, chunks=self.chunks
        )


def _micro_loss(
    params: dict,
    graphdef: nnx.GraphDef,
    micro: Batch,
    *,
    loss: LmHeadLoss,
    z_loss: float,
    fp8_amax: dict | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Summed objective over one micro-batch's trained tokens, and the loss statistics."""
    model = nnx.merge(graphdef, params)
    # Packed documents (--document_masking) carry their positions and segment ids.
    h_BxTxD = model(
        micro["inputs"],
        micro.get("positions"),
        fp8_amax=fp8_amax,
        segment_ids_BxT=micro.get("segment_ids"),
    )
    B, T, D = h_BxTxD.shape
    return loss(
        h_BxTxD.reshape(B * T, D),
        model.head_weight(),
        micro["targets"].reshape(B * T),
        micro["loss_mask"].reshape(B * T),
        z_loss=z_loss,
    )


def _row_major(x: jax.Array) -> Layout:
    return Layout(major_to_minor=tuple(range(x.ndim)))


def make_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    *,
    z_loss: float = 0.0,
    loss: LmHeadLoss = LmHeadLoss(),
    grad_shardings: dict | None = None,
    streams: Streams | None = None,
    gather_params: Callable[[dict], dict] | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """The pure train step: accumulate grads over the micro-batches, normalize, update.

    grad_shardings (ZeRO-2/3): each micro-batch's gradients are constrained to these, so XLA
    reduce-scatters them instead of all-reducing, and the fp32 accumulator is sharded too.
    streams (host offload): the weights and the update stream to and from host memory.
    gather_params: the updated parameters, computed where the optimizer state lives, to where
    the parameters live (rules.gather_on_new_axis); None leaves that to XLA.
    """
    # Gradients for the params and, with delayed fp8 scaling, the reference amaxes: their
    # "gradient" is this micro-batch's amaxes (model/fp8_delayed.py).
    grad_fn = jax.value_and_grad(
        lambda params, amax, *args, **kwargs: _micro_loss(params, *args, **kwargs, fp8_amax=amax),
        argnums=(0, 1),
        has_aux=True,
    )

    def shard_grads(g):
        if grad_shardings is not None:
            g = jax.lax.with_sharding_constraint(g, grad_shardings)
        # Row-major, as the parameters are. With fp8 block linears XLA otherwise stacks the
        # per-layer weight gradients [L, K, N] as [K, L, N] (the fp8 GEMM writes [N, K]-major)
        # and the optimizer reads them transposed: pinning the layout took the 8B e4m3 step on
        # the H200 from 767 to 580 ms. In bf16 it pins the layout XLA picks anyway.
        return with_layout_constraint(g, jax.tree.map(_row_major, g))

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        weights = state.params if streams is None else streams.compute_params(state.params)
        reference = fp8_delayed.reference(state.fp8) if state.fp8 else None

        def accumulate(carry, micro):
            grads, stats, amax = carry
            (_, aux), (g, micro_amax) = grad_fn(
                weights, reference, graphdef, micro, loss=loss, z_loss=z_loss
            )
            amax = jax.tree.map(jnp.maximum, amax, micro_amax)  # the step's: max, not sum
            # Accumulate in fp32: summing bf16 micro-batch grads loses their small components.
            grads = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grads, shard_grads(g))
            stats = {
                "ce_sum": stats["ce_sum"] + aux["ce_sum"],
                "lse_sum": stats["lse_sum"] + aux["lse_sum"],
                "lse_max": jnp.maximum(stats["lse_max"], aux["lse_max"]),
            }
            return (grads, stats, amax), None

        zeros = shard_grads(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params))
        stats0 = {"ce_sum": 0.0, "lse_sum": 0.0, "lse_max": -jnp.inf}
        stats0 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), stats0)
        amax0 = jax.tree.map(jnp.zeros_like, reference)
        (grads, stats, amax), _ = jax.lax.scan(accumulate, (zeros, stats0, amax0), batch)
        # The loss is a mean over every trained token of the whole step, not of micro-batch means,
        # so accumulation and masking do not reweight tokens.
        tokens = jnp.sum(batch["loss_mask"], dtype=jnp.int32)
        denom = jnp.maximum(tokens, 1).astype(jnp.float32)
        if streams is None:
            grads = jax.tree.map(lambda g: g / denom, grads)
            norm = optax.tree.norm(grads)
            updates, opt_state = optimizer.update(
                grads, state.opt_state, state.params, grad_norm=norm
            )
            params = apply_updates(state.params, updates, opt_state)
            if gather_params is not None:
                params = gather_params(params)
        else:
            params, opt_state, norm = streams.update(grads, denom, state.opt_state, state.params)
        consecutive, total = nonfinite_counts(opt_state)
        metrics = {
            "loss": stats["ce_sum"] / denom,
            "norm": norm,
            "lr": schedule(state.step),
            "tokens": tokens,
            "lse_max": stats["lse_max"],
            "lse_mean": stats["lse_sum"] / denom,
            "nonfinite": consecutive,
            "nonfinite_total": total,
        }
        fp8 = fp8_delayed.record(state.fp8, amax) if state.fp8 else state.fp8
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, fp8=fp8)
        return new_state, metrics

    return train_step


def make_eval_step(
    graphdef: nnx.GraphDef,
    *,
    loss: LmHeadLoss = LmHeadLoss(),
    streams: Streams | None = None,
) -> Callable[[dict, Batch], tuple[jax.Array, jax.Array]]:
    """(ce_sum, tokens) over one [1, B, T] batch."""

    def eval_step(params: dict, batch: Batch) -> tuple[jax.Array, jax.Array]:
        micro = jax.tree.map(lambda x: x[0], batch)
        weights = params if streams is None else streams.compute_params(params)
        _, aux = _micro_loss(weights, graphdef, micro, loss=loss, z_loss=0.0)
        return aux["ce_sum"], jnp.sum(micro["loss_mask"], dtype=jnp.int32)

    return eval_step


def init_params(
    spec: ModelSpec, model_cfg: ModelConfig, abstract: dict, shardings: dict, seed: int
) -> dict:
    """Parameters born on device in their shardings: random init or the HF checkpoint."""
    if not spec.from_scratch:
        sharding_of = lambda key: (
            shardings[key[0]] if len(key) == 1 else shardings["layers"][key[1]]
        )
        return hf.load_hf_params(
            spec.model, model_cfg, abstract, lambda key, x: jax.device_put(x, sharding_of(key))
        )

    def init():
        model = Llama(
            model_cfg,
            rngs=nnx.Rngs(seed),
            param_dtype=DTYPES[spec.model_dtype],
            init_proj_to_zero=spec.init_proj_to_zero,
        )
        return params_of(model)

    return jax.jit(init, out_shardings=shardings)()


@dataclasses.dataclass
class ModelOnMesh:
    """A model's state on the mesh and the jitted steps over it."""

    graphdef: nnx.GraphDef
    axes: dict
    state: TrainState
    train_step: Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]
    eval_step: Callable[[dict, Batch], tuple[jax.Array, jax.Array]]
    batch_sharding: jax.sharding.Sharding
    plan: Plan  # what build executed
    # The params as device arrays in the compute dtype, for code outside the steps (sampling):
    # with --offload_master the state's params live in host memory.
    weights: Callable[[dict], dict] = lambda params: params


def build(
    model_cfg: ModelConfig,
    spec: ModelSpec,
    optim: OptimConfig,
    plan: Plan,
    *,
    mesh: jax.sharding.Mesh,
    total_steps: int,
    seed: int,
    z_loss: float = 0.0,
) -> ModelOnMesh:
    """Initialize (or import) the parameters and optimizer on the mesh; jit the steps: as `plan`
    (jaxllmq/plan.py, made for this model, spec and mesh) says.

    The training run and the benchmark both come through here, so they time the same code.
    """
    if dict(mesh.shape) != plan.mesh_shape:
        raise ValueError(f"build: a plan for a mesh of {plan.mesh_shape}, not {dict(mesh.shape)}")
    on_mesh = lambda specs: jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    per_device = lambda on: mesh if on else None
    loss = LmHeadLoss(
        plan.kernels["lm_head_loss"], plan.lmhead_chunks, per_device(plan.loss_per_device)
    )
    quantizer = Quantizer(
        plan.kernels["fp8_quantize"], per_device(plan.quantize_per_device), BATCH_AXES
    )
    model_kwargs = dict(
        param_dtype=DTYPES[spec.model_dtype],
        dtype=DTYPES[spec.compute_dtype],
        scan_layers=spec.scan_layers,
        attention=plan.attention,
        norm_impl=plan.kernels["rms_norm"],
        recompute=plan.recompute,
        linear_dtype=spec.linear_dtype,
        gradient_dtype=spec.gradient_dtype,
        fp8_quantizer=quantizer,
        fuse_qkv_grads=plan.fuse_qkv_grads,
        documents_per_window=plan.documents_per_window,
        attention_mesh=per_device(plan.attention_per_device),
        deterministic_attention=spec.deterministic,
    )
    _, abstract, axes = abstract_model(model_cfg, **model_kwargs)
    layer_compute = on_mesh(plan.layer_compute_specs)
    activations = NamedSharding(mesh, PartitionSpec(BATCH_AXES, None, None))
    graphdef, _, _ = abstract_model(
        model_cfg,
        **model_kwargs,
        constrain=lambda x: jax.lax.with_sharding_constraint(x, activations),
        # Cast before the constraint: ZeRO-3's per-layer all-gather moves compute-dtype bytes.
        # (The backward needs no hook: XLA's partitioner reduces each layer's weight gradient
        # where its GEMM produces the partial sums, scanned or unrolled, in the GEMM's dtype.)
        gather_layer=lambda p: {
            k: jax.lax.with_sharding_constraint(v.astype(model_kwargs["dtype"]), layer_compute[k])
            for k, v in p.items()
        },
        replicate=lambda x: jax.lax.with_sharding_constraint(x, replicated(mesh)),
        gather_embed_below=plan.gather_embed_below,
    )
    check_supported(mesh, plan.offload)
    # Host offload: the master weights and/or Adam's moments live in pinned host memory.
    param_shardings = place_params(on_mesh(plan.param_specs), plan.offload)
    params = init_params(spec, model_cfg, abstract, param_shardings, seed)
    optimizer = make_optimizer(optim, total_steps, axes)
    rep = replicated(mesh)
    opt_param_shardings = on_mesh(plan.opt_specs)
    opt_shardings = optax.tree_map_params(
        optimizer,
        lambda _, s: s,
        jax.eval_shape(optimizer.init, abstract),
        opt_param_shardings,
        transform_non_params=lambda _: rep,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    opt_shardings = place_opt(opt_shardings, plan.offload)
    streams = None
    if plan.offload.any:
        streams = Streams(optimizer, param_shardings, opt_shardings, model_kwargs["dtype"])
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
    fp8 = {}
    if spec.fp8_scaling == "delayed":
        # The first step's weight scales come from the weights, unless those are in host memory
        # (reading them here would move them all to the GPU at once): then they start at 1.
        fp8 = jax.jit(
            lambda layers: fp8_delayed.init_history(
                model_cfg.num_hidden_layers, spec.fp8_amax_history, layers, model_kwargs["dtype"]
            ),
            out_shardings=rep,
        )(None if plan.offload.master else params["layers"])
    # The step counter placed as the step returns it: left uncommitted, the second call's input
    # (the first's output) would differ in type and compile the step again.
    step = jax.device_put(jnp.zeros((), jnp.int32), rep)
    state = TrainState(step=step, params=params, opt_state=opt_state, fp8=fp8)
    state_sharding = TrainState(
        step=rep,
        params=param_shardings,
        opt_state=opt_shardings,
        fp8=jax.tree.map(lambda _: rep, fp8),
    )
    data_sharding = batch_sharding(mesh)
    train_step = jax.jit(
        make_train_step(
            graphdef,
            optimizer,
            lr_schedule(optim, total_steps),
            z_loss=z_loss,
            loss=loss,
            grad_shardings=on_mesh(plan.grad_specs),
            streams=streams,
            gather_params=functools.partial(
                rules.gather_on_new_axis, src=opt_param_shardings, dst=param_shardings
            ),
        ),
        in_shardings=(state_sharding, data_sharding),
        out_shardings=(state_sharding, rep),
        donate_argnums=0,
        compiler_options=xla_flags.step_options(spec.scan_layers) or None,
    )
    eval_step = jax.jit(
        make_eval_step(graphdef, loss=loss, streams=streams),
        in_shardings=(param_shardings, data_sharding),
        out_shardings=rep,
    )
    weights = jax.jit(streams.compute_params) if streams is not None else (lambda p: p)
    return ModelOnMesh(graphdef, axes, state, train_step, eval_step, data_sharding, plan, weights)
