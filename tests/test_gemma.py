"""Gemma 3 (Gemma3ForCausalLM): its config.json read as the presets, float32 logits against
transformers with local layers' windows shorter than the sequence, the export transformers
loads, and the plan's choices for it. (Generation: test_generate.py; documents with windows:
test_documents.py; ten AdamW steps against PyTorch: test_loss_parity.py.)"""

import dataclasses

import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_models import hf_logits, tiny_gemma3, tiny_gemma3_image_text
from jax.sharding import PartitionSpec as P

from jaxllmq.model import hf
from jaxllmq.model.architecture import ModelConfig, ModelConfigError, RopeScaling, preset
from jaxllmq.model.llama import abstract_model, params_of
from jaxllmq.plan import make_plan
from jaxllmq.settings import ModelSpec

# google/gemma-3-1b-pt's config.json, as published (transformers 4's rope spelling).
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": 1,
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "initializer_range": 0.02,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 262144,
}
# google/gemma-3-4b-pt's text_config (its own config.json is the image-text model's), as a
# text-only Gemma3ForCausalLM.
GEMMA3_4B_TEXT = dict(
    GEMMA3_1B,
    hidden_size=2560,
    intermediate_size=10240,
    num_hidden_layers=34,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=131072,
    sliding_window=1024,
    rope_scaling={"factor": 8.0, "rope_type": "linear"},
    vocab_size=262208,
)


def test_the_published_configs_read_as_the_presets():
    one = ModelConfig.from_hf_dict(GEMMA3_1B)
    assert one == preset("gemma-3-1b")
    assert ModelConfig.from_hf_dict(GEMMA3_4B_TEXT) == preset("gemma-3-4b")
    # Every sixth layer global, the others local with their own RoPE base, unscaled.
    assert one.layer_windows()[:7] == (512,) * 5 + (None, 512)
    assert one.layer_local_rope()[:7] == (True,) * 5 + (False, True)
    assert preset("gemma-3-12b").rope_scaling == RopeScaling("linear", factor=8.0)
    # Left-out fields take Gemma 3's defaults, not Llama's.
    bare = {k: v for k, v in GEMMA3_1B.items() if k not in ("head_dim", "rms_norm_eps")}
    assert ModelConfig.from_hf_dict(bare) == one
    out = one.to_hf_dict()
    assert (out["model_type"], out["query_pre_attn_scalar"], "hidden_act" in out) == (
        "gemma3_text",
        256,
        False,
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("final_logit_softcapping", 30.0),
        ("attn_logit_softcapping", 50.0),
        ("use_bidirectional_attention", True),
        ("hidden_activation", "gelu"),
    ],
)
def test_what_gemma3_does_not_implement_is_refused(field, value):
    with pytest.raises(ModelConfigError, match=field):
        ModelConfig.from_hf_dict(dict(GEMMA3_1B, **{field: value}))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gemma3"))
    return path, tiny_gemma3(path)


def _tokens(vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(2, 29), dtype=np.int32)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_logits_match_transformers_past_the_local_window(hf_dir, scan_layers):
    path, ref = hf_dir
    model = hf.from_pretrained(path, attention="xla", scan_layers=scan_layers)
    assert model.cfg.layer_windows() == (8, 8, None, 8)  # 29 tokens: windows of 8 bite
    tokens = _tokens(model.cfg.vocab_size)
    assert np.abs(np.asarray(model.logits(tokens)) - hf_logits(ref, tokens)).max() < 1e-4


def test_the_local_layers_window_and_rope_base_are_what_matches(hf_dir):
    path, ref = hf_dir
    model = hf.from_pretrained(path, attention="xla")
    tokens = _tokens(model.cfg.vocab_size)
    for change in (dict(sliding_window=64), dict(rope_local_base_freq=1e6)):
        other = dataclasses.replace(model.cfg, **change)
        logits = nnx.merge(abstract_model(other, attention="xla")[0], params_of(model))
        assert np.abs(np.asarray(logits.logits(tokens)) - hf_logits(ref, tokens)).max() > 1e-3


def test_export_loads_in_transformers_with_the_same_logits(hf_dir, tmp_path):
    path, ref = hf_dir
    model = hf.from_pretrained(path, attention="xla")
    out = str(tmp_path / "out")
    hf.save_pretrained(out, model)
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert isinstance(again, transformers.Gemma3ForCausalLM)
    assert again.config.layer_types == ref.config.layer_types
    tokens = _tokens(model.cfg.vocab_size, seed=1)
    np.testing.assert_allclose(hf_logits(again, tokens), hf_logits(ref, tokens), atol=1e-5)
    assert hf.from_pretrained(out).cfg == model.cfg
    with torch.no_grad():
        for name, p in ref.state_dict().items():
            np.testing.assert_array_equal(again.state_dict()[name].numpy(), p.numpy(), name)


def test_an_image_text_checkpoint_trains_and_exports_its_language_model(tmp_path):
    """Gemma 3 4B/12B/27B are published image-text (Gemma3ForConditionalGeneration): their
    language model is read, its logits on text those of the whole model, and it exports alone."""
    path = str(tmp_path / "image-text")
    ref = tiny_gemma3_image_text(path)
    model = hf.from_pretrained(path, attention="xla")
    assert model.cfg.architecture == "Gemma3ForCausalLM"
    assert model.cfg.layer_windows() == (8, 8, None, 8)
    tokens = _tokens(model.cfg.vocab_size - 3)  # not its image tokens
    np.testing.assert_allclose(model.logits(tokens), hf_logits(ref, tokens), atol=1e-4)
    out = str(tmp_path / "out")
    hf.save_pretrained(out, model)
    text = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    assert isinstance(text, transformers.Gemma3ForCausalLM)
    np.testing.assert_allclose(hf_logits(text, tokens), hf_logits(ref, tokens), atol=1e-5)


def test_an_image_text_config_fills_what_its_text_config_leaves_out_as_transformers_does():
    # gemma-3-4b-pt's text_config as published: transformers' defaults fill the rest.
    sparse = {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    }
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": sparse}
    ours = ModelConfig.from_hf_dict(config)
    assert ours == ModelConfig.from_hf_dict(GEMMA3_4B_TEXT)
    theirs = transformers.Gemma3TextConfig(**sparse)
    fields = ("vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    for field in fields + ("bos_token_id", "eos_token_id"):
        assert getattr(ours, field) == getattr(theirs, field), field
    # The whole model's end-of-turn ids (the instruction-tuned configs list two) reach it.
    tuned = ModelConfig.from_hf_dict(dict(config, eos_token_id=[1, 106]))
    assert tuned.eos_token_id == [1, 106]
    bad = {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": [1]}
    with pytest.raises(ModelConfigError, match="text_config must be an object, got list"):
        ModelConfig.from_hf_dict(bad)


def test_the_plan_runs_xla_norms_and_gives_each_layer_its_window_scanned_or_not():
    h200 = dict(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0")
    one, two = ({"data": n, "fsdp": 1, "tensor": 1} for n in (1, 2))
    cfg = preset("gemma-3-1b")
    spec = ModelSpec(model="gemma-3-1b", from_scratch=True, matmul_dtype="bfloat16")
    for scan_layers in (True, False):
        spec = dataclasses.replace(spec, scan_layers=scan_layers)
        plan = make_plan(cfg, spec, mesh_shape=one, **h200)
        # Norms of (1 + w) in fp32: XLA's, not the Pallas kernel's (weight multiplied in bf16).
        assert plan.kernels["rms_norm"] == "xla"
        # Scanned in groups of five local layers and a global one, or unrolled, each layer has
        # its window: ours on one Hopper GPU (measured faster at head dim 256), cuDNN's on two.
        assert plan.attention == "mosaic"
        assert make_plan(cfg, spec, mesh_shape=two, **h200).attention == "cudnn"
        cudnn = dataclasses.replace(spec, attention="cudnn")
        assert make_plan(cfg, cudnn, mesh_shape=one, **h200).attention == "cudnn"


def test_the_extra_norms_split_like_the_others():
    # ZeRO-3 with tensor parallelism: every norm weight split over fsdp, whole for tensor.
    spec = ModelSpec(model="gemma-3-1b", from_scratch=True, matmul_dtype="float32")
    mesh = dict(data=1, fsdp=2, tensor=2)
    cfg = dataclasses.replace(preset("gemma-3-1b"), num_key_value_heads=2)
    plan = make_plan(cfg, spec, mesh_shape=mesh, platform="cpu", device_kind="cpu", zero_level=3)
    for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm", "input_layernorm"):
        assert plan.param_specs["layers"][name] == P(None, "fsdp")
        assert plan.layer_compute_specs[name] == P(None)
    assert plan.param_specs["layers"]["q_norm"] == P(None, "fsdp")
