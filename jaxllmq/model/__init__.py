"""The Llama-family model: config and presets, the Flax NNX module, HF safetensors in and out."""

from jaxllmq.model.architecture import PRESETS, ModelConfig, ModelConfigError, RopeScaling, preset
from jaxllmq.model.hf import CheckpointFormatError, from_pretrained, save_pretrained
from jaxllmq.model.llama import Llama, abstract_model, logical_axes, params_of

__all__ = [
    "PRESETS",
    "CheckpointFormatError",
    "Llama",
    "ModelConfig",
    "ModelConfigError",
    "RopeScaling",
    "abstract_model",
    "from_pretrained",
    "logical_axes",
    "params_of",
    "preset",
    "save_pretrained",
]
