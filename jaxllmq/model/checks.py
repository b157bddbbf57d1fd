"""The model config's error and the checks of its values, shared by architecture.py and rope.py."""

import math
from typing import Any


class ModelConfigError(ValueError):
    """A model config that this trainer cannot build, with what to do about it."""


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # JSON's true is no size


def check_int(name: str, x: Any) -> None:
    """Refuse a size that is not a positive integer ("256", 256.0 and true included)."""
    if not is_int(x) or x <= 0:
        raise ModelConfigError(f"{name} must be a positive integer, got {x!r}")


def check_number(name: str, x: Any, minimum: float | None = None) -> None:
    """Refuse a value that is not a finite number, > 0 (or >= minimum where given)."""
    try:
        ok = (is_int(x) or isinstance(x, float)) and math.isfinite(x)
    except OverflowError:  # an integer past float's range
        ok = False
    if not ok or (x < minimum if minimum is not None else x <= 0):
        bound = f">= {minimum}" if minimum is not None else "> 0"
        raise ModelConfigError(f"{name} must be a number {bound}, got {x!r}")
