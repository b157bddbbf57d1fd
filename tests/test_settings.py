"""Settings and the commands' flags: only jaxllmq/cli/ reads the command line, and each command's
settings dataclass and its flags say the same thing."""

import ast
import pathlib

import pytest
from absl import flags

from jaxllmq.cli import flags as cli_flags
from jaxllmq.data.prepare import PrepareConfig
from jaxllmq.export import ExportConfig
from jaxllmq.generate import GenerateConfig
from jaxllmq.plot import PlotConfig
from jaxllmq.setting import entries
from jaxllmq.settings import DataConfig, ModelSpec, TrainConfig

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxllmq"
COMMAND_LINE_MODULES = {"absl.flags", "absl.app", "argparse"}
# Any existing file: the settings check that --train_file's files exist, not what they hold.
EXISTING_FILE = str(pathlib.Path(__file__).resolve())


def imported_modules(source: str) -> set[str]:
    """Every module a file imports; `from absl import flags` counts as absl.flags."""
    modules = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def test_only_the_commands_import_absl_flags_app_or_argparse():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if PACKAGE / "cli" in path.parents:
            continue
        found = imported_modules(path.read_text(encoding="utf-8")) & COMMAND_LINE_MODULES
        if found:
            offenders[str(path.relative_to(PACKAGE.parent))] = sorted(found)
    assert not offenders, f"command-line parsing outside jaxllmq/cli/: {offenders}"


# Each command's settings, the flags it cannot run without, and the settings those give.
COMMANDS = [
    (
        TrainConfig,
        ["--model=tiny", "--from_scratch", f"--train_file={EXISTING_FILE}", "--steps=1"],
        dict(
            model=ModelSpec(model="tiny", from_scratch=True),
            data=DataConfig(train_files=(EXISTING_FILE,)),
            steps=1,
        ),
    ),
    (ExportConfig, ["--checkpoint=ckpt", "--out_dir=out"], dict(checkpoint="ckpt", out_dir="out")),
    (GenerateConfig, [], {}),
    (PlotConfig, [], {}),
    (PrepareConfig, ["--quickstart", "--out_dir=out"], dict(quickstart=True, out_dir="out")),
]


@pytest.mark.parametrize("cls, argv, given", COMMANDS, ids=[c[0].__name__ for c in COMMANDS])
def test_command_settings_round_trip_through_their_flags(cls, argv, given):
    """Every setting has exactly one flag, with the setting's help and default: flags parsed
    with only the required ones given build the dataclass's own defaults."""
    flag_values = flags.FlagValues()
    cli_flags.define(cls, flag_values)
    settings = list(entries(cls))
    assert sorted(flag_values) == sorted(entry.flag for entry in settings)
    for entry in settings:
        flag = flag_values[entry.flag]
        assert entry.meta.help in flag.help, entry.flag
        assert flag.default == cli_flags.flag_default(entry), entry.flag
    flag_values(["command", *argv])
    assert cli_flags.build(cls, flag_values) == cls(**given)


def test_a_repeated_flag_adds_its_values():
    flag_values = flags.FlagValues()
    cli_flags.define(PrepareConfig, flag_values)
    flag_values(["prepare", "--input=a,b", "--input=c", "--tokenizer=t", "--out_dir=out"])
    assert cli_flags.build(PrepareConfig, flag_values).input == ("a", "b", "c")


def test_dashed_and_argparse_spellings_name_the_same_flags():
    flag_values = flags.FlagValues()
    cli_flags.define(PrepareConfig, flag_values)
    argv = [
        "--text-field=body",
        "--no-add-special-tokens",
        "--no-such-flag",
        "--noadd_special_tokens",
    ]
    assert cli_flags.normalize_dashes(argv, flag_values) == [
        "--text_field=body",
        "--noadd_special_tokens",
        "--no-such-flag",  # left for absl to report as the user spelled it
        "--noadd_special_tokens",
    ]
