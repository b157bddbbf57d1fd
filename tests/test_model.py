"""Model config, presets (shapes via eval_shape, no memory) and the module's own invariants."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllmq.model import gemma
from jaxllmq.model.architecture import PRESETS, ModelConfig, ModelConfigError, RopeScaling, preset
from jaxllmq.model.custom_vjps import gated_activation, matmul_heads
from jaxllmq.model.families import FULL, SLIDING
from jaxllmq.model.llama import Llama, abstract_model, kinds_period, params_of

REAL_COUNTS = {
    "llama-3.2-1b": 1_235_814_400,
    "qwen2.5-0.5b": 494_032_768,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.2-3b": 3_212_749_824,
    "llama-2-7b": 6_738_415_616,
    "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-3b": 3_085_938_688,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-4b": 4_022_468_096,
    "qwen3-8b": 8_190_735_360,
    "qwen3-14b": 14_768_307_200,
    # The 1B as published; the 4B's and 12B's text decoders count 64 image tokens x D more
    # than their published text-only counts (3,880,099,328 and 11,765,788,416, over a vocab of
    # 262,144): this preset's vocab is their config.json's 262,208.
    "gemma-3-1b": 999_885_952,
    "gemma-3-4b": 3_880_099_328 + 64 * 2560,
    "gemma-3-12b": 11_765_788_416 + 64 * 3840,
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_parameter_count(name):
    _, abstract, axes = abstract_model(PRESETS[name])
    count = sum(x.size for x in jax.tree.leaves(abstract))
    assert count == PRESETS[name].num_params()
    if name in REAL_COUNTS:
        assert count == REAL_COUNTS[name]
    # Every parameter carries one logical axis name per dimension.
    shapes = jax.tree.map(lambda x: x.shape, abstract)
    names = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    assert [len(s) for s in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))] == [
        len(n) for n in names
    ]


def test_tiny_is_a_few_million_params():
    assert 1e6 < preset("tiny").num_params() < 2e7


def test_unknown_preset():
    with pytest.raises(ModelConfigError, match="unknown preset 'llama-9'.*tiny"):
        preset("llama-9")


LLAMA3_HF = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
LLAMA3_SCALING = {
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_both_rope_spellings_read_the_same():
    tf4 = dict(
        LLAMA3_HF, rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING, rope_type="llama3")
    )
    old = dict(LLAMA3_HF, rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING, type="llama3"))
    tf5 = dict(
        LLAMA3_HF, rope_parameters=dict(LLAMA3_SCALING, rope_type="llama3", rope_theta=500000.0)
    )
    a, b, c = (ModelConfig.from_hf_dict(d) for d in (tf4, old, tf5))
    assert a == b == c == preset("llama-3.2-1b")
    assert a.rope_scaling == RopeScaling("llama3", **LLAMA3_SCALING)


def test_hf_dict_round_trip():
    for name, cfg in PRESETS.items():
        assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg, name


def test_unsupported_fields_fail_clearly():
    yarn = dict(LLAMA3_HF, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ModelConfigError, match="'yarn' is not implemented"):
        ModelConfig.from_hf_dict(yarn)
    with pytest.raises(ModelConfigError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf_dict(dict(LLAMA3_HF, hidden_act="gelu"))
    with pytest.raises(ModelConfigError, match="attention_bias=true.*LlamaForCausalLM"):
        ModelConfig.from_hf_dict(dict(LLAMA3_HF, attention_bias=True))  # o_proj's bias too
    with pytest.raises(ModelConfigError, match="mlp_bias"):
        ModelConfig.from_hf_dict(dict(LLAMA3_HF, mlp_bias=True))
    with pytest.raises(ModelConfigError, match="missing required field 'vocab_size'"):
        ModelConfig.from_hf_dict({k: v for k, v in LLAMA3_HF.items() if k != "vocab_size"})
    with pytest.raises(ModelConfigError, match="multiple of num_key_value_heads"):
        dataclasses.replace(preset("tiny"), num_key_value_heads=3)


def test_flops_per_token_formula():
    cfg = preset("llama-3.2-1b")
    # 6 x (matmul params incl. the LM head: all params but the norms) + 6 L T (N H).
    matmul = cfg.num_params() - cfg.hidden_size * (2 * cfg.num_hidden_layers + 1)
    assert cfg.flops_per_token(2048) == 6 * matmul + 6 * 16 * 2048 * 2048


def test_init_scales_and_zero_proj():
    cfg = dataclasses.replace(preset("tiny"), num_hidden_layers=8)
    p = params_of(Llama(cfg, rngs=nnx.Rngs(0)))
    assert abs(float(jnp.std(p["layers"]["q_proj"])) - 0.02) < 1e-3
    assert abs(float(jnp.std(p["layers"]["down_proj"])) - 0.02 / 4) < 5e-4  # 1/sqrt(2*8)
    assert float(jnp.min(p["layers"]["input_layernorm"])) == 1.0
    z = params_of(Llama(cfg, rngs=nnx.Rngs(0), init_proj_to_zero=True))
    assert not np.any(z["layers"]["o_proj"]) and not np.any(z["layers"]["down_proj"])
    assert np.any(z["layers"]["up_proj"])


def test_bf16_compute_over_fp32_params_is_close():
    cfg = preset("tiny")
    tokens = jax.random.randint(jax.random.key(1), (2, 64), 0, cfg.vocab_size)
    f32 = Llama(cfg, rngs=nnx.Rngs(0))
    bf16 = Llama(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    assert params_of(bf16)["layers"]["q_proj"].dtype == jnp.float32
    assert bf16(tokens).dtype == jnp.bfloat16
    a, b = f32.logits(tokens), bf16.logits(tokens)
    assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a)) < 2e-2


def test_a_sliding_window_changes_only_the_positions_past_it():
    cfg = dataclasses.replace(
        preset("tiny"), architecture="MistralForCausalLM", sliding_window=16, num_hidden_layers=2
    )
    full = dataclasses.replace(cfg, sliding_window=None)
    params = params_of(Llama(cfg, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(1), (1, 40), 0, cfg.vocab_size)
    a, b = (nnx.merge(abstract_model(c)[0], params).logits(tokens) for c in (cfg, full))
    assert float(jnp.abs(a[:, :16] - b[:, :16]).max()) < 1e-5
    assert float(jnp.abs(a[:, 16:] - b[:, 16:]).max()) > 1e-3
    # MFU's attention term: each query of 40 reads 2W - W^2/T = 25.6 keys on average, not 40.
    q = cfg.num_attention_heads * cfg.dim_per_head
    saved = 6 * cfg.num_hidden_layers * q * (40 - 25.6)
    assert math.isclose(full.flops_per_token(40) - cfg.flops_per_token(40), saved)


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_qkv_input_gradient_as_one_gemm(scan, bias):
    # fuse_qkv_grads: the same loss and gradients, with q/k/v's three input-gradient GEMMs (and
    # their three weight-gradient GEMMs) each replaced by one per layer.
    biases = dict(architecture="Qwen2ForCausalLM", attention_bias=True) if bias else {}
    cfg = dataclasses.replace(preset("tiny"), num_hidden_layers=2, **biases)
    tokens = jax.random.randint(jax.random.key(2), (2, 33), 0, cfg.vocab_size)
    params = params_of(Llama(cfg, rngs=nnx.Rngs(0)))
    if bias:  # Llama initializes them to zero; nonzero ones must reach the gradients too
        params["layers"]["q_bias"] = params["layers"]["q_bias"] + 0.1

    def loss_and_grads(fuse):
        graphdef, _, _ = abstract_model(cfg, scan_layers=scan, attention="xla", fuse_qkv_grads=fuse)

        def loss(p):
            logits = nnx.merge(graphdef, p).logits(tokens[:, :-1])
            logp = jax.nn.log_softmax(logits)
            return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

        fn = jax.value_and_grad(loss)
        dots = str(jax.make_jaxpr(fn)(params)).count("dot_general")
        return jax.jit(fn)(params), dots

    (l0, g0), dots0 = loss_and_grads(False)
    (l1, g1), dots1 = loss_and_grads(True)
    assert abs(float(l0) - float(l1)) <= 2e-7 * abs(float(l0))
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        assert float(jnp.linalg.norm(a - b)) <= 1e-5 * float(jnp.linalg.norm(b)) + 1e-12
    layers_traced = 1 if scan else cfg.num_hidden_layers
    assert dots0 - dots1 == 4 * layers_traced


@pytest.mark.parametrize("act", [jax.nn.silu, gemma.gelu_tanh], ids=["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gated_activation_has_autodiffs_gradients(act, dtype):
    # Its backward recomputes act from gate: the same operations autodiff runs, so the same bits.
    keys = jax.random.split(jax.random.key(0), 3)
    gate, up, g = (jax.random.normal(k, (4, 64), jnp.float32).astype(dtype) for k in keys)
    ours = jax.vjp(lambda a, b: gated_activation(act, a, b), gate, up)
    theirs = jax.vjp(lambda a, b: act(a) * b, gate, up)
    np.testing.assert_array_equal(ours[0], theirs[0])
    for a, b in zip(ours[1](g), theirs[1](g), strict=True):
        np.testing.assert_array_equal(a, b)


def test_scanned_layers_keep_two_mlp_activations_and_no_norm_outputs(capsys):
    # A scan over layers stacks whatever a layer keeps for its backward. Of the MLP's [B, T, F]
    # arrays that is gate and up: not silu's intermediates (six arrays in all before
    # `gated_activation`: 24 of the 1B's 55 GiB at 8 x 2048 in fp32), nor their gated product.
    # Of the [B, T, D] ones, the layer's input and the residual after attention: not the two
    # norms' outputs. Scanned layers recompute the product and the norms (Recompute.for_layers).
    cfg = dataclasses.replace(preset("tiny"), num_hidden_layers=2, vocab_size=256)
    graphdef, _, _ = abstract_model(cfg, scan_layers=True, attention="xla")
    params = params_of(Llama(cfg, rngs=nnx.Rngs(0)))
    tokens = np.zeros((2, 33), np.int32)
    loss = lambda p: nnx.merge(graphdef, p).logits(tokens[:, :-1]).sum()  # noqa: E731
    jax.ad_checkpoint.print_saved_residuals(loss, params)
    saved = capsys.readouterr().out
    stacked = lambda width: f"[{cfg.num_hidden_layers},2,32,{width}] output of scan"  # noqa: E731
    assert saved.count(stacked(cfg.intermediate_size)) == 2
    assert saved.count(stacked(cfg.hidden_size)) == 2


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matmul_heads_has_autodiffs_gradients(dtype):
    # Its backward reshapes o and runs autodiff's own backward of the matmul: the same bits.
    keys = jax.random.split(jax.random.key(0), 3)
    o = jax.random.normal(keys[0], (2, 8, 4, 16), jnp.float32).astype(dtype)
    w = jax.random.normal(keys[1], (64, 32), jnp.float32).astype(dtype)
    g = jax.random.normal(keys[2], (2, 8, 32), jnp.float32).astype(dtype)
    ours = jax.vjp(matmul_heads, o, w)
    theirs = jax.vjp(lambda o, w: o.reshape(2, 8, 64) @ w, o, w)
    np.testing.assert_array_equal(ours[0], theirs[0])
    for a, b in zip(ours[1](g), theirs[1](g), strict=True):
        np.testing.assert_array_equal(a, b)


def test_kinds_period_is_the_shortest_repeat():
    local, glob = (512, True), (None, False)
    assert kinds_period([glob] * 4) == 1
    assert kinds_period(([local] * 5 + [glob]) * 4 + [local] * 2) == 6  # Gemma 3 1B's 26
    assert kinds_period([glob, local, local]) == 3  # Qwen2's max_window_layers: no repeat


def test_scanned_groups_of_layer_kinds_match_unrolled_layers(capsys):
    # Windowed and full layers alternate: scanned in two groups of two and one layer after them,
    # each with its static window. The same loss and gradients as unrolled, and no copy of any
    # layer's weights kept for the backward (the gate's [256, 768] in no stacked residual).
    cfg = dataclasses.replace(
        preset("tiny"),
        num_hidden_layers=5,
        vocab_size=256,
        sliding_window=8,
        layer_types=(SLIDING, FULL) * 2 + (SLIDING,),
    )
    params = params_of(Llama(cfg, rngs=nnx.Rngs(0)))
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (2, 25), 0, 256))
    results = []
    for scan in (True, False):
        graphdef, _, _ = abstract_model(cfg, scan_layers=scan, attention="xla")

        def loss(p, graphdef=graphdef):
            logp = jax.nn.log_softmax(nnx.merge(graphdef, p).logits(tokens[:, :-1]))
            return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

        results.append(jax.jit(jax.value_and_grad(loss))(params))
        if scan:
            jax.ad_checkpoint.print_saved_residuals(loss, params)
    (l0, g0), (l1, g1) = results
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    stacked = [line for line in capsys.readouterr().out.splitlines() if "output of scan" in line]
    assert stacked and not [line for line in stacked if "256,768]" in line]
