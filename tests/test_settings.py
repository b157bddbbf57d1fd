"""Settings are written once: each dataclass field is one flag with its default and help, every
flag is a field, llmq's spellings parse to the same settings, resume policies come from the
fields, and only jaxllmq/cli/ reads the command line."""

import ast
import dataclasses
import pathlib

import pytest
from absl import flags as absl_flags

from jaxllmq.cli import flags
from jaxllmq.data.prepare import PrepareConfig
from jaxllmq.export import ExportConfig
from jaxllmq.generate import GenerateConfig
from jaxllmq.plot import PlotConfig
from jaxllmq.setting import Resume, SettingError, entries
from jaxllmq.settings import DataConfig, ModelSpec, OptimConfig, TrainConfig

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
    flag_values = absl_flags.FlagValues()
    flags.define(cls, flag_values)
    settings = list(entries(cls))
    assert sorted(flag_values) == sorted(entry.flag for entry in settings)
    for entry in settings:
        flag = flag_values[entry.flag]
        assert entry.meta.help in flag.help, entry.flag
        assert flag.default == flags.flag_default(entry), entry.flag
    flag_values(["command", *argv])
    assert flags.build(cls, flag_values) == cls(**given)


def test_a_repeated_flag_adds_its_values():
    flag_values = absl_flags.FlagValues()
    flags.define(PrepareConfig, flag_values)
    flag_values(["prepare", "--input=a,b", "--input=c", "--tokenizer=t", "--out_dir=out"])
    assert flags.build(PrepareConfig, flag_values).input == ("a", "b", "c")


def test_dashed_and_argparse_spellings_name_the_same_flags():
    flag_values = absl_flags.FlagValues()
    flags.define(PrepareConfig, flag_values)
    argv = [
        "--text-field=body",
        "--no-add-special-tokens",
        "--no-such-flag",
        "--noadd_special_tokens",
    ]
    assert flags.normalize_dashes(argv, flag_values) == [
        "--text_field=body",
        "--noadd_special_tokens",
        "--no-such-flag",  # left for absl to report as the user spelled it
        "--noadd_special_tokens",
    ]


def _flag_values(cls=TrainConfig) -> absl_flags.FlagValues:
    values = absl_flags.FlagValues()
    flags.define(cls, values)
    return values


def test_every_field_is_one_flag_with_its_default_and_help():
    values = _flag_values()
    settings = list(entries(TrainConfig))
    names = [entry.flag for entry in settings]
    assert len(names) == len(set(names)), "two fields claim one flag"
    assert sorted(values) == sorted(names), "a flag without a field, or a field without a flag"
    for entry in settings:
        flag = values[entry.flag]
        assert flag.default == flags.flag_default(entry), entry.flag
        assert flag.help.endswith(entry.meta.help), entry.flag
        parse = entry.meta.parse
        # The flag's default, read as a command line would be, is the field's default.
        if parse is not None and flag.default is not None:
            assert parse(flag.default) == entry.default, entry.flag


def test_a_dataclass_built_without_arguments_has_the_flags_defaults():
    # The defaults a test or benchmark gets by building OptimConfig() are the users' defaults.
    values = _flag_values(OptimConfig)
    values(["prog"])
    assert flags.build(OptimConfig, values) == OptimConfig()
    assert OptimConfig().weight_decay == 0.1 and OptimConfig().final_lr_fraction == 0.0


def _parse(argv: list[str], cls=TrainConfig):
    values = _flag_values(cls)
    values(flags.normalize_dashes(["prog", *argv], values))
    return flags.build(cls, values)


def test_llmq_spellings_parse_to_the_same_settings(tmp_path):
    shard = tmp_path / "t.bin"
    shard.write_bytes(b"")
    ours = [
        "--model=tiny",
        "--from_scratch",
        "--model_dtype=float32",
        "--matmul_dtype=e4m3",
        "--gradient_dtype=e5m2",
        "--opt_m_dtype=bfloat16",
        "--opt_v_dtype=float32",
        f"--train_file={shard}",
        "--batch_size=8",
        "--seq_len=512",
        "--grad_accumulation=2",
        "--recompute_swiglu",
        "--offload_master",
        "--nosave_training_state",
        "--lr_schedule=wsd",
        "--cooldown=10",
        "--steps=100",
        "--zero_level=2",
    ]
    llmq = [
        "--model=tiny",
        "--from-scratch",
        "--model-dtype=FP32",
        "--matmul-dtype=E4M3",
        "--gradient-dtype=fp8_e5m2",
        "--opt-m-dtype=BF16",
        "--opt-v-dtype=f32",
        f"--train-file={shard}",
        "--batch-size=8",
        "--seq-len=512",
        "--grad-accumulation=2",
        "--recompute-swiglu",
        "--offload-master",
        "--nosave-training-state",
        "--lr-schedule=WSD",
        "--cooldown=10",
        "--steps=100",
        "--zero-level=2",
    ]
    assert _parse(llmq) == _parse(ours)
    spec = _parse(["--model=tiny", "--from_scratch", "--matmul_dtype=bf16"], ModelSpec)
    assert spec.matmul_dtype == "bfloat16"
    assert _parse(["--model=tiny", "--from-scratch", "--matmul-dtype=BF16"], ModelSpec) == spec


def test_a_bad_spelling_names_the_flag_and_its_choices():
    with pytest.raises(absl_flags.IllegalFlagValueError, match="float32|bfloat16"):
        _parse(["--model=tiny", "--from_scratch", "--model_dtype=fp16"], ModelSpec)
    # Constructed directly, the dataclass checks the same choices and bounds.
    with pytest.raises(SettingError, match="--lr_schedule=exp: not one of cosine, linear, wsd"):
        OptimConfig(lr_schedule="exp")
    with pytest.raises(SettingError, match="--final_lr_fraction=2.0: must be <= 1"):
        OptimConfig(final_lr_fraction=2.0)


def test_run_paths_take_the_run_name(tmp_path):
    shard = tmp_path / "t.bin"
    shard.write_bytes(b"")
    cfg = _parse(
        [
            "--model=tiny",
            "--from_scratch",
            f"--train_file={shard}",
            "--steps=1",
            "--name=exp1",
            "--out_dir=out/%n",
            "--checkpoint_dir=ckpt/%n",
            "--log_file=logs/%n.jsonl",
        ]
    )
    assert (cfg.out_dir, cfg.ckpt.checkpoint_dir, cfg.log_file) == (
        "out/exp1",
        "ckpt/exp1",
        "logs/exp1.jsonl",
    )
    assert cfg.data.train_files == (str(shard),)


def test_resume_policies_are_read_from_the_fields():
    policy = {entry.flag: entry.meta.resume for entry in entries(TrainConfig)}
    assert {f for f, p in policy.items() if p is Resume.MEANING} == {
        "model_dtype",
        "fp8_scaling",
        "fp8_amax_history",
        "opt_m_dtype",
        "opt_v_dtype",
    }
    assert {f for f, p in policy.items() if p is Resume.STRUCTURE} == {"grad_clip", "weight_decay"}
    assert {f for f, p in policy.items() if p is Resume.SESSION} == {
        "continue",
        "new_data",
        "coordinator_address",
    }


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        OptimConfig().lr = 1.0
