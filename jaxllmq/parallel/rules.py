"""Logical axis -> mesh axis tables. ZeRO levels and tensor parallelism are tables, not code paths.

Parameters carry logical axis names (model/llama.py). Three tables say where each logical axis
lives on the mesh for the parameters, the gradients and the optimizer state:

  ZeRO-1: optimizer state sharded over the fsdp axis; parameters and gradients replicated.
  ZeRO-2: gradients sharded too (the grad all-reduce becomes a reduce-scatter).
  ZeRO-3: parameters sharded as well (FSDP: each layer's weights gathered where they are used).

Tensor parallelism (Megatron-style) shards attention heads, the MLP hidden dim and the vocab over
the tensor axis in all three, at every level.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxllmq.parallel.mesh import FSDP, TENSOR, MeshError

# Logical axis -> mesh axis, or mesh axes (major first) that split one dimension together.
Rules = dict[str, str | tuple[str, ...]]

TENSOR_RULES: Rules = {"q_heads": TENSOR, "kv_heads": TENSOR, "mlp": TENSOR, "vocab": TENSOR}
# Every matrix has an embed (D) dimension and every norm weight a norm (D) one: sharding D over the
# fsdp axis splits every large array evenly. Qwen3's q/k norm weights ([Dh], one per layer) are
# split the same way; every tensor-parallel shard of the heads uses all of them.
ZERO_RULES: Rules = {"embed": FSDP, "norm": FSDP, "head_dim": FSDP}
# ZeRO-1's optimizer state is split on each array's leading dimension where it divides (layers;
# the embedding's vocab, each tensor-parallel shard of it): its shard of the summed (replicated)
# gradients is then a contiguous slice, and the updated parameters' all-gather concatenates whole
# rows, where an embed split needs a transpose on each side (about 4 ms of the 1B step on two
# H200s). Levels 2 and 3 keep embed: their gradients are reduce-scattered layer by layer in the
# backward, which a split by layer would turn into one all-reduce at the end. So does ZeRO-1
# when the update streams one layer at a time (host offload), where each layer must be spread
# over the devices.
ZERO1_OPT_RULES: Rules = {"vocab": (TENSOR, FSDP), **ZERO_RULES}
LAYER_SPLIT: Rules = {"layers": FSDP}
ZERO_LEVELS = (1, 2, 3)


@dataclasses.dataclass(frozen=True)
class Tables:
    """Where the parameters, gradients and optimizer state live, for one ZeRO level."""

    params: Rules
    grads: Rules
    opt: Rules


def tables(zero_level: int, streamed_update: bool = False) -> Tables:
    """The three tables for a ZeRO level; `streamed_update`: the optimizer runs one layer at a
    time (host offload)."""
    if zero_level not in ZERO_LEVELS:
        raise ValueError(f"--zero_level must be 1, 2 or 3, got {zero_level}")
    zero = lambda level: {**TENSOR_RULES, **ZERO_RULES} if zero_level >= level else TENSOR_RULES
    by_layer = {} if streamed_update else LAYER_SPLIT
    opt = {**TENSOR_RULES, **by_layer, **ZERO1_OPT_RULES} if zero_level == 1 else zero(1)
    return Tables(params=zero(3), grads=zero(2), opt=opt)


def as_axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """A rules value or PartitionSpec entry (one mesh axis, several, or None) as a tuple."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def spec(
    axes: tuple[str, ...], shape: tuple[int, ...], rules: Rules, mesh: Mesh | AbstractMesh
) -> PartitionSpec:
    """PartitionSpec for one array: each logical axis mapped by `rules`, where its size divides.

    A mesh axis is used once per array, by the first dimension that names it. Of a dimension's
    mesh axes, the longest major-first run that divides its size is used; none dividing leaves
    it whole (tensor-parallel sizes are checked up front by check_tensor_parallel, so that only
    leaves small odd-sized arrays replicated).
    """
    used, out = set(), []
    for name, size in zip(axes, shape, strict=True):
        # Axes an earlier dimension took stay with it (e.g. fsdp).
        group = [a for a in as_axes(rules.get(name)) if a not in used]
        while group and size % math.prod(mesh.shape[a] for a in group):
            group.pop()  # the major axes alone, if they divide
        used.update(group)
        out.append((group[0] if len(group) == 1 else tuple(group)) if group else None)
    return PartitionSpec(*out)


def specs(axes_tree: dict, abstract_tree: dict, rules: Rules, mesh: Mesh | AbstractMesh) -> dict:
    """PartitionSpecs for a params-shaped tree, from its logical axes and shapes."""
    is_axes = lambda x: isinstance(x, tuple)
    return jax.tree.map(
        lambda axes, x: spec(axes, x.shape, rules, mesh), axes_tree, abstract_tree, is_leaf=is_axes
    )


def check_tensor_parallel(tp: int, *, heads: int, kv_heads: int, ffn: int, vocab: int) -> None:
    """Refuse tensor-parallel sizes that do not divide the model, saying what to change."""
    if tp == 1:
        return
    bad = [
        f"{name} ({size})"
        for name, size in (
            ("num_attention_heads", heads),
            ("num_key_value_heads", kv_heads),
            ("intermediate_size", ffn),
            ("vocab_size", vocab),
        )
        if size % tp
    ]
    if bad:
        raise MeshError(
            f"--tensor_parallel={tp} does not divide {', '.join(bad)}; choose a tensor-parallel "
            "size that divides all of them"
        )


def _gathered_dim(src: PartitionSpec, dst: PartitionSpec, ndim: int) -> int | None:
    """The one dimension (not the first) whose fsdp split `dst` drops, leaving all else as `src`
    has it, with fsdp the minor-most axis of that dimension's split; else None."""

    def entries(spec: PartitionSpec) -> list[tuple[str, ...]]:
        return [as_axes(e) for e in (*spec, *[None] * (ndim - len(spec)))]

    a, b = entries(src), entries(dst)
    diff = [d for d in range(ndim) if a[d] != b[d]]
    if len(diff) != 1 or diff[0] == 0:
        return None
    d = diff[0]
    return d if a[d][-1:] == (FSDP,) and a[d][:-1] == b[d] else None


def gather_on_new_axis(tree, src: dict, dst: dict):
    """`tree` (laid out as the NamedShardings `src`) in the layout `dst`, where dst only drops the
    fsdp split of an array's non-leading dimension (ZeRO-2's updated weights, split on embed,
    becoming whole): gathered on a new leading axis, then moved into place.

    XLA's all-gather runs on the array's major dimension: gathering on embed, it wrote the update
    transposed and transposed the gathered weights back. Here the update is written in its own
    layout, the gather is contiguous, and one transposing copy puts the pieces in place (1B at
    ZeRO-2 on two H200s: fusions and copies 3.5 ms less per step, tokens/s +1.3%,
    docs/experiments/2026-11-30-multi-gpu-2.md). Other arrays are left to XLA.
    """

    def one(x, s: NamedSharding, t: NamedSharding):
        d = _gathered_dim(s.spec, t.spec, x.ndim)
        if d is None:
            return x

        def body(local):
            pieces = jax.lax.all_gather(local, FSDP, axis=0, tiled=False)  # [fsdp, *local]
            pieces = jnp.moveaxis(pieces, 0, d)
            return pieces.reshape(*local.shape[:d], -1, *local.shape[d + 1 :])

        gather = jax.shard_map(
            body, mesh=s.mesh, in_specs=s.spec, out_specs=t.spec, check_vma=False
        )
        return gather(jax.lax.with_sharding_constraint(x, s))  # the update runs split, as src

    return jax.tree.map(one, tree, src, dst)
