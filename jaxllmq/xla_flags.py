"""XLA GPU flags jaxllmq sets unless the user's XLA_FLAGS already name them, and the train
step's compile options (step_options), on the same terms.

The flags are applied by the entry points before the backend starts (XLA reads XLA_FLAGS once),
the options by train_step.build. Each default is here because it was measured
(docs/experiments/); set the flag in XLA_FLAGS to override it.

Also the GPU client's pinned host memory pool (XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, 64 GB unless
set): host offload (jaxllmq/offload.py) keeps the fp32 master and Adam moments there, 12 bytes a
parameter, 96 GB for an 8B model. The default here is 3/4 of the machine's memory, split
between the host's GPUs.
"""

import glob
import os

DEFAULTS = {
    # cuBLAS instead of Triton GEMM fusions: on the 1B step (H200) +3.9% tokens/s, and compiling
    # 47 s -> 8 s because the Triton tilings are no longer autotuned.
    "xla_gpu_enable_triton_gemm": "false",
    # Schedule async collectives against compute, so the per-layer gradient reductions
    # overlap with the rest of the backward pass.
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # All-reduces combined up to 64 MiB, not larger: the last one of the backward pass, which
    # nothing hides, is smaller. ZeRO-1 on two H200s: exposed NCCL 5.9 -> 3.9 ms a step,
    # scaling efficiency 0.940 -> 0.947 (two runs each, same call).
    "xla_gpu_all_reduce_combine_threshold_bytes": str(64 * 2**20),
}


# XLA options of a train step whose layers are scanned. No dynamic-slice fusions: the scan stacks
# what the backward keeps (dynamic-update-slices into [L, ...] buffers), and XLA (jax 0.11) fused
# each such store into the product or kernel that made the value, running that a second time
# where the layer uses the value too: q_proj, gate_proj, up_proj and the attention's forward ran
# twice a layer. Without them, on an H100: Qwen3 1.7B at 2 x 8192 36,579 tokens/s against
# 33,024, the 1B at 8 x 2048 in fp32 (the defaults) 62,470 against 57,449, 0.5 GiB more peak
# memory. Unrolled steps ran level either way with 1.6-2.2 GiB less peak with them, so they keep
# XLA's default.
# And no zeros written into the stacked buffers that the scan then fills whole (XLA's
# zero-init elimination): 23 GiB of zero writes a step fewer for Qwen3 1.7B at 2 x 8192, 25 for
# Gemma 3 1B at 8 x 2048, 16 for the 1B's defaults. On an H100, tokens/s without and with it:
# Gemma 68,558 and 68,544 against 70,981 and 71,123 (+3.6%), the 1B's defaults 63,139 against
# 64,214 and 64,323 (+1.8%), Qwen3 36,372 against 36,630 and 36,721 (+0.8%), the same peaks.
SCANNED_STEP_OPTIONS = {
    "xla_gpu_enable_dynamic_slice_fusion": False,
    "xla_gpu_enable_dus_accumulator_zero_init_elimination": True,
}


def _named(xla_flags: str) -> set[str]:
    """The flags `xla_flags` sets."""
    return {f.split("=", 1)[0].lstrip("-") for f in xla_flags.split()}


def with_defaults(xla_flags: str, defaults: dict[str, str] = DEFAULTS) -> str:
    """`xla_flags` plus each default flag it does not set already."""
    named = _named(xla_flags)
    extra = [f"--{k}={v}" for k, v in defaults.items() if k not in named]
    return " ".join([xla_flags.strip(), *extra]).strip()


def step_options(scan_layers: bool) -> dict[str, bool]:
    """The train step's XLA compile options: SCANNED_STEP_OPTIONS where the layers are scanned,
    less any this process's XLA_FLAGS set (the user's choice stands)."""
    if not scan_layers:
        return {}
    named = _named(os.environ.get("XLA_FLAGS", ""))
    return {k: v for k, v in SCANNED_STEP_OPTIONS.items() if k not in named}


HOST_MEMORY_LIMIT = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"


def host_memory_bytes() -> int:
    """This host's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_memory_limit_gb() -> int:
    """The pinned host memory pool jaxllmq asks for, per GPU (each GPU has its own): 3/4 of
    physical memory shared by the host's GPUs, in GB. Every GPU of the host counts, not only this
    process's: with one process per GPU, each process sees one GPU but shares the memory."""
    total = host_memory_bytes()
    gpus = len(glob.glob("/dev/nvidia[0-9]*"))
    if not gpus and os.environ.get("CUDA_VISIBLE_DEVICES"):
        gpus = len(os.environ["CUDA_VISIBLE_DEVICES"].split(","))
    return int(0.75 * total / 1e9 / max(gpus, 1))


# --deterministic: XLA's deterministic ops (no atomics in scatter-adds and reductions).
DETERMINISTIC = {"xla_gpu_deterministic_ops": "true"}


def apply_defaults(deterministic: bool = False) -> None:
    """Add the defaults (and with `deterministic` DETERMINISTIC's) to this process's XLA_FLAGS and
    the host memory pool's size to its environment, where the user has not set them (call before
    jax touches a device)."""
    os.environ["XLA_FLAGS"] = with_defaults(
        os.environ.get("XLA_FLAGS", ""), {**DEFAULTS, **(DETERMINISTIC if deterministic else {})}
    )
    os.environ.setdefault(HOST_MEMORY_LIMIT, str(host_memory_limit_gb()))
