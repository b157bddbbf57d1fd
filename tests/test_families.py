"""Float32 logits against transformers for each family's variants: RoPE scaling (llama3, linear)
past the original context, and sliding windows shorter than the sequence (Mistral's on every
layer, Qwen2's from max_window_layers on)."""

import dataclasses
import math

import numpy as np
import pytest
from flax import nnx
from hf_models import hf_logits, tiny_llama, tiny_mistral, tiny_qwen2

from jaxllmq.model import hf
from jaxllmq.model.architecture import ModelConfig, RopeScaling
from jaxllmq.model.llama import abstract_model, params_of


def _tokens(vocab: int, length: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(2, length), dtype=np.int32)


def _max_logit_diff(path: str, ref, length: int) -> float:
    model = hf.from_pretrained(path, attention="xla")
    tokens = _tokens(model.cfg.vocab_size, length)
    return float(np.abs(np.asarray(model.logits(tokens)) - hf_logits(ref, tokens)).max())


# head_dim 32 (16 frequencies, query width 128 != hidden 64), theta 1e4: wavelengths 2 pi x
# 10^(i/4). With an original context of 64 and factors 1 and 4 the band is wavelengths 16..64:
# two frequencies above it (kept), three inside (blended), eleven below (slowed by `factor`).
LLAMA3 = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=64,
)
ROPE_SHAPE = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e4)


def test_llama3_rope_frequencies_fall_on_both_sides_of_and_inside_the_band():
    wavelengths = [2 * math.pi * 1e4 ** (i / 32) for i in range(0, 32, 2)]
    high = LLAMA3["original_max_position_embeddings"] / LLAMA3["high_freq_factor"]
    low = LLAMA3["original_max_position_embeddings"] / LLAMA3["low_freq_factor"]
    kept = sum(w < high for w in wavelengths)
    slowed = sum(w > low for w in wavelengths)
    assert (kept, len(wavelengths) - kept - slowed, slowed) == (2, 3, 11)


@pytest.mark.parametrize(
    "scaling",
    [LLAMA3, {"rope_type": "linear", "factor": 4.0}],
    ids=["llama3", "linear"],
)
def test_scaled_rope_matches_transformers_past_the_original_context(scaling, tmp_path):
    ref = tiny_llama(str(tmp_path), rope_scaling=dict(scaling), **ROPE_SHAPE)  # it edits it
    model_cfg = ModelConfig.from_hf_dir(str(tmp_path))
    assert model_cfg.rope_scaling == RopeScaling(**scaling)
    assert model_cfg.dim_per_head == 32
    assert _max_logit_diff(str(tmp_path), ref, 96) < 1e-4  # 96 positions > 64


def _without_windows(path: str, ref, length: int) -> float:
    """_max_logit_diff of the same weights with every layer attending to all earlier keys."""
    model = hf.from_pretrained(path, attention="xla")
    full = dataclasses.replace(model.cfg, sliding_window=None, layer_types=None)
    graphdef, _, _ = abstract_model(full, attention="xla")
    tokens = _tokens(full.vocab_size, length)
    logits = nnx.merge(graphdef, params_of(model)).logits(tokens)
    return float(np.abs(np.asarray(logits) - hf_logits(ref, tokens)).max())


def test_mistral_matches_transformers_past_its_sliding_window(tmp_path):
    ref = tiny_mistral(str(tmp_path), sliding_window=7)
    model = hf.from_pretrained(str(tmp_path), attention="xla")
    assert model.cfg.layer_windows() == (7, 7)
    tokens = _tokens(model.cfg.vocab_size, 29)
    assert np.abs(np.asarray(model.logits(tokens)) - hf_logits(ref, tokens)).max() < 1e-4
    assert _without_windows(str(tmp_path), ref, 29) > 1e-2  # the window is what matches


@pytest.mark.parametrize("scan_layers", [True, False])
def test_qwen2_matches_transformers_with_use_sliding_window(scan_layers, tmp_path):
    # Windows on the layers from max_window_layers on: a scan over layers of two kinds.
    ref = tiny_qwen2(
        str(tmp_path),
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    )
    model = hf.from_pretrained(str(tmp_path), attention="xla", scan_layers=scan_layers)
    assert model.cfg.layer_windows() == (None, 6, 6)
    tokens = _tokens(model.cfg.vocab_size, 29)
    assert np.abs(np.asarray(model.logits(tokens)) - hf_logits(ref, tokens)).max() < 1e-4
    assert _without_windows(str(tmp_path), ref, 29) > 1e-2
    # Exported as transformers reads it: the same windows.
    out = model.cfg.to_hf_dict()
    assert (out["use_sliding_window"], out["sliding_window"], out["max_window_layers"]) == (
        True,
        6,
        1,
    )
    assert ModelConfig.from_hf_dict(out) == model.cfg
