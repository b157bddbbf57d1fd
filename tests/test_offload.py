"""Host offload: each switch trains to the same losses, bit for bit, with its state in host memory.

On CPU (jax 0.10) `pinned_host` is an addressable memory: the state's arrays live there and the
compiled step's arguments carry it (S(5) in the entry layout), but a device_put inside jit lowers
to nothing, so the streams' transfers are exercised as code, not as copies. The GPU side is
tests/gpu/test_gpu_training.py.
"""

import dataclasses

import jax
import numpy as np
import pytest

from jaxllmq import checkpoint, checkpoint_files, train_step
from jaxllmq.bench import synthetic_batch
from jaxllmq.model.architecture import preset
from jaxllmq.model.recompute import Recompute
from jaxllmq.offload import HOST, Offload, OffloadError, check_supported
from jaxllmq.parallel.mesh import make_mesh
from jaxllmq.plan import plan_for
from jaxllmq.settings import CheckpointConfig, ModelSpec, OptimConfig

CFG = dataclasses.replace(preset("tiny"), num_hidden_layers=2, vocab_size=512)
OPTIM = OptimConfig(lr=3e-3, weight_decay=0.1, adam_epsilon=1e-6)
BATCH = synthetic_batch(CFG, 2, 8, 32, seed=7)
ALL = Offload(master=True, opt_m=True, opt_v=True)


def _build(gpus: int = 1, zero_level: int = 1, **spec) -> train_step.ModelOnMesh:
    spec, mesh = ModelSpec(model="tiny", from_scratch=True, **spec), make_mesh(gpus)
    plan = plan_for(CFG, dataclasses.replace(spec, kernels="xla"), mesh, zero_level=zero_level)
    return train_step.build(CFG, spec, OPTIM, plan, mesh=mesh, total_steps=10, seed=0)


def _train(
    built: train_step.ModelOnMesh, steps: int = 2, state=None, step=None
) -> tuple[list, object]:
    # A copy of the initial state: the step donates its input, and a built model serves twice.
    state = state or jax.tree.map(lambda x: x.copy(), built.state)
    losses, step = [], step or built.train_step
    batch = jax.device_put(BATCH, built.batch_sharding)
    for _ in range(steps):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    return losses, state


def _kinds(tree) -> set[str]:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree) if x.ndim > 0}


def _moments(opt_state):
    adam = opt_state.inner[1]  # clip -> Adam -> decay
    return adam.mu, adam.nu


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return _train(_build())[0]


@pytest.fixture(scope="module")
def offloaded() -> train_step.ModelOnMesh:
    return _build(offload=ALL)


# Every switch, and one alone: its parameters stay on the device, its moment goes to the host.
@pytest.mark.parametrize("offload", [ALL, Offload(opt_m=True)])
def test_each_switch_trains_bit_for_bit_from_host_memory(reference, offloaded, offload):
    built = offloaded if offload == ALL else _build(offload=offload)
    mu, nu = _moments(built.state.opt_state)
    for tree, on in (
        (built.state.params, offload.master),
        (mu, offload.opt_m),
        (nu, offload.opt_v),
    ):
        assert _kinds(tree) == {HOST if on else "device"}
    batch = jax.device_put(BATCH, built.batch_sharding)
    lowered = built.train_step.lower(built.state, batch)
    assert 'mhlo.memory_kind = "pinned_host"' in lowered.as_text()
    compiled = lowered.compile()
    assert "S(5)" in compiled.as_text()  # host memory space in the entry layout
    losses, state = _train(built, step=compiled)
    assert losses == reference
    assert _kinds(state.params) == _kinds(built.state.params)  # the step keeps them there
    # What the sampler gets: device arrays; streamed from the host, the layers in bf16.
    weights = built.weights(state.params)
    assert _kinds(weights) == {"device"}
    want = "bfloat16" if offload.master else "float32"
    assert {x.dtype.name for x in jax.tree.leaves(weights["layers"])} == {want}


# Compute in fp32: on CPU a remat policy changes how XLA fuses bf16 arithmetic (rounding differs
# with and without it), offload or not; in fp32 the residual's offload is exact too.
FP32 = dict(matmul_dtype="float32")


@pytest.fixture(scope="module")
def reference_8() -> list[float]:
    """Losses on 8 devices without offload. In fp32 every ZeRO level trains to these same losses,
    bit for bit, so one reference serves each level's offloaded run."""
    return _train(_build(8, 1, recompute=Recompute(swiglu=True), **FP32))[0]


@pytest.mark.parametrize("zero_level", [1, 2, 3])
def test_every_zero_level_on_8_devices_with_every_offload(reference_8, zero_level):
    built = _build(
        8, zero_level, recompute=Recompute(swiglu=True, offload_residual=True), offload=ALL, **FP32
    )
    q = built.state.params["layers"]["q_proj"]
    assert q.sharding.memory_kind == HOST
    assert (q.sharding.spec[1] == "fsdp") == (zero_level == 3)  # ZeRO-3 shards the master
    mu = _moments(built.state.opt_state)[0]["layers"]["q_proj"]
    assert mu.sharding.memory_kind == HOST and "fsdp" in mu.sharding.spec  # sharded at any level
    jaxpr = str(built.train_step.trace(built.state, BATCH).jaxpr)
    assert "MemorySpace.Host" in jaxpr  # the residual's offload, which CPU lowers to nothing
    assert _train(built)[0] == reference_8


def test_zero_1_spreads_each_layers_state_when_the_update_streams_by_layer():
    # On the device ZeRO-1 splits its state by layer (2 layers over 2 devices here); the streamed
    # update takes one layer at a time, which must then be spread over the devices (embed).
    on_device = _moments(_build(2, 1).state.opt_state)[0]["layers"]["q_proj"]
    streamed = _moments(_build(2, 1, offload=Offload(opt_m=True)).state.opt_state)[0]
    assert on_device.sharding.spec[0] == "fsdp"
    assert streamed["layers"]["q_proj"].sharding.spec[:2] == (None, "fsdp")


def test_checkpoint_round_trip_of_host_resident_state(reference, offloaded, tmp_path):
    built = offloaded
    _, state = _train(built, steps=1)
    ckpt = checkpoint.Checkpointing(
        CheckpointConfig(checkpoint_dir=str(tmp_path)), run={}, model={}, info=print
    )
    ckpt.save(1, state, data={}, log={})
    ckpt.close()
    restored = checkpoint_files.restore_arrays(
        str(tmp_path / "1"), checkpoint_files.abstract_like(state)
    )
    assert _kinds(restored.params) == {HOST}
    assert jax.tree.map(lambda x: x.sharding, restored) == jax.tree.map(lambda x: x.sharding, state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert _train(built, steps=1, state=restored)[0] == reference[1:]


def test_a_device_without_host_memory_is_refused_naming_the_flags():
    # main.py turns OffloadError into one "error:" line; a GPU or CPU here has pinned_host.
    memory = lambda kind: type("Memory", (), {"kind": kind})()
    device = type(
        "Device", (), {"platform": "xpu", "addressable_memories": lambda self: [memory("device")]}
    )()
    mesh = type("Mesh", (), {"devices": np.array([device])})()
    check_supported(mesh, Offload())  # nothing asked for: nothing refused
    with pytest.raises(
        OffloadError, match="--offload_master, --offload_opt_v: xpu device .* has no pinned_host"
    ):
        check_supported(mesh, Offload(master=True, opt_v=True))
