"""Every flagfile under configs/ parses and validates: its flags exist, its values are allowed
and its model and data paths are the only things a user has to supply."""

import glob
import os
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
print(cfg.model.model, cfg.steps, cfg.epochs)
"""


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_flagfile_parses_and_validates(path, tmp_path):
    write_shard(tmp_path / "t.bin", np.arange(4096, dtype=np.int32) % 200, vocab_size=256)
    write_eos_id(str(tmp_path), 0)  # as prepare writes it (--document_masking reads it)
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


ATTENTION = """
import sys
from jaxllmq.cli import flags
from jaxllmq.model.architecture import preset
from jaxllmq.plan import make_plan
from jaxllmq.settings import ModelSpec
flags.define(ModelSpec)
flags.parse_argv(sys.argv)
spec = flags.build(ModelSpec)
hopper = dict(platform="gpu", compute_capability="9.0")  # where auto would pick cuDNN
print(make_plan(preset("tiny"), spec, mesh_shape=dict(data=1, fsdp=1, tensor=1), **hopper).attention)
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
