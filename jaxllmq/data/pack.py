"""Packing fine-tuning examples whole into training windows (`prepare --pack --seq_len=T`).

The pipeline cuts shards into windows of T + 1 tokens from each shard's start (inputs are a
window's first T tokens, targets its last T). With --pack, prepare writes shards that are whole
windows: each example (prompt + response + EOS, or text + EOS) lies inside one window, placed by
best-fit decreasing over a buffer of examples, and the rest of a window is padding with a loss
mask of 0. Padding is a token other than EOS (`pad_id`), so under --document_masking it is one
document (it follows the last example's EOS and ends with the window): no real token attends to
it, it costs one document of the window, not one per pad token, and the target after the last
EOS is not trained on. The windows then go to the train shards and eval.bin as whole units;
shards hold a multiple of T + 1 tokens.

An example longer than a window is cut to its first window (--pack_overlong=truncate; dropped
when that part has nothing to train on) or left out (drop). pack.json beside eos.json records T:
a run with another --seq_len is refused (DataConfig.check).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import os
from collections.abc import Iterable, Iterator

import numpy as np

from jaxllmq.documents import DOCUMENTS_PER_WINDOW
from jaxllmq.setting import SettingError, Settings, setting

PACK_FILE = "pack.json"
# Examples are packed a buffer of about this many tokens at a time, each buffer into windows of
# its own, so memory stays flat on large sets.
BUFFER_TOKENS = 1 << 25

Chunk = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # tokens, lengths, mask (None: all 1)


@dataclasses.dataclass(frozen=True)
class PackConfig(Settings):
    """Packing: examples placed whole into training windows."""

    pack: bool = setting(
        False,
        "Place each example (prompt + response + EOS, or text + EOS) whole into windows of "
        "--seq_len + 1 tokens (best-fit decreasing), the rest of a window padding that is not "
        "trained on. Train with the same --seq_len and --document_masking (each example then "
        "gets the loss it gets alone).",
    )
    seq_len: int | None = setting(
        None, "With --pack: the training run's --seq_len (a window is seq_len + 1 tokens).", lower=2
    )
    pack_overlong: str = setting(
        "truncate",
        "With --pack, an example longer than a window: cut to its first window (truncate; left "
        "out if that part has nothing to train on) or left out (drop).",
        choices=("truncate", "drop"),
    )
    pack_max_examples: int | None = setting(
        None,
        "With --pack: at most this many examples a window. Under --document_masking each is "
        "one of the window's documents, the padding one more: the default is one less than "
        "--max_documents_per_window's default for --seq_len, so that every example is trained.",
        lower=1,
    )

    def check(self) -> None:
        if self.pack and self.seq_len is None:
            raise SettingError(
                "--pack needs --seq_len, the training run's: windows are seq_len + 1 tokens"
            )
        if self.seq_len is not None and not self.pack:
            raise SettingError(f"--seq_len={self.seq_len} is for --pack: add --pack or drop it")


def pad_id(eos_id: int) -> int:
    """The token packed windows are padded with: any id but EOS (so padding is one document)."""
    return 1 if eos_id == 0 else 0


def best_fit_decreasing(
    lengths: np.ndarray, window: int, max_items: int | None = None
) -> list[list[int]]:
    """Indices of `lengths` (each <= window) grouped into windows of `window` tokens, at most
    `max_items` each: longest first, each into the fullest window it fits in (the
    lowest-numbered one among equals), a new window when none has room. Deterministic."""
    windows: list[list[int]] = []
    free: list[int] = []  # sorted distinct room left in open windows
    open_: dict[int, list[int]] = {}  # room -> windows with that room, oldest first
    for i in np.argsort(-lengths, kind="stable").tolist():
        n = int(lengths[i])
        k = bisect.bisect_left(free, n)
        if k == len(free):
            w, room = len(windows), window
            windows.append([])
        else:
            room = free[k]
            w = open_[room].pop(0)
            if not open_[room]:
                del open_[room]
                free.pop(k)
        windows[w].append(i)
        room -= n
        if room and len(windows[w]) != max_items:
            if room not in open_:
                bisect.insort(free, room)
                open_[room] = []
            bisect.insort(open_[room], w)
    return windows


class Packer:
    """Turns chunks of examples (prepare's encode_in_order) into chunks of packed windows, each
    a "document" of `window` tokens for prepare's Split; counts what it did."""

    def __init__(
        self,
        window: int,
        eos_id: int,
        overlong: str,
        max_examples: int | None = None,
        buffer_tokens: int = BUFFER_TOKENS,
    ):
        self.window, self.pad_id, self.overlong = window, pad_id(eos_id), overlong
        self.max_examples, self.buffer_tokens = max_examples, buffer_tokens
        self.examples = self.windows = self.trained = 0
        self.truncated = self.dropped = 0
        self._tokens: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._buffered = 0

    def pack(self, chunks: Iterable[Chunk]) -> Iterator[Chunk]:
        """Packed windows of the examples in `chunks`, a buffer at a time."""
        for tokens, lengths, mask in chunks:
            mask = np.ones(len(tokens), bool) if mask is None else mask
            ends = np.cumsum(lengths).tolist()
            for start, end in zip([0, *ends[:-1]], ends, strict=True):
                self._add(tokens[start:end], mask[start:end])
            if self._buffered >= self.buffer_tokens:
                yield self._flush()
        if self._tokens:
            yield self._flush()

    def _add(self, tokens: np.ndarray, mask: np.ndarray) -> None:
        self.examples += 1
        if len(tokens) > self.window:
            tokens, mask = tokens[: self.window], mask[: self.window]
            if self.overlong == "drop" or not mask[1:].any():
                self.dropped += 1
                return
            self.truncated += 1
        self._tokens.append(tokens)
        self._masks.append(mask)
        self._buffered += len(tokens)

    def _flush(self) -> Chunk:
        lengths = np.array([len(t) for t in self._tokens], np.int64)
        placed = best_fit_decreasing(lengths, self.window, self.max_examples)
        tokens = np.full((len(placed), self.window), self.pad_id, np.int32)
        mask = np.zeros((len(placed), self.window), bool)
        for w, examples in enumerate(placed):
            at = 0
            for i in examples:
                n = len(self._tokens[i])
                tokens[w, at : at + n] = self._tokens[i]
                mask[w, at : at + n] = self._masks[i]
                # An example's first token is never a target: it starts its document.
                self.trained += int(self._masks[i][1:].sum())
                at += n
        self.windows += len(placed)
        self._tokens, self._masks, self._buffered = [], [], 0
        return tokens.ravel(), np.full(len(placed), self.window, np.int64), mask.ravel()

    @property
    def efficiency(self) -> float:
        """Trained targets over the windows' targets (window - 1 each)."""
        return self.trained / max(1, self.windows * (self.window - 1))

    def summary(self) -> str:
        overlong = (
            f"{self.truncated:,} longer than a window truncated, {self.dropped:,} dropped"
            if self.overlong == "truncate"
            else f"{self.dropped:,} longer than a window dropped"
        )
        return (
            f"packed {self.examples - self.dropped:,} of {self.examples:,} examples into "
            f"{self.windows:,} windows of {self.window:,} tokens ({overlong}); efficiency "
            f"{self.efficiency:.1%} ({self.trained:,} trained tokens / {self.windows:,} x "
            f"{self.window - 1:,} window targets)"
        )

    def stats(self) -> dict:
        return {"examples": self.examples, "windows": self.windows, "trained": self.trained,
                "truncated": self.truncated, "dropped": self.dropped,
                "efficiency": self.efficiency}  # fmt: skip


def whole_windows(tokens: int, window: int) -> int:
    """`tokens` rounded down to whole windows (one at least): a packed shard's size."""
    return max(window, tokens // window * window)


def write_pack_record(data_dir: str, seq_len: int | None) -> None:
    """Record in `data_dir` the --seq_len its shards were packed for (None: not packed, so an
    earlier record there is removed)."""
    path = os.path.join(data_dir, PACK_FILE)
    if seq_len is None:
        if os.path.exists(path):
            os.remove(path)
        return
    with open(path, "w") as f:
        json.dump({"seq_len": seq_len}, f)


def read_pack_record(data_dir: str) -> int | None:
    """The --seq_len the shards in `data_dir` were packed for; None if they were not packed."""
    path = os.path.join(data_dir, PACK_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return int(json.load(f)["seq_len"])


def check_packed_for(files: Iterable[str], seq_len: int, flag: str) -> None:
    """Refuse shards packed (prepare --pack) for another --seq_len than the run's."""
    for data_dir in sorted({os.path.dirname(f) for f in files}):
        packed_for = read_pack_record(data_dir)
        if packed_for is not None and packed_for != seq_len:
            raise SettingError(
                f"{flag}: {os.path.join(data_dir, PACK_FILE)} says its shards were packed for "
                f"--seq_len={packed_for}, not --seq_len={seq_len}: train with "
                f"--seq_len={packed_for}, or prepare again with --pack --seq_len={seq_len}"
            )


def max_examples_per_window(cfg: PackConfig) -> int:
    """--pack_max_examples, by default one less than the documents a training window of
    --seq_len keeps apart (the padding is one more document)."""
    if cfg.pack_max_examples is not None:
        return cfg.pack_max_examples
    return DOCUMENTS_PER_WINDOW - 1
