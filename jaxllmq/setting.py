"""A setting is a dataclass field that carries everything about itself: its default, help, flag
name, allowed values or bounds, and what changing it on a resume means.

The settings dataclasses (settings.py, plus Recompute and Offload) are built from `setting(...)`
fields; jaxllmq/cli/flags.py turns them into flags, resume_rules.py reads their resume policy, and
`Settings.__post_init__` checks choices and bounds, naming the flag. Nothing here imports absl.
"""

import dataclasses
import enum
import math
import typing
from collections.abc import Callable, Iterator
from typing import Any


class SettingError(ValueError):
    """A setting (or a combination) that cannot run, with the flag named: one line for the user."""


class Resume(enum.Enum):
    """What a resume (--continue) that changes a setting means for the saved state."""

    MEANING = "meaning"  # the saved state means something else: the resume is refused
    STRUCTURE = "structure"  # switching it on (> 0) or off (0) changes the optimizer state: refused
    FREE = "free"  # harmless (lr, cadence, data, devices): allowed and logged
    SESSION = "session"  # how this process was started or resumed: neither a change nor logged


# Value spellings llmq accepts (case-insensitive) for the canonical names used here.
DTYPE_SPELLINGS = {
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp8_e4m3": "e4m3",
    "float8_e4m3fn": "e4m3",
    "fp8_e5m2": "e5m2",
    "float8_e5m2": "e5m2",
}


@dataclasses.dataclass(frozen=True)
class Meta:
    """What a setting field knows about itself besides its default."""

    help: str
    flag: str | None  # the flag's name; None: the field's own name
    choices: tuple[str, ...] | None = None  # allowed values (matched case-insensitively)
    spellings: dict[str, str] | None = None  # other spellings of the choices (llmq's)
    lower: float | None = None
    upper: float | None = None
    resume: Resume = Resume.FREE
    # The flag's text -> the field's value, where they differ (globs -> files, a prompts file).
    parse: Callable[[str], Any] | None = None
    run_path: bool = False  # a path in which %n stands for the run's --name
    repeated: bool = False  # a tuple whose flag may be given several times, adding values


def setting(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    spellings: dict[str, str] | None = None,
    lower: float | None = None,
    upper: float | None = None,
    resume: Resume = Resume.FREE,
    parse: Callable[[str], Any] | None = None,
    run_path: bool = False,
    repeated: bool = False,
) -> Any:
    """A dataclass field that is a setting (one flag)."""
    meta = Meta(help, flag, choices, spellings, lower, upper, resume, parse, run_path, repeated)
    return dataclasses.field(default=default, metadata={"setting": meta})


def section(cls: type, *, required: bool = False) -> Any:
    """A dataclass field holding a nested settings dataclass, whose flags are grouped under the
    first line of its docstring. `required`: no default (it has settings it cannot run without)."""
    if required:
        return dataclasses.field(metadata={"section": True})
    return dataclasses.field(default_factory=cls, metadata={"section": True})


@dataclasses.dataclass(frozen=True)
class Entry:
    """One setting as seen from the root of a settings tree."""

    path: tuple[str, ...]  # field names from the root, e.g. ("optim", "lr")
    field: dataclasses.Field
    meta: Meta
    type: Any  # the field's annotation (e.g. int | None)
    section: str  # the title of the dataclass that holds it

    @property
    def flag(self) -> str:
        return self.meta.flag or self.field.name

    @property
    def default(self) -> Any:
        return None if self.field.default is dataclasses.MISSING else self.field.default


def title(cls: type) -> str:
    """A settings dataclass's section title: its docstring's first line."""
    return (cls.__doc__ or cls.__name__).splitlines()[0].rstrip(".")


def entries(cls: type, path: tuple[str, ...] = ()) -> Iterator[Entry]:
    """Every setting of a settings dataclass, nested sections included, in field order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            yield from entries(hints[f.name], (*path, f.name))
        elif "setting" in f.metadata:
            yield Entry((*path, f.name), f, f.metadata["setting"], hints[f.name], title(cls))


def canonical(meta: Meta, value: str) -> str:
    """A choice as spelled here: lower-cased, llmq's other spellings mapped to ours."""
    value = value.lower()
    return (meta.spellings or {}).get(value, value)


class Settings:
    """Base of the settings dataclasses: checks every field's choices and bounds on construction,
    then the class's own `check` (combinations of fields)."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            meta = f.metadata.get("setting")
            value = getattr(self, f.name)
            if meta is None or value is None:
                continue
            flag = f"--{meta.flag or f.name}={value}"
            if meta.choices is not None:
                value = canonical(meta, value)
                if value not in meta.choices:
                    raise SettingError(f"{flag}: not one of {', '.join(meta.choices)}")
                object.__setattr__(self, f.name, value)
            if isinstance(value, float) and not math.isfinite(value):
                raise SettingError(f"{flag}: must be a finite number")
            if meta.lower is not None and value < meta.lower:
                raise SettingError(f"{flag}: must be >= {meta.lower:g}")
            if meta.upper is not None and value > meta.upper:
                raise SettingError(f"{flag}: must be <= {meta.upper:g}")
        self.check()

    def check(self) -> None:
        """Combinations of fields that cannot run (raise SettingError naming the flags)."""
