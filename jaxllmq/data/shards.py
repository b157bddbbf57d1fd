"""llmq's BIN.TOK token shards: a 1024-byte header, int32 tokens, optional packed-bit masks.

Layout (int32 little-endian header words):

    bytes 0-7   magic b"BIN.TOK\\n"
    word  [2]   version (2 written; 1 also read)
    word  [3]   bytes per token (4)
    word  [4]   token count N
    word  [5]   vocab size (version 2 only)
    word  [6]   has-masks flag (version 2 only)
    rest        padding up to 1024 bytes
    body        int32[N] tokens, then, if masks, np.packbits(mask, bitorder="little") (ceil(N/8) B)

The writer pads the header with llmq's own filler (b"*" x 1023 + b"\\n"), so for the same tokens
our files are byte-identical to the ones llmq's tokenize script writes. Reading memory-maps the
file: opening a shard costs a header read, whatever its size.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
from collections.abc import Sequence

import numpy as np

MAGIC = b"BIN.TOK\n"
HEADER_BYTES = 1024
VERSION = 2
BYTES_PER_TOKEN = 4
# llmq keeps token counts in an int32 header word.
MAX_TOKENS = 2**31 - 1
_HEADER_FILL = b"*" * (HEADER_BYTES - 1) + b"\n"
_REMAKE = "re-create it with `python -m jaxllmq.data.prepare`"


class ShardError(ValueError):
    """A token shard is missing, corrupt, truncated or does not fit the model."""


def _shard_bytes(num_tokens: int, has_mask: bool) -> int:
    mask_bytes = (num_tokens + 7) // 8 if has_mask else 0
    return HEADER_BYTES + BYTES_PER_TOKEN * num_tokens + mask_bytes


@dataclasses.dataclass(frozen=True, eq=False)
class Shard:
    """One opened shard: header fields plus memory-mapped tokens (and packed mask bits)."""

    path: str
    version: int
    num_tokens: int
    header_vocab_size: int  # 0 in version-1 headers, which carry none
    has_mask: bool
    tokens: np.ndarray  # memmap int32[N]
    mask_bits: np.ndarray | None  # memmap uint8[ceil(N / 8)], little bit order

    @functools.cached_property
    def vocab_size(self) -> int:
        """Vocab size from the header; version-1 headers have none, so max token + 1 is scanned."""
        if self.header_vocab_size > 0:
            return self.header_vocab_size
        chunk = 1 << 24  # 64 MiB at a time: never the whole shard in RAM
        top = max(int(self.tokens[i : i + chunk].max()) for i in range(0, self.num_tokens, chunk))
        return top + 1

    @property
    def file_bytes(self) -> int:
        """Size of the file: header, tokens and masks (open_shard checked it is exactly this)."""
        return _shard_bytes(self.num_tokens, self.has_mask)

    def mask(self, start: int, stop: int) -> np.ndarray:
        """Loss mask of tokens [start, stop) as bool; all True when the shard has no masks."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"mask range [{start}, {stop}) outside {self.num_tokens} tokens")
        if self.mask_bits is None:
            return np.ones(stop - start, dtype=bool)
        bits = self.mask_bits[start // 8 : (stop + 7) // 8]
        first = start % 8
        return np.unpackbits(bits, bitorder="little")[first : first + stop - start].view(bool)


def open_shard(path: str | os.PathLike) -> Shard:
    """Validate a shard's header and size, and memory-map its tokens and masks."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise ShardError(f"token shard {path!r} cannot be read: {e.strerror}") from e
    if size == 0:
        raise ShardError(f"token shard {path!r} is empty (0 bytes); {_REMAKE}")
    if size < HEADER_BYTES:
        raise ShardError(
            f"token shard {path!r} is truncated: {size} bytes, shorter than the "
            f"{HEADER_BYTES}-byte header; {_REMAKE}"
        )
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if head[: len(MAGIC)] != MAGIC:
        raise ShardError(
            f"{path!r} is not a BIN.TOK token shard (starts with {head[:8]!r}, "
            f"expected {MAGIC!r}); tokenize raw text with `python -m jaxllmq.data.prepare`"
        )
    words = np.frombuffer(head, dtype="<i4")
    version, bytes_per_token, num_tokens = (int(w) for w in words[2:5])
    if version not in (1, 2):
        raise ShardError(f"token shard {path!r} has version {version}; only 1 and 2 are read")
    if bytes_per_token != BYTES_PER_TOKEN:
        raise ShardError(
            f"token shard {path!r} has {bytes_per_token} bytes per token; only "
            f"{BYTES_PER_TOKEN} (int32) is supported; {_REMAKE}"
        )
    # Version 1 ends at word [4]; its words [5] and [6] are header padding (llmq fills with "*").
    vocab_size, has_mask = (int(words[5]), int(words[6])) if version == 2 else (0, 0)
    if has_mask not in (0, 1) or vocab_size < 0 or num_tokens < 0:
        raise ShardError(
            f"token shard {path!r} has a corrupt header (vocab size {vocab_size}, "
            f"has-masks flag {has_mask}, token count {num_tokens}); {_REMAKE}"
        )
    if num_tokens == 0:
        raise ShardError(f"token shard {path!r} holds no tokens; remove it from the file list")
    expected = _shard_bytes(num_tokens, bool(has_mask))
    if size < expected:
        raise ShardError(
            f"token shard {path!r} is truncated: its header promises {num_tokens} tokens"
            f"{' with masks' if has_mask else ''}, which is {expected} bytes, but the file has "
            f"{size} bytes; {_REMAKE}"
        )
    if size > expected:
        raise ShardError(
            f"token shard {path!r} has {size - expected} bytes more than its header's "
            f"{num_tokens} tokens{' with masks' if has_mask else ''} account for ({expected} "
            f"bytes): corrupt header or appended data; {_REMAKE}"
        )
    tokens = np.memmap(path, dtype="<i4", mode="r", offset=HEADER_BYTES, shape=(num_tokens,))
    bits = None
    if has_mask:
        bits = np.memmap(
            path,
            dtype=np.uint8,
            mode="r",
            offset=HEADER_BYTES + BYTES_PER_TOKEN * num_tokens,
            shape=((num_tokens + 7) // 8,),
        )
    return Shard(path, version, num_tokens, vocab_size, bool(has_mask), tokens, bits)


def expand_files(files: Sequence[str] | str, flag_name: str = "--train_file") -> list[str]:
    """Paths, globs or comma-separated globs -> files (each glob sorted, each file once)."""
    items = [files] if isinstance(files, str) else files
    patterns = [p.strip() for item in items for p in item.split(",") if p.strip()]
    if not patterns:
        raise ShardError(f"{flag_name} is empty: give file paths or globs")
    paths: dict[str, None] = {}  # ordered set
    for pattern in patterns:
        pattern = os.path.expanduser(pattern)
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern, recursive=True))
        else:
            matches = [pattern] if os.path.exists(pattern) else []
        if not matches:
            raise ShardError(f"{flag_name}: no files match {pattern!r}")
        paths.update(dict.fromkeys(matches))
    return list(paths)


def check_vocab_size(shards: Sequence[Shard], model_vocab_size: int) -> None:
    """Raise ShardError naming the first shard whose vocab exceeds the model's."""
    for shard in shards:
        if shard.vocab_size > model_vocab_size:
            raise ShardError(
                f"token shard {shard.path!r} has vocab size {shard.vocab_size}, more than the "
                f"model's {model_vocab_size}: it was tokenized for another model; tokenize the "
                f"data with this model's tokenizer"
            )


class ShardWriter:
    """Streams documents into one shard; the header is written on close, llmq's way.

    `with_mask`: True always writes masks, False never does, None (default) writes them only
    if some appended token is masked out.
    """

    def __init__(self, path: str | os.PathLike, *, vocab_size: int, with_mask: bool | None = None):
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.path = os.fspath(path)
        self.vocab_size = vocab_size
        self.with_mask = with_mask
        self.num_tokens = 0
        self._any_masked = False
        self._packed: list[np.ndarray] = []  # masks packed 8 tokens a byte as they arrive
        self._rest = np.zeros(0, dtype=bool)  # the < 8 mask bits not yet packed
        # Write to a temporary name, rename on close: a crash never leaves a valid-looking shard.
        self._tmp = self.path + ".tmp"
        self._file = open(self._tmp, "wb")
        self._file.write(_HEADER_FILL)

    def append(self, tokens: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Append int tokens in [0, vocab_size) and their loss mask (None: all trained on)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"tokens must be a 1-D integer array, got {tokens.dtype}{tokens.shape}"
            )
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(
                f"tokens for {self.path!r} span [{tokens.min()}, {tokens.max()}], outside "
                f"the vocab [0, {self.vocab_size})"
            )
        if self.num_tokens + tokens.size > MAX_TOKENS:
            raise ValueError(f"a shard holds at most {MAX_TOKENS} tokens (int32 header)")
        if mask is None:
            mask = np.ones(tokens.size, dtype=bool)
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != tokens.shape:
            raise ValueError(f"mask shape {mask.shape} differs from tokens shape {tokens.shape}")
        if self.with_mask is False and not mask.all():
            raise ValueError(f"{self.path!r} was opened with_mask=False but a mask was given")
        self._file.write(tokens.astype("<i4", copy=False).tobytes())
        self.num_tokens += tokens.size
        self._any_masked |= not mask.all()
        bits = np.concatenate([self._rest, mask])
        whole = bits.size // 8 * 8
        self._packed.append(np.packbits(bits[:whole], bitorder="little"))
        self._rest = bits[whole:]

    def close(self) -> None:
        """Write masks and header, and move the shard into place."""
        if self._file.closed:
            return
        if self.num_tokens == 0:
            self._abort()
            raise ValueError(f"refusing to write {self.path!r} with no tokens")
        has_mask = self._any_masked if self.with_mask is None else self.with_mask
        if has_mask:
            for part in [*self._packed, np.packbits(self._rest, bitorder="little")]:
                self._file.write(part.tobytes())
        self._file.seek(0)
        self._file.write(MAGIC)
        header = [VERSION, BYTES_PER_TOKEN, self.num_tokens, self.vocab_size, int(has_mask)]
        self._file.write(np.array(header, dtype="<i4").tobytes())
        self._file.close()
        os.replace(self._tmp, self.path)

    def _abort(self) -> None:
        self._file.close()
        os.remove(self._tmp)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif not self._file.closed:
            self._abort()


def write_shard(
    path: str | os.PathLike,
    tokens: np.ndarray,
    mask: np.ndarray | None = None,
    *,
    vocab_size: int,
) -> None:
    """Write one version-2 shard; masks are stored iff `mask` is given."""
    with ShardWriter(path, vocab_size=vocab_size, with_mask=mask is not None) as writer:
        writer.append(tokens, mask)
