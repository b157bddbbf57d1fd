"""The prepare CLI: tokenize .txt/.jsonl/.parquet into shards the pipeline reads; masks; errors."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tiny_tokenizer import write_tiny_tokenizer
from tokenizers import Tokenizer

from jaxllmq.cli.prepare import main
from jaxllmq.data.pipeline import TokenBatches
from jaxllmq.data.shards import open_shard

EOS = "</s>"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def sentences(n, seed):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(3, 30))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A tiny byte-level BPE tokenizer, config files as a Hugging Face model directory has them."""
    path = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(path, sentences(200, 0), EOS)
    return path


def prepare(*flags, check=True):
    """Run the CLI as a user does; returns the completed process."""
    cmd = [sys.executable, "-m", "jaxllmq.data.prepare", *flags]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def prepare_here(*flags):
    """Run the CLI's main() in this process (faster); returns its error line, or None."""
    try:
        main(["prepare", *flags])
    except SystemExit as e:
        return e.code
    return None


def documents_of(paths, tokenizer_dir):
    """Decode shards back into documents, split at EOS, with each token's mask."""
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    tokens = np.concatenate([open_shard(p).tokens for p in paths])
    masks = np.concatenate([open_shard(p).mask(0, open_shard(p).num_tokens) for p in paths])
    ends = np.flatnonzero(tokens == eos) + 1
    assert ends[-1] == len(tokens), "every document ends with EOS"
    return [
        (tok.decode(tokens[a : b - 1].tolist()), masks[a:b])
        for a, b in zip(np.r_[0, ends[:-1]], ends, strict=True)
    ]


def test_cli_tokenizes_txt_jsonl_parquet_into_readable_shards(tmp_path, tokenizer_dir):
    txt, jsonl, parquet = sentences(30, 1), sentences(60, 2), sentences(40, 3)
    (tmp_path / "a.txt").write_text("\n\n".join(txt))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in jsonl))
    pq.write_table(pa.table({"body": parquet, "id": range(40)}), tmp_path / "c.parquet")
    out = tmp_path / "out"
    done = prepare(
        f"--input={tmp_path}/*.txt,{tmp_path}/*.jsonl",
        f"--input={tmp_path / 'c.parquet'}",
        f"--tokenizer={tokenizer_dir}",
        f"--out_dir={out}",
        "--text-field=body",  # llmq's dashed spelling works too
        "--txt_documents=paragraph",
        "--shard_tokens=600",
        "--eval_fraction=0.1",
        "--workers=2",
    )
    assert "train shard(s)" in done.stdout and "vocab 300" in done.stdout
    shards = sorted(str(p) for p in out.glob("train-*.bin"))
    assert len(shards) > 2 and all(open_shard(p).num_tokens == 600 for p in shards[:-1])
    assert (out / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    assert (out / "tokenizer_config.json").exists()
    train = documents_of(shards, tokenizer_dir)
    held_out = documents_of([out / "eval.bin"], tokenizer_dir)
    everything = txt + jsonl + parquet
    # Every document exactly once, in order, across train and eval; ~10% of tokens held out.
    assert sorted(d for d, _ in train + held_out) == sorted(everything)
    assert [d for d, _ in train] == [d for d in everything if d not in {h for h, _ in held_out}]
    eval_tokens = open_shard(out / "eval.bin").num_tokens
    total = eval_tokens + sum(open_shard(p).num_tokens for p in shards)
    assert 0.08 < eval_tokens / total < 0.15
    assert not any(open_shard(p).has_mask for p in shards)
    batches = TokenBatches(str(out / "train-*.bin"), seq_len=16, batch_size=4, process_count=1)
    assert batches.vocab_size == 300
    batch = next(batches)
    assert batch["inputs"].shape == (1, 4, 16) and batch["inputs"].max() < 300


def test_prompt_response_masks_train_only_the_response(tmp_path, tokenizer_dir):
    rows = [{"prompt": f"alpha {w} ?", "response": f" {w} beta."} for w in WORDS]
    rows.insert(3, {"text": "gamma gamma."})  # plain documents mix in, fully trained
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    prepare(
        f"--input={tmp_path / 'sft.jsonl'}",
        f"--tokenizer={tokenizer_dir / 'tokenizer.json'}",
        f"--out_dir={out}",
        "--eval_fraction=0",
        "--workers=1",
    )
    assert not (out / "eval.bin").exists()
    assert open_shard(out / "train-000.bin").has_mask
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    docs = documents_of([out / "train-000.bin"], tokenizer_dir)
    assert len(docs) == len(rows)
    for row, (text, mask) in zip(rows, docs, strict=True):
        if "text" in row:
            assert text == row["text"] and mask.all()
            continue
        n_prompt = len(tok.encode(row["prompt"]).ids)
        assert text == row["prompt"] + row["response"]
        assert not mask[:n_prompt].any() and mask[n_prompt:].all()  # response and its EOS
        assert len(mask) == n_prompt + len(tok.encode(row["response"]).ids) + 1


def test_eos_from_config_json_and_missing_eos_error(tmp_path, tokenizer_dir):
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    (tmp_path / "a.txt").write_text("alpha beta")
    args = [
        f"--input={tmp_path / 'a.txt'}",
        f"--tokenizer={model}",
        "--eval_fraction=0",
        "--workers=1",
    ]
    error = prepare_here(*args, f"--out_dir={tmp_path / 'x'}")
    assert "no EOS token known" in error and "pass --eos_token" in error
    (model / "config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    assert prepare_here(*args, f"--out_dir={tmp_path / 'y'}") is None
    assert open_shard(tmp_path / "y" / "train-000.bin").tokens[-1] == 7
    prepare_here(*args, f"--out_dir={tmp_path / 'z'}", f"--eos_token={EOS}")
    assert open_shard(tmp_path / "z" / "train-000.bin").tokens[-1] == 0


@pytest.mark.parametrize(
    "name, content, extra, message",
    [
        ("a.txt", None, [], r"--input: no files match '.*a.txt'"),
        (
            "bad.jsonl",
            '{"text": "ok"}\n{"title": "x"}\n',
            [],
            r"bad.jsonl:2: record has neither a 'text' field nor 'prompt' \+ 'response'",
        ),
        ("bad.jsonl", '{"text": "ok"\n', [], r"bad.jsonl:1: not JSON"),
        ("a.csv", "alpha", [], r"'.*a.csv' is not one of .txt, .jsonl, .parquet"),
        ("a.txt", "alpha", ["--eos_token=<nope>"], "EOS token '<nope>' .* not in the tokenizer"),
        ("a.txt", "alpha", ["--eval_tokens=99"], "no train tokens: all 2 tokens .* to eval.bin"),
    ],
)
def test_bad_inputs_give_clear_errors(tmp_path, tokenizer_dir, name, content, extra, message):
    if content is not None:
        (tmp_path / name).write_text(content)
    out = tmp_path / "out"
    error = prepare_here(
        f"--input={tmp_path / name}",
        f"--tokenizer={tokenizer_dir}",
        f"--out_dir={out}",
        "--workers=1",
        *extra,
    )
    assert error.startswith("error:") and "\n" not in error
    assert re.search(message, error), error
    assert not list(out.glob("train-*.bin"))


def test_refuses_to_mix_with_old_shards_unless_overwrite(tmp_path, tokenizer_dir):
    (tmp_path / "a.txt").write_text("alpha beta gamma")
    args = [f"--input={tmp_path / 'a.txt'}", f"--tokenizer={tokenizer_dir}", "--workers=1"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "train-007.bin").write_bytes(b"stale")
    assert "pass --overwrite" in prepare_here(*args, f"--out_dir={out}")
    bad_eos = prepare_here(*args, f"--out_dir={out}", "--overwrite", "--eos_token=<nope>")
    assert "not in the tokenizer's vocab" in bad_eos
    assert (out / "train-007.bin").exists(), "a run that fails its checks deletes nothing"
    prepare_here(*args, f"--out_dir={out}", "--overwrite", "--eval_fraction=0")
    assert sorted(p.name for p in out.glob("*.bin")) == ["train-000.bin"]


def test_quickstart_is_deterministic_and_fits_the_tiny_model(tmp_path):
    flags = ["--quickstart", "--quickstart_mb=0.3", "--vocab_size=512", "--shard_tokens=20000"]
    first = prepare(*flags, f"--out_dir={tmp_path / 'a'}", "--workers=2")
    prepare_here(*flags, f"--out_dir={tmp_path / 'b'}", "--workers=1")  # same output either way
    assert "standard library files" in first.stdout and "EOS id 0" in first.stdout
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names[:4] == ["eos.json", "eval.bin", "tokenizer.json", "tokenizer_config.json"]
    assert len(names) > 5  # several train shards
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    config = json.loads((tmp_path / "a" / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    assert config["eos_token"] == "<|endoftext|>" and tok.token_to_id("<|endoftext|>") == 0
    assert tok.get_vocab_size() == 512
    data = TokenBatches(str(tmp_path / "a" / "train-*.bin"), seq_len=64, batch_size=8)
    assert data.vocab_size == 512
    assert data.validate(8192, note=lambda _: None) > 0  # the tiny preset's vocab
    assert tok.decode(next(data)["inputs"][0, 0].tolist())  # real text comes back


def test_prepare_and_its_workers_import_no_jax():
    """Tokenizing needs no jax, and importing it cost each process (the CLI's and every worker's,
    which imports jaxllmq.data.prepare) about 2 s; in a fresh process, as the workers start."""
    code = (
        "import sys, jaxllmq.data.prepare, jaxllmq.cli.prepare; "
        "print(' '.join(m for m in ('jax', 'flax', 'grain') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [], f"imported: {done.stdout.strip()}"
