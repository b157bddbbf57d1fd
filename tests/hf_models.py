"""Tiny random transformers models, built and saved locally (no downloads), for parity tests."""

import torch
import transformers


def tiny_llama(path: str, seed: int = 0, **fields) -> transformers.PreTrainedModel:
    """A Llama with GQA, llama3 rope scaling and untied embeddings (config `fields` override),
    saved as safetensors to path."""
    cfg = dict(
        vocab_size=311,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        tie_word_embeddings=False,
    )
    return _build(
        transformers.LlamaForCausalLM, transformers.LlamaConfig(**{**cfg, **fields}), path, seed
    )


def tiny_qwen2(path: str, seed: int = 0, **fields) -> transformers.PreTrainedModel:
    """A Qwen2 with q/k/v biases and tied embeddings (config `fields` override), saved as
    safetensors to path."""
    cfg = dict(
        vocab_size=293,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    )
    return _build(
        transformers.Qwen2ForCausalLM, transformers.Qwen2Config(**{**cfg, **fields}), path, seed
    )


def tiny_qwen3(path: str, tie: bool = False, seed: int = 0) -> transformers.PreTrainedModel:
    """A Qwen3 with q/k norms, head_dim 32 (query width 128 over hidden 64) and tied or untied
    embeddings, saved as safetensors to path."""
    cfg = transformers.Qwen3Config(
        vocab_size=283,
        hidden_size=64,
        intermediate_size=144,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        rope_theta=1000000.0,
        tie_word_embeddings=tie,
    )
    return _build(transformers.Qwen3ForCausalLM, cfg, path, seed)


def tiny_mistral(path: str, sliding_window: int, seed: int = 0) -> transformers.PreTrainedModel:
    """A Mistral with GQA, an explicit head_dim and a sliding window, saved as safetensors."""
    cfg = transformers.MistralConfig(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_theta=10000.0,
        sliding_window=sliding_window,
        tie_word_embeddings=False,
    )
    return _build(transformers.MistralForCausalLM, cfg, path, seed)


def tiny_gemma3(path: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A Gemma 3 of 4 layers (local, local, global, local: window 8), GQA, head_dim 32 over
    hidden 64, linear RoPE scaling on the global layer, tied embeddings, saved as safetensors."""
    return _build(
        transformers.Gemma3ForCausalLM,
        transformers.Gemma3TextConfig(**_TINY_GEMMA3),
        path,
        seed,
    )


def tiny_gemma3_image_text(path: str, seed: int = 0) -> transformers.PreTrainedModel:
    """tiny_gemma3's language model inside an image-text Gemma 3 (a one-layer SigLIP vision
    tower and its projector beside it), saved as transformers saves one."""
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    special = dict(image_token_index=262, boi_token_index=260, eoi_token_index=261)
    cfg = transformers.Gemma3Config(
        text_config=_TINY_GEMMA3, vision_config=vision, mm_tokens_per_image=4, **special
    )
    return _build(transformers.Gemma3ForConditionalGeneration, cfg, path, seed)


_TINY_GEMMA3 = dict(
    vocab_size=263,
    hidden_size=64,
    intermediate_size=144,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    query_pre_attn_scalar=24,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    sliding_window=8,
    layer_types=[
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
    ],
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
    tie_word_embeddings=True,
)


def _build(cls, cfg, path: str, seed: int) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    cfg.attn_implementation = "eager"
    model = cls(cfg).to(torch.float32).eval()
    # Random biases and norm weights too: zeros and ones would hide a missing or misplaced one.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_logits(model: transformers.PreTrainedModel, tokens) -> "torch.Tensor":
    """fp32 logits of a transformers model on int tokens [B, T]."""
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()
