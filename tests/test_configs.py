"""Every flagfile under configs/ parses and validates: its flags exist, its values are allowed
and its model and data paths are the only things a user has to supply."""

import glob
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from hf_models import tiny_qwen2

from jaxllmq.data.shards import write_shard
from jaxllmq.tokenizer_files import write_eos_id

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.flags")))

CHECK = """
import sys
from jaxllmq.cli import flags
from jaxllmq.settings import TrainConfig
flags.define(TrainConfig)
flags.parse_argv(sys.argv)
cfg = flags.build(TrainConfig)
print(cfg.model.model, cfg.steps, cfg.epochs, cfg.data.document_masking)
"""
# Configs that train on documents masked apart (each attends to itself only).
DOCUMENT_MASKING = (
    "llama-3.2-1b-pretrain.flags",
    "qwen2.5-0.5b-finetune.flags",
    "qwen2.5-0.5b-chat.flags",
)


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_flagfile_parses_and_validates(path, tmp_path):
    write_shard(tmp_path / "t.bin", np.arange(4096, dtype=np.int32) % 200, vocab_size=256)
    write_eos_id(str(tmp_path), 0)  # as prepare writes it beside the shards
    data = [f"--train_file={tmp_path}/t.bin", f"--eval_file={tmp_path}/t.bin"]
    # A fine-tuning flagfile names an HF directory the user supplies: a tiny one stands in.
    with open(path) as f:
        from_hf = "--from_scratch" not in f.read().split()
    if from_hf:
        tiny_qwen2(str(tmp_path / "hf"))
        data.append(f"--model={tmp_path}/hf")
    out = subprocess.run(
        [sys.executable, "-c", CHECK, f"--flagfile={path}", *data],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    masking = out.stdout.split()[-1] == "True"
    assert masking == (os.path.basename(path) in DOCUMENT_MASKING)


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


ATTENTION = """
import sys
from jaxllmq.cli import flags
from jaxllmq.model.architecture import preset
from jaxllmq.plan import make_plan
from jaxllmq.settings import ModelSpec
flags.define(ModelSpec)
flags.parse_argv(sys.argv)
spec = flags.build(ModelSpec)
ampere = dict(platform="gpu", compute_capability="8.0")  # where auto would pick cuDNN
print(make_plan(preset("tiny"), spec, mesh_shape=dict(data=1, fsdp=1, tensor=1), **ampere).attention)
"""


def test_deterministic_picks_xla_attention_and_refuses_cudnn():
    def run(*flags):
        return subprocess.run(
            [sys.executable, "-c", ATTENTION, "--model=tiny", "--from_scratch", *flags],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )

    assert run("--deterministic").stdout.split() == ["xla"]
    refused = run("--deterministic", "--attention=cudnn")
    assert refused.returncode != 0 and "--deterministic with --attention=cudnn" in refused.stderr
