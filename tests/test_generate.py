"""Generation: the cached decode against the full forward and transformers' greedy generate,
seeded sampling, the CLI on an exported model, and the trainer's `sample` records."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hf_models import tiny_gemma3, tiny_llama, tiny_qwen2, tiny_qwen3
from tiny_tokenizer import write_tiny_tokenizer
from tokenizers import Tokenizer
from train_here import train_here

from jaxllmq import generate as gen
from jaxllmq.data.shards import write_shard
from jaxllmq.model import hf
from jaxllmq.model.llama import KVCache, params_of

EOS = "<eos>"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


# Gemma 3's local layers' window (8) is shorter than the decoded sequences: scanned in groups
# of its layer kinds or unrolled, each layer with its own window.
BUILDERS = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "gemma3": tiny_gemma3}


@pytest.fixture(params=sorted(BUILDERS), scope="module")
def hf_dir(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    ref = BUILDERS[request.param](path)
    model = hf.from_pretrained(path, attention="xla")
    return path, ref, model


def _tokens(vocab: int, shape: tuple[int, int], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=shape, dtype=np.int32)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_cached_logits_equal_the_full_forward(hf_dir, scan_layers):
    path, _, _ = hf_dir
    model = hf.from_pretrained(path, attention="xla", scan_layers=scan_layers)
    cfg, params, graphdef = model.cfg, params_of(model), nnx.graphdef(model)
    tokens = _tokens(cfg.vocab_size, (2, 21), seed=0)
    full = np.asarray(model.logits(tokens))
    # Prefill 13 tokens, then one token per step, as decoding runs (a longer cache than used).
    cache = KVCache.empty(cfg, 2, 32, jnp.float32)
    step = jax.jit(lambda p, t, c: nnx.merge(graphdef, p).cached_logits(t, c))
    logits, cache = step(params, tokens[:, :13], cache)
    parts = [np.asarray(logits)]
    for i in range(13, 21):
        logits, cache = step(params, tokens[:, i : i + 1], cache)
        parts.append(np.asarray(logits))
    assert (np.asarray(cache.length) == 21).all()
    assert np.abs(np.concatenate(parts, axis=1) - full).max() < 1e-5


def test_greedy_equals_transformers_generate(hf_dir):
    _, ref, model = hf_dir
    cfg, params = model.cfg, params_of(model)
    prompt = _tokens(cfg.vocab_size, (2, 11), seed=1)
    M = 20
    decode = jax.jit(gen.make_decode(cfg, max_new_tokens=M))  # no EOS: all M tokens
    ours = np.asarray(decode(params, prompt, np.int32(11), jax.random.key(0)))
    with torch.no_grad():
        theirs = ref.generate(
            torch.as_tensor(prompt, dtype=torch.long),
            attention_mask=torch.ones(prompt.shape, dtype=torch.long),
            do_sample=False,
            max_new_tokens=M,
            min_new_tokens=M,
            pad_token_id=0,
        )
    np.testing.assert_array_equal(ours, theirs[:, 11:].numpy())

    # A prompt padded to a longer width continues exactly as the unpadded one.
    padded = np.concatenate([prompt, _tokens(cfg.vocab_size, (2, 5), seed=2)], axis=1)
    again = np.asarray(decode(params, padded, np.int32(11), jax.random.key(0)))
    np.testing.assert_array_equal(again, ours)


def test_sampling_is_deterministic_for_a_seed(model_dir):
    model = hf.from_pretrained(str(model_dir))
    cfg, params = model.cfg, params_of(model)
    prompt = np.tile(_tokens(cfg.vocab_size, (1, 6), seed=3), (3, 1))
    decode = jax.jit(gen.make_decode(cfg, max_new_tokens=12, temperature=1.5, top_p=0.95))
    a, b, c = (
        np.asarray(decode(params, prompt, np.int32(6), jax.random.key(s))) for s in (7, 7, 8)
    )
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    assert len({tuple(row) for row in a}) > 1  # the samples of one prompt differ


def test_top_p_keeps_the_nucleus():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
    draws = np.asarray(
        [gen.sample_token(logits, jax.random.key(s), 1.0, 0.7)[0] for s in range(200)]
    )
    assert set(draws) == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3: the two most likely only
    tiny_p = [gen.sample_token(logits, jax.random.key(s), 1.0, 1e-6)[0] for s in range(20)]
    assert set(np.asarray(tiny_p)) == {0}
    assert int(gen.sample_token(logits, jax.random.key(0), 0.0, 1.0)[0]) == 0


# ---- with a tokenizer: the CLI, errors, the trainer ----


def _sentences(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(3, 12))) + "." for _ in range(n)]


def _write_tokenizer(path) -> Tokenizer:
    """A tiny byte-level BPE tokenizer (300 ids) and its config naming the EOS token."""
    return write_tiny_tokenizer(path, _sentences(200, 0), EOS)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """An exported tiny Llama (vocab 311) with a 300-id tokenizer beside it."""
    path = tmp_path_factory.mktemp("with_tok")
    tiny_llama(str(path))
    _write_tokenizer(path)
    return path


def _generate_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxllmq.generate", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_samples_from_an_exported_model(model_dir):
    proc = _generate_cli(
        f"--model={model_dir}", "--prompt=alpha beta", "--num_samples=2", "--max_new_tokens=8"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "--- sample 1" and "--- sample 2" in lines
    assert lines[1].startswith("alpha beta")
    # The same seed in this process: the same texts.
    cfg, params, tok_dir = gen.load(model=str(model_dir))
    texts = gen.generate(cfg, params, tok_dir, "alpha beta", max_new_tokens=8, num_samples=2)
    assert proc.stdout == "".join(
        f"--- sample {i + 1}\nalpha beta{t}\n" for i, t in enumerate(texts)
    )


def test_clear_errors(model_dir, tmp_path):
    proc = _generate_cli(f"--model={tmp_path}/missing", "--prompt=a")
    assert proc.returncode == 1 and "no such directory" in proc.stderr
    assert "Traceback" not in proc.stderr
    cfg, params, tok_dir = gen.load(model=str(model_dir))
    with pytest.raises(gen.GenerateError, match="empty"):
        gen.generate(cfg, params, tok_dir, "")
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    with pytest.raises(gen.GenerateError, match="no tokenizer.json"):
        gen.generate(*gen.load(model=str(bare)), "alpha")
    with pytest.raises(gen.GenerateError, match="exactly one"):
        gen.load()


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Token shards of the tiny tokenizer's text, the tokenizer beside them (as prepare does)."""
    d = tmp_path_factory.mktemp("tok_shards")
    tok = _write_tokenizer(d)
    eos = tok.token_to_id(EOS)
    ids = np.concatenate([tok.encode(s).ids + [eos] for s in _sentences(600, 1)])
    write_shard(d / "train-000.bin", ids.astype(np.int32), vocab_size=tok.get_vocab_size())
    return d


def _train(shards, out, *extra: str) -> subprocess.CompletedProcess:
    return train_here(
        "--model=tiny",
        "--from_scratch",
        f"--train_file={shards}/train-*.bin",
        "--seq_len=32",
        "--batch_size=1",
        "--matmul_dtype=float32",
        "--steps=4",
        f"--log_file={out}/log.jsonl",
        *extra,
    )


def test_trainer_logs_samples_and_its_checkpoint_generates(shards, tmp_path):
    proc = _train(
        shards,
        tmp_path,
        "--sample_every_n_steps=2",
        "--sample_prompts=alpha ,beta gamma",
        "--sample_max_new_tokens=6",
        f"--checkpoint_dir={tmp_path}/ckpt",
        "--save_training_state",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "log.jsonl") as f:
        samples = [r for r in map(json.loads, f) if r["log"] == "sample"]
    assert [(r["step"], r["prompt"]) for r in samples] == [
        (2, "alpha "),
        (2, "beta gamma"),
        (4, "alpha "),
        (4, "beta gamma"),
    ]
    assert all(isinstance(r["text"], str) for r in samples)
    assert "sample step 2 | 'alpha " in proc.stdout

    # The checkpoint, read as `generate --checkpoint` does, with the data's tokenizer: its greedy
    # text is the trainer's last sample.
    cfg, params, tok_dir = gen.load(checkpoint_spec=f"{tmp_path}/ckpt")
    assert os.path.samefile(tok_dir, shards)
    (text,) = gen.generate(cfg, params, tok_dir, "alpha ", max_new_tokens=6, temperature=0)
    assert text == samples[2]["text"]


def test_trainer_refuses_samples_without_a_tokenizer(shards, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(shards / "train-000.bin", bare)
    proc = _train(bare, tmp_path, "--sample_every_n_steps=2")
    assert proc.returncode == 1
    assert "--sample_every_n_steps needs a tokenizer" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_decoding_stops_at_eos(model_dir):
    model = hf.from_pretrained(str(model_dir))
    cfg, params = model.cfg, params_of(model)
    prompt = _tokens(cfg.vocab_size, (2, 7), seed=4)
    free = np.asarray(
        jax.jit(gen.make_decode(cfg, max_new_tokens=10))(params, prompt, 7, jax.random.key(0))
    )
    eos = int(free[0, 3])
    first = int(np.argmax(free[0] == eos))  # the first time row 0 writes it
    stop = gen.make_decode(cfg, max_new_tokens=10, eos_ids=(eos,))
    out = np.asarray(jax.jit(stop)(params, prompt, 7, jax.random.key(0)))
    np.testing.assert_array_equal(out[0, : first + 1], free[0, : first + 1])
    assert (out[0, first:] == eos).all()  # then only EOS
    assert gen.cut_at_eos(out[0], (eos,)) == free[0, :first].tolist()
