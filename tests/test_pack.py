"""prepare --pack: fine-tuning examples placed whole into the pipeline's windows, padded with
untrained tokens; with --document_masking each example gets the loss it gets alone."""

import collections
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_tokenizer import write_tiny_tokenizer
from train_here import train_here

from jaxllmq.cli.prepare import main
from jaxllmq.data.pack import PACK_FILE, Packer, best_fit_decreasing, pad_id
from jaxllmq.data.pipeline import TokenBatches
from jaxllmq.data.shards import open_shard
from jaxllmq.model.architecture import preset
from jaxllmq.model.llama import Llama
from jaxllmq.setting import SettingError
from jaxllmq.settings import DataConfig

EOS = "</s>"
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
T = 63  # --seq_len: windows of 64 tokens


def _words(rng, lo, hi):
    return " ".join(rng.choice(WORDS, rng.integers(lo, hi)))


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A tokenizer directory and prompt/response jsonl (a few plain texts mixed in), some
    examples longer than a window: (directory, EOS id)."""
    path = tmp_path_factory.mktemp("chat")
    rng = np.random.default_rng(0)
    tok = write_tiny_tokenizer(path, [_words(rng, 3, 30) for _ in range(200)], EOS)
    rows = [{"prompt": _words(rng, 1, 12), "response": _words(rng, 1, 25)} for _ in range(150)]
    rows[10] = {"prompt": _words(rng, 40, 50), "response": _words(rng, 40, 50)}  # overlong
    rows[20] = {"prompt": _words(rng, 80, 90), "response": "alpha"}  # its prompt fills a window
    rows[30] = {"text": _words(rng, 5, 10)}
    (path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, tok.token_to_id(EOS)


def _prepare(chat, out, *flags):
    try:
        main(["prepare", f"--input={chat / 'chat.jsonl'}", f"--tokenizer={chat}",
              f"--out_dir={out}", "--workers=1", *flags])  # fmt: skip
    except SystemExit as e:
        return e.code
    return None


def _read(paths):
    shards = [open_shard(p) for p in paths]
    tokens = np.concatenate([s.tokens for s in shards])
    mask = np.concatenate([s.mask(0, s.num_tokens) for s in shards])
    return tokens, mask


def _examples(tokens, mask, eos):
    """Each example of unpacked shards (tokens and mask up to and including its EOS)."""
    ends = np.flatnonzero(tokens == eos) + 1
    return [(tokens[a:b], mask[a:b]) for a, b in zip(np.r_[0, ends[:-1]], ends, strict=True)]


def _key(tokens, mask):
    return tuple(tokens.tolist()), tuple(mask.tolist())


def test_best_fit_decreasing_fills_windows_with_whole_examples():
    lengths = np.array([5, 3, 8, 2, 2, 6, 1, 4])
    windows = best_fit_decreasing(lengths, 10)
    assert sorted(i for w in windows for i in w) == list(range(8))  # each once, none split
    assert all(lengths[w].sum() <= 10 for w in windows)
    assert len(windows) == int(np.ceil(lengths.sum() / 10))  # as few as the tokens allow here
    assert windows == best_fit_decreasing(lengths, 10)
    assert windows[0] == [2, 3]  # the longest first, then the window it fills best
    ones = np.ones(7, int)  # at most 3 a window: windows of 3, 3 and 1, not one of 7
    assert best_fit_decreasing(ones, 10) == [list(range(7))]
    assert best_fit_decreasing(ones, 10, max_items=3) == [[0, 1, 2], [3, 4, 5], [6]]


def test_the_packer_packs_a_buffer_at_a_time():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 12, 60)
    docs = [np.r_[rng.integers(1, 50, n - 1), 0].astype(np.int32) for n in lengths]
    chunks = [
        (np.concatenate(docs[i : i + 15]), lengths[i : i + 15], None) for i in range(0, 60, 15)
    ]
    packer = Packer(16, 0, "truncate", buffer_tokens=50)  # a buffer a chunk
    packed = list(packer.pack(chunks))
    assert len(packed) == 4 and all((n == 16).all() for _, n, _ in packed)
    tokens = np.concatenate([t for t, _, _ in packed])
    mask = np.concatenate([m for _, _, m in packed])
    assert packer.windows * 16 == len(tokens) and packer.trained == (lengths - 1).sum()
    found = []
    for window, m in zip(tokens.reshape(-1, 16), mask.reshape(-1, 16), strict=True):
        ends = np.flatnonzero(window == 0) + 1
        found += [tuple(window[a:b]) for a, b in zip(np.r_[0, ends[:-1]], ends, strict=True)]
        # The rest of a window: padding, not EOS (one document), not trained on.
        assert (window[ends[-1] :] == pad_id(0)).all() and not m[ends[-1] :].any()
    assert sorted(found) == sorted(tuple(d) for d in docs)  # each example once, whole


def test_prepare_packs_whole_examples_into_the_pipelines_windows(chat, tmp_path, capsys):
    chat, eos = chat
    assert _prepare(chat, tmp_path / "plain", "--eval_fraction=0") is None
    plain = _examples(*_read([tmp_path / "plain" / "train-000.bin"]), eos)
    capsys.readouterr()
    flags = ["--pack", f"--seq_len={T}", "--eval_fraction=0.1", "--shard_tokens=1000"]
    assert _prepare(chat, tmp_path / "packed", *flags) is None
    printed = capsys.readouterr().out
    out = tmp_path / "packed"
    shards = sorted(out.glob("train-*.bin"))
    assert len(shards) > 1 and json.loads((out / PACK_FILE).read_text()) == {"seq_len": T}
    # Shards hold whole windows: 960 tokens (15 windows) each, the last one fewer.
    assert all(open_shard(p).num_tokens % (T + 1) == 0 for p in [*shards, out / "eval.bin"])
    assert open_shard(shards[0]).num_tokens == 960
    tokens, mask = _read([*shards, out / "eval.bin"])
    windows, masks = tokens.reshape(-1, T + 1), mask.reshape(-1, T + 1)
    found, pads, trained = [], 0, 0
    for window, m in zip(windows, masks, strict=True):
        ends = np.flatnonzero(window == eos) + 1
        if len(ends) == 0:  # a truncated example: the whole window, no EOS
            found.append(_key(window, m))
            trained += m[1:].sum()
            continue
        for a, b in zip(np.r_[0, ends[:-1]], ends, strict=True):
            found.append(_key(window[a:b], m[a:b]))
            trained += m[a + 1 : b].sum()
        # After the last example's EOS: padding, never trained on.
        assert (window[ends[-1] :] == pad_id(eos)).all() and not m[ends[-1] :].any()
        pads += T + 1 - ends[-1]
    # Every example is in one window, whole, but the one longer than a window (cut to its first
    # window) and the one whose prompt fills a window (dropped: nothing to train on).
    long = [e for e in plain if len(e[0]) > T + 1]
    assert len(long) == 2 and not long[1][1][: T + 1].any()
    whole = [_key(*e) for e in plain if len(e[0]) <= T + 1]
    assert collections.Counter(found) == collections.Counter(
        [*whole, _key(long[0][0][: T + 1], long[0][1][: T + 1])]
    )
    assert pads == len(tokens) - sum(len(k[0]) for k in found)
    efficiency = trained / (len(windows) * T)
    assert (
        f"packed 149 of 150 examples into {len(windows)} windows of 64 tokens (1 longer than a "
        f"window truncated, 1 dropped); efficiency {efficiency:.1%}" in printed
    )
    assert efficiency > 0.5
    # Deterministic: the same flags write the same bytes.
    assert _prepare(chat, tmp_path / "again", *flags) is None
    again = sorted((tmp_path / "again").glob("*.bin"))
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in sorted(out.glob("*.bin"))]


def test_overlong_examples_dropped_and_other_seq_lens_refused(chat, tmp_path, capsys):
    chat, eos = chat
    flags = ["--pack", f"--seq_len={T}", "--pack_overlong=drop", "--eval_fraction=0",
             "--pack_max_examples=2"]  # fmt: skip
    assert _prepare(chat, tmp_path / "out", *flags) is None
    assert "2 longer than a window dropped" in capsys.readouterr().out
    shard = str(tmp_path / "out" / "train-000.bin")
    windows = open_shard(shard).tokens.reshape(-1, T + 1)
    assert (windows == eos).sum(axis=1).max() == 2  # examples a window (none truncated here)
    assert DataConfig(train_files=(shard,), seq_len=T).seq_len == T
    with pytest.raises(SettingError, match=r"^--train_file: .*pack.json says .* --seq_len=63, not"):
        DataConfig(train_files=(shard,), seq_len=2 * T)
    with pytest.raises(SettingError, match=r"^--eval_file: .*--seq_len=63, not --seq_len=32"):
        DataConfig(eval_files=(shard,), seq_len=32)
    refused = train_here("--model=tiny", "--from_scratch", f"--train_file={shard}", "--seq_len=32",
                         "--steps=1", "--document_masking")  # fmt: skip
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .startswith(
            f"error: --train_file: {tmp_path / 'out' / PACK_FILE} says its shards were packed for "
            "--seq_len=63, not --seq_len=32: train with --seq_len=63"
        )
    )
    assert _prepare(chat, tmp_path / "x", "--pack") == (
        "error: --pack needs --seq_len, the training run's: windows are seq_len + 1 tokens"
    )
    assert _prepare(chat, tmp_path / "x", "--seq_len=8").startswith("error: --seq_len=8 is for")
    # Prepared again without --pack, the directory's record goes with the packed shards.
    assert _prepare(chat, tmp_path / "out", "--overwrite", "--eval_fraction=0") is None
    assert not (tmp_path / "out" / PACK_FILE).exists()


def test_each_packed_example_gets_the_loss_it_gets_alone(chat, tmp_path):
    chat, eos = chat
    flags = ["--pack", f"--seq_len={T}", "--eval_fraction=0"]
    assert _prepare(chat, tmp_path / "out", *flags) is None
    data = TokenBatches(str(tmp_path / "out" / "train-*.bin"), seq_len=T, batch_size=16,
                        shuffle=False, process_count=1, eos_id=eos)  # fmt: skip
    batch = {k: v[0] for k, v in next(data).items()}
    cfg = dataclasses.replace(preset("tiny"), num_hidden_layers=2, vocab_size=300,
                              hidden_size=64, intermediate_size=128)  # fmt: skip
    model = Llama(cfg, rngs=nnx.Rngs(0), attention="xla")

    def ce(logits, targets):
        lse = jax.nn.logsumexp(logits, axis=-1)
        return lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]

    logits = jax.jit(lambda *a: model.logits(*a))
    packed = ce(logits(batch["inputs"], batch["positions"], batch["segment_ids"]),
                batch["targets"])  # fmt: skip
    examples, sums = [], []  # each example's tokens and its trained tokens; its packed loss
    for b in range(len(batch["inputs"])):
        window = np.r_[batch["inputs"][b], batch["targets"][b, -1]]
        mask = np.r_[False, batch["loss_mask"][b]]  # the window's mask, less pads and EOS
        for s in np.unique(batch["segment_ids"][b]):
            idx = np.flatnonzero(batch["segment_ids"][b] == s)
            if not batch["loss_mask"][b, idx].any():
                assert s == batch["segment_ids"][b, -1]  # padding: one document, the last
                continue
            # The example: its tokens through its EOS (the target of its last input, or its
            # last input when a document follows, whose first token is not trained on).
            end = idx[-1] + (1 if window[idx[-1]] == eos else 2)
            examples.append((window[idx[0] : end], mask[idx[0] + 1 : end]))
            sums.append(np.sum(packed[b, idx] * batch["loss_mask"][b, idx]))
    assert len(examples) > len(batch["inputs"])  # windows of several examples
    # Alone: each example from position 0 in a row of its own, right-padded (causal attention:
    # the padding changes nothing before it).
    rows = np.zeros((len(examples), T + 1), np.int32)
    for row, (example, _) in zip(rows, examples, strict=True):
        row[: len(example)] = example
    alone = ce(logits(rows[:, :-1]), rows[:, 1:])
    for row, (_, trained), packed_sum in zip(alone, examples, sums, strict=True):
        np.testing.assert_allclose(packed_sum, np.sum(row[: len(trained)] * trained), rtol=1e-5)
