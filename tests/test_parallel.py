"""SPMD on 8 fake CPU devices: what each ZeRO level shards, and that it trains the same."""

import dataclasses
import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllmq import train_step
from jaxllmq.bench import synthetic_batch
from jaxllmq.model.architecture import preset
from jaxllmq.parallel import rules
from jaxllmq.parallel.mesh import batch_rows, make_mesh
from jaxllmq.plan import Plan, plan_for
from jaxllmq.settings import ModelSpec, OptimConfig

CFG = dataclasses.replace(preset("tiny"), num_hidden_layers=2, vocab_size=512)
SPEC = ModelSpec(model="tiny", from_scratch=True, matmul_dtype="float32")
OPTIM = OptimConfig(lr=3e-3, weight_decay=0.1, adam_epsilon=1e-6)
# One batch repeated: its loss must fall, and every step must match the one-device run.
BATCHES = [synthetic_batch(CFG, 2, 8, 32, seed=7)] * 4


def _build(
    gpus: int, zero_level: int = 1, tp: int = 1, kernels: str = "xla"
) -> train_step.ModelOnMesh:
    mesh = make_mesh(gpus, tensor_parallel=tp)
    plan = plan_for(CFG, dataclasses.replace(SPEC, kernels=kernels), mesh, zero_level=zero_level)
    return train_step.build(CFG, SPEC, OPTIM, plan, mesh=mesh, total_steps=10, seed=0)


_BUILT: dict = {}


def _on_8(zero_level: int, tp: int = 1) -> tuple[train_step.ModelOnMesh, jax.stages.Compiled]:
    """The model built on 8 devices and its train step compiled for BATCHES, once a module: the
    sharding, memory, HLO and loss tests read the same ones (each build and compile ~10 s)."""
    if (zero_level, tp) not in _BUILT:
        built = _build(8, zero_level, tp)
        batch = jax.device_put(BATCHES[0], built.batch_sharding)
        _BUILT[zero_level, tp] = built, built.train_step.lower(built.state, batch).compile()
    return _BUILT[zero_level, tp]


def _plan(gpus: int, zero_level: int, tp: int = 1) -> Plan:
    return plan_for(CFG, SPEC, make_mesh(gpus, tensor_parallel=tp), zero_level=zero_level)


def _device_bytes(tree) -> float:
    """Bytes held by device 0 over the total bytes of the tree."""
    leaves = [x for x in jax.tree.leaves(tree) if x.ndim > 0]
    dev0 = jax.devices()[0]
    held = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == dev0)
    return held / sum(x.nbytes for x in leaves)


@pytest.mark.parametrize(
    "zero_level, tp, params, opt",
    [(1, 1, 1.0, 1 / 8), (2, 1, 1.0, 1 / 8), (3, 1, 1 / 8, 1 / 8), (3, 2, 1 / 8, 1 / 8)],
)
def test_each_level_shards_what_it_promises(zero_level, tp, params, opt):
    built, _ = _on_8(zero_level, tp)
    assert _device_bytes(built.state.params) == pytest.approx(params, rel=1e-3)
    assert _device_bytes(built.state.opt_state) == pytest.approx(opt, rel=1e-3)
    if tp == 2:
        q = built.state.params["layers"]["q_proj"]
        assert q.sharding.spec[-1] == "tensor"  # heads split over the tensor axis
    # q/k/v's input gradient is one GEMM unless tensor parallelism splits their heads.
    assert train_step.nnx.merge(built.graphdef, built.state.params).fuse_qkv_grads == (tp == 1)


def test_gradients_shard_from_zero_2():
    _, abstract, _ = train_step.abstract_model(CFG)
    mesh = make_mesh(8)
    for level, expect in [(1, 1.0), (2, 1 / 8), (3, 1 / 8)]:
        grads = jax.tree.leaves(_plan(8, level).grad_specs, is_leaf=lambda x: isinstance(x, P))
        fraction = sum(
            np.prod(NamedSharding(mesh, s).shard_shape(x.shape))
            for s, x in zip(grads, jax.tree.leaves(abstract), strict=True)
        ) / sum(x.size for x in jax.tree.leaves(abstract))
        assert fraction == pytest.approx(expect, rel=1e-3), level


@pytest.mark.parametrize(
    "src, dst, gathered",
    [
        (P(None, "fsdp", None), P(), True),  # ZeRO-2's stacked weight, split on embed
        (P(None, ("tensor", "fsdp")), P(None, "tensor"), True),  # fsdp minor within tensor
        (P(None, ("fsdp", "tensor")), P(None, "tensor"), False),  # fsdp major: left to XLA
        (P("fsdp", None, None), P(), False),  # the leading dim: XLA's gather is contiguous
        (P(None, "fsdp", "tensor"), P(None, None, None), False),  # tensor dropped too
    ],
)
def test_the_updated_weights_are_gathered_on_a_new_leading_axis(src, dst, gathered):
    mesh = make_mesh(8, tensor_parallel=2)  # fsdp 4 x tensor 2
    x = jax.random.normal(jax.random.key(0), (8, 16, 24)[: len(src)])
    s, t = (jax.sharding.NamedSharding(mesh, spec) for spec in (src, dst))
    out = jax.jit(lambda a: rules.gather_on_new_axis(a, s, t), out_shardings=t)(
        jax.device_put(x, s)
    )
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))
    lowered = jax.jit(lambda a: rules.gather_on_new_axis(a, s, t)).lower(x).as_text()
    assert ("all_gather" in lowered) == gathered


@pytest.mark.parametrize("gpus, tp", [(2, 1), (4, 2), (8, 1)])
def test_zero_1_splits_the_optimizer_state_on_leading_dims(gpus, tp):
    """Layers (2 here) where the fsdp size divides them, else embed; the embedding by vocab."""
    opt = _plan(gpus, 1, tp).opt_specs
    fsdp_dim = lambda spec: list(spec).index("fsdp")  # gate_proj: [L, embed, mlp]
    by_layer = gpus // tp <= CFG.num_hidden_layers
    assert fsdp_dim(opt["layers"]["gate_proj"]) == (0 if by_layer else 1)
    assert opt["embed_tokens"][0] == ("tensor", "fsdp")
    # ZeRO-2 and 3 keep embed, where the backward reduce-scatters each layer's gradient.
    zero_2 = _plan(gpus, 2, tp).opt_specs
    assert fsdp_dim(zero_2["layers"]["gate_proj"]) == 1


def test_compiled_memory_falls_with_the_level():
    sizes = []
    for level in (1, 2, 3):
        mem = _on_8(level)[1].memory_analysis()
        sizes.append(mem.argument_size_in_bytes + mem.temp_size_in_bytes)
    assert sizes[0] > sizes[1] > sizes[2], sizes


def _forward_layer_scans(jaxpr) -> list:
    """The scans over layers that run forward (not reversed) and hold no loop of their own."""
    found = []
    for eqn in jaxpr.eqns:
        inner = [p.jaxpr for p in eqn.params.values() if hasattr(getattr(p, "jaxpr", None), "eqns")]
        nested = [scan for sub in inner for scan in _forward_layer_scans(sub)]
        innermost = eqn.primitive.name == "scan" and not any(
            e.primitive.name in ("scan", "while") for sub in inner for e in sub.eqns
        )
        found += nested
        if (
            innermost
            and not eqn.params["reverse"]
            and eqn.params["length"] == CFG.num_hidden_layers
        ):
            found.append(eqn)
    return found


@pytest.mark.parametrize("zero_level", [1, 3])
def test_the_scanned_forward_keeps_no_layers_weights(zero_level):
    # What a scan's forward keeps for the backward pass it stacks, a layer a step. Of the
    # layers' weights that was each one's sharding constraint (recompute.Recompute.wrap): a
    # no-op under ZeRO-1/2, but a new array all the same, and ZeRO-3's all-gather, which the
    # backward now gathers again.
    built, _ = _on_8(zero_level)
    batch = jax.device_put(BATCHES[0], built.batch_sharding)
    [forward] = _forward_layer_scans(built.train_step.trace(built.state, batch).jaxpr.jaxpr)
    weights = {x.shape for x in jax.tree.leaves(built.state.params["layers"])}
    assert not weights & {v.aval.shape for v in forward.outvars}


def _losses(built: train_step.ModelOnMesh, step=None) -> np.ndarray:
    # A copy of the initial state: the step donates its input, and a built model serves twice.
    state, out = jax.tree.map(lambda x: x.copy(), built.state), []
    for b in BATCHES:
        state, m = (step or built.train_step)(state, jax.device_put(b, built.batch_sharding))
        out.append(float(m["loss"]))
    return np.array(out)


@pytest.fixture(scope="module")
def one_device_losses() -> np.ndarray:
    return _losses(_build(1))


@pytest.mark.parametrize("zero_level, tp", [(1, 1), (2, 1), (3, 1), (3, 2)])
def test_losses_match_one_device(one_device_losses, zero_level, tp):
    sharded = _losses(*_on_8(zero_level, tp))
    np.testing.assert_allclose(sharded, one_device_losses, rtol=2e-5)
    assert sharded[-1] < sharded[0]


@pytest.mark.parametrize("impl", ["pallas", "mosaic"])
def test_pallas_loss_runs_per_device_and_trains_the_same(one_device_losses, impl):
    """The fused Pallas loss on 8 devices (ZeRO-3): inside shard_map, on each device's tokens.
    (Mosaic GPU's kernel takes bf16 only: this fp32 model shows its choice routed, on Triton.)"""
    built = _build(8, 3, kernels=f"lm_head_loss={impl}")
    batch = jax.device_put(BATCHES[0], built.batch_sharding)
    lowered = built.train_step.lower(built.state, batch)
    assert "manual_computation" in lowered.as_text()
    sharded = _losses(built, lowered.compile())
    np.testing.assert_allclose(sharded, one_device_losses, rtol=2e-5)


def test_embedding_backward_gathers_the_tokens_gradients():
    """Below the size rule the table's dense [V, D] gradient is never all-reduced: the tokens'
    gradients [B, T, D] are all-gathered instead (plan.gather_embed_below, Llama.embed)."""
    built, compiled = _on_8(1)
    hlo = compiled.as_text()
    V, D = CFG.vocab_size, CFG.hidden_size
    reduced = " ".join(re.findall(r"= (.*?) all-reduce(?:-start)?\(", hlo))
    gathered = " ".join(re.findall(r"= (.*?) all-gather(?:-start)?\(", hlo))
    assert f"[{V},{D}]" not in reduced and f"[{D},{V}]" in reduced  # the untied head's is
    assert f"[8,32,{D}]" in gathered
    assert built.plan.gather_embed_below == 2 * V
    assert _plan(8, 3).gather_embed_below == V
    assert _plan(1, 1).gather_embed_below == 0
    assert _plan(8, 1, tp=2).gather_embed_below == 0


def test_xla_loss_runs_per_device_without_tensor_parallelism():
    """Its [D, V] weight gradient is summed across devices after the cast to the compute dtype
    (shard_map), not as the fp32 product XLA's partitioner would reduce; under tensor
    parallelism (vocab split) it stays with the partitioner."""
    for tp, per_device in ((1, True), (2, False)):
        built, _ = _on_8(1, tp)
        batch = jax.device_put(BATCHES[0], built.batch_sharding)
        # The locations name the function that placed each op (other shard_maps gather weights).
        lowered = built.train_step.lower(built.state, batch).as_text(debug_info=True)
        assert ("lm_head_loss_sharded" in lowered) == per_device, tp


def test_a_batch_has_batch_size_rows_per_data_and_fsdp_device():
    assert batch_rows(make_mesh(8), 3) == 24
    assert batch_rows(make_mesh(8, tensor_parallel=2), 3) == 12  # a tensor group shares rows
    assert batch_rows(make_mesh(8, tensor_parallel=2, data_parallel=2), 3) == 12


def test_tensor_parallel_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="does not divide num_key_value_heads"):
        _build(8, 1, tp=8)


def test_a_dimension_takes_the_mesh_axes_left_to_it():
    mesh = make_mesh(8, tensor_parallel=2)  # fsdp 4 x tensor 2
    rules_ = {"vocab": ("tensor", "fsdp"), "embed": "fsdp"}
    # Tied embedding [V, D]: the vocab takes both axes; an untied head [D, V] keeps tensor on V.
    assert rules.spec(("vocab", "embed"), (512, 64), rules_, mesh) == P(("tensor", "fsdp"), None)
    assert rules.spec(("embed", "vocab"), (64, 512), rules_, mesh) == P("fsdp", "tensor")
    # A vocab that tensor divides but tensor x fsdp does not keeps tensor; fsdp goes to embed.
    assert rules.spec(("vocab", "embed"), (6, 64), rules_, mesh) == P("tensor", "fsdp")
