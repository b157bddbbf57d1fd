"""Checkpoints: orbax's CheckpointManager over --checkpoint_dir, saving and resuming (--continue).

A checkpoint is the directory `<checkpoint_dir>/<step>/`, one orbax Composite of items:

    params/       the parameters                     (orbax PyTree: tensorstore OCDBT files)
    train_state/  the rest of the TrainState: step, optimizer state (moments, counters)
    data/         the data pipeline's position, with the seed of the data order (JSON)
    log/          the outlier detector's history     (JSON)
    run/          the run's argv and TrainConfig     (JSON)
    model/        the model's HF config.json dict    (JSON)
    files.json    every file above with its size and CRC-32 (checkpoint_files.py)

The train step draws no random numbers (no dropout), so the data order's seed is the run's only
RNG state. Orbax writes a checkpoint into `<step>.orbax-checkpoint-tmp` and renames it to `<step>`
once every item is complete, so a directory named by a step is whole: a run killed mid-save leaves
only the tmp directory, which the next run's manager deletes. `files.json` is written into that
tmp directory just before the rename (orbax's post-finalization callback), so it is part of the
atomic checkpoint; on resume, before anything of the checkpoint is read, it names any file that
has since gone missing, been truncated or changed.

Saves are asynchronous: `save` returns once the arrays are copied to host memory, and orbax
writes them from a background thread while training goes on. Retention is orbax's preservation
policy: the newest `--ckpt_keep_n`, plus every step that is a multiple of `--ckpt_major`, applied
only once a save is complete. A save that fails (a full disk) is found at the next step: its
temporary directory is removed and the run stops with one line (`--ckpt_failure=continue`: a
warning, and the next save is tried).

Here: `Checkpointing`, one run's checkpoints (finding, restoring, saving, retention). One
checkpoint directory (its file list, verification, reading its items, finding checkpoints, and
the filters of orbax's log noise) is checkpoint_files.py; which changed flags a resume refuses is
resume_rules.py; stopping with a checkpoint on SIGTERM / SIGINT is preemption.py.

Orbax API used here and in checkpoint_files.py (present and identical in orbax-checkpoint 0.12.4
and 0.12.8): CheckpointManager (`item_handlers=`, save(force=), wait_until_finished,
is_saving_in_progress, reload, close), CheckpointManagerOptions (`preservation_policy`, `async_options=AsyncOptions(post_finalization_callback=)`,
`cleanup_tmp_directories`), `checkpoint_managers.{AnyPreservationPolicy, LatestN, EveryNSteps}`,
Checkpointer + CompositeCheckpointHandler for reading, `args.{Composite, StandardSave,
StandardRestore, JsonSave, JsonRestore}`, and `path.step.checkpoint_steps`. After a failed save
only, where present: the manager's `_checkpointer._async_manager._commit_futures`.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from orbax.checkpoint import checkpoint_managers as policies

from jaxllmq.checkpoint_files import (
    CheckpointError,
    DamagedCheckpointError,
    Saved,
    _first_line,
    _handlers,
    _same,
    _split,
    _steps_text,
    abstract_like,
    checkpoint_steps,
    read_json_items,
    resolve,
    restore_arrays,
    verify,
    write_file_list,
)
from jaxllmq.resume_rules import check_resume
from jaxllmq.settings import CheckpointConfig


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written (a full disk, an I/O error): the run stops (one line)."""


def _os_error(e: BaseException) -> str:
    """The OS error under a failed write, as "[Errno 28] No space left on device": Python's
    own, or tensorstore's (a ValueError ending in "[os_error_code='28']"); else the first line."""
    code = e.errno if isinstance(e, OSError) else None
    if code is None and (found := re.search(r"os_error_code='(\d+)'", str(e))):
        code = int(found[1])
    return f"[Errno {code}] {os.strerror(code)}" if code else _first_line(e)


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
        self._unchecked: int | None = None  # a started save whose outcome is not yet checked
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
        # Orbax would wait for the previous save too; a failure is that save's, not this one's.
        if line := self._finish(step):
            self._on_failure(line)
        self._in_flight.append(step)
        try:
            # force: our cadence decides when to save, not orbax's save-decision policy.
            self._mgr.save(step, args=items, force=True)
        except Exception as e:
            self._on_failure(self._failed(step, step, e))
        else:
            self.last_saved = self._unchecked = step
        return time.perf_counter() - t0

    def check_saves(self, step: int) -> None:
        """Between steps (cheap: a flag): once the save in flight has ended, check its outcome.
        A failed save stops the run, or with --ckpt_failure=continue warns (`_on_failure`)."""
        if self._unchecked is not None and not self._mgr.is_saving_in_progress():
            if line := self._finish(step):
                self._on_failure(line)

    def _finish(self, step: int | None) -> str | None:
        """Wait for the save in flight, if any; None if it is complete, else `_failed`'s line."""
        if self._unchecked is None:
            return None
        saved, self._unchecked = self._unchecked, None
        try:
            self._mgr.wait_until_finished()
        except Exception as e:
            return self._failed(saved, step, e)
        return None

    def _failed(self, saved: int, step: int | None, e: Exception) -> str:
        """Clean up after the failed save of checkpoint `saved` (found at `step`); says what
        happened in one line. Orbax deletes old checkpoints (retention) only once a save is
        complete, so the previous ones are untouched; this removes the save's temporary
        directory (a full disk stays full otherwise) and re-reads the steps on disk."""
        self._in_flight.clear()
        if self.last_saved == saved:
            self.last_saved = None
        # Orbax stops waiting at the first write that fails: let the others end before the
        # removal (orbax 0.12's internals; without them the next run's manager removes it).
        writes = getattr(getattr(self._mgr, "_checkpointer", None), "_async_manager", None)
        for write in getattr(writes, "_commit_futures", None) or []:
            with contextlib.suppress(Exception):
                write.result(timeout=300)
        if jax.process_index() == 0:
            for name in os.listdir(self.dir):
                if name.startswith(f"{saved}.") and "tmp" in name:
                    shutil.rmtree(os.path.join(self.dir, name), ignore_errors=True)
        self._mgr.reload()
        steps = checkpoint_steps(self.dir)
        newest = self.path(steps[-1]) if steps else "none"
        return (
            f"{f'step {step}: ' if step is not None else ''}checkpoint {self.path(saved)} could "
            f"not be saved ({_os_error(e)}); its temporary directory is removed, the newest "
            f"complete checkpoint is {newest}"
        )

    def _on_failure(self, line: str) -> None:
        if self.cfg.ckpt_failure == "continue":
            self.info(f"warning: {line}; training goes on (--ckpt_failure=continue)")
            return
        raise CheckpointSaveError(
            f"{line}; stopping, as a run that cannot checkpoint would lose more at its next "
            "failure: fix the cause and resume with --continue=latest, or train on with "
            "--ckpt_failure=continue"
        )

    def resume_advice(self) -> str:
        """One sentence for a run stopping on its own (diverged): the newest complete checkpoint
        in --checkpoint_dir whose files verify, once the save in flight is complete, and the
        flag that resumes it."""
        if self._mgr is None:
            return "This run saves no checkpoints (no --checkpoint_dir)."
        if line := self._finish(None):
            self.info(f"warning: {line}")
        damaged = []
        for step in reversed(checkpoint_steps(self.dir)):
            if verify(self.path(step)):
                damaged.append(str(step))
                continue
            aside = f" (move the damaged newer ones aside first: {', '.join(damaged)})"
            return (
                f"The newest checkpoint that verifies is {self.path(step)}: resume with "
                f"--continue={step}{aside if damaged else ''}."
            )
        return f"No checkpoint in {self.dir} verifies: there is none to resume from."

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
        """Block until every started save is complete on disk (or failed: `check_saves`)."""
        if self._mgr is not None:
            if line := self._finish(None):
                self._on_failure(line)

    @property
    def saving(self) -> bool:
        """Whether this run can save (it has a --checkpoint_dir)."""
        return self._mgr is not None

    def close(self) -> None:
        """Wait until every started save is complete on disk (or failed: `check_saves`); release
        the manager."""
        if self._mgr is not None:
            try:
                if line := self._finish(None):
                    self._on_failure(line)
            finally:
                self._mgr.close()
                self._mgr = None
