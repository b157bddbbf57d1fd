"""Settings dataclasses <-> absl flags: the only module that defines flags from settings.

`define(cls)` registers one flag per setting field (jaxllmq/setting.py), grouped in --helpfull by
the section it belongs to; `build(cls)` makes the validated dataclass from the parsed flags.
`parse_argv` is every entry point's absl flags parser: flagfiles (later flags win), llmq's dashed
names (--batch-size) and value spellings (bf16, BF16, fp32, E4M3, fp8_e4m3, ...).
"""

import dataclasses
import re
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from absl import flags, logging

from jaxllmq.setting import Entry, Meta, canonical, entries

FLAGS = flags.FLAGS


class _ChoiceParser(flags.ArgumentParser):
    """One of a setting's choices, in any case or llmq spelling; parsed to our spelling."""

    def __init__(self, meta: Meta):
        self.meta = meta

    def parse(self, argument):
        if argument is None:
            return None
        value = canonical(self.meta, str(argument))
        if value not in self.meta.choices:
            raise ValueError(f"value should be one of <{'|'.join(self.meta.choices)}>")
        return value

    def flag_type(self) -> str:
        return "string enum"


def _base_type(annotation: Any) -> type:
    """int for `int | None`, tuple for `tuple[str, ...]`, the type itself otherwise."""
    if isinstance(annotation, types.UnionType):
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    return typing.get_origin(annotation) or annotation


def flag_default(entry: Entry) -> Any:
    """The flag's default: the field's, with a tuple written as its comma-separated text (or
    its list of values, for a flag given several times)."""
    default = entry.default
    if _base_type(entry.type) is tuple:
        return (list(default) if entry.meta.repeated else ",".join(default)) or None
    return default


def define(cls: type, flag_values: flags.FlagValues = FLAGS) -> None:
    """Register a flag for every setting of `cls` (nested sections included), unless an earlier
    run of the same command in this process has. Another command's flag of the same name is
    replaced (tests run several commands in one process)."""
    for entry in entries(cls):
        meta, name, default = entry.meta, entry.flag, flag_default(entry)
        defined_by = flag_values.find_module_defining_flag(name)
        if defined_by == entry.section:
            continue
        if defined_by is not None:
            delattr(flag_values, name)
        kw = {"flag_values": flag_values, "module_name": entry.section}
        kind = _base_type(entry.type)
        if meta.choices is not None:
            help_ = f"<{'|'.join(meta.choices)}>: {meta.help}"
            parser = _ChoiceParser(meta)
            flags.DEFINE(parser, name, default, help_, serializer=flags.ArgumentSerializer(), **kw)
        elif meta.repeated:
            flags.DEFINE_multi_string(name, default, meta.help, **kw)
        elif kind is bool:
            flags.DEFINE_bool(name, default, meta.help, **kw)
        elif kind in (int, float):
            define_number = flags.DEFINE_integer if kind is int else flags.DEFINE_float
            bounds = {"lower_bound": meta.lower, "upper_bound": meta.upper}
            define_number(name, default, meta.help, **bounds, **kw)
        else:
            flags.DEFINE_string(name, default, meta.help, **kw)


def _value(entry: Entry, raw: Any, run_name: str | None) -> Any:
    """The field's value from its flag's parsed value."""
    if entry.meta.run_path and raw is not None and run_name is not None:
        raw = raw.replace("%n", run_name)
    if _base_type(entry.type) is tuple:
        if not raw:
            return ()
        if entry.meta.repeated:
            raw = ",".join(raw)
        parse = entry.meta.parse or (lambda text: tuple(p for p in text.split(",") if p))
        return parse(raw)
    if entry.meta.parse is not None and raw is not None:
        return entry.meta.parse(raw)
    return raw


def build(cls: type, flag_values: flags.FlagValues = FLAGS, **given: Any) -> Any:
    """The settings dataclass `cls` from the parsed flags (SettingError names a bad flag).
    `given`: top-level fields supplied by the caller instead of flags."""
    run_name = flag_values["name"].value if "name" in flag_values else None
    tree: dict = {}
    for entry in entries(cls):
        if entry.path[0] in given:
            continue
        node = tree
        for key in entry.path[:-1]:
            node = node.setdefault(key, {})
        node[entry.path[-1]] = _value(entry, flag_values[entry.flag].value, run_name)
    return _construct(cls, {**tree, **given})


def _construct(cls: type, values: dict) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        value = values[f.name]
        if "section" in f.metadata and isinstance(value, dict):
            value = _construct(hints[f.name], value)
        kwargs[f.name] = value
    return cls(**kwargs)


_DASHED = re.compile(r"^--([a-z0-9_]*-[a-z0-9_-]*)(=|$)")


def normalize_dashes(argv: Sequence[str], flag_values: flags.FlagValues = FLAGS) -> list[str]:
    """Accept llmq's dashed spellings (--batch-size=8) for our underscore flags (--batch_size=8),
    and argparse's negations (--no-add-special-tokens) for absl's (--noadd_special_tokens)."""
    out = []
    for arg in argv:
        m = _DASHED.match(arg)
        if m:
            name = m.group(1).replace("-", "_")
            if name.startswith("no_") and name not in flag_values:
                name = "no" + name.removeprefix("no_")
            if name in flag_values or name.removeprefix("no") in flag_values:
                arg = "--" + name + arg[m.end(1) :]
        out.append(arg)
    return out


def parse_argv(argv: list[str]) -> list[str]:
    """absl flags_parser: flagfiles expanded, dashed spellings normalized; exit 1 on bad flags.
    Flags start from their defaults, also when a command runs again in one process (tests)."""
    FLAGS.unparse_flags()
    try:
        argv = FLAGS.read_flags_from_files(argv, force_gnu=False)
    except flags.CantOpenFlagFileError as e:
        cause = e.__context__  # absl's message lacks the flag; the OSError it wraps has the file
        if isinstance(cause, OSError):
            sys.exit(f"error: --flagfile={cause.filename}: cannot read it ({cause.strerror})")
        sys.exit(f"error: --flagfile: {e}")
    try:
        argv = FLAGS(normalize_dashes(argv))
    except flags.Error as e:
        print(f"FATAL Flags parsing error: {e}", file=sys.stderr)
        print("Pass --helpfull to see help on flags.", file=sys.stderr)
        sys.exit(1)
    if not FLAGS["verbosity"].present:
        # jax's INFO lines (backend probing) would drown the step lines; --verbosity=0 shows them.
        logging.set_verbosity(logging.WARNING)
    return argv


def build_or_exit(cls: type, **given: Any) -> Any:
    """`build`, with a bad setting reported in one line and exit 1."""
    try:
        return build(cls, **given)
    except ValueError as e:  # SettingError, ShardError (--train_file globs) and the like
        sys.exit(f"error: {e}")
