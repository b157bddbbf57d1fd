"""jaxllmq: a JAX/XLA SPMD trainer for Llama-family language models.

The model's names load on first use (PEP 562): importing a submodule that needs no jax, such as
data preparation and its worker processes, does not import jax.
"""

__all__ = ["PRESETS", "Llama", "ModelConfig", "from_pretrained", "preset", "save_pretrained"]


def __getattr__(name: str):
    if name in __all__:
        from jaxllmq import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
