"""Exclusive use of a run's output paths: one lock file per path, held for the run's life.

Two runs writing one --checkpoint_dir, --out_dir or --log_file would interleave their
checkpoints and log lines, and the second run's checkpoint manager would delete the first's save
in progress as a leftover temporary. So a run takes, before it writes anything:

    <checkpoint_dir>/.jaxllmq.lock   inside (orbax lists only directories named by a step, and
                                     cleans up only names holding `.orbax-checkpoint-tmp`)
    <parent>/.<name>.lock            beside --out_dir, which the export replaces as a whole
    <log_file>.lock

A lock file is made with O_CREAT|O_EXCL and held with flock(2) while the run lasts; the kernel
drops a flock when its holder dies, however it dies. The file holds JSON naming its holder:
`host`, `pid`, `pid_start` (the process's start in clock ticks since boot, from
/proc/<pid>/stat: tells a reused pid; null without /proc), `started` (unix time) and `argv`.
A lock file that nobody holds was left by a run that ended without removing it: taken over when
its holder was a process of this host that is gone (its pid is free, or another process's now),
refused when its holder is on another host, whose processes this host cannot see.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import socket
import time

import jax

from jaxllmq.settings import TrainConfig

CHECKPOINT_DIR_LOCK = ".jaxllmq.lock"
_READ_TRIES = 20  # a holder writes its JSON just after taking the lock: read again meanwhile


class RunLockError(Exception):
    """A path that another run is using (one line: the path, its holder and what to do)."""


def lock_file(flag: str, path: str) -> str:
    """Where the lock of `path`, given as `flag`, is (see the module docstring)."""
    path = os.path.abspath(path)
    if flag == "--checkpoint_dir":
        return os.path.join(path, CHECKPOINT_DIR_LOCK)
    if flag == "--out_dir":
        parent, name = os.path.split(path)
        return os.path.join(parent, f".{name}.lock")
    return f"{path}.lock"


def _pid_start(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (field 22 of /proc/<pid>/stat)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # the fields after `(comm)` start at 3


@dataclasses.dataclass
class Holder:
    """Who holds a lock: the JSON in its lock file."""

    host: str
    pid: int
    pid_start: int | None
    started: float
    argv: list[str]

    @classmethod
    def this_process(cls, argv: list[str]) -> Holder:
        pid = os.getpid()
        return cls(socket.gethostname(), pid, _pid_start(pid), time.time(), list(argv))

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        """The holder a lock file names; None when it names none (empty, or not this JSON)."""
        try:
            holder = cls(**json.loads(text))
        except (ValueError, TypeError):
            return None
        ok = isinstance(holder.pid, int) and holder.pid > 0 and isinstance(holder.argv, list)
        return holder if ok else None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    def __str__(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(self.started))
        command = " ".join([os.path.basename(self.argv[0]), *self.argv[1:]] if self.argv else [])
        if len(command) > 160:
            command = command[:160] + " ..."
        return f"pid {self.pid} on host {self.host} since {since} ({command})"

    def gone(self) -> bool:
        """Whether this holder, a process of this host, has ended: its pid is free, or is
        another process's (another start time)."""
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # another user's process: alive
        now = _pid_start(self.pid)
        return self.pid_start is not None and now is not None and now != self.pid_start


def _flock(fd: int) -> bool:
    """Take the flock of `fd` without waiting: False when another open file holds it. On a file
    system without flock this says True: the holder's JSON then decides alone."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
    return True


def _is_at(fd: int, path: str) -> bool:
    """Whether open file `fd` is still the file at `path` (not removed or replaced since)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino)


def _read(fd: int) -> Holder | None:
    size = os.fstat(fd).st_size
    return Holder.parse(os.pread(fd, size, 0).decode(errors="replace")) if size else None


def _write(fd: int, holder: Holder) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.to_json().encode(), 0)


def _in_use(flag: str, path: str, fd: int, holder: Holder | None = None) -> RunLockError:
    """The refusal of a lock held by a live run (its JSON is read again while it is written)."""
    for _ in range(_READ_TRIES):
        if holder is not None:
            break
        time.sleep(0.05)
        holder = _read(fd)
    by = f"by {holder}" if holder else "by another run"
    return RunLockError(f"{flag} {path} is in use {by}; wait for it to end or give another {flag}")


def _take_over(flag: str, path: str, file: str, fd: int, me: Holder) -> str:
    """The note on taking over lock file `file` (open as `fd`, flocked), which no open file held:
    its holder is gone. Raises RunLockError when the holder may still run."""
    old = _read(fd)
    if old is None:
        return f"{flag} {path}: taking over the lock file {file}, which names no holder"
    if old.host != me.host:
        raise RunLockError(
            f"{flag} {path} is in use by {old}; wait for it to end or give another {flag}; if "
            f"you are sure that run has ended, delete {file}"
        )
    if not old.gone():  # alive, on a file system without flock
        raise _in_use(flag, path, fd, old)
    return f"{flag} {path}: taking over the lock of a run that is gone: {old}"


def _take(flag: str, path: str, me: Holder) -> tuple[int, str | None]:
    """Hold the lock of `path` (given as `flag`): its open file, and a note when a lock left
    over by a run that is gone was taken over. Raises RunLockError when a run holds it."""
    file = lock_file(flag, path)
    os.makedirs(os.path.dirname(file), exist_ok=True)
    while True:
        try:
            fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            created = True
        except FileExistsError:
            try:
                fd = os.open(file, os.O_RDWR)
            except FileNotFoundError:
                continue  # its holder removed it in between
            created = False
        try:
            if not _flock(fd):
                raise _in_use(flag, path, fd)
            if _is_at(fd, file):
                note = None if created else _take_over(flag, path, file, fd, me)
                _write(fd, me)
                return fd, note
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # removed or replaced since it was opened: look again


class RunLock:
    """The locks one run holds on its output paths, until `release` (or its process ends).

    `targets` are (flag, path) pairs; `notes` says which locks, left over by runs that are
    gone, were taken over (for the run's log)."""

    def __init__(self, targets: list[tuple[str, str]], argv: list[str]):
        me = Holder.this_process(argv)
        self.notes: list[str] = []
        self._held: dict[str, int] = {}  # lock file -> its open file, flocked
        try:
            for flag, path in targets:
                file = lock_file(flag, path)
                if file in self._held:
                    continue
                try:
                    fd, note = _take(flag, path, me)
                except OSError as e:
                    raise RunLockError(
                        f"{flag} {path}: cannot write its lock file {file} ({e.strerror or e}); "
                        "give a writable path"
                    ) from e
                self._held[file] = fd
                self.notes += [note] if note else []
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Remove the lock files (those still ours) and let go of them; again does nothing."""
        for file, fd in self._held.items():
            if _is_at(fd, file):  # removed before letting go: no one takes it in between
                os.remove(file)
            os.close(fd)
        self._held = {}

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def for_run(cfg: TrainConfig, argv: list[str]) -> RunLock:
    """The locks of a training run's --checkpoint_dir, --out_dir and --log_file. Process 0
    holds them; the other processes of a multi-host run hold none."""
    paths = [
        ("--checkpoint_dir", cfg.ckpt.checkpoint_dir),
        ("--out_dir", cfg.out_dir),
        ("--log_file", cfg.log_file),
    ]
    if jax.process_index() != 0:
        paths = []
    return RunLock([(flag, path) for flag, path in paths if path], argv)
