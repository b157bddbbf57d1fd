"""The training command end to end: train, log and export; bad flags and input. Through main() in
this process (train_here); a real process trains in test_readme.py's tutorial, and prints its one
error line in test_bad_input.py."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import transformers
from test_log import read_tensorboard_scalars
from train_here import train_here

from jaxllmq.data.shards import write_shard

VOCAB = 256


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxllmq.main", *args], capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    """Learnable data: a few short token patterns repeated with noise, train and eval shards."""
    d = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    motifs = [rng.integers(0, VOCAB, size=rng.integers(5, 12)) for _ in range(8)]

    def stream(n_docs: int) -> np.ndarray:
        return np.concatenate([motifs[i] for i in rng.integers(0, len(motifs), n_docs)])

    write_shard(d / "train-000.bin", stream(3000).astype(np.int32), vocab_size=VOCAB)
    write_shard(d / "train-001.bin", stream(3000).astype(np.int32), vocab_size=VOCAB)
    write_shard(d / "eval.bin", stream(400).astype(np.int32), vocab_size=VOCAB)
    (d / "tokenizer.json").write_text("{}")  # stands for the data's tokenizer: copied on export
    return str(d)


def _flags(shards: str, out: str, *extra: str) -> list[str]:
    return [
        "--model=tiny",
        "--from_scratch",
        f"--train_file={shards}/train-*.bin",
        f"--eval_file={shards}/eval.bin",
        "--seq_len=32",
        "--batch-size=1",  # llmq's dashed spelling works too
        "--matmul_dtype=float32",
        "--steps=16",
        "--lr=3e-3",
        "--warmup=5",
        "--eval_every_n_steps=8",
        "--eval_num_steps=2",
        "--name=e2e",
        f"--out_dir={out}/%n/model",
        f"--log_file={out}/%n/log.jsonl",
        *extra,
    ]


def test_train_end_to_end(shards, tmp_path):
    flagfile = tmp_path / "run.flags"
    flagfile.write_text("\n".join(_flags(shards, str(tmp_path))) + "\n--steps=5\n")
    # The flagfile says 5 steps; the later command-line flag wins.
    tb = tmp_path / "tb"
    proc = train_here(
        f"--flagfile={flagfile}", "--steps=16", "--log_gpu_util=8", f"--tensorboard_dir={tb}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "e2e" / "log.jsonl") as f:
        records = [json.loads(line) for line in f]
    kinds = {r["log"] for r in records}
    assert {"cmd", "options", "model", "gpu", "dataset", "step", "eval"} <= kinds
    model = next(r for r in records if r["log"] == "model")
    assert model["kernels"] == {"rms_norm": "xla", "lm_head_loss": "xla", "fp8_quantize": "xla"}
    gpus = [r for r in records if r["log"] == "gpu"]
    assert [r["step"] for r in gpus] == [0, 8, 16]  # at start, then every --log_gpu_util
    for gpu in gpus:
        assert len(gpu["devices"]) == 8 and gpu["devices"][0]["platform"] == "cpu"
    assert all({"log", "time", "step"} <= r.keys() for r in records)
    steps = [r for r in records if r["log"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 17))
    for r in steps:
        assert {"loss", "norm", "lr", "tokens", "duration_ms", "tokens_per_s", "mfu"} <= r.keys()
    evals = [r for r in records if r["log"] == "eval"]
    assert [r["step"] for r in evals] == [8, 16]
    assert evals[-1]["loss"] < evals[0]["loss"] - 0.5 < np.log(VOCAB)
    assert steps[-1]["loss"] < steps[0]["loss"] - 1.0
    scalars = read_tensorboard_scalars(tb)
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 17))
    assert [s for s, _ in scalars["eval/loss"]] == [8, 16]

    model_dir = tmp_path / "e2e" / "model"
    assert (model_dir / "tokenizer.json").exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    assert model.config.num_hidden_layers == 4 and model.config.vocab_size == 8192


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--lr=-1"], "lr"),
        (["--lr_schedule=exp"], "lr_schedule"),
        (["--epochs=2"], "exactly one of --steps and --epochs"),
        (["--no_such_flag=1"], "no_such_flag"),
        (["--batch_size=0"], "batch_size"),
    ],
)
def test_bad_flags_exit_1_naming_the_flag(shards, tmp_path, extra, message):
    # A value absl's parser refuses gets its message; a combination the settings refuse, one line.
    proc = train_here(*_flags(shards, str(tmp_path)), *extra)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "Flags parsing error" in proc.stderr or proc.stderr.startswith("error: ")
    assert message in proc.stderr


def test_a_bad_flag_ends_the_process_with_status_1(shards, tmp_path):
    # The cases above run in this process; absl's own message and exit, in a real one.
    proc = _run(*_flags(shards, str(tmp_path)), "--no_such_flag=1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("FATAL Flags parsing error: Unknown command line flag")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model=llama-9"], "--model=llama-9"),
        (["--model=/nonexistent", "--nofrom_scratch"], "no such Hugging Face model directory"),
        (["--train_file=/nonexistent/*.bin"], "--train_file"),
        # 160 rows on the 8 test devices: the train set (~1450 windows) has steps of them, the
        # eval set (~96 windows) not one batch.
        (["--batch_size=20"], "--eval_file"),
        (["--gpus=16"], "--gpus=16, but this process sees only 8 device(s)"),
        # Written only after training: refused before it.
        (["--out_dir=/proc/nope/model"], "--out_dir: cannot write to /proc/nope/model (/proc"),
    ],
)
def test_bad_input_is_one_clear_line(shards, tmp_path, extra, message):
    proc = train_here(*_flags(shards, str(tmp_path)), *extra)
    assert proc.returncode == 1
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "e2e" / "log.jsonl").exists()  # refused before the first step


def test_vocab_larger_than_the_model_is_refused(tmp_path):
    write_shard(tmp_path / "big.bin", np.arange(100, dtype=np.int32), vocab_size=50000)
    big = f"{tmp_path}/big.bin"
    proc = train_here(
        *_flags(str(tmp_path), str(tmp_path), f"--train_file={big}", f"--eval_file={big}")
    )
    assert proc.returncode == 1
    assert "big.bin" in proc.stderr and "vocab" in proc.stderr
    assert not os.path.exists(tmp_path / "e2e" / "model")
