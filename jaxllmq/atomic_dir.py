"""Replace a directory as a whole: readers find all of the old contents or all of the new.

`replace_dir(path, fill)` has `fill` write the new contents into a temporary sibling
`.<name>.export-<host>-<pid>` (same parent, so renames are atomic), carries over the files of the
old directory that the new one does not supersede (hard links, else copies), fsyncs every file and
directory, then swaps the two:

- On Linux, renameat2(RENAME_EXCHANGE) exchanges them in one step; the old contents, now at the
  temporary name, are then removed.
- Elsewhere, or where the filesystem refuses the exchange, the old directory is renamed aside to
  `.<name>.old-<host>-<pid>` and the new one renamed into place. Between those two renames, the
  fallback's one non-atomic moment, `path` does not exist; a process killed there leaves the old
  contents aside and the complete new ones at the temporary name, and `recover(path)` (run first by
  every `replace_dir`) puts the new ones in place.

A failure before the swap removes the temporary directory and leaves `path` as it was. Siblings
left by a killed writer are removed (or, in the gap above, finished) only once their owner, named by
host and pid, is dead on this host, so a writer never touches another live writer's files. One
process must not replace the same directory from two threads at once.
"""

import ctypes
import errno
import os
import re
import shutil
import socket
import stat
import sys
from collections.abc import Callable

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


class AtomicDirError(Exception):
    """A directory that could not be written, naming it and saying whether it changed."""


def _owner() -> tuple[str, int]:
    """(host, pid) of this process, as the sibling names carry them."""
    return socket.gethostname().replace(os.sep, "_"), os.getpid()


def _sibling(path: str, kind: str, owner: tuple[str, int]) -> str:
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.{kind}-{owner[0]}-{owner[1]}")


def _siblings(path: str) -> list[tuple[str, str, tuple[str, int]]]:
    """(sibling path, "export" or "old", owner) of every temporary sibling of `path`, sorted."""
    parent, name = os.path.split(path)
    pattern = re.compile(rf"\.{re.escape(name)}\.(export|old)-(.+)-(\d+)")
    found = []
    for entry in sorted(os.listdir(parent)):
        m = pattern.fullmatch(entry)
        if m:
            found.append((os.path.join(parent, entry), m[1], (m[2], int(m[3]))))
    return found


def _alive(owner: tuple[str, int], including_ours: bool) -> bool:
    """False only for a process known to be dead: one of this host that no longer exists, or
    this process itself if `including_ours` (it is writing nothing now)."""
    host, pid = owner
    if host != _owner()[0]:
        return True
    if pid == os.getpid():
        return not including_ours
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover(path: str, *, including_ours: bool = False) -> None:
    """Finish or undo what writers of `path` that died (and, if `including_ours`, this process's
    failed attempts) left beside it.

    A dead writer's temporary directory is removed, unless `path` is missing and that writer had
    moved the old contents aside (it died inside the fallback's gap, so its temporary directory is
    complete): then it goes into place. An old directory set aside is removed once `path` exists,
    or put back if nothing else can be.
    """
    path = os.path.realpath(path)
    dead = [s for s in _siblings(path) if not _alive(s[2], including_ours)]
    if not os.path.lexists(path):
        for aside, kind, owner in dead:
            if kind == "old":
                new = _sibling(path, "export", owner)
                os.rename(new if os.path.isdir(new) else aside, path)
                _fsync(os.path.dirname(path))
                break
    for sibling, _, _ in dead:
        if os.path.lexists(sibling):
            shutil.rmtree(sibling)


def replace_dir(path: str, fill: Callable[[str], None], superseded: Callable[[str], bool]) -> None:
    """Make `path` a directory holding what `fill(tmp)` writes into the empty directory `tmp`.

    Entries of the old `path` that `fill` did not write and `superseded(name)` does not claim are
    carried over. OSErrors are raised as one AtomicDirError naming `path`; any failure before the
    swap leaves `path` as it was and removes the temporary directory.
    """
    shown, path = path, os.path.realpath(path)
    parent = os.path.dirname(path)
    tmp = _sibling(path, "export", _owner())
    aside = _sibling(path, "old", _owner())
    swapped = False
    try:
        if os.path.lexists(path) and not os.path.isdir(path):
            raise AtomicDirError(f"{shown} exists and is not a directory; give a directory path")
        os.makedirs(parent, exist_ok=True)
        recover(path, including_ours=True)
        os.mkdir(tmp)
        fill(tmp)
        if os.path.isdir(path):
            _carry_over(path, tmp, superseded)
        _fsync_tree(tmp)
        old = None
        if not os.path.isdir(path):
            os.rename(tmp, path)
        elif _exchange(tmp, path):
            old = tmp  # the old contents, now at the temporary name
        else:
            os.rename(path, aside)
            try:
                os.rename(tmp, path)
            except BaseException:
                os.rename(aside, path)  # if this fails too, recover() completes the swap
                raise
            old = aside
        swapped = True
        _fsync(parent)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        if not os.path.lexists(aside):  # else tmp is the complete new copy recover() needs
            shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, OSError):
            raise
        state = "the new contents are in place" if swapped else "it is left as it was"
        raise AtomicDirError(f"could not write {shown} ({e}); {state}") from e


def _exchange(a: str, b: str) -> bool:
    """Swap directories `a` and `b` atomically; False where the OS or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    path_at = [ctypes.c_int, ctypes.c_char_p]  # (directory fd, path), for each of the two
    renameat2.argtypes = [*path_at, *path_at, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _carry_over(old: str, new: str, superseded: Callable[[str], bool]) -> None:
    """Bring `old`'s entries that `new` lacks and `superseded` does not claim into `new`."""
    for name in sorted(os.listdir(old)):
        src, dst = os.path.join(old, name), os.path.join(new, name)
        if os.path.lexists(dst) or superseded(name):
            continue
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        elif os.path.isdir(src):
            shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(src, dst)


def _fsync(path: str) -> None:
    """fsync a file or a directory (an O_RDONLY descriptor serves both on POSIX)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    """fsync every regular file and directory under `root`, `root` itself last."""
    for top, _, files in os.walk(root, topdown=False):
        for name in files:
            if stat.S_ISREG(os.lstat(os.path.join(top, name)).st_mode):
                _fsync(os.path.join(top, name))
        _fsync(top)
