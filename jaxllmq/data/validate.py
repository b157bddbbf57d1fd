"""Token shards checked before training: every token id inside the model's vocab, and some token
whose loss mask is set.

One pass over each memory-mapped shard, CHUNK tokens at a time, gives its smallest and largest
token id and how many tokens its loss mask scores (ShardStats). The stats are cached per file in
a JSON file under the user's cache directory, keyed by absolute path, size and mtime, so a
restart rescans nothing; the bound (the model's vocab size) is applied to the cached min and
max, so another model needs no rescan either. The cache is rewritten whole (temporary file, then
rename): processes sharing it may drop each other's new entries, never corrupt the file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence

import numpy as np

from jaxllmq.data.shards import Shard, ShardError

CACHE_VERSION = 1  # of the cache file's layout; a file of another version is ignored
CHUNK = 1 << 24  # tokens per read (64 MiB of int32): never a whole shard in RAM
_PROGRESS_AFTER_S = 2.0  # a scan this long gets progress lines, one every _PROGRESS_EVERY_S
_PROGRESS_EVERY_S = 10.0

Note = Callable[[str], None]  # where a warning or progress line goes (the run log, print)


@dataclasses.dataclass(frozen=True)
class ShardStats:
    """What one pass over a shard found."""

    min_id: int
    max_id: int
    scored: int  # tokens whose loss mask is set: all of them when the shard has no masks


def scan(shard: Shard, progress: Callable[[int], None] | None = None) -> ShardStats:
    """Min and max token id and the scored-token count of `shard`; `progress(n)` after each
    chunk of n tokens."""
    lows, highs, scored = [], [], 0
    for start in range(0, shard.num_tokens, CHUNK):
        stop = min(start + CHUNK, shard.num_tokens)
        chunk = shard.tokens[start:stop]
        lows.append(int(chunk.min()))
        highs.append(int(chunk.max()))
        if shard.mask_bits is not None:  # CHUNK is a multiple of 8: start is a byte boundary
            bits = shard.mask_bits[start // 8 : (stop + 7) // 8]
            scored += int(np.bitwise_count(bits).sum(dtype=np.int64))
            # The last byte's bits past the last token are padding: not tokens.
            scored -= int(np.bitwise_count(bits[-1] >> (stop % 8))) if stop % 8 else 0
        if progress is not None:
            progress(stop - start)
    if shard.mask_bits is None:
        scored = shard.num_tokens
    return ShardStats(min(lows), max(highs), scored)


def first_outside(shard: Shard, vocab_size: int) -> tuple[int, int]:
    """(offset, id) of the first token of `shard` outside [0, vocab_size); the shard has one."""
    for start in range(0, shard.num_tokens, CHUNK):
        chunk = shard.tokens[start : start + CHUNK]
        bad = (chunk < 0) | (chunk >= vocab_size)
        if bad.any():
            i = int(bad.argmax())
            return start + i, int(chunk[i])
    raise ValueError(f"{shard.path!r} has no token outside [0, {vocab_size})")


def cache_path() -> str:
    """$XDG_CACHE_HOME/jaxllmq/shard_stats.json (XDG_CACHE_HOME unset: ~/.cache)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "jaxllmq", "shard_stats.json")


def _load_cache(path: str) -> dict[str, dict]:
    """The cache's entries by absolute shard path; {} if it is missing, unreadable or another
    version."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
        return {}
    entries = data.get("shards")
    return entries if isinstance(entries, dict) else {}


def _save_cache(path: str, new: dict[str, dict]) -> None:
    """Add `new` to the cache file (re-read now: other processes may have written it) and drop
    the entries of files that are gone. Raises OSError if it cannot be written."""
    entries = {**_load_cache(path), **new}
    entries = {p: e for p, e in entries.items() if os.path.exists(p)}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".shard_stats.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"version": CACHE_VERSION, "shards": entries}, f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _cached(entry: object, st: os.stat_result) -> ShardStats | None:
    """The stats in a cache entry, if it is for this size and mtime and well formed."""
    if not isinstance(entry, dict):
        return None
    if entry.get("bytes") != st.st_size or entry.get("mtime_ns") != st.st_mtime_ns:
        return None
    try:
        return ShardStats(int(entry["min_id"]), int(entry["max_id"]), int(entry["scored"]))
    except (KeyError, TypeError, ValueError):
        return None


class _Progress:
    """Progress lines for a scan of `total` tokens that takes more than _PROGRESS_AFTER_S."""

    def __init__(self, total: int, note: Note):
        self.total, self.note, self.done = total, note, 0
        self.start = self.last = time.perf_counter()

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.start >= _PROGRESS_AFTER_S and (
            self.last == self.start or now - self.last >= _PROGRESS_EVERY_S
        ):
            self.last = now
            self.note(
                f"checking token ids: {4 * self.done / 1e9:.1f} of {4 * self.total / 1e9:.1f} "
                f"GB scanned in {now - self.start:.0f} s"
            )


def shard_stats(shards: Sequence[Shard], note: Note) -> tuple[list[ShardStats], int]:
    """Each shard's stats, from the cache or a scan (then cached), and how many were scanned."""
    cache_file = cache_path()
    cache = _load_cache(cache_file)
    files = [(path, os.stat(path)) for path in (os.path.abspath(s.path) for s in shards)]
    stats = [_cached(cache.get(path), st) for path, st in files]
    todo = [i for i, s in enumerate(stats) if s is None]
    progress = _Progress(sum(shards[i].num_tokens for i in todo), note)
    new = {}
    for i in todo:
        stats[i] = scan(shards[i], progress)
        path, st = files[i]
        new[path] = {
            "bytes": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            **dataclasses.asdict(stats[i]),
        }
    if new:
        try:
            _save_cache(cache_file, new)
        except OSError as e:
            note(
                f"cannot write the token-id cache {cache_file} ({e.strerror or e}); the shards "
                "are scanned again at the next start"
            )
    return stats, len(todo)


def name_files(paths: Sequence[str]) -> str:
    """The first three paths, then how many more: for messages."""
    more = f", ... ({len(paths)} files)" if len(paths) > 3 else ""
    return ", ".join(paths[:3]) + more


def check_shards(
    shards: Sequence[Shard],
    model_vocab_size: int,
    *,
    flag_name: str,
    need_scored: bool,
    note: Note,
) -> int:
    """Check every token id of `shards` is in [0, model_vocab_size) and some token is scored;
    returns the number of scored tokens.

    Raises ShardError on a token outside the vocab (naming the shard, the first such token's
    offset and its id) and, if `need_scored` (training data), when no token is scored; eval data
    without one gets a warning. A shard without scored tokens among others gets a warning too.
    """
    start = time.perf_counter()
    stats, scanned = shard_stats(shards, note)
    for shard, s in zip(shards, stats, strict=True):
        if s.min_id < 0 or s.max_id >= model_vocab_size:
            offset, token = first_outside(shard, model_vocab_size)
            raise ShardError(
                f"token shard {shard.path!r} holds token id {token} at token offset {offset}, "
                f"outside the model's vocab [0, {model_vocab_size}): it was tokenized for "
                "another model, or is corrupt; re-tokenize the data with the model's tokenizer "
                "(`python -m jaxllmq.data.prepare`)"
            )
    scored = sum(s.scored for s in stats)
    paths = [shard.path for shard in shards]
    if scored == 0 and need_scored:
        raise ShardError(
            f"no token to train on: every loss mask in {flag_name} ({name_files(paths)}) is "
            "zero; give data with tokens to train on (a prompt/response record trains on its "
            "response)"
        )
    if scored == 0:
        note(
            f"{flag_name}: no token to evaluate on: every loss mask in {name_files(paths)} is "
            "zero; no eval loss is reported"
        )
    else:
        for path, s in zip(paths, stats, strict=True):
            if s.scored == 0:
                note(
                    f"{flag_name}: token shard {path!r} has no scored token (every loss mask is "
                    "zero): it adds nothing to the loss"
                )
    tokens = sum(shard.num_tokens for shard in shards)
    note(
        f"{flag_name}: {len(shards)} shard(s), {tokens:,} tokens ({scored:,} scored), ids "
        f"{min(s.min_id for s in stats)}..{max(s.max_id for s in stats)} (vocab "
        f"{model_vocab_size}), checked in "
        f"{time.perf_counter() - start:.1f} s ({len(shards) - scanned} from the cache)"
    )
    return scored
