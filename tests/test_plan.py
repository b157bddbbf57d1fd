"""The plan: each choice as it will run, made from plain values (no GPU needed), and executed."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxllmq import train_step
from jaxllmq.bench import synthetic_batch
from jaxllmq.kernels import KERNELS
from jaxllmq.model.architecture import preset
from jaxllmq.model.families import FULL, SLIDING
from jaxllmq.model.recompute import Recompute
from jaxllmq.offload import Offload
from jaxllmq.parallel.mesh import MeshError, make_mesh
from jaxllmq.plan import make_plan, plan_for
from jaxllmq.settings import ModelSpec, OptimConfig

TINY = dataclasses.replace(preset("tiny"), num_hidden_layers=2, vocab_size=512)
BF16 = ModelSpec(model="tiny", from_scratch=True, matmul_dtype="bfloat16")
H200 = dict(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0")
A100 = dict(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0")
CPU = dict(platform="cpu", device_kind="cpu")


def _mesh(data: int = 1, fsdp: int = 1, tensor: int = 1) -> dict[str, int]:
    return {"data": data, "fsdp": fsdp, "tensor": tensor}


def _plan(cfg=TINY, spec=BF16, mesh=None, hardware=H200, zero_level=1, **spec_fields):
    spec = dataclasses.replace(spec, **spec_fields)  # --kernels, --lmhead_chunks
    return make_plan(cfg, spec, mesh_shape=mesh or _mesh(), **hardware, zero_level=zero_level)


def test_one_hopper_gpu_runs_the_fused_kernels_and_our_attention():
    plan = _plan(preset("llama-3.2-1b"))
    assert plan.kernels == {
        "rms_norm": "pallas",
        "lm_head_loss": "mosaic",
        "fp8_quantize": "pallas",
    }
    assert not plan.mosaic_fallback and not plan.loss_per_device
    assert plan.attention == "mosaic" and plan.fuse_qkv_grads  # head dim 64
    assert plan.gather_embed_below == 0  # one device: no reduction to save
    # Not a Hopper: the Triton kernel, as chosen (no fallback).
    assert _plan(hardware=A100).kernels["lm_head_loss"] == "pallas"
    assert not _plan(hardware=A100).mosaic_fallback


@pytest.mark.parametrize(
    "cfg, spec",
    [
        (preset("qwen2.5-0.5b"), BF16),  # vocab 151,936: not a multiple of Mosaic's tile pairs
        (TINY, dataclasses.replace(BF16, matmul_dtype="float32")),  # wgmma takes 16-bit only
    ],
)
def test_mosaic_falls_back_to_triton_where_its_tiles_do_not_fit(cfg, spec):
    plan = _plan(cfg, spec)
    assert plan.kernels["lm_head_loss"] == "pallas" and plan.mosaic_fallback
    assert "Mosaic's tiles do not fit" in plan.describe()
    asked = _plan(cfg, spec, hardware=CPU, kernels="lm_head_loss=mosaic")
    assert asked.kernels["lm_head_loss"] == "pallas" and asked.mosaic_fallback


def test_attention_is_xla_when_deterministic_on_cpu_and_in_fp32():
    assert _plan().attention == "cudnn"
    deterministic = dataclasses.replace(BF16, deterministic=True)
    assert _plan(spec=deterministic, hardware=CPU).attention == "xla"
    assert _plan(spec=deterministic).attention == "mosaic"  # ours: head dim 32, padded to 64
    assert _plan(spec=dataclasses.replace(BF16, matmul_dtype="float32")).attention == "xla"
    assert _plan(hardware=CPU).attention == "xla"
    assert _plan(spec=dataclasses.replace(BF16, attention="cudnn")).attention == "cudnn"


def test_auto_picks_ours_where_every_layer_s_attention_was_measured_faster():
    at = lambda head_dim: dataclasses.replace(TINY, head_dim=head_dim)
    window = lambda cfg, w, **kw: dataclasses.replace(cfg, sliding_window=w, **kw)
    assert _plan(at(128)).attention == "mosaic"  # causal
    assert _plan(at(96)).attention == "cudnn"  # runs padded to 128: 0.95-1.00x cuDNN's speed
    assert _plan(window(at(128), 1024)).attention == "mosaic"
    assert _plan(window(at(128), 2048)).attention == "mosaic"
    assert _plan(window(at(128), 4096)).attention == "cudnn"  # 0.96x cuDNN's at 2 x 8192
    assert _plan(window(at(64), 4096)).attention == "mosaic"  # at 64 windows of any length
    assert _plan(window(at(256), 2048)).attention == "cudnn"  # not measured there
    assert _plan(window(TINY, 512)).attention == "cudnn"  # head dim 32 runs padded to 64
    # Each layer counts: causal layers beside windows of 512, or of 4096.
    mixed = lambda w: window(at(128), w, layer_types=(SLIDING, FULL))
    assert _plan(mixed(512), scan_layers=False).attention == "mosaic"
    assert _plan(mixed(4096), scan_layers=False).attention == "cudnn"
    assert _plan(window(at(128), 512), mesh=_mesh(fsdp=2)).attention == "cudnn"  # timed on one


def test_cpu_runs_xla_everywhere_with_auto():
    plan = _plan(mesh=_mesh(fsdp=8), hardware=CPU)
    assert plan.kernels == dict.fromkeys(KERNELS, "xla")
    assert plan.platform == "cpu" and plan.mesh_shape == _mesh(fsdp=8)
    # The XLA loss runs per device without tensor parallelism; no Pallas quantize pass to split.
    assert plan.loss_per_device and not plan.quantize_per_device


def test_several_gpus_and_tensor_parallelism():
    eight = _plan(mesh=_mesh(fsdp=8))
    assert eight.kernels == {"rms_norm": "xla", "lm_head_loss": "mosaic", "fp8_quantize": "pallas"}
    assert eight.loss_per_device and eight.quantize_per_device
    tp = _plan(mesh=_mesh(fsdp=4, tensor=2))
    assert tp.kernels == dict.fromkeys(KERNELS, "xla")
    assert not tp.loss_per_device and not tp.fuse_qkv_grads and tp.gather_embed_below == 0
    # Pallas asked for: per device on a data/ZeRO mesh; tensor parallelism splits the columns
    # the quantize pass's scales would span, so it stays in XLA.
    asked = _plan(mesh=_mesh(fsdp=4, tensor=2), hardware=CPU, kernels="pallas")
    assert asked.kernels == {"rms_norm": "pallas", "lm_head_loss": "pallas", "fp8_quantize": "xla"}
    assert asked.loss_per_device and not asked.quantize_per_device


def test_fp8_linears_keep_q_k_v_gradients_apart():
    assert not _plan(spec=dataclasses.replace(BF16, matmul_dtype="e4m3")).fuse_qkv_grads


@pytest.mark.parametrize(
    "level, params, grads, opt",
    [
        (1, P(None, None, "tensor"), P(None, None, "tensor"), P("fsdp", None, "tensor")),
        (2, P(None, None, "tensor"), P(None, "fsdp", "tensor"), P(None, "fsdp", "tensor")),
        (3, P(None, "fsdp", "tensor"), P(None, "fsdp", "tensor"), P(None, "fsdp", "tensor")),
    ],
)
def test_each_zero_level_places_a_layer_weight(level, params, grads, opt):
    plan = _plan(mesh=_mesh(data=2, fsdp=2), hardware=CPU, zero_level=level)
    q = lambda specs: specs["layers"]["q_proj"]  # [L, embed, q_heads]
    assert (q(plan.param_specs), q(plan.grad_specs), q(plan.opt_specs)) == (params, grads, opt)
    assert plan.layer_compute_specs["q_proj"] == P(None, "tensor")  # used whole but for tensor
    assert plan.gather_embed_below == TINY.vocab_size * (2 if level == 1 else 1)


def test_offload_moves_the_optimizer_state_by_layer_no_more():
    """A streamed update spreads each layer over the devices: ZeRO-1 splits embed, not layers."""
    spec = dataclasses.replace(BF16, offload=Offload(master=True, opt_v=True))
    plan = _plan(spec=spec, mesh=_mesh(fsdp=2), hardware=CPU)
    assert plan.opt_specs["layers"]["q_proj"] == P(None, "fsdp", "tensor")
    record = plan.to_record()
    assert record["offload"] == {"master": "pinned_host", "opt_m": "device", "opt_v": "pinned_host"}
    assert "offload: master weights, Adam's v in pinned host memory" in plan.describe()


def test_record_and_description():
    plan = _plan(mesh=_mesh(fsdp=4, tensor=2), hardware=CPU, zero_level=3, lmhead_chunks=2)
    record = json.loads(json.dumps(plan.to_record()))
    assert record["kernels"] == plan.kernels and record["zero_level"] == 3
    assert record["mesh_shape"] == {"data": 1, "fsdp": 4, "tensor": 2}
    assert record["lmhead_chunks"] == 2 and record["attention"] == "xla"
    assert record["shardings"]["layers.q_proj"] == {
        "params": "P(None, 'fsdp', 'tensor')",
        "grads": "P(None, 'fsdp', 'tensor')",
        "opt": "P(None, 'fsdp', 'tensor')",
        "compute": "P(None, 'tensor')",
    }
    assert record["shardings"]["embed_tokens"]["params"] == "P('tensor', 'fsdp')"
    assert set(record["shardings"]) >= {"embed_tokens", "norm", "lm_head", "layers.down_proj"}
    lines = plan.describe().splitlines()
    assert lines[0] == "plan: 8 cpu device(s), data 1 x fsdp 4 x tensor 2, ZeRO-3"
    assert len(lines) == 4 and "params split over fsdp, tensor" in lines[2]


def test_the_plan_names_what_the_backward_recomputes():
    # Scanned layers recompute the SwiGLU product and the norms, Gemma's too; unrolled ones what
    # the switches name (Recompute.for_layers).
    gemma = dataclasses.replace(
        preset("gemma-3-1b"), num_hidden_layers=2, layer_types=(SLIDING, FULL)
    )
    for cfg, scan, flags, recomputed in [
        (TINY, True, {}, ["norm", "swiglu"]),
        (TINY, False, {}, []),
        (TINY, False, {"att": True}, ["qkv", "att"]),
        (TINY, True, {"block": True}, ["norm", "qkv", "att", "ffn", "swiglu", "block"]),
        (gemma, True, {}, ["norm", "swiglu"]),
    ]:
        spec = dataclasses.replace(BF16, scan_layers=scan, recompute=Recompute(**flags))
        plan = _plan(cfg=cfg, spec=spec, hardware=CPU)
        assert plan.to_record()["recompute"] == recomputed, (cfg.architecture, scan, flags)
        assert plan.describe().endswith(
            f"the backward recomputes {', '.join(recomputed) or 'nothing'}"
        )


def test_a_plan_that_cannot_run_is_refused():
    with pytest.raises(MeshError, match="does not divide num_key_value_heads"):
        _plan(mesh=_mesh(tensor=8))
    with pytest.raises(ValueError, match="--zero_level must be 1, 2 or 3"):
        _plan(zero_level=4)


def test_build_executes_the_plan_it_is_given():
    """A plan made from plain values builds the same step as the mesh's own, and trains; a plan
    for another mesh is refused."""
    spec = dataclasses.replace(BF16, matmul_dtype="float32")
    mesh = make_mesh(8)
    plan = _plan(spec=spec, mesh=_mesh(fsdp=8), hardware=CPU, kernels="xla", zero_level=2)
    assert plan_for(
        TINY, dataclasses.replace(spec, kernels="xla"), mesh, zero_level=2
    ).to_record() == dict(plan.to_record(), device_kind=jax.devices()[0].device_kind)
    optim = OptimConfig(lr=3e-3)
    built = train_step.build(TINY, spec, optim, plan, mesh=mesh, total_steps=10, seed=0)
    assert built.plan is plan
    q = lambda tree: tree["layers"]["q_proj"]
    assert q(built.state.params).sharding.spec == q(plan.param_specs)
    assert q(built.state.opt_state.inner[1].mu).sharding.spec == q(plan.opt_specs)
    batch = jax.device_put(synthetic_batch(TINY, 1, 8, 32, seed=3), built.batch_sharding)
    state, losses = built.state, []
    for _ in range(3):
        state, m = built.train_step(state, batch)
        losses.append(float(m["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    with pytest.raises(ValueError, match="a plan for a mesh of"):
        train_step.build(TINY, spec, optim, plan, mesh=make_mesh(4), total_steps=10, seed=0)
