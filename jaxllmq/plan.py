"""A run's plan: every choice train_step.build makes, decided before anything is built.

make_plan is a pure function of the model, its settings (ModelSpec, --kernels, --lmhead_chunks,
--zero_level) and the hardware as plain values (the mesh's axis sizes, the devices' platform,
kind and compute capability), so a plan can be made, read and tested without the devices. It
holds each choice as it will run, after every fallback; build only executes it. The trainer
prints `describe()` at start and logs `to_record()`; the benchmark reports its kernels.
"""

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from jaxllmq.kernels import KERNELS, is_hopper, resolve_impl
from jaxllmq.kernels.lm_head_loss import kernel_used
from jaxllmq.model.architecture import ModelConfig, ModelConfigError
from jaxllmq.model.attention import resolve_attention
from jaxllmq.model.llama import abstract_model, can_fuse_qkv_grads
from jaxllmq.model.recompute import Recompute
from jaxllmq.offload import DEVICE, HOST, Offload
from jaxllmq.parallel import rules
from jaxllmq.parallel.mesh import DATA, FSDP, MESH_AXES, TENSOR
from jaxllmq.settings import ModelSpec

# What each part of the train state is called in describe().
_OFFLOADED = {"master": "master weights", "opt_m": "Adam's m", "opt_v": "Adam's v"}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a run executes on its mesh: each choice as it will run."""

    mesh_shape: dict[str, int]  # data, fsdp, tensor
    platform: str  # the devices' ("gpu", "cpu")
    device_kind: str  # e.g. "NVIDIA H200"
    zero_level: int
    # Per fused kernel (kernels.KERNELS): "xla", "pallas", or for the LM-head loss "mosaic",
    # which falls back to the Triton kernel ("pallas") where its tiles do not fit the head.
    kernels: dict[str, str]
    mosaic_fallback: bool  # --kernels chose Mosaic for the LM-head loss; the Triton kernel runs
    # The LM-head loss and the fp8 quantize pass per device's tokens, under shard_map over the
    # mesh (False: one call over the whole batch, partitioned by XLA).
    loss_per_device: bool
    quantize_per_device: bool
    lmhead_chunks: int
    attention: str  # "xla", "cudnn" or "mosaic"
    # Our flash attention ("mosaic") per device's rows and heads, under shard_map over the mesh.
    attention_per_device: bool
    # Attention within each packed document, at most this many a window (None: windows are one
    # causal sequence each); cuDNN's attention takes them as segments, XLA's as a mask.
    documents_per_window: int | None
    fuse_qkv_grads: bool  # q/k/v's input gradient as one GEMM
    gather_embed_below: int  # micro-batch tokens below which the embedding backward gathers
    offload: Offload  # which parts of the train state live in pinned host memory
    recompute: Recompute  # what the backward pass recomputes (Recompute.for_layers)
    # PartitionSpecs shaped like the params: each parameter's as parameter, gradient and
    # optimizer state (the ZeRO level's tables), and each layer weight's where it is used.
    param_specs: dict
    grad_specs: dict
    opt_specs: dict
    layer_compute_specs: dict

    def describe(self) -> str:
        """A few lines for a person: mesh, kernels, shardings, offload."""
        devices = math.prod(self.mesh_shape.values())
        mesh = " x ".join(f"{axis} {size}" for axis, size in self.mesh_shape.items())
        kernels = ", ".join(f"{k} {impl}" for k, impl in self.kernels.items())
        if self.mosaic_fallback:
            kernels += " (Mosaic's tiles do not fit the LM head)"
        qkv = "fused" if self.fuse_qkv_grads else "separate"
        attention = self.attention + (" per device" if self.attention_per_device else "")
        if self.documents_per_window and self.attention == "mosaic":
            attention += f" (documents by segment ids, up to {self.documents_per_window} a window)"
        elif self.documents_per_window and self.attention == "cudnn":
            attention += f" (documents as segments, up to {self.documents_per_window} a window)"
        elif self.documents_per_window:
            attention += f" (documents by a mask, up to {self.documents_per_window} a window)"

        def split(specs: dict) -> str:
            entries = [e for s in jax.tree.leaves(specs, is_leaf=_is_spec) for e in s]
            axes = {a for e in entries for a in rules.as_axes(e) if self.mesh_shape[a] > 1}
            return f"split over {', '.join(sorted(axes))}" if axes else "replicated"

        embed = (
            f"gathers the tokens' gradients below {self.gather_embed_below} tokens a micro-batch"
            if self.gather_embed_below
            else "reduces the table's gradient"
        )
        on_host = [_OFFLOADED[k] for k, on in dataclasses.asdict(self.offload).items() if on]
        offload = f"{', '.join(on_host)} in pinned host memory" if on_host else "none"
        recompute = ", ".join(self.recompute.labels()) or "nothing"
        return "\n".join(
            [
                f"plan: {devices} {self.device_kind or self.platform} device(s), {mesh}, "
                f"ZeRO-{self.zero_level}",
                f"kernels: {kernels}; attention {attention}; q/k/v input gradients {qkv}",
                f"params {split(self.param_specs)}, gradients {split(self.grad_specs)}, "
                f"optimizer state {split(self.opt_specs)}; the embedding backward {embed}",
                f"offload: {offload}; the backward recomputes {recompute}",
            ]
        )

    def to_record(self) -> dict:
        """The plan as a JSON-able dict: PartitionSpecs as strings, per parameter."""
        record = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if not f.name.endswith("_specs") and f.name not in ("offload", "recompute")
        }
        record["recompute"] = self.recompute.labels()
        record["offload"] = {
            part: HOST if on else DEVICE for part, on in dataclasses.asdict(self.offload).items()
        }
        flat = lambda specs: jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)[0]
        shardings = {}
        for (path, param), (_, grad), (_, opt) in zip(
            flat(self.param_specs), flat(self.grad_specs), flat(self.opt_specs), strict=True
        ):
            keys = [k.key for k in path]
            group = {"params": param, "grads": grad, "opt": opt}
            if keys[0] == "layers":
                group["compute"] = self.layer_compute_specs[keys[1]]
            shardings[".".join(keys)] = {part: _spec_str(s) for part, s in group.items()}
        record["shardings"] = shardings
        return record


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def _spec_str(spec: PartitionSpec) -> str:
    """E.g. "P('fsdp', None)", "P(('tensor', 'fsdp'), None)", "P()" (replicated)."""
    return f"P({', '.join(map(repr, spec))})"


def gather_embed_below(vocab: int, mesh_shape: Mapping[str, int], zero_level: int) -> int:
    """Micro-batch size in tokens below which the embedding's backward gathers the tokens'
    gradients rather than reducing the table's dense gradient (Llama.embed).

    Per device, the gather receives (n - 1) x tokens/n x D elements for n batch devices; the
    table's reduction (n - 1)/n x V x D as a reduce-scatter (ZeRO-2/3), twice that as an
    all-reduce (ZeRO-1, gradients replicated). So: gather below V tokens, or 2V at ZeRO-1.
    Not under tensor parallelism: the vocab-split table's lookup is summed over the tensor axis,
    which for the whole batch would cost the forward pass what the backward saves (unmeasured).
    """
    if mesh_shape[DATA] * mesh_shape[FSDP] == 1 or mesh_shape[TENSOR] > 1:
        return 0
    return vocab * (2 if zero_level == 1 else 1)


def _mosaic_attention_refusal(model_cfg, dtype, platform, hopper) -> str | None:
    """Why jaxllmq's flash attention (--attention=mosaic) cannot run here, in one line (None:
    it can)."""
    if platform not in ("gpu", "cuda") or not hopper:
        where = "this GPU" if platform in ("gpu", "cuda") else platform
        return f"--attention=mosaic runs on a Hopper GPU (H100, H200) only, not on {where}"
    from jaxllmq.kernels import flash_attention  # Mosaic GPU's Pallas: where it can run only

    why = flash_attention.fits(
        model_cfg.head_dim, model_cfg.num_attention_heads, model_cfg.num_key_value_heads, dtype
    )
    return f"--attention=mosaic: the kernel does not take {why}" if why else None


def _mosaic_attention_faster(model_cfg, devices: int, documents: bool) -> bool:
    """Whether jaxllmq's flash attention, where it can run, was measured faster than cuDNN's for
    this model's attention: on one GPU (on several it runs per device, not yet timed there),
    over packed documents at every head dim it takes, and where every layer's attention is:
    causal at CAUSAL_FASTER_HEAD_DIMS, within a window no longer than FASTER_WINDOW_MAX gives for
    its head dim, within any window at ANY_WINDOW_FASTER_HEAD_DIMS."""
    from jaxllmq.kernels import flash_attention as fa  # Mosaic GPU's Pallas: where it can run

    head_dim = model_cfg.head_dim

    def faster(window: int | None) -> bool:
        if window is None:
            return head_dim in fa.CAUSAL_FASTER_HEAD_DIMS
        short = window <= fa.FASTER_WINDOW_MAX.get(head_dim, 0)
        return short or head_dim in fa.ANY_WINDOW_FASTER_HEAD_DIMS

    return devices == 1 and (documents or all(map(faster, model_cfg.layer_windows())))


def make_plan(
    model_cfg: ModelConfig,
    spec: ModelSpec,
    *,
    mesh_shape: Mapping[str, int],
    platform: str,
    device_kind: str = "",
    compute_capability: str = "",
    zero_level: int = 1,
    documents_per_window: int | None = None,
) -> Plan:
    """The plan for `model_cfg` and `spec` on a mesh of `mesh_shape` (data, fsdp, tensor) of
    `platform` devices (`compute_capability` "9.x": Hopper GPUs) at `zero_level`, with packed
    documents kept apart (up to `documents_per_window` a window) or not. Refuses a tensor-parallel size that
    does not divide the model, and a ZeRO level that does not exist."""
    shape = {axis: int(mesh_shape[axis]) for axis in MESH_AXES}
    devices, tp = math.prod(shape.values()), shape[TENSOR]
    rules.check_tensor_parallel(
        tp,
        heads=model_cfg.num_attention_heads,
        kv_heads=model_cfg.num_key_value_heads,
        ffn=model_cfg.intermediate_size,
        vocab=model_cfg.vocab_size,
    )
    tables = rules.tables(zero_level, streamed_update=spec.offload.any)
    hopper = is_hopper(compute_capability)
    chosen = {
        k: resolve_impl(
            spec.kernels,
            k,
            platform=platform,
            num_devices=devices,
            tensor_parallel=tp,
            hopper=hopper,
        )
        for k in KERNELS
    }
    dtype = jnp.dtype(spec.compute_dtype)  # the compute dtype: the LM head's and attention's
    head = kernel_used(chosen["lm_head_loss"], model_cfg.hidden_size, model_cfg.vocab_size, dtype)
    run = {**chosen, "lm_head_loss": head}
    if model_cfg.is_gemma:  # its norms of (1 + w) run in fp32 in XLA only (model/gemma.py)
        run["rms_norm"] = "xla"
    # A Pallas call has no partitioning rule: on several devices it runs per device's tokens.
    per_device = lambda impl: impl in ("pallas", "mosaic") and devices > 1
    mosaic_refusal = _mosaic_attention_refusal(model_cfg, dtype, platform, hopper)
    if spec.attention == "mosaic" and mosaic_refusal:
        raise ModelConfigError(f"{mosaic_refusal}; use --attention=auto")
    attention = resolve_attention(
        spec.attention,
        dtype,
        platform=platform,
        deterministic=spec.deterministic,
        mosaic=mosaic_refusal is None,
        mosaic_faster=mosaic_refusal is None
        and _mosaic_attention_faster(model_cfg, devices, documents_per_window is not None),
    )
    mesh = AbstractMesh(tuple(shape.values()), MESH_AXES)
    _, abstract, axes = abstract_model(model_cfg, attention=attention)
    return Plan(
        mesh_shape=shape,
        platform=platform,
        device_kind=device_kind,
        zero_level=zero_level,
        kernels=run,
        mosaic_fallback=chosen["lm_head_loss"] == "mosaic" and head != "mosaic",
        # The XLA loss too, without tensor parallelism (which splits the vocab): per device, its
        # weight gradient is cast to the compute dtype before shard_map sums it across devices,
        # where XLA's partitioner reduced the fp32 product, twice the bytes.
        loss_per_device=(devices > 1 and tp == 1) or per_device(head),
        quantize_per_device=per_device(run["fp8_quantize"]),
        lmhead_chunks=spec.lmhead_chunks,
        attention=attention,
        attention_per_device=per_device(attention),
        documents_per_window=documents_per_window,
        # Not under tensor parallelism, which splits q, k and v by heads: the concatenation
        # would cross that split.
        fuse_qkv_grads=tp == 1 and can_fuse_qkv_grads(spec.linear_dtype),
        gather_embed_below=gather_embed_below(model_cfg.vocab_size, shape, zero_level),
        offload=spec.offload,
        recompute=spec.recompute.for_layers(spec.scan_layers),
        param_specs=rules.specs(axes, abstract, tables.params, mesh),
        grad_specs=rules.specs(axes, abstract, tables.grads, mesh),
        opt_specs=rules.specs(axes, abstract, tables.opt, mesh),
        # A layer's weights are used with their tensor-parallel sharding only (gathered over
        # fsdp); the stacked [L] axis dropped.
        layer_compute_specs={
            name: rules.spec(axes["layers"][name][1:], x.shape[1:], rules.TENSOR_RULES, mesh)
            for name, x in abstract["layers"].items()
        },
    )


def plan_for(
    model_cfg: ModelConfig,
    spec: ModelSpec,
    mesh: Mesh,
    *,
    zero_level: int = 1,
    documents_per_window: int | None = None,
) -> Plan:
    """make_plan for `mesh`: its axis sizes, and its first device's platform, kind and compute
    capability."""
    device = mesh.devices.flat[0]
    return make_plan(
        model_cfg,
        spec,
        mesh_shape=mesh.shape,
        platform=device.platform,
        device_kind=device.device_kind,
        compute_capability=str(getattr(device, "compute_capability", "")),
        zero_level=zero_level,
        documents_per_window=documents_per_window,
    )
