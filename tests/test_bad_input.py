"""Bad model configs, weight files and flagfiles: one line naming the file or flag, exit 1.

Each case is checked at the function that refuses it; a few go through `python -m jaxllmq.main`
to check the one `error:` line on stderr, the exit code and that no traceback is printed.
"""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import time

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxllmq import memory
from jaxllmq.cli import flags
from jaxllmq.data.shards import write_shard
from jaxllmq.model import hf
from jaxllmq.model.architecture import PRESETS, ModelConfig, ModelConfigError
from jaxllmq.model.llama import abstract_model
from jaxllmq.setting import SettingError
from jaxllmq.settings import DataConfig

GIB = 1024**3
# A small model of the tiny preset's family: one layer, quick to write and read.
SMALL = dataclasses.replace(
    PRESETS["tiny"],
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("model") / "small")
    _, abstract, _ = abstract_model(SMALL)
    params = jax.tree.map(lambda s: np.full(s.shape, 0.01, s.dtype), abstract)
    hf.save_hf(path, SMALL, params)
    return path


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "train.bin"
    write_shard(path, np.arange(4096, dtype=np.int32) % 256, vocab_size=256)
    return str(path)


def _copy(model_dir: str, dst, *, config_edit=None, tensors_edit=None) -> str:
    """A copy of model_dir with its config.json dict and/or its tensors edited."""
    dst = str(dst)
    shutil.copytree(model_dir, dst)
    if config_edit is not None:
        with open(os.path.join(dst, "config.json")) as f:
            d = json.load(f)
        config_edit(d)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(d, f)
    if tensors_edit is not None:
        tensors = load_file(os.path.join(model_dir, WEIGHTS))
        tensors_edit(tensors)
        save_file(tensors, os.path.join(dst, WEIGHTS), {"format": "pt"})
    return dst


# ---- 1. --seq_len beyond max_position_embeddings ----


def test_seq_len_beyond_max_position_needs_the_flag():
    tiny = PRESETS["tiny"]  # 4096 positions
    data = DataConfig(train_files=("t.bin",), seq_len=8192)
    with pytest.raises(SettingError, match=r"--seq_len=8192.*4096.*--allow_seq_len_beyond"):
        data.check_seq_len(tiny, "tiny")
    dataclasses.replace(data, seq_len=4096).check_seq_len(tiny, "tiny")
    allowed = dataclasses.replace(data, allow_seq_len_beyond_max_position=True)
    allowed.check_seq_len(tiny, "tiny")


# ---- 2. weight tensors that are not floating point ----


def test_non_float_tensors_are_refused_naming_them_half_ones_read(model_dir, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    for dtype, code in [(np.int8, "I8"), (np.uint8, "U8"), (np.bool_, "BOOL")]:
        bad = _copy(
            model_dir,
            tmp_path / code,
            tensors_edit=lambda t, dtype=dtype: t.update({name: t[name].astype(dtype)}),
        )
        pattern = re.escape(f"{bad}/{WEIGHTS}: tensor {name} has dtype {code}")
        with pytest.raises(hf.CheckpointFormatError, match=pattern):
            hf.from_pretrained(bad)

    def to_half(t):
        for i, name in enumerate(sorted(t)):
            t[name] = t[name].astype(ml_dtypes.bfloat16 if i % 2 else np.float16)

    half = _copy(model_dir, tmp_path / "half", tensors_edit=to_half)
    model = hf.from_pretrained(half)
    assert float(model.norm[...][0]) == pytest.approx(0.01, rel=1e-2)


# ---- 3. sizes no machine holds: refused from the parameter count, at once ----


@pytest.mark.parametrize(
    "field, value",
    [("hidden_size", 10**9), ("num_hidden_layers", 10**6), ("vocab_size", 10**12)],
)
def test_absurd_sizes_are_refused_before_anything_is_read(
    model_dir, tmp_path, monkeypatch, field, value
):
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 64 * GIB)

    def edit(d):
        d[field] = value
        d.pop("head_dim")

    big = _copy(model_dir, tmp_path / "big", config_edit=edit)
    os.remove(os.path.join(big, WEIGHTS))  # never opened: refused before
    start = time.perf_counter()
    with pytest.raises(ModelConfigError, match=re.escape(big) + r"/config.json: [\d,]+ param"):
        hf.from_pretrained(big)
    cfg = ModelConfig.from_hf_dir(big)
    with pytest.raises(ModelConfigError, match=r"--model=big: [\d,]+ parameters need at least"):
        memory.check_training_fits(
            cfg,
            "--model=big",
            model_dtype="float32",
            opt_m_dtype="float32",
            opt_v_dtype="float32",
            offload=True,
            devices=jax.devices(),
        )
    assert time.perf_counter() - start < 2.0


@dataclasses.dataclass
class FakeGpu:
    """A GPU as device_memory_bytes sees it: its platform, process and allocator limit."""

    bytes_limit: int
    platform: str = "gpu"
    process_index: int = 0

    def memory_stats(self):
        return {"bytes_limit": self.bytes_limit}


def test_training_floor_sums_the_devices_and_the_host_when_offloading(monkeypatch):
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: 64 * GIB)
    cfg = PRESETS["llama-3.1-8b"]  # 8.0e9 parameters: 119.7 GiB of fp32 state and gradients
    kw = dict(model_dtype="float32", opt_m_dtype="float32", opt_v_dtype="float32")
    two = [FakeGpu(40 * GIB), FakeGpu(40 * GIB)]
    with pytest.raises(ModelConfigError, match=r"8,030,261,248 .* 119\.7 GiB.* 80\.0 GiB of 2 gpu"):
        memory.check_training_fits(cfg, "--model=llama-3.1-8b", **kw, offload=False, devices=two)
    memory.check_training_fits(cfg, "--model=llama-3.1-8b", **kw, offload=True, devices=two)
    bf16 = dict(model_dtype="bfloat16", opt_m_dtype="bfloat16", opt_v_dtype="bfloat16")
    memory.check_training_fits(cfg, "--model=llama-3.1-8b", **bf16, offload=False, devices=two)


# ---- 4. config.json that is not an object of the right types ----


@pytest.mark.parametrize(
    "blob, pattern",
    [
        (b"[1, 2]", "expected a JSON object, got list"),
        (b'"LlamaForCausalLM"', "expected a JSON object, got str"),
        (b"\x89PNG\r\n\x1a\n", "not valid JSON"),  # not UTF-8
        (b'{"hidden_size": 1' + b"0" * 5000 + b"}", "not valid JSON"),  # past int's digit limit
    ],
)
def test_config_json_that_is_not_an_object_names_the_file(tmp_path, blob, pattern):
    (tmp_path / "config.json").write_bytes(blob)
    with pytest.raises(ModelConfigError, match=re.escape(f"{tmp_path}/config.json: {pattern}")):
        ModelConfig.from_hf_dir(str(tmp_path))


@pytest.mark.parametrize("value", ["256", 256.0, True, None])
def test_config_field_of_the_wrong_type_names_it(model_dir, tmp_path, value):
    bad = _copy(model_dir, tmp_path / "bad", config_edit=lambda d: d.update(hidden_size=value))
    message = f"{bad}/config.json: hidden_size must be a positive integer, got {value!r}"
    with pytest.raises(ModelConfigError, match=re.escape(message)):
        ModelConfig.from_hf_dir(bad)


# ---- 5. damaged weight files and indexes ----


@pytest.mark.parametrize(
    "damage, pattern",
    [
        (lambda b: b[: len(b) // 2], "not a readable safetensors file"),
        (lambda b: b"garbage" * 20, "not a readable safetensors file"),
        (lambda b: b"", "not a readable safetensors file"),
    ],
)
def test_damaged_safetensors_names_the_file(model_dir, tmp_path, damage, pattern):
    bad = _copy(model_dir, tmp_path / "bad")
    weights = os.path.join(bad, WEIGHTS)
    with open(weights, "rb") as f:
        blob = f.read()
    with open(weights, "wb") as f:
        f.write(damage(blob))
    with pytest.raises(hf.CheckpointFormatError, match=re.escape(f"{weights}: {pattern}")):
        hf.from_pretrained(bad)


@pytest.mark.parametrize(
    "index, pattern",
    [
        (
            '{"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}',
            "names shard",
        ),
        ("not json", "cannot read it as JSON"),
        ('{"metadata": {}}', "no 'weight_map'"),
        ("[]", "no 'weight_map'"),
        ('{"weight_map": [1]}', "'weight_map' must map"),
    ],
)
def test_bad_index_names_it(model_dir, tmp_path, index, pattern):
    bad = _copy(model_dir, tmp_path / "bad")
    os.rename(os.path.join(bad, WEIGHTS), os.path.join(bad, "model-00001-of-00002.safetensors"))
    (tmp_path / "bad" / "model.safetensors.index.json").write_text(index)
    message = f"{bad}/model.safetensors.index.json: {pattern}"
    with pytest.raises(hf.CheckpointFormatError, match=re.escape(message)):
        hf.from_pretrained(bad)


# ---- 6. flagfiles that cannot be read ----


def test_unreadable_flagfile_is_one_line(tmp_path, capsys):
    for path, reason in [(tmp_path / "none.flags", "No such file"), (tmp_path, "Is a directory")]:
        with pytest.raises(SystemExit) as e:
            flags.parse_argv(["main", f"--flagfile={path}"])
        assert str(e.value.code).startswith(f"error: --flagfile={path}: cannot read it ({reason}")


# ---- through the entry point: one line, exit 1, no traceback ----


def _bad_model(model_dir, tmp_path, case: str) -> tuple[list[str], str]:
    """Flags for a bad-input case and what its error line must name."""
    if case == "seq_len":
        return [f"--model={model_dir}", "--seq_len=128"], "--allow_seq_len_beyond_max_position"
    if case == "int8":
        name = "model.norm.weight"
        bad = _copy(
            model_dir, tmp_path / "m", tensors_edit=lambda t: t.update({name: t[name].astype("i1")})
        )
        return [f"--model={bad}"], f"{bad}/{WEIGHTS}: tensor {name} has dtype I8"
    if case == "vocab":
        bad = _copy(model_dir, tmp_path / "m", config_edit=lambda d: d.update(vocab_size=10**12))
        return [f"--model={bad}"], f"--model={bad}: 128,000,000,"
    if case == "field":
        bad = _copy(model_dir, tmp_path / "m", config_edit=lambda d: d.update(hidden_size="64"))
        return [f"--model={bad}"], f"{bad}/config.json: hidden_size must be a positive integer"
    if case == "shard":
        bad = _copy(model_dir, tmp_path / "m")
        index = os.path.join(bad, "model.safetensors.index.json")
        with open(index, "w") as f:
            json.dump({"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}, f)
        return [f"--model={bad}"], f"{index}: names shard files that are not in"
    assert case == "flagfile"
    return [f"--flagfile={tmp_path}/missing.flags"], f"--flagfile={tmp_path}/missing.flags"


@pytest.mark.parametrize("case", ["seq_len", "int8", "vocab", "field", "shard", "flagfile"])
def test_main_prints_one_error_line(model_dir, train_file, tmp_path, case):
    flags, names = _bad_model(model_dir, tmp_path, case)
    common = [f"--train_file={train_file}", "--seq_len=32", "--batch_size=1", "--steps=1"]
    proc = subprocess.run(
        [sys.executable, "-m", "jaxllmq.main", *common, *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert names in lines[0]
