"""Every flagfile under configs/ parses and validates: its flags exist, its values are allowed
and its model and data paths are the only things a user has to supply."""

import glob
import os
import re

import numpy as np
import pytest
from hf_models import tiny_qwen2

from jaxllmq.cli import flags
from jaxllmq.data.shards import write_shard
from jaxllmq.model.architecture import preset
from jaxllmq.plan import make_plan
from jaxllmq.setting import SettingError
from jaxllmq.settings import ModelSpec, TrainConfig
from jaxllmq.tokenizer_files import write_eos_id

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.flags")))


def _parsed(cls: type, *args: str):
    """`cls` from the flags `args`, parsed and validated as the training command does."""
    flags.define(cls)
    flags.parse_argv(["jaxllmq.main", *args])
    return flags.build(cls)


# Configs that train on documents masked apart (each attends to itself only).
DOCUMENT_MASKING = (
    "llama-3.2-1b-pretrain.flags",
    "qwen2.5-0.5b-finetune.flags",
    "qwen2.5-0.5b-chat.flags",
)


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_flagfile_parses_and_validates(path, tmp_path, monkeypatch):
    write_shard(tmp_path / "t.bin", np.arange(4096, dtype=np.int32) % 200, vocab_size=256)
    write_eos_id(str(tmp_path), 0)  # as prepare writes it beside the shards
    data = [f"--train_file={tmp_path}/t.bin", f"--eval_file={tmp_path}/t.bin"]
    # A fine-tuning flagfile names an HF directory the user supplies: a tiny one stands in.
    with open(path) as f:
        from_hf = "--from_scratch" not in f.read().split()
    if from_hf:
        tiny_qwen2(str(tmp_path / "hf"))
        data.append(f"--model={tmp_path}/hf")
    monkeypatch.chdir(tmp_path)
    cfg = _parsed(TrainConfig, f"--flagfile={path}", *data)
    assert cfg.data.document_masking == (os.path.basename(path) in DOCUMENT_MASKING)


@pytest.mark.parametrize("name", ["qwen2.5-0.5b-finetune.flags", "qwen2.5-0.5b-chat.flags"])
def test_the_finetune_recipe_packs_for_the_configs_seq_len(name):
    """A fine-tuning config's data recipe (its header and the README's tutorial) packs the
    examples for the --seq_len it trains with (a run with another is refused)."""
    with open(os.path.join(ROOT, "configs", name)) as f:
        config = f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    (seq_len,) = re.findall(r"^--seq_len=(\d+)$", config, flags=re.M)
    (data_dir,) = re.findall(r"^--train_file=(.+)/[^/]+$", config, flags=re.M)
    header = config.replace("\\\n#", " ")  # the recipe's continued line joined
    recipes = [
        line
        for text in (header, readme)
        for line in text.splitlines()
        if "jaxllmq.data.prepare" in line and f"--out_dir={data_dir}" in line.split()
    ]
    assert len(recipes) == 2
    for recipe in recipes:
        assert " --pack " in f"{recipe} " and f" --seq_len={seq_len} " in f"{recipe} ", recipe


def test_deterministic_picks_xla_attention_and_refuses_cudnn():
    spec = _parsed(ModelSpec, "--model=tiny", "--from_scratch", "--deterministic")
    ampere = dict(platform="gpu", compute_capability="8.0")  # where auto would pick cuDNN
    mesh_shape = dict(data=1, fsdp=1, tensor=1)
    assert make_plan(preset("tiny"), spec, mesh_shape=mesh_shape, **ampere).attention == "xla"
    with pytest.raises(SettingError, match="--deterministic with --attention=cudnn"):
        _parsed(ModelSpec, "--model=tiny", "--from_scratch", "--deterministic", "--attention=cudnn")
