"""Checkpoints: orbax's CheckpointManager over --checkpoint_dir, resuming (--continue), preemption.

A checkpoint is the directory `<checkpoint_dir>/<step>/`, one orbax Composite of items:

    params/       the parameters                     (orbax PyTree: tensorstore OCDBT files)
    train_state/  the rest of the TrainState: step, optimizer state (moments, counters)
    data/         the data pipeline's position, with the seed of the data order (JSON)
    log/          the outlier detector's history     (JSON)
    run/          the run's argv and TrainConfig     (JSON)
    model/        the model's HF config.json dict    (JSON)
    files.json    every file above with its size

The train step draws no random numbers (no dropout), so the data order's seed is the run's only
RNG state. Orbax writes a checkpoint into `<step>.orbax-checkpoint-tmp` and renames it to `<step>`
once every item is complete, so a directory named by a step is whole: a run killed mid-save leaves
only the tmp directory, which the next run's manager deletes. `files.json` is written into that
tmp directory just before the rename (orbax's post-finalization callback), so it is part of the
atomic checkpoint; on resume it names any file that has since gone missing or been truncated.

Saves are asynchronous: `save` returns once the arrays are copied to host memory, and orbax
writes them from a background thread while training goes on. Retention is orbax's preservation
policy: the newest `--ckpt_keep_n`, plus every step that is a multiple of `--ckpt_major`.

Orbax API used (present and identical in orbax-checkpoint 0.12.4 and 0.12.8): CheckpointManager
(`item_handlers=`, save(force=), wait_until_finished, reload, close), CheckpointManagerOptions
(`preservation_policy`, `async_options=AsyncOptions(post_finalization_callback=)`,
`cleanup_tmp_directories`), `checkpoint_managers.{AnyPreservationPolicy, LatestN, EveryNSteps}`,
Checkpointer + CompositeCheckpointHandler for reading, `args.{Composite, StandardSave,
StandardRestore, JsonSave, JsonRestore}`, and `path.step.checkpoint_steps`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as policies

if TYPE_CHECKING:  # config.py defines the trainer's flags; the export CLI has its own
    from jaxllmq.config import CheckpointConfig

FILE_LIST = "files.json"
ARRAY_ITEMS = ("params", "train_state")
JSON_ITEMS = ("data", "log", "run", "model")


class _QuietOrbax(logging.Filter):
    """Drop orbax's INFO chatter (a dozen lines per save) from absl's log; keep its warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or f"{os.sep}orbax{os.sep}" not in record.pathname


logging.getLogger("absl").addFilter(_QuietOrbax())

# Written or rewritten by orbax after the post-finalization callback: not in the file list.
_LATE_FILES = ("_CHECKPOINT_METADATA", "commit_success.txt")


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


# ---- the file list: naming damage ----


def write_file_list(directory: str) -> None:
    """Record every file under `directory` with its size in `directory/files.json`."""
    files = {}
    for parent, _, names in os.walk(directory):
        for name in names:
            rel = os.path.relpath(os.path.join(parent, name), directory)
            if rel not in _LATE_FILES and not rel.startswith(FILE_LIST):
                files[rel] = os.path.getsize(os.path.join(parent, name))
    tmp = os.path.join(directory, FILE_LIST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"files": dict(sorted(files.items()))}, f, indent=0)
    os.replace(tmp, os.path.join(directory, FILE_LIST))


def verify(path: str) -> list[str]:
    """What is wrong with checkpoint directory `path`, file by file (empty: nothing found).

    Every file that `files.json` lists must be there, as long as when it was written. Without
    the list (a checkpoint from elsewhere) nothing is checked here; reading it will tell.
    """
    listing = os.path.join(path, FILE_LIST)
    if not os.path.exists(listing):
        return []
    try:
        with open(listing) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError):
        return [f"{FILE_LIST} is unreadable"]
    problems = []
    for rel, size in files.items():
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            problems.append(f"{rel} is missing")
        elif (now := os.path.getsize(file)) != size:
            problems.append(f"{rel} is {now} bytes, {size} were written (truncated)")
    return problems


# ---- reading one checkpoint ----


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


# ---- what a changed flag means for a resume ----

# Saved values that give the state its meaning: a resume that changes them is refused.
MEANING = {
    ("model", "model_dtype"): "--model_dtype",
    ("optim", "opt_m_dtype"): "--opt_m_dtype",
    ("optim", "opt_v_dtype"): "--opt_v_dtype",
    ("model", "fp8_scaling"): "--fp8_scaling",
}
# On/off switches that add or remove a part of the optimizer state.
STRUCTURE = {("optim", "grad_clip"): "--grad_clip", ("optim", "weight_decay"): "--weight_decay"}
# How this process was asked to resume, and where its peers meet: not a change of the run.
_IGNORED = {("ckpt", "continue_from"), ("ckpt", "new_data"), ("mesh", "coordinator_address")}
_FLAG_NAMES = {"train_files": "train_file", "eval_files": "eval_file"}


def _flatten(d: dict, prefix: tuple = ()) -> dict[tuple, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, (*prefix, k)))
        else:
            out[(*prefix, k)] = v
    return out


def check_resume(saved: Saved, config: dict, model: dict) -> list[str]:
    """Compare a checkpoint's run with this one's (TrainConfig as a dict, the HF model dict).

    Raises CheckpointError on a change of meaning: another model, parameter or moment dtypes,
    an optimizer part switched on or off. Returns the harmless changes (lr, steps, eval
    cadence, data, devices, ...) as "--flag: old -> new" for the log.
    """
    where = f"--continue: checkpoint {saved.path}"
    if saved.model != model:
        keys = sorted(
            k for k in saved.model.keys() | model.keys() if saved.model.get(k) != model.get(k)
        )
        diff = ", ".join(f"{k} {saved.model.get(k)!r} -> {model.get(k)!r}" for k in keys[:4])
        raise CheckpointError(
            f"{where} holds another model ({diff}); resume with the --model it was saved with, "
            "or start a new run from an export of it (python -m jaxllmq.export)"
        )
    old = _flatten(saved.run.get("config", {}))
    new = _flatten(json.loads(json.dumps(config)))
    for key, flag in MEANING.items():
        if key in old and old[key] != new.get(key):
            raise CheckpointError(
                f"{where} was saved with {flag}={old[key]}, this run has {flag}={new.get(key)}, "
                "which changes what the saved state means; resume with the saved value, or start "
                "a new run from an export of it (python -m jaxllmq.export)"
            )
    for key, flag in STRUCTURE.items():
        if key in old and (old[key] > 0) != (new.get(key, 0) > 0):
            on = old[key] > 0
            raise CheckpointError(
                f"{where} was saved with {flag}={old[key]}, this run has {flag}={new.get(key)}: "
                f"switching it {'off' if on else 'on'} changes the optimizer state's structure; "
                f"resume with {flag} {'> 0' if on else '= 0'}"
            )
    return [
        f"--{_FLAG_NAMES.get(key[-1], key[-1])}: {old.get(key)!r} -> {new.get(key)!r}"
        for key in sorted(old.keys() | new.keys(), key=str)
        if key not in _IGNORED and old.get(key) != new.get(key)
    ]


# ---- one run's checkpoints ----


class Checkpointing:
    """One run's checkpoints: finds what --continue asks for and restores it; saves every
    --ckpt_interval steps, asynchronously; keeps --ckpt_keep_n and every --ckpt_major.

    Construct it before the model is built, so refusals (damaged, incompatible, a directory
    holding another run's checkpoints) come before any device work. `run` is the JSON saved as
    the run's record ({"argv", "config": TrainConfig as a dict}), `model` the HF config dict;
    `info` prints and logs a message.
    """

    def __init__(
        self, cfg: CheckpointConfig, *, run: dict, model: dict, info: Callable[[str], None]
    ):
        self.cfg = cfg
        self.run = json.loads(json.dumps(run))
        self.model = model
        self.info = info
        self.dir = os.path.abspath(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
        self.resume: Saved | None = None
        self.last_saved: int | None = None
        self._root: str | None = None
        self._candidates: list[int] = []
        self._fallback = False
        self._damaged: list[str] = []
        self._mgr: ocp.CheckpointManager | None = None
        self._in_flight: collections.deque[int] = collections.deque()
        if cfg.continue_from:
            self._root, self._candidates, self._fallback = resolve(cfg.continue_from, self.dir)
            if not self._candidates:
                self.info(f"--continue=latest: no checkpoint in {self.dir} yet, starting fresh")
            else:
                self._select()
        if self.dir:
            self._check_no_newer()
            self._mgr = self._writer()

    # -- resuming --

    def _select(self) -> None:
        """Take the newest remaining candidate whose JSON reads and fits; past damage, fall back."""
        while self._candidates:
            path = os.path.join(self._root, str(self._candidates.pop(0)))
            try:
                saved = read_json_items(path)
            except DamagedCheckpointError as e:
                self._on_damage(e)
                continue
            changes = check_resume(saved, self.run["config"], self.model)
            if changes:
                self.info(f"resuming with changed settings: {', '.join(changes)}")
            self.resume = saved
            self._set_aside_damaged()
            return
        raise CheckpointError(f"--continue: every checkpoint in {self._root} is damaged")

    def _on_damage(self, e: DamagedCheckpointError) -> None:
        if not self._fallback:
            raise e
        self.info(f"{e}; falling back to the checkpoint before it")
        self._damaged.append(e.path)

    def _set_aside_damaged(self) -> None:
        """Rename damaged checkpoints of our own directory to <step>.damaged, so that this run's
        saves of those steps do not collide with them (and they stay for a look)."""
        if not self._damaged or self.dir is None or not _same(self._root, self.dir):
            self._damaged = []
            return
        if jax.process_count() > 1:  # every process has read them before one renames them
            multihost_utils.sync_global_devices("jaxllmq: damaged checkpoints found")
        for path in self._damaged:
            aside = f"{path}.damaged"
            if jax.process_index() == 0:
                if os.path.exists(aside):
                    aside = f"{path}.damaged-{int(time.time())}"
                os.rename(path, aside)
            self.info(f"moved the damaged checkpoint {path} aside to {aside}")
        self._damaged = []
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("jaxllmq: damaged checkpoints moved")
        if self._mgr is not None:
            self._mgr.reload()

    def restore(self, state: Any) -> Any:
        """The resumed TrainState laid out like `state` (whose arrays are freed first), or
        `state` itself when there is nothing to resume. `self.resume` is then the checkpoint
        used (an older one if the newest could not be read)."""
        if self.resume is None:
            return state
        target = abstract_like(state)
        # Free the initial state first: restoring beside it would need twice the memory.
        jax.tree.map(lambda x: x.delete(), state)
        while True:
            try:
                restored = restore_arrays(self.resume.path, target)
                break
            except DamagedCheckpointError as e:
                self._on_damage(e)
                self.resume = None
                self._select()
        self.info(f"resumed from {self.resume.path} (step {int(restored.step)})")
        return restored

    def _check_no_newer(self) -> None:
        """Refuse a --checkpoint_dir whose existing checkpoints this run's saves would collide
        with (orbax never overwrites a step): another run's, or newer ones than the resumed."""
        start = self.resume.step if self.resume else 0  # this run saves steps after it
        newer = [s for s in checkpoint_steps(self.dir) if s > start]
        if not newer:
            return
        if self.resume is None:
            raise CheckpointError(
                f"--checkpoint_dir={self.dir} already holds checkpoints (steps "
                f"{_steps_text(newer)}): resume them with --continue=latest, or give another "
                "--checkpoint_dir"
            )
        raise CheckpointError(
            f"--continue: resuming step {self.resume.step}, but --checkpoint_dir={self.dir} holds "
            f"newer checkpoints (steps {_steps_text(newer)}) that this run's saves would collide "
            "with; move them away or give another --checkpoint_dir"
        )

    # -- saving --

    def _writer(self) -> ocp.CheckpointManager:
        keep = []
        if self.cfg.ckpt_keep_n:
            keep.append(policies.LatestN(self.cfg.ckpt_keep_n))
            if self.cfg.ckpt_major:
                keep.append(policies.EveryNSteps(self.cfg.ckpt_major))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=policies.AnyPreservationPolicy(keep) if keep else None,
            enable_async_checkpointing=True,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._before_rename),
            cleanup_tmp_directories=True,  # what a save killed mid-way left behind
        )
        return ocp.CheckpointManager(self.dir, options=options, item_handlers=_handlers())

    def _before_rename(self) -> None:
        # Orbax's background thread, after every item of the oldest save in flight is written
        # and before its tmp directory is renamed to <step>: the list joins the atomic rename.
        step = self._in_flight.popleft()
        if jax.process_index() != 0:
            return
        tmp = [n for n in os.listdir(self.dir) if n.startswith(f"{step}.") and "tmp" in n]
        if len(tmp) == 1:  # <step>.orbax-checkpoint-tmp
            write_file_list(os.path.join(self.dir, tmp[0]))

    def due(self, step: int) -> bool:
        """Whether the --ckpt_interval cadence saves at `step`."""
        n = self.cfg.ckpt_interval
        return self._mgr is not None and n > 0 and step % n == 0

    def save(self, step: int, state: Any, *, data: dict, log: dict) -> float:
        """Start saving `state` as checkpoint `step`; returns the seconds the caller was held
        (copying the arrays to host memory; waiting for the previous save, if still writing)."""
        assert self._mgr is not None, "saving needs --checkpoint_dir"
        params, rest = _split(state)
        items = ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            train_state=ocp.args.StandardSave(rest),
            data=ocp.args.JsonSave(data),
            log=ocp.args.JsonSave(log),
            run=ocp.args.JsonSave(self.run),
            model=ocp.args.JsonSave(self.model),
        )
        t0 = time.perf_counter()
        self._in_flight.append(step)
        try:
            # force: our cadence decides when to save, not orbax's save-decision policy.
            self._mgr.save(step, args=items, force=True)
        except BaseException:
            self._in_flight.pop()
            raise
        self.last_saved = step
        return time.perf_counter() - t0

    def path(self, step: int) -> str:
        """Where this run's checkpoint `step` is (or will be)."""
        assert self.dir is not None
        return os.path.join(self.dir, str(step))

    def has(self, step: int) -> bool:
        """Whether this run's --checkpoint_dir holds a complete checkpoint `step`."""
        if self._mgr is None:
            return False
        return step == self.last_saved or step in self._mgr.all_steps()

    @property
    def writing(self) -> bool:
        """Whether a started save is still being written in the background."""
        return self._mgr is not None and self._mgr.is_saving_in_progress()

    def wait(self) -> None:
        """Block until every started save is complete on disk."""
        if self._mgr is not None:
            self._mgr.wait_until_finished()

    @property
    def saving(self) -> bool:
        """Whether this run can save (it has a --checkpoint_dir)."""
        return self._mgr is not None

    def close(self) -> None:
        """Wait until every started save is complete on disk; release the manager."""
        if self._mgr is not None:
            self._mgr.wait_until_finished()
            self._mgr.close()
            self._mgr = None


# ---- preemption ----


class Preemption:
    """SIGTERM / SIGINT: the host loop finishes the current step, checkpoints and exits.

    One process: our own handler notes the signal (a second one stops at once). Several
    processes (jax.distributed initialized): jax's preemption sync point, where every process
    agrees on the step to stop at; it needs `reached(step)` called at every step.
    """

    def __init__(self) -> None:
        self.signal: str | None = None
        self._old: dict[int, Any] = {}
        self._multi = False

    def install(self) -> None:
        """Start listening (the trainer calls this when it can checkpoint)."""
        if jax.process_count() > 1:
            self._multi = True  # jax's preemption notifier owns SIGTERM
            return
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is not None:  # asked twice: stop now, the default way
            self.uninstall()
            signal.raise_signal(signum)
            return
        self.signal = signal.Signals(signum).name

    def reached(self, step: int) -> bool:
        """Whether to stop after `step` (all processes agree on it)."""
        if self._multi:
            if multihost_utils.reached_preemption_sync_point(step):
                self.signal = self.signal or "a preemption notice"
                return True
            return False
        return self.signal is not None

    def uninstall(self) -> None:
        """Give SIGTERM and SIGINT back to the handlers they had."""
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}
