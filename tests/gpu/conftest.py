"""GPU tests: what only a GPU can show, each failing on a wrong result.

Run on a GPU machine with `pytest -m gpu tests/gpu` (about 5 minutes on one H200). Elsewhere they
are deselected (pyproject's addopts) and, when selected anyway, skipped with the reason.
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
