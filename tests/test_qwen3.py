"""Qwen3: its config.json read and written, its q/k norm weights' shardings, and SPMD training.
(Logits, import and export against transformers: test_model_hf.py; the loss over ten AdamW
steps: test_loss_parity.py.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxllmq import train_step
from jaxllmq.bench import synthetic_batch
from jaxllmq.model.architecture import ModelConfig, ModelConfigError, preset
from jaxllmq.model.llama import Llama, abstract_model, params_of
from jaxllmq.parallel.mesh import make_mesh
from jaxllmq.plan import make_plan, plan_for
from jaxllmq.settings import ModelSpec, OptimConfig

# Qwen/Qwen3-0.6B's config.json, as published (head_dim 128, where hidden / heads is 64).
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
# Two layers, head_dim 32 over hidden 64 / 4 heads: every weight divides an fsdp of 2 or 8.
TINY = dataclasses.replace(
    preset("qwen3-0.6b"),
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)
SPEC = ModelSpec(model="tiny", from_scratch=True, matmul_dtype="float32")


def test_the_published_config_reads_as_the_preset():
    cfg = ModelConfig.from_hf_dict(QWEN3_06B)
    assert cfg == preset("qwen3-0.6b")
    assert cfg.qk_norm and not cfg.attention_bias and cfg.dim_per_head == 128
    _, abstract, _ = abstract_model(cfg)
    assert abstract["layers"]["q_norm"].shape == abstract["layers"]["k_norm"].shape == (28, 128)
    assert abstract["layers"]["q_proj"].shape == (28, 1024, 2048)
    out = cfg.to_hf_dict()
    assert (out["model_type"], out["head_dim"], out["attention_bias"]) == ("qwen3", 128, False)
    no_eps = {k: v for k, v in QWEN3_06B.items() if k != "rms_norm_eps"}
    assert ModelConfig.from_hf_dict(no_eps).rms_norm_eps == 1e-6  # Qwen's default, not Llama's


def test_use_sliding_window_windows_the_layers_from_max_window_layers_on():
    windowed = dict(QWEN3_06B, use_sliding_window=True, sliding_window=4096, max_window_layers=20)
    cfg = ModelConfig.from_hf_dict(windowed)
    assert cfg.layer_windows() == (None,) * 20 + (4096,) * 8
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    # As transformers reads it: no window without use_sliding_window, none from layer 28 of 28.
    assert not any(
        ModelConfig.from_hf_dict(dict(windowed, use_sliding_window=False)).layer_windows()
    )
    assert ModelConfig.from_hf_dict(dict(windowed, max_window_layers=28)) == preset("qwen3-0.6b")


def test_what_qwen3_does_not_implement_is_refused():
    with pytest.raises(ModelConfigError, match="attention_bias=true is not supported"):
        ModelConfig.from_hf_dict(dict(QWEN3_06B, attention_bias=True))


@pytest.mark.parametrize(
    "level, params, grads, opt",
    [
        (1, P(None, None), P(None, None), P("fsdp", None)),  # ZeRO-1: the state split by layer
        (2, P(None, None), P(None, "fsdp"), P(None, "fsdp")),
        (3, P(None, "fsdp"), P(None, "fsdp"), P(None, "fsdp")),
    ],
)
def test_q_k_norms_split_over_fsdp_and_stay_whole_for_tensor(level, params, grads, opt):
    mesh = dict(data=1, fsdp=2, tensor=2)
    plan = make_plan(
        TINY, SPEC, mesh_shape=mesh, platform="cpu", device_kind="cpu", zero_level=level
    )
    for name in ("q_norm", "k_norm"):
        got = (plan.param_specs, plan.grad_specs, plan.opt_specs)
        assert tuple(s["layers"][name] for s in got) == (params, grads, opt)
        assert plan.layer_compute_specs[name] == P(None)  # each head shard uses all of it
    assert plan.layer_compute_specs["q_proj"] == P(None, "tensor")


def test_q_k_norms_through_the_pallas_kernel_as_through_xla():
    # Rows of head_dim (one per token and head): the kernel's other shape than the model's D.
    tokens = jax.random.randint(jax.random.key(3), (2, 17), 0, TINY.vocab_size)
    params = params_of(Llama(TINY, rngs=nnx.Rngs(0)))
    for name in ("q_norm", "k_norm"):  # ones would hide a weight applied to the wrong rows
        params["layers"][name] = 1 + 0.1 * jax.random.normal(jax.random.key(4), (2, 32))

    def loss_and_grads(norm_impl):
        graphdef, _, _ = abstract_model(TINY, attention="xla", norm_impl=norm_impl)
        loss = lambda p: nnx.merge(graphdef, p).logits(tokens).std()
        return jax.value_and_grad(loss)(params)

    (l0, g0), (l1, g1) = loss_and_grads("xla"), loss_and_grads("pallas")
    assert abs(float(l0) - float(l1)) <= 1e-6 * abs(float(l0))
    for name in ("q_norm", "k_norm", "q_proj"):
        a, b = g0["layers"][name], g1["layers"][name]
        assert float(jnp.linalg.norm(a - b)) <= 1e-5 * float(jnp.linalg.norm(a)), name


def _losses(gpus: int, zero_level: int = 1, tp: int = 1) -> np.ndarray:
    mesh = make_mesh(gpus, tensor_parallel=tp)
    plan = plan_for(TINY, SPEC, mesh, zero_level=zero_level)
    built = train_step.build(
        TINY, SPEC, OptimConfig(lr=3e-3), plan, mesh=mesh, total_steps=10, seed=0
    )
    state, out = built.state, []
    for _ in range(3):
        batch = jax.device_put(synthetic_batch(TINY, 2, 8, 32, seed=7), built.batch_sharding)
        state, m = built.train_step(state, batch)
        out.append(float(m["loss"]))
    return np.array(out)


def test_zero_3_with_tensor_parallelism_trains_as_one_device():
    one = _losses(1)
    np.testing.assert_allclose(_losses(8, zero_level=3, tp=2), one, rtol=2e-5)
    assert one[-1] < one[0]
