"""RoPE scaling: the kinds implemented (linear, llama3), as read from an HF config.json."""

import dataclasses
import math
from typing import Any

from jaxllmq.model.checks import ModelConfigError, check_int, check_number

ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: "linear" (factor) or "llama3" (factor, low/high, original ctx)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ("linear", "llama3"):
            raise ModelConfigError(
                f"rope scaling type {self.rope_type!r} is not implemented "
                f"(supported: linear, llama3)"
            )
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            check_number(f"rope scaling {name}", getattr(self, name))
        check_int(
            "rope scaling original_max_position_embeddings", self.original_max_position_embeddings
        )


def read_rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE theta and scaling from either spelling: rope_theta + rope_scaling, or rope_parameters."""
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    theta = d.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        scaling = params
    if theta is None:
        theta = 10000.0
    check_number("rope_theta", theta)
    if not scaling:
        return float(theta), None
    if not isinstance(scaling, dict):
        raise ModelConfigError(f"rope_scaling must be a JSON object, got {scaling!r}")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(
            f"rope scaling type {rope_type!r} is not implemented "
            f"(supported: {', '.join(ROPE_TYPES)})"
        )
    fields = {k: scaling[k] for k in dataclasses.asdict(RopeScaling("linear")) if k in scaling}
    fields["rope_type"] = rope_type
    return float(theta), RopeScaling(**fields)


def scaling_dict(s: RopeScaling) -> dict[str, Any]:
    """config.json's rope_scaling object for `s`."""
    d: dict[str, Any] = {"rope_type": s.rope_type, "factor": s.factor}
    if s.rope_type == "llama3":
        d.update(
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
        )
    return d


def inv_freq(head_dim: int, theta: float, s: RopeScaling | None) -> list[float]:
    """Per-pair inverse frequencies (head_dim/2 of them) of base `theta`, `s` applied."""
    dh = head_dim
    inv = [1.0 / (theta ** (i / dh)) for i in range(0, dh, 2)]
    if s is None:
        return inv
    if s.rope_type == "linear":
        return [f / s.factor for f in inv]
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend between
    # (Meta's Llama 3.1 reference, as transformers implements it).
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / s.factor)
        else:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            out.append((1 - smooth) * f / s.factor + smooth * f)
    return out
