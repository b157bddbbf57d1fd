"""Multi-process on CPU: launch/local.sh with 2 processes x 2 devices, its master weights and
moments offloaded to host memory, trains like 1 x 4 without offload, and its checkpoint resumes
in one process (those two runs: main() on 4 of this process's devices)."""

import json
import os
import subprocess
import sys

import numpy as np
from train_here import train_here

from jaxllmq.data.shards import write_shard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _flags(data: str, out: str, steps: int = 4, *, multi: bool = False) -> list[str]:
    # Only the two-process run evaluates and exports (across processes, what is checked here);
    # one process's eval and export are the other tests', and cost these runs ~10 s of compiling.
    return [
        "--model=tiny",
        "--from_scratch",
        f"--train_file={data}/train.bin",
        *([f"--eval_file={data}/train.bin", f"--out_dir={out}/model"] if multi else []),
        "--seq_len=32",
        "--batch_size=2",
        "--matmul_dtype=float32",
        f"--steps={steps}",
        "--lr_schedule=wsd",  # a constant lr: a run stopped early trains like a longer one
        "--final_lr_fraction=1",
        "--eval_every_n_steps=0",
        "--zero_level=3",
        f"--log_file={out}/log.jsonl",
    ]


def _losses(path: str) -> list[float]:
    with open(path) as f:
        return [r["loss"] for r in map(json.loads, f) if r["log"] == "step"]


def test_two_processes_match_one_and_resume_in_one(tmp_path):
    rng = np.random.default_rng(0)
    write_shard(tmp_path / "train.bin", rng.integers(0, 256, 20000, dtype=np.int32), vocab_size=256)
    # The suite's XLA flags (fast compiles) carry over; the device count given after them wins.
    env = dict(os.environ)
    ckpt = [f"--checkpoint_dir={tmp_path}/ckpt", "--save_training_state", "--ckpt_interval=0"]
    two = subprocess.run(
        [
            "bash",
            os.path.join(ROOT, "launch/local.sh"),
            "2",
            *_flags(str(tmp_path), f"{tmp_path}/two", 6, multi=True),
            *ckpt,
            "--steps=4",
            *("--offload_master", "--offload_opt_m", "--offload_opt_v"),
        ],
        env={**env, "JAXLLMQ_CPU_DEVICES": "2", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    one = train_here(*_flags(str(tmp_path), f"{tmp_path}/one", 6), "--gpus=4")
    assert one.returncode == 0, one.stderr[-3000:]
    two_losses, one_losses = (
        _losses(f"{tmp_path}/two/log.jsonl"),
        _losses(f"{tmp_path}/one/log.jsonl"),
    )
    assert len(two_losses) == 4  # process 0 alone writes the log
    np.testing.assert_allclose(two_losses, one_losses[:4], rtol=1e-5)
    # The model is exported once, whole, by process 0 (gathered from both processes' shards).
    assert os.path.exists(f"{tmp_path}/two/model/model.safetensors")
    # The two-process run's checkpoint (written collectively) resumes in one process.
    resumed = train_here(
        *_flags(str(tmp_path), f"{tmp_path}/two", 6), *ckpt, "--continue=latest", "--gpus=4"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    np.testing.assert_allclose(_losses(f"{tmp_path}/two/log.jsonl")[4:], one_losses[4:], rtol=1e-5)
