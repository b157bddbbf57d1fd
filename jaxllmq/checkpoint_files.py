"""One checkpoint directory on disk: its file list with checksums, verification, reading its
items, finding checkpoints (resolving --continue and export's --checkpoint). Also the filters
that keep orbax's log chatter and asyncio leftovers out of the output, installed on import by
every user of orbax here (the trainer, export, generate).

The file list, `files.json`: every file's size and CRC-32, to name damage on resume.

    {"files": {"params/manifest.ocdbt": 116, ...}, "crc32": {"params/manifest.ocdbt": "9a3c01fe"}}

Paths are relative to the checkpoint directory; "crc32" (zlib's CRC-32, 8 hex digits) was added
after "files", so a list with sizes only (an older checkpoint) is checked by size alone.

The checksum is there to catch accidental damage (a flipped bit, a same-size overwrite), not
tampering, so the fastest standard-library hash does. Measured on the development CPU (SHA
extensions, AVX-512), one thread, 8 MiB chunks, in memory / reading a page-cached file:
zlib.crc32 3.8 / 2.1 GB/s, hashlib sha256 1.75 / 1.4 GB/s, blake2b 0.6 / 0.6 GB/s; xxhash's
xxh3 56 / 9 GB/s (the speed of reading alone). Files are hashed in up to 8 threads (zlib and
hashlib release the GIL on large buffers), past what storage delivers, in orbax's background
thread while training goes on: xxh3's gain is not worth a package the GPU machines must carry.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import orbax.checkpoint as ocp

FILE_LIST = "files.json"
# Written or rewritten by orbax after the post-finalization callback: not in the file list.
LATE_FILES = ("_CHECKPOINT_METADATA", "commit_success.txt")
_CHUNK = 8 << 20  # bytes read (and hashed) at a time: a file is never read whole into memory


def crc32(file: str) -> str:
    """The CRC-32 of `file`'s content, as 8 hex digits."""
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    crc = 0
    with open(file, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def _checksums(directory: str, rels: list[str]) -> dict[str, str]:
    """{rel: crc32} of the files `rels` under `directory`, hashed in parallel threads."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        sums = pool.map(crc32, [os.path.join(directory, rel) for rel in rels])
        return dict(zip(rels, sums, strict=True))


def write_file_list(directory: str) -> None:
    """Record every file under `directory` with its size and CRC-32 in `directory/files.json`."""
    sizes = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            rel = os.path.relpath(os.path.join(parent, name), directory)
            if rel not in LATE_FILES and not rel.startswith(FILE_LIST):
                sizes[rel] = os.path.getsize(os.path.join(parent, name))
    rels = sorted(sizes)
    listing = {"files": {rel: sizes[rel] for rel in rels}, "crc32": _checksums(directory, rels)}
    tmp = os.path.join(directory, FILE_LIST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(listing, f, indent=0)
    os.replace(tmp, os.path.join(directory, FILE_LIST))


def verify(path: str) -> list[str]:
    """What is wrong with checkpoint directory `path`, file by file (empty: nothing found).

    Every file that `files.json` lists must be there, as long as when it was written, and with
    the content it was written with (its CRC-32, where the list has them). Without the list (a
    checkpoint from elsewhere) nothing is checked here; reading it will tell.
    """
    listing = os.path.join(path, FILE_LIST)
    if not os.path.exists(listing):
        return []
    try:
        with open(listing) as f:
            saved = json.load(f)
        files, sums = saved["files"], saved.get("crc32", {})
    except (OSError, ValueError, KeyError, AttributeError):
        return [f"{FILE_LIST} is unreadable"]
    problems, whole = [], []
    for rel, size in files.items():
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            problems.append(f"{rel} is missing")
        elif (now := os.path.getsize(file)) != size:
            problems.append(f"{rel} is {now} bytes, {size} were written (truncated)")
        elif rel in sums:
            whole.append(rel)
    for rel, crc in _checksums(path, whole).items():
        if crc != sums[rel]:
            problems.append(
                f"{rel} has changed since it was written (CRC-32 {crc}, was {sums[rel]})"
            )
    return problems


# ---- orbax's noise ----

_ORBAX = f"{os.sep}orbax{os.sep}"


class _QuietOrbax(logging.Filter):
    """Drop orbax's INFO chatter (a dozen lines per save) from absl's log; keep its warnings, but
    not the tracebacks of a failed save, logged by each layer it passes (orbax raises it to
    Checkpointing, which reports it in one line)."""

    SAVE_LAYERS = ("future.py", "async_checkpointer.py", "checkpoint_manager.py")

    def filter(self, record: logging.LogRecord) -> bool:
        if _ORBAX not in record.pathname:
            return True
        failed_save = record.exc_info and record.filename in self.SAVE_LAYERS
        return record.levelno >= logging.WARNING and not failed_save


logging.getLogger("absl").addFilter(_QuietOrbax())


class _QuietOrbaxTasks(logging.Filter):
    """Drop asyncio's "Task exception was never retrieved" reports (through the root logger, with
    a traceback) for orbax's abandoned reads and writes: the failure itself is reported once."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.exc_info or record.exc_info[2] is None:
            return True
        tb = record.exc_info[2]
        while tb is not None:
            if _ORBAX in tb.tb_frame.f_code.co_filename:
                return False
            tb = tb.tb_next
        return True


logging.getLogger("asyncio").addFilter(_QuietOrbaxTasks())


def _quiet_unraisable(report: Any, _default=sys.unraisablehook, _orbax=_ORBAX) -> None:
    """Drop what orbax's asyncio use leaves behind when a read or write fails (the failure itself
    is reported): tensorstore's callbacks into orbax's closed event loop ("Event loop is closed",
    with no object), and the abandoned reads' and writes' coroutines raising as they are freed
    (also at exit: hence the defaults, bound while the module's globals exist)."""
    code = getattr(report.object, "cr_code", None)
    if code is not None and _orbax in code.co_filename:
        return
    value = report.exc_value
    if (
        report.object is None
        and type(value) is RuntimeError
        and str(value) == "Event loop is closed"
    ):
        return
    _default(report)


sys.unraisablehook = _quiet_unraisable


# ---- reading one checkpoint ----

ARRAY_ITEMS = ("params", "train_state")
JSON_ITEMS = ("data", "log", "run", "model")


class CheckpointError(ValueError):
    """A checkpoint this run cannot use: missing, or saved with another meaning (one line)."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint whose files are missing, truncated or unreadable."""

    def __init__(self, path: str, what: str):
        super().__init__(f"checkpoint {path} is damaged: {what}")
        self.path = path


def _handlers() -> dict[str, ocp.CheckpointHandler]:
    handlers: dict[str, ocp.CheckpointHandler] = {
        name: ocp.StandardCheckpointHandler() for name in ARRAY_ITEMS
    }
    handlers.update({name: ocp.JsonCheckpointHandler() for name in JSON_ITEMS})
    return handlers


def _reader() -> ocp.Checkpointer:
    """Reads one checkpoint directory (a manager would also list, delete and write)."""
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler(**_handlers()))


def checkpoint_steps(root: str) -> list[int]:
    """Steps of the complete (renamed, finalized) checkpoints under `root`, ascending."""
    return sorted(ocp.path.step.checkpoint_steps(root)) if os.path.isdir(root) else []


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:400]


@dataclasses.dataclass
class Saved:
    """The JSON part of one checkpoint, and where it is."""

    path: str
    data: dict
    log: dict
    run: dict
    model: dict

    @property
    def step(self) -> int:
        return int(os.path.basename(self.path))


def read_json_items(path: str) -> Saved:
    """The JSON items of checkpoint `path`, after checking its files against the list."""
    problems = verify(path)
    if problems:
        raise DamagedCheckpointError(path, "; ".join(problems))
    args = ocp.args.Composite(**{name: ocp.args.JsonRestore() for name in JSON_ITEMS})
    try:
        with _reader() as reader:
            items = reader.restore(path, args=args)
    except Exception as e:  # orbax raises whatever its storage layer raises
        raise DamagedCheckpointError(path, _first_line(e)) from e
    return Saved(path, **{name: items[name] for name in JSON_ITEMS})


def _split(state: Any) -> tuple[Any, dict]:
    """(params, the other fields) of a TrainState-like dataclass pytree.

    An empty field (TrainState.fp8 without delayed fp8 scaling) is left out, so such a state
    saves what checkpoints from before the field did, and restores from them."""
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    rest = {
        k: v for k, v in fields.items() if k != "params" and not (isinstance(v, dict) and not v)
    }
    return state.params, rest


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs with the arrays' shardings: a restore target (orbax reshards to it)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _leaves(tree: Any) -> dict[str, tuple[tuple, str]]:
    tree = getattr(tree, "tree", tree)  # orbax's TreeMetadata wraps the tree
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = "/".join(
            str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path
        )
        out[name] = (tuple(x.shape), str(x.dtype))
    return out


def _check_fits(path: str, saved: dict, target: dict) -> None:
    """Refuse a checkpoint whose arrays (names, shapes, dtypes) are not this run's state's."""
    have, want = {}, {}
    for item in target:
        have.update({f"{item}/{k}": v for k, v in _leaves(saved[item]).items()})
        want.update({f"{item}/{k}": v for k, v in _leaves(target[item]).items()})
    diffs = [f"{k} is not in it" for k in want if k not in have]
    diffs += [f"it has {k}, this run does not" for k in have if k not in want]
    diffs += [
        f"{k} is {have[k][1]}{list(have[k][0])} there, {want[k][1]}{list(want[k][0])} here"
        for k in want
        if k in have and have[k] != want[k]
    ]
    if diffs:
        more = f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else ""
        hint = ""
        if any("train_state/fp8/" in d for d in diffs):
            hint = " (train_state/fp8: the amax histories of --fp8_scaling=delayed"
            hint += ", --fp8_amax_history steps long)"
        raise CheckpointError(
            f"--continue: checkpoint {path} does not fit this run's state: "
            f"{'; '.join(diffs[:3])}{more}; resume with the flags it was saved with{hint}"
        )


def restore_arrays(path: str, target: Any) -> Any:
    """The TrainState of checkpoint `path`, laid out as `target` (arrays or ShapeDtypeStructs).

    Orbax reads each array straight into the target's sharding, so a checkpoint saved on 8
    devices restores onto 4 or 1, or under another ZeRO level.
    """
    params, rest = _split(target)
    want = {"params": abstract_like(params), "train_state": abstract_like(rest)}
    try:
        with _reader() as reader:
            saved = reader.metadata(path).item_metadata
            _check_fits(path, {k: saved[k] for k in want}, want)
            items = reader.restore(
                path,
                args=ocp.args.Composite(
                    **{k: ocp.args.StandardRestore(v) for k, v in want.items()}
                ),
            )
    except CheckpointError:
        raise
    except Exception as e:
        raise DamagedCheckpointError(path, _first_line(e)) from e
    return target.replace(params=items["params"], **items["train_state"])


def restore_params(path: str, target: Any) -> Any:
    """Only the parameters of checkpoint `path`, laid out as `target` (for export)."""
    try:
        with _reader() as reader:
            saved = reader.metadata(path).item_metadata
            _check_fits(path, {"params": saved["params"]}, {"params": target})
            args = ocp.args.Composite(params=ocp.args.StandardRestore(abstract_like(target)))
            return reader.restore(path, args=args)["params"]
    except CheckpointError:
        raise
    except Exception as e:
        raise DamagedCheckpointError(path, _first_line(e)) from e


def resolve(spec: str, checkpoint_dir: str | None) -> tuple[str, list[int], bool]:
    """(root, steps to try in order, may fall back) for --continue=spec.

    `latest` is the newest complete checkpoint in `checkpoint_dir`, falling back to older ones
    past damage (none yet: no steps); a number is that step there; anything else is a path.
    """
    if spec != "latest" and not spec.isdigit():
        return resolve_path(spec)
    if not checkpoint_dir:
        raise CheckpointError(f"--continue={spec} needs --checkpoint_dir")
    steps = checkpoint_steps(checkpoint_dir)
    if spec == "latest":
        return checkpoint_dir, steps[::-1], True
    if int(spec) not in steps:
        raise CheckpointError(
            f"--continue={spec}: no complete checkpoint {os.path.join(checkpoint_dir, spec)} "
            f"(there are: {_steps_text(steps)})"
        )
    return checkpoint_dir, [int(spec)], False


def resolve_path(spec: str) -> tuple[str, list[int], bool]:
    """A checkpoint (`<root>/<step>`: just it) or a directory of them (newest first, with
    fallback), as (root, steps to try in order, may fall back)."""
    path = os.path.normpath(spec)
    parent, name = os.path.split(path)
    if name.isdigit() and int(name) in checkpoint_steps(parent):
        return parent, [int(name)], False
    steps = checkpoint_steps(path)
    if not steps:
        raise CheckpointError(
            f"{spec}: neither a complete checkpoint (<dir>/<step>) nor a directory holding one"
        )
    return path, steps[::-1], True


def _same(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _steps_text(steps: list[int]) -> str:
    if not steps:
        return "none"
    return ", ".join(map(str, steps[-8:])) + (" ..." if len(steps) > 8 else "")
