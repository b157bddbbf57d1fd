"""jaxllmq: a JAX/XLA SPMD trainer for Llama-family language models."""

from jaxllmq.model import (
    PRESETS,
    Llama,
    ModelConfig,
    from_pretrained,
    preset,
    save_pretrained,
)

__all__ = ["PRESETS", "Llama", "ModelConfig", "from_pretrained", "preset", "save_pretrained"]
