"""Where prepare's documents go: whole documents to eval.bin or to train shards (Split), and its
progress line on stderr (Progress)."""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from jaxllmq.data.shards import ShardWriter


class PrepareError(ValueError):
    """Bad inputs or flags; the message names the file or flag and what to do."""


class Split:
    """Routes whole documents to eval.bin or to train shards of `shard_tokens` tokens each."""

    def __init__(self, out_dir: str, vocab_size: int, shard_tokens: int, eval_fraction: float,
                 eval_tokens: int):  # fmt: skip
        self.out_dir, self.vocab_size, self.shard_tokens = out_dir, vocab_size, shard_tokens
        self.eval_fraction, self.eval_tokens = eval_fraction, eval_tokens
        self.documents = self.eval_documents = self.tokens = self.eval_written = 0
        self.masked_out = self.shards_written = 0
        self.train: ShardWriter | None = None
        self.eval: ShardWriter | None = None

    def _to_eval(self) -> bool:
        if self.eval_tokens:
            return self.eval_written < self.eval_tokens
        # Greedy: a document is held out while eval is below its share of the tokens so far.
        return self.eval_written < self.eval_fraction * self.tokens

    def add(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None) -> None:
        """Write a chunk of documents (concatenated tokens, their lengths, optional mask)."""
        mask = np.ones(len(tokens), dtype=bool) if mask is None else mask
        self.masked_out += int((~mask).sum())
        to_eval = np.zeros(len(lengths), dtype=bool)
        for i, n in enumerate(lengths.tolist()):
            self.tokens += n
            if self._to_eval():
                to_eval[i] = True
                self.eval_written += n
        self.documents += len(lengths)
        self.eval_documents += int(to_eval.sum())
        # Append runs of documents bound for the same file at once, not one by one.
        ends = np.cumsum(lengths)
        for run in np.split(np.arange(len(lengths)), np.flatnonzero(np.diff(to_eval)) + 1):
            start, end = ends[run[0]] - lengths[run[0]], ends[run[-1]]
            if not to_eval[run[0]]:
                self._add_train(tokens[start:end], mask[start:end])
                continue
            if self.eval is None:
                path = os.path.join(self.out_dir, "eval.bin")
                self.eval = ShardWriter(path, vocab_size=self.vocab_size)
            self.eval.append(tokens[start:end], mask[start:end])

    def _add_train(self, tokens: np.ndarray, mask: np.ndarray) -> None:
        while len(tokens):  # a document may straddle shards: windows ignore document bounds
            if self.train is None:
                name = f"train-{self.shards_written:03d}.bin"
                self.train = ShardWriter(
                    os.path.join(self.out_dir, name), vocab_size=self.vocab_size
                )
            room = self.shard_tokens - self.train.num_tokens
            self.train.append(tokens[:room], mask[:room])
            tokens, mask = tokens[room:], mask[room:]
            if self.train.num_tokens == self.shard_tokens:
                self._close_train()

    def _close_train(self) -> None:
        self.train.close()
        self.train = None
        self.shards_written += 1

    def __enter__(self) -> Split:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for writer in (self.train, self.eval):
            if writer is not None:
                writer.__exit__(exc_type, exc, tb)  # on error: removes the partial file
        if exc_type is None and self.train is not None:
            self.train = None
            self.shards_written += 1
        if exc_type is None and self.shards_written == 0:
            raise PrepareError(
                f"no train tokens: all {self.tokens} tokens ({self.documents} documents) went "
                f"to eval.bin; lower --eval_fraction / --eval_tokens or add input"
            )


class Progress:
    """A one-line progress report on stderr (rewritten in place on a terminal)."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, documents: int, tokens: int, final: bool = False) -> float:
        """Report if a while has passed since the last report (always when final); -> tokens/s."""
        now = time.perf_counter()
        rate = tokens / max(now - self.start, 1e-9)
        if final or now - self.last >= (0.5 if self.tty else 10):
            self.last = now
            line = f"{documents:,} documents, {tokens:,} tokens, {rate:,.0f} tokens/s"
            end = "\n" if final or not self.tty else ""
            print(("\r" if self.tty else "") + line, end=end, file=sys.stderr, flush=True)
        return rate
