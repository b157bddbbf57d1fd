"""GPU tests: what only a GPU can show, each failing on a wrong result.

Run on a GPU machine with `pytest -m gpu tests/gpu`: about 18 minutes on one H100 (2026-12-06),
most of it compiling the flash attention kernels' 40 cases (about 9 minutes with the documents
file), the kernels file about 4 and the training file 5; a file at a time where a command's time is
limited. Elsewhere they are deselected (pyproject's addopts) and, when selected anyway, skipped
with the reason.
"""

import os

import jax
import pytest

from jaxllmq import xla_flags

if os.environ.get("JAX_PLATFORMS") != "cpu":
    # As a run starts: the trainer's XLA flags and the pinned host memory pool (host offload),
    # before the backend starts.
    xla_flags.apply_defaults()


@pytest.fixture(autouse=True)
def needs_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip(f"needs a GPU (this backend: {jax.default_backend()}); run on a GPU machine")
