"""The Llama-family model: config and presets, the Flax NNX module, HF safetensors in and out.

The names below load from their modules on first use (PEP 562), so that importing one module of
the package loads no other: memory.py imports model/architecture.py and model/hf.py imports
memory.py, so were hf imported here, importing memory.py first would be circular.
"""

import importlib

_MODULE_OF = {
    **dict.fromkeys(
        ("PRESETS", "ModelConfig", "ModelConfigError", "RopeScaling", "preset"), "architecture"
    ),
    **dict.fromkeys(("CheckpointFormatError", "from_pretrained", "save_pretrained"), "hf"),
    **dict.fromkeys(("Llama", "abstract_model", "logical_axes", "params_of"), "llama"),
}

__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f"jaxllmq.model.{_MODULE_OF[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
