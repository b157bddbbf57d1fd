"""Dense peak FLOP/s of the GPUs MFU is reported against, from their spec sheets.

MFU is a model's useful FLOP/s over the peak of the device that ran it: bf16 dense tensor-core
FLOP/s (fp32 accumulation), and for fp8 runs also the fp8 dense peak. Spec sheets quote
sparse figures too (twice these); these are the dense ones. A device not in the table has no
peak here (None): its MFU is omitted rather than guessed.
"""

import re

# (model, variant) -> (bf16, fp8) dense TFLOP/s; fp8 None where the GPU has no fp8 tensor cores.
# The variant is a word of jax's device_kind: "NVIDIA H100 PCIe", "NVIDIA H100 NVL", and "" for
# the SXM part ("NVIDIA H100 80GB HBM3", "NVIDIA H200").
PEAK_TFLOPS: dict[tuple[str, str], tuple[float, float | None]] = {
    ("H100", ""): (989.4, 1978.9),
    ("H100", "PCIE"): (756.0, 1513.0),
    ("H100", "NVL"): (835.5, 1670.5),
    ("H200", ""): (989.4, 1978.9),
    ("H200", "NVL"): (835.5, 1670.5),
    ("GH200", ""): (989.4, 1978.9),
    ("H800", ""): (989.4, 1978.9),
    ("H800", "PCIE"): (756.0, 1513.0),
    ("B200", ""): (2250.0, 4500.0),
    ("GB200", ""): (2500.0, 5000.0),
    ("A100", ""): (312.0, None),  # SXM and PCIe alike
    ("A800", ""): (312.0, None),
    ("L40S", ""): (362.05, 733.0),
    ("L40", ""): (181.05, 362.1),
    ("L4", ""): (121.0, 242.5),
}
VARIANTS = ("PCIE", "NVL")


def _model_and_variant(device_kind: str) -> tuple[str, str] | None:
    """("H100", "PCIE") from "NVIDIA H100 PCIe"; None when no word names a model in the table."""
    words = [w.upper() for w in re.split(r"[\s_-]+", device_kind) if w]
    models = {m for m, _ in PEAK_TFLOPS}
    model = next((w for w in words if w in models), None)
    if model is None:
        return None
    variant = next((w for w in words if w in VARIANTS), "")
    return model, variant


def gpu_model(device_kind: str) -> str | None:
    """The GPU model a device_kind names ("H100" from "NVIDIA H100 80GB HBM3"), None where no
    word of it is a model in the table."""
    key = _model_and_variant(device_kind)
    return key and key[0]


def peak_flops(device_kind: str, dtype: str = "bfloat16") -> float | None:
    """Dense peak FLOP/s of one device of `device_kind` (jax's Device.device_kind) in `dtype`
    ("bfloat16" or "fp8"), or None where the table does not know it."""
    if dtype not in ("bfloat16", "fp8"):
        raise ValueError(f"peak_flops: dtype must be 'bfloat16' or 'fp8', got {dtype!r}")
    key = _model_and_variant(device_kind)
    if key is None:
        return None
    peaks = PEAK_TFLOPS.get(key) or PEAK_TFLOPS.get((key[0], ""))
    tflops = peaks[0] if dtype == "bfloat16" else peaks[1]
    return None if tflops is None else tflops * 1e12
