"""Fused kernels for the hot paths, each beside a pure-JAX reference that referees it.

The model calls `rms_norm`, `add_rms_norm` (the post-attention residual add fused into its norm
when no recompute policy applies), `lm_head_loss` and (fp8 block linears)
`fp8_quantize.quantize_both` with an `impl` chosen once by `resolve_impl` from the trainer's
`--kernels=auto|pallas|xla`.
"""

import jax

KERNELS = ("rms_norm", "lm_head_loss", "fp8_quantize")

# What `auto` picks on one GPU, per kernel: Pallas only where it measured faster than XLA on an
# H200, in the kernel alone and in the train step (docs/PERFORMANCE.md, "Kernels"): the RMSNorm
# and its fused variants, the LM-head loss (faster, and a fraction of the memory: it never
# writes the logits), the fp8 quantize into both layouts.
AUTO_GPU = {"rms_norm": "pallas", "lm_head_loss": "pallas", "fp8_quantize": "pallas"}
# On Hopper (compute capability 9.x) the LM-head loss's kernel in Mosaic GPU (wgmma, TMA), where
# its shapes apply (the Triton kernel elsewhere): faster alone and in the 1B step.
AUTO_HOPPER = {**AUTO_GPU, "lm_head_loss": "mosaic"}
# On several GPUs the LM-head loss and the fp8 quantize pass run per device under shard_map, as
# on one GPU, and measured faster there than XLA's (docs/PERFORMANCE.md, "Several GPUs", "fp8").
# The RMSNorm stays XLA: its Pallas call is not wrapped in shard_map, so XLA would gather its
# operands onto every device.
AUTO_MULTI_GPU = {"rms_norm": "xla"}
# Under tensor parallelism the head's vocab and the linears' columns are split: the per-device
# loss would gather the head and repeat each token's loss on every tensor rank, and the quantize
# pass's scales would span the split columns (resolve_impl keeps it in XLA even if asked).
AUTO_TENSOR_PARALLEL = dict.fromkeys(KERNELS, "xla")


def parse_kernels(kernels: str) -> dict[str, str]:
    """--kernels as a choice per kernel: "auto"/"pallas"/"xla" for all, or "name=impl,..."
    (the LM-head loss also takes "mosaic": its Pallas kernel in Mosaic GPU, for Hopper)."""
    choices = ("auto", "pallas", "xla")
    if "=" not in kernels:
        if kernels not in choices:
            raise ValueError(
                f"--kernels must be auto, pallas or xla, or kernel=impl pairs, got {kernels!r}"
            )
        return dict.fromkeys(KERNELS, kernels)
    out = dict.fromkeys(KERNELS, "auto")
    for part in kernels.split(","):
        name, _, impl = part.partition("=")
        allowed = choices + (("mosaic",) if name == "lm_head_loss" else ())
        if name not in KERNELS or impl not in allowed:
            raise ValueError(
                f"--kernels: {part!r} is not kernel=impl with kernel in {', '.join(KERNELS)} "
                "and impl auto, pallas or xla (lm_head_loss also mosaic), e.g. "
                "--kernels=rms_norm=pallas,lm_head_loss=xla"
            )
        out[name] = impl
    return out


def is_hopper(compute_capability: str | None = None) -> bool:
    """Whether a GPU of `compute_capability` (default: this process's first device's) is a Hopper
    (H100, H200: 9.x), the only one the Mosaic GPU kernels' wgmma runs on."""
    if compute_capability is None:
        compute_capability = str(getattr(jax.devices()[0], "compute_capability", ""))
    return compute_capability.startswith("9.")


def resolve_impl(
    kernels: str,
    kernel: str,
    *,
    platform: str | None = None,
    num_devices: int = 1,
    tensor_parallel: int = 1,
    hopper: bool | None = None,
) -> str:
    """Implementation ("pallas", "xla", or for the LM-head loss "mosaic") of `kernel` for the
    `--kernels` setting.

    auto: XLA on CPU (Pallas there only interprets); on one GPU whichever measured faster
    (AUTO_GPU, or AUTO_HOPPER where `hopper`, default is_hopper()); on several, the same but
    for AUTO_MULTI_GPU's entries, and AUTO_TENSOR_PARALLEL's where `tensor_parallel` > 1.
    A Pallas call has no SPMD partitioning rule: on several devices the LM-head loss and the fp8
    quantize pass run per device inside shard_map (train_step.build ->
    lm_head_loss.lm_head_loss_sharded, fp8_quantize.Quantizer); the RMSNorm call is not wrapped,
    so XLA gathers its operands. Under tensor parallelism the quantize pass stays in XLA even if
    asked: its per-device scales would span the split columns.
    """
    if kernel not in KERNELS:
        raise ValueError(f"resolve_impl: unknown kernel {kernel!r} (expected one of {KERNELS})")
    choice = parse_kernels(kernels)[kernel]
    if kernel == "fp8_quantize" and tensor_parallel > 1:
        return "xla"
    if choice != "auto":
        return choice
    platform = platform or jax.default_backend()
    if platform not in ("gpu", "cuda"):
        return "xla"
    one_gpu = AUTO_HOPPER if (is_hopper() if hopper is None else hopper) else AUTO_GPU
    if tensor_parallel > 1:
        return {**one_gpu, **AUTO_TENSOR_PARALLEL}[kernel]
    if num_devices > 1:
        return {**one_gpu, **AUTO_MULTI_GPU}[kernel]
    return one_gpu[kernel]
