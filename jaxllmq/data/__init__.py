"""Token data: BIN.TOK shards (shards), the Grain input pipeline (pipeline), tokenizing (prepare),
the checks of token ids and loss masks before training (validate).

The shard API is numpy-only and imported here eagerly; the pipeline's names load on first use
(PEP 562) so that `python -m jaxllmq.data.prepare` and its worker processes never import jax or
grain.
"""

from jaxllmq.data.shards import (
    Shard,
    ShardError,
    ShardWriter,
    check_vocab_size,
    expand_files,
    open_shard,
    write_shard,
)

_PIPELINE_NAMES = ("TokenBatches", "to_global_arrays")

__all__ = [
    "Shard",
    "ShardError",
    "ShardWriter",
    "check_vocab_size",
    "expand_files",
    "open_shard",
    "write_shard",
    *_PIPELINE_NAMES,
]


def __getattr__(name: str):
    if name in _PIPELINE_NAMES:
        from jaxllmq.data import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
