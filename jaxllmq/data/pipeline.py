"""Grain input pipeline: BIN.TOK shards -> shuffled (seq_len+1)-token windows -> per-process batches.

Every shard is cut into non-overlapping windows of T+1 tokens (a shard's last partial window is
not used). Window w gives inputs = w[:-1], targets = w[1:] and loss_mask = mask[1:]: the mask
applies at the *target* position. Windows are numbered across the files in the order given (each
glob sorted); the order in which an epoch visits them is a permutation that depends only on
(seed, epoch): Grain's index shuffle (a 4-round Feistel-style bijection computed per position),
so nothing of size num_windows is ever materialized.

A step takes the next `grad_accumulation x batch_size` windows of the epoch: micro-batch m, global
row r is epoch position step_in_epoch x A x B + m x B + r, and process p owns rows
[p x B_local, (p + 1) x B_local). That is the row block `jax.make_array_from_process_local_data`
expects from process p when the batch axis is sharded over the mesh's data axes in process
order. The element Grain reads is one whole step, gathered with one slice copy per row, so the
per-element Python cost is paid once per row, not per token.

With an end-of-document id (--document_masking) a window holds documents, each ending with that
id: the batch also has segment_ids (a new id after each EOS in the inputs; a window that starts
mid-document starts with a fragment) and positions (from 0 at each document's first token, the
fragment's too), and the target after an EOS, the next document's first token, is not trained on.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import zlib
from collections.abc import Sequence

import grain
import jax
import numpy as np
from grain.experimental import index_shuffle

from jaxllmq.data.shards import Shard, ShardError, check_vocab_size, expand_files, open_shard
from jaxllmq.data.validate import Note, check_shards, name_files
from jaxllmq.documents import DOCUMENTS_PER_WINDOW

# Bytes read from each end of a data file for the CRC-32 a saved data position records.
_SAMPLE_BYTES = 1 << 20
# A step is one Grain element: inputs, targets int32[A, B_local, T] and loss_mask bool[A, B_local, T]
# (with documents also segment_ids, positions int32[A, B_local, T]).
Batch = dict[str, np.ndarray]


def documents(
    inputs_NxT: np.ndarray, eos_id: int, per_window: int, loss_mask_NxT: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(segment_ids, positions int32[N, T], trained bool[N, T]) of windows whose documents end
    with `eos_id`: each token's document within its row, its position in that document, and
    whether its target is in the same document (False where the input is the EOS).

    A row holds at most `per_window` documents (attention's segments): the documents past the
    last are joined to it (its segment id) and not trained on, so what is trained is the same as
    if each were alone; a warning says so once, if any of their tokens were to be trained
    (`loss_mask_NxT`, default all: packed windows' padding is not)."""
    eos = inputs_NxT == eos_id
    starts = np.zeros_like(eos)
    starts[:, 1:] = eos[:, :-1]  # a document starts after each EOS
    segment_ids = np.cumsum(starts, axis=1, dtype=np.int32)
    t = np.arange(inputs_NxT.shape[1], dtype=np.int32)
    first = np.maximum.accumulate(np.where(starts, t, 0), axis=1)
    joined = segment_ids >= per_window
    lost = joined & ~eos if loss_mask_NxT is None else joined & ~eos & loss_mask_NxT
    if lost.any() and not _joined_warned.is_set():
        _joined_warned.set()
        print(
            f"warning: a window holds {int(segment_ids.max()) + 1} documents, more than "
            f"--max_documents_per_window={per_window}: the tokens of the documents past the "
            f"{per_window}-th are not trained on (raise the flag to train them)",
            file=sys.stderr,
            flush=True,
        )
    return np.minimum(segment_ids, per_window - 1), t - first, ~eos & ~joined


_joined_warned = threading.Event()


class _WindowReader:
    """Maps window ids to (shard, offset) and copies windows out of the memmaps.

    Pickles as its file list (for Grain worker processes), reopening the shards on arrival.
    """

    def __init__(self, paths: list[str], window: int):
        self.paths = paths
        self.window = window
        self._open()

    def _open(self) -> None:
        self.shards: list[Shard] = [open_shard(p) for p in self.paths]
        counts = [s.num_tokens // self.window for s in self.shards]
        # first[k] is shard k's first window id; empty shards share their successor's.
        self.first = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.num_windows = int(self.first[-1])

    def __getstate__(self) -> dict:
        return {"paths": self.paths, "window": self.window}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def read(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Inputs, targets int32[n, T] and loss mask bool[n, T] of windows `ids`."""
        n, t = len(ids), self.window - 1
        inputs = np.empty((n, t), dtype=np.int32)
        targets = np.empty((n, t), dtype=np.int32)
        loss_mask = np.ones((n, t), dtype=bool)
        which = np.searchsorted(self.first, ids, side="right") - 1
        starts = (ids - self.first[which]) * self.window
        for row, (k, start) in enumerate(zip(which.tolist(), starts.tolist(), strict=True)):
            shard = self.shards[k]
            inputs[row] = shard.tokens[start : start + t]
            targets[row] = shard.tokens[start + 1 : start + t + 1]
            if shard.mask_bits is not None:
                loss_mask[row] = shard.mask(start + 1, start + t + 1)
        return inputs, targets, loss_mask


class _Order:
    """Epoch position -> window id: Grain's index shuffle seeded by (seed, epoch), or identity."""

    def __init__(self, num_windows: int, seed: int, shuffle: bool):
        self.num_windows, self.seed, self.shuffle = num_windows, seed, shuffle

    def window_ids(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Window ids at `positions` of `epoch`'s order."""
        if not self.shuffle:
            return positions
        # Mix (seed, epoch) into one 32-bit seed. (Grain's own shuffle + repeat uses seed + epoch,
        # which would make seed s's epoch 1 the same order as seed s + 1's epoch 0.)
        epoch_seed = int(np.random.SeedSequence([self.seed, epoch]).generate_state(1)[0])
        last = self.num_windows - 1
        ids = (index_shuffle(p, last, epoch_seed, 4) for p in positions.tolist())
        return np.fromiter(ids, np.int64, len(positions))


class _StepLoader:
    """Global step -> this process's rows of that step's batch (the function Grain maps)."""

    def __init__(
        self,
        reader: _WindowReader,
        order: _Order,
        shape: tuple[int, int, int, int],
        eos_id: int | None,
        documents_per_window: int | None,
    ):
        self.reader, self.order, self.eos_id = reader, order, eos_id
        self.documents_per_window = documents_per_window
        self.acc, self.batch_size, self.process_index, self.local_rows = shape
        self.steps_per_epoch = reader.num_windows // (self.acc * self.batch_size)

    def __call__(self, step: int) -> Batch:
        epoch, step_in_epoch = divmod(step, self.steps_per_epoch)
        first_row = self.process_index * self.local_rows
        positions_AxBl = (
            step_in_epoch * self.acc * self.batch_size
            + np.arange(self.acc)[:, None] * self.batch_size
            + first_row
            + np.arange(self.local_rows)[None, :]
        )
        ids = self.order.window_ids(epoch, positions_AxBl.ravel())
        inputs, targets, loss_mask = self.reader.read(ids)
        batch = {"inputs": inputs, "targets": targets, "loss_mask": loss_mask}
        if self.eos_id is not None:
            segment_ids, positions, trained = documents(
                inputs, self.eos_id, self.documents_per_window, loss_mask
            )
            batch.update(
                segment_ids=segment_ids, positions=positions, loss_mask=loss_mask & trained
            )
        shape_AxBlxT = (self.acc, self.local_rows, self.reader.window - 1)
        return {k: v.reshape(shape_AxBlxT) for k, v in batch.items()}


class TokenBatches:
    """Iterator over training steps: this process's rows of each global batch, read ahead by Grain.

    Each step is {"inputs", "targets": int32[A, B_local, T], "loss_mask": bool[A, B_local, T]}
    with A = grad_accumulation, B_local = batch_size // process_count. An epoch is
    `steps_per_epoch` full steps; the windows left over at an epoch's end (fewer than one step)
    are dropped, and the next epoch is a new permutation of all windows (shuffle=False: file
    order, every epoch). With repeat=False (eval) iteration stops after one epoch; `reset()`
    rewinds to the same first batch. `prefetch` steps are read ahead by `num_threads` threads,
    in each of `num_workers` Grain worker processes if that is > 0, else in this process (Grain
    starts its workers only once absl flags are parsed: by absl.app in a command, elsewhere
    `absl.flags.FLAGS.mark_as_parsed()`, which leaves Grain's flags at their defaults).
    `flag_name` is the flag that errors about the files name (--train_file, --eval_file).
    `eos_id`: the end-of-document id; given, each step also has "segment_ids" and "positions"
    (see `documents`, which keeps `documents_per_window` documents a window apart).
    """

    def __init__(
        self,
        files: Sequence[str] | str,
        *,
        seq_len: int,
        batch_size: int,
        grad_accumulation: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        process_index: int | None = None,
        process_count: int | None = None,
        repeat: bool = True,
        prefetch: int = 8,
        num_threads: int = 1,
        num_workers: int = 0,
        flag_name: str = "--train_file",
        eos_id: int | None = None,
        documents_per_window: int | None = None,
    ):
        for name, value in [("seq_len", seq_len), ("batch_size", batch_size)]:
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if grad_accumulation < 1:
            raise ValueError(f"grad_accumulation must be positive, got {grad_accumulation}")
        if not 0 <= seed < 2**63:
            raise ValueError(f"seed must be a non-negative integer, got {seed}")
        if prefetch < 0 or num_threads < 0 or num_workers < 0:
            raise ValueError("prefetch, num_threads and num_workers must be >= 0")
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} not in [0, {process_count})")
        if batch_size % process_count:
            raise ValueError(
                f"global batch size {batch_size} (--batch_size x data-parallel devices) must be "
                f"divisible by the number of processes, {process_count}"
            )
        self.files = expand_files(files, flag_name)
        self.flag_name = flag_name
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.grad_accumulation = grad_accumulation
        self.seed, self.shuffle, self.repeat = seed, shuffle, repeat
        self.process_index, self.process_count = process_index, process_count
        self.prefetch, self.num_threads, self.num_workers = prefetch, num_threads, num_workers
        reader = _WindowReader(self.files, seq_len + 1)
        self.num_windows = reader.num_windows
        self.rows_per_step = grad_accumulation * batch_size
        self.steps_per_epoch = self.num_windows // self.rows_per_step
        if self.steps_per_epoch == 0:
            raise ShardError(
                f"{flag_name}: {len(self.files)} file(s) ({name_files(self.files)}) hold "
                f"{self.num_windows} windows of "
                f"--seq_len+1={seq_len + 1} tokens, fewer than one step needs "
                f"(grad_accumulation {grad_accumulation} x global batch {batch_size} = "
                f"{self.rows_per_step}); give more data or lower --batch_size / --seq_len"
            )
        shape = (grad_accumulation, batch_size, process_index, batch_size // process_count)
        order = _Order(self.num_windows, seed, shuffle)
        if eos_id is not None and documents_per_window is None:
            documents_per_window = DOCUMENTS_PER_WINDOW
        self._loader = _StepLoader(reader, order, shape, eos_id, documents_per_window)
        self._step = 0  # global step of the next batch
        self._iter: grain.DatasetIterator | None = None

    @property
    def epoch(self) -> int:
        """Epoch of the next batch."""
        return self._step // self.steps_per_epoch

    @property
    def vocab_size(self) -> int:
        """Largest vocab size over the shards' headers."""
        return max(shard.vocab_size for shard in self._loader.reader.shards)

    def validate(
        self, model_vocab_size: int, *, need_scored: bool = True, note: Note = print
    ) -> int:
        """Check the shards fit the model before training: header vocab sizes, every token id in
        [0, model_vocab_size), and some token to train on (`need_scored`; else a warning to
        `note`). Raises ShardError; returns the number of scored tokens."""
        shards = self._loader.reader.shards
        check_vocab_size(shards, model_vocab_size)
        return check_shards(
            shards, model_vocab_size, flag_name=self.flag_name, need_scored=need_scored, note=note
        )

    def _dataset(self, start: int) -> grain.IterDataset:
        stop = sys.maxsize if self.repeat else self.steps_per_epoch
        reading = grain.ReadOptions(
            num_threads=self.num_threads, prefetch_buffer_size=self.prefetch
        )
        ds = grain.MapDataset.range(start, max(start, stop)).map(self._loader)
        ds = ds.to_iter_dataset(reading)
        if self.num_workers:
            per_worker = max(1, self.prefetch // self.num_workers)
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(self.num_workers, per_worker))
        return ds

    def __iter__(self) -> TokenBatches:
        return self

    def __next__(self) -> Batch:
        if self._iter is None:
            self._iter = iter(self._dataset(self._step))
        batch = next(self._iter)
        self._step += 1
        return batch

    def get_state(self) -> dict:
        """The position of the next batch, plus what it is only valid for (JSON-serializable):
        the files (see _file_identities), seed, order and shapes."""
        return {
            "step": self._step,
            "files": self._file_identities,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_windows": self.num_windows,
            "seq_len": self.seq_len,
            "rows_per_step": self.rows_per_step,
        }

    @functools.cached_property
    def _file_identities(self) -> list[dict]:
        """Each file's path, size, token count and the CRC-32 of its first and last MiB: the
        data a saved position belongs to. A resume compares all but the path (so a copy or a
        moved directory resumes) and never the mtime (which a copy changes)."""
        files = []
        for shard in self._loader.reader.shards:
            with open(shard.path, "rb") as f:
                crc = zlib.crc32(f.read(_SAMPLE_BYTES))
                f.seek(max(0, shard.file_bytes - _SAMPLE_BYTES))
                crc = zlib.crc32(f.read(_SAMPLE_BYTES), crc)
            files.append(
                {
                    "path": os.path.abspath(shard.path),
                    "bytes": shard.file_bytes,
                    "tokens": shard.num_tokens,
                    "sample_crc32": f"{crc:08x}",
                }
            )
        return files

    def set_state(self, state: dict) -> None:
        """Resume at a position from get_state(): the next batches are the ones it would give."""
        mine = self.get_state()
        saved_files = state.get("files")  # None in states saved before files were recorded
        if saved_files is not None and _identities(saved_files) != _identities(mine["files"]):
            diff = _files_diff(saved_files, mine["files"])
            raise ValueError(
                f"the saved data position is in other files ({diff}); resume with the same "
                f"{self.flag_name}, or pass --new_data to start this data from its beginning"
            )
        changed = [k for k in mine if k not in ("step", "files") and state.get(k) != mine[k]]
        if changed:
            diff = ", ".join(f"{k}: saved {state.get(k)!r}, now {mine[k]!r}" for k in changed)
            raise ValueError(
                f"the saved data position does not fit this data pipeline ({diff}); resume "
                f"with the same data, seed, --seq_len and batch, or start the data over "
                f"(--new_data)"
            )
        self.close()
        self._step = int(state["step"])

    def reset(self) -> None:
        """Rewind to the first batch (eval passes all start here)."""
        self.close()
        self._step = 0

    def close(self) -> None:
        """Stop the read-ahead threads or worker processes."""
        if self._iter is not None:
            self._iter.close()
            self._iter = None


def _identities(files: list) -> list:
    """What tells files apart for a resume: all of a _file_identities entry but its path."""
    return [
        {k: v for k, v in f.items() if k != "path"} if isinstance(f, dict) else f for f in files
    ]


def _files_diff(saved: list, now: list) -> str:
    """The first difference between two get_state() file lists, in words."""
    common = min(len(saved), len(now))
    saved_ids, now_ids = _identities(saved), _identities(now)
    i = next((i for i in range(common) if saved_ids[i] != now_ids[i]), common)

    def describe(files: list) -> str:
        if i >= len(files) or not isinstance(files[i], dict):
            return "none"
        f = files[i]
        return f"{f.get('path')!r} ({f.get('tokens')} tokens, {f.get('bytes')} bytes)"

    return (
        f"saved {len(saved)} files, now {len(now)}; file {i + 1} was {describe(saved)}, now "
        f"{describe(now)}"
    )


def to_global_arrays(batch: Batch, sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
    """Assemble each process's rows into global arrays; `sharding` splits axis 1 (batch)."""
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}
