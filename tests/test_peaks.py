"""jaxllmq/peaks.py: the dense peak of the device that ran, from its device_kind, or None."""

import pytest

from jaxllmq.peaks import peak_flops


@pytest.mark.parametrize(
    "kind,bf16,fp8",
    [
        ("NVIDIA H200", 989.4, 1978.9),
        ("NVIDIA H200 NVL", 835.5, 1670.5),
        ("NVIDIA H100 80GB HBM3", 989.4, 1978.9),  # SXM
        ("NVIDIA H100 PCIe", 756.0, 1513.0),
        ("NVIDIA H100 NVL", 835.5, 1670.5),
        ("NVIDIA GH200 480GB", 989.4, 1978.9),
        ("NVIDIA B200", 2250.0, 4500.0),
        ("NVIDIA A100-SXM4-80GB", 312.0, None),  # no fp8 tensor cores
        ("NVIDIA A100-PCIE-40GB", 312.0, None),  # a variant the table lacks: the model's
        ("NVIDIA L40S", 362.05, 733.0),
        ("NVIDIA L40", 181.05, 362.1),
        ("NVIDIA L4", 121.0, 242.5),  # not L40's
    ],
)
def test_known_devices(kind, bf16, fp8):
    assert peak_flops(kind) == pytest.approx(bf16 * 1e12)
    assert peak_flops(kind, "bfloat16") == peak_flops(kind)
    want_fp8 = None if fp8 is None else pytest.approx(fp8 * 1e12)
    assert peak_flops(kind, "fp8") == want_fp8


@pytest.mark.parametrize(
    "kind", ["cpu", "TFRT_CPU_0", "NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-16GB", ""]
)
def test_unknown_devices_have_no_peak(kind):
    assert peak_flops(kind) is None and peak_flops(kind, "fp8") is None


def test_other_dtypes_are_refused():
    with pytest.raises(ValueError, match="'bfloat16' or 'fp8'"):
        peak_flops("NVIDIA H200", "float32")
