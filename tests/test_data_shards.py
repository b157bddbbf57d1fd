"""BIN.TOK shards: byte layout against hand-built files, round trips, and clear errors."""

import struct

import numpy as np
import pytest

from jaxllmq.data.shards import (
    HEADER_BYTES,
    ShardError,
    ShardWriter,
    check_vocab_size,
    open_shard,
    write_shard,
)


def hand_built(tokens, mask=None, *, version=2, vocab=1000, fill=b"\0", bytes_per_token=4):
    """A shard assembled from the layout in shards.py's docstring alone, not from our writer."""
    words = [version, bytes_per_token, len(tokens)]
    if version == 2:
        words += [vocab, int(mask is not None)]
    head = b"BIN.TOK\n" + struct.pack(f"<{len(words)}i", *words)
    head += fill * (HEADER_BYTES - len(head))
    body = np.asarray(tokens, dtype="<i4").tobytes()
    if mask is not None:
        body += np.packbits(np.asarray(mask, dtype=bool), bitorder="little").tobytes()
    return head + body


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000, 1003])
def test_round_trip_tokens_and_masks(tmp_path, n):
    rng = np.random.default_rng(n)
    tokens = rng.integers(0, 500, n).astype(np.int32)
    mask = rng.random(n) < 0.5
    write_shard(tmp_path / "a.bin", tokens, mask, vocab_size=500)
    shard = open_shard(tmp_path / "a.bin")
    assert (shard.version, shard.num_tokens, shard.vocab_size, shard.has_mask) == (2, n, 500, True)
    assert isinstance(shard.tokens, np.memmap) and shard.tokens.dtype == np.int32
    np.testing.assert_array_equal(shard.tokens, tokens)
    np.testing.assert_array_equal(shard.mask(0, n), mask)
    for start, stop in [(0, 0), (1, n), (n // 3, n // 2 + 1), (n - 1, n)]:
        np.testing.assert_array_equal(shard.mask(start, stop), mask[start:stop])


def test_no_mask_reads_all_true(tmp_path):
    write_shard(tmp_path / "a.bin", np.arange(20), vocab_size=20)
    shard = open_shard(tmp_path / "a.bin")
    assert not shard.has_mask and shard.mask_bits is None
    assert shard.mask(3, 11).all() and shard.mask(3, 11).shape == (8,)
    assert (tmp_path / "a.bin").stat().st_size == HEADER_BYTES + 4 * 20


def test_writer_bytes_equal_hand_built_layout_with_llmq_padding(tmp_path):
    tokens = np.array([5, 0, 99, 7, 3, 2, 1, 8, 9, 4, 6], dtype=np.int32)
    mask = np.array([0, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1], dtype=bool)
    write_shard(tmp_path / "ours.bin", tokens, mask, vocab_size=100)
    # llmq's writer reserves the header as b"*" * 1023 + b"\n", then writes the words over it.
    expected = bytearray(hand_built(tokens, mask, vocab=100, fill=b"*"))
    expected[HEADER_BYTES - 1] = ord("\n")
    assert (tmp_path / "ours.bin").read_bytes() == bytes(expected)


def test_reads_hand_built_v2_with_zero_padding(tmp_path):
    tokens, mask = np.arange(13) * 3, np.arange(13) % 3 == 0
    (tmp_path / "h.bin").write_bytes(hand_built(tokens, mask, vocab=40))
    shard = open_shard(tmp_path / "h.bin")
    np.testing.assert_array_equal(shard.tokens, tokens)
    np.testing.assert_array_equal(shard.mask(0, 13), mask)
    assert shard.vocab_size == 40


def test_reads_version_1_header(tmp_path):
    # Version 1 has no vocab or mask words: llmq's "*" filler sits where v2 keeps them.
    (tmp_path / "v1.bin").write_bytes(hand_built([4, 8, 15, 16, 23, 42], version=1, fill=b"*"))
    shard = open_shard(tmp_path / "v1.bin")
    assert (shard.version, shard.num_tokens, shard.has_mask) == (1, 6, False)
    np.testing.assert_array_equal(shard.tokens, [4, 8, 15, 16, 23, 42])
    assert shard.vocab_size == 43  # not in the header: scanned from the tokens


def test_writer_writes_masks_only_when_some_token_is_masked(tmp_path):
    with ShardWriter(tmp_path / "plain.bin", vocab_size=10) as w:
        w.append(np.arange(5), np.ones(5, bool))
        w.append(np.arange(3))
    with ShardWriter(tmp_path / "masked.bin", vocab_size=10) as w:
        w.append(np.arange(5))
        w.append(np.arange(4), np.array([0, 1, 1, 1], bool))
    assert not open_shard(tmp_path / "plain.bin").has_mask
    masked = open_shard(tmp_path / "masked.bin")
    np.testing.assert_array_equal(masked.tokens, [0, 1, 2, 3, 4, 0, 1, 2, 3])
    np.testing.assert_array_equal(masked.mask(0, 9), [1, 1, 1, 1, 1, 0, 1, 1, 1])


def test_writer_leaves_no_file_when_interrupted(tmp_path):
    with pytest.raises(RuntimeError), ShardWriter(tmp_path / "x.bin", vocab_size=10) as w:
        w.append(np.arange(5))
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_writer_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match=r"outside the vocab \[0, 10\)"):
        write_shard(tmp_path / "a.bin", np.array([1, 10]), vocab_size=10)
    with pytest.raises(ValueError, match="no tokens"):
        write_shard(tmp_path / "a.bin", np.array([], np.int32), vocab_size=10)
    with pytest.raises(ValueError, match="mask shape"):
        write_shard(tmp_path / "a.bin", np.arange(4), np.ones(3, bool), vocab_size=10)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", r"'.*bad.bin' is empty"),
        (b"BIN.TOK\n" + b"\0" * 100, r"truncated: 108 bytes, shorter than the 1024-byte header"),
        (b"PK\x03\x04" + b"\0" * 2000, r"not a BIN.TOK token shard \(starts with b'PK"),
        (hand_built([1, 2], version=3), "version 3; only 1 and 2"),
        (hand_built([1, 2], bytes_per_token=2), "2 bytes per token"),
        (hand_built([], vocab=10), "holds no tokens"),
        (
            hand_built([1, 2, 3])[:-5],
            r"promises 3 tokens, which is 1036 bytes, but the file has 1031",
        ),
        (hand_built([1, 2, 3], [1, 0, 1])[:-1], r"3 tokens with masks, which is 1037 bytes"),
        (hand_built([1, 2, 3]) + b"\0" * 8, "8 bytes more than its header's 3 tokens"),
    ],
)
def test_corrupt_shards_give_clear_errors(tmp_path, content, message):
    (tmp_path / "bad.bin").write_bytes(content)
    with pytest.raises(ShardError, match=message):
        open_shard(tmp_path / "bad.bin")


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ShardError, match=r"'.*nope.bin' cannot be read"):
        open_shard(tmp_path / "nope.bin")


def test_check_vocab_size_names_the_shard(tmp_path):
    write_shard(tmp_path / "small.bin", np.arange(5), vocab_size=100)
    write_shard(tmp_path / "big.bin", np.arange(5), vocab_size=300)
    shards = [open_shard(tmp_path / "small.bin"), open_shard(tmp_path / "big.bin")]
    check_vocab_size(shards, 300)
    with pytest.raises(
        ShardError, match=r"'.*big.bin' has vocab size 300, more than the model's 256"
    ):
        check_vocab_size(shards, 256)
