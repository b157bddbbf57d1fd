"""XLA GPU flags jaxllmq sets unless the user's XLA_FLAGS already name them.

Applied by the entry points before the backend starts (XLA reads XLA_FLAGS once). Each default is
here because it was measured (docs/PERFORMANCE.md); set the flag in XLA_FLAGS to override it.
"""

import os

DEFAULTS = {
    # cuBLAS instead of Triton GEMM fusions: on the 1B step (H200) +3.9% tokens/s, and compiling
    # 47 s -> 8 s because the Triton tilings are no longer autotuned.
    "xla_gpu_enable_triton_gemm": "false",
    # Schedule async collectives against compute, so the per-layer gradient reductions
    # (parallel/layer_weights.py) overlap with the rest of the backward pass.
    "xla_gpu_enable_latency_hiding_scheduler": "true",
}


def with_defaults(xla_flags: str) -> str:
    """`xla_flags` plus each default flag it does not set already."""
    named = {f.split("=", 1)[0].lstrip("-") for f in xla_flags.split()}
    extra = [f"--{k}={v}" for k, v in DEFAULTS.items() if k not in named]
    return " ".join([xla_flags.strip(), *extra]).strip()


def apply_defaults() -> None:
    """Add the defaults to this process's XLA_FLAGS (call before jax touches a device)."""
    os.environ["XLA_FLAGS"] = with_defaults(os.environ.get("XLA_FLAGS", ""))
