"""The HF export replaces its directory as a whole: kills at every step, a full disk, user files."""

import contextlib
import dataclasses
import errno
import os
import shutil
import subprocess

import jax
import numpy as np
import pytest

from jaxllmq import atomic_dir
from jaxllmq.model import hf
from jaxllmq.model.architecture import PRESETS, ModelConfig
from jaxllmq.model.llama import abstract_model

CFG = dataclasses.replace(
    PRESETS["tiny"],
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
)
_, ABSTRACT, _ = abstract_model(CFG)
# The old model is sharded and the new one a single file: an old shard left behind shows.
OLD_SHARDS = 3000
README = "the user's notes\n"


class Killed(BaseException):
    """The process died: this call and every later one never reach the disk."""


def _params(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), ABSTRACT)


OLD, NEW = _params(0), _params(1)


def _load(path: str) -> dict:
    return hf.load_hf_params(path, CFG, ABSTRACT, place=lambda _, x: x)


def _same(path: str, params: dict) -> bool:
    return all(jax.tree.leaves(jax.tree.map(np.array_equal, _load(path), params)))


def _is(path: str, params: dict, shards: int) -> bool:
    """`path` holds exactly `params` in `shards` files, the config and the user's README."""
    names = set(os.listdir(path))
    weights = {n for n in names if n.startswith("model") and n.endswith(".safetensors")}
    index = {"model.safetensors.index.json"} if shards > 1 else set()
    if len(weights) != shards or names - weights != {"config.json", "README.md", *index}:
        return False
    with open(os.path.join(path, "README.md")) as f:
        readme = f.read()
    return readme == README and ModelConfig.from_hf_dir(path) == CFG and _same(path, params)


def _old_model(path: str) -> int:
    """Export OLD to `path` with a README beside it; returns how many shard files it has."""
    hf.save_hf(path, CFG, OLD, max_shard_bytes=OLD_SHARDS)
    with open(os.path.join(path, "README.md"), "w") as f:
        f.write(README)
    return sum(n.endswith(".safetensors") for n in os.listdir(path))


@pytest.fixture(scope="module")
def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@contextlib.contextmanager
def _dies_at(k: int, fallback: bool, dead_pid: int):
    """Every write, fsync, rename, link, copy, mkdir and removal is counted; call k and all
    later ones raise Killed. The writer is a process of this host that has since died."""
    count = [0]

    def wrap(fn):
        def call(*args, **kwargs):
            count[0] += 1
            if count[0] >= k:
                raise Killed
            return fn(*args, **kwargs)

        return call

    with pytest.MonkeyPatch.context() as mp:
        host = atomic_dir._owner()[0]
        mp.setattr(atomic_dir, "_owner", lambda: (host, dead_pid))
        if fallback:
            mp.setattr(atomic_dir, "_exchange", lambda a, b: False)
        for module, name in [
            (hf, "save_file"),
            (hf, "_write_json"),
            (os, "fsync"),
            (os, "rename"),
            (os, "link"),
            (os, "mkdir"),
            (os, "symlink"),
            (shutil, "copy2"),
            (shutil, "rmtree"),
            (atomic_dir, "_exchange"),
        ]:
            if hasattr(module, name):
                mp.setattr(module, name, wrap(getattr(module, name)))
        yield count


def _leftovers(path: str) -> list[str]:
    parent, name = os.path.split(path)
    return [n for n in os.listdir(parent) if n.startswith(f".{name}.")]


@pytest.mark.parametrize("fallback", [False, True], ids=["exchange", "fallback"])
def test_a_kill_at_any_step_leaves_the_old_or_the_new_model(tmp_path, dead_pid, fallback):
    seen = set()
    for k in range(1, 200):
        out = str(tmp_path / str(k) / "model")
        shards = _old_model(out)
        assert shards > 1
        try:
            with _dies_at(k, fallback, dead_pid):
                hf.save_hf(out, CFG, NEW)
        except Killed:
            pass
        else:
            break
        if os.path.exists(out):
            state = "old" if _is(out, OLD, shards) else "new" if _is(out, NEW, 1) else "broken"
        else:
            state = "gap"  # the fallback's one moment without the directory
        assert state in (("old", "new", "gap") if fallback else ("old", "new")), k
        atomic_dir.recover(out)  # what the next export (by a live process) does first
        after = "old" if _is(out, OLD, shards) else "new" if _is(out, NEW, 1) else "broken"
        assert after == ("new" if state == "gap" else state), (k, state)
        assert _leftovers(out) == [], k
        seen.add(state)
    else:
        raise AssertionError("the export never completed")
    assert _is(out, NEW, 1) and _leftovers(out) == []
    assert seen == ({"old", "new", "gap"} if fallback else {"old", "new"})


def test_the_next_export_closes_the_fallbacks_gap(tmp_path, dead_pid):
    for k in range(1, 200):  # the first kill that leaves no directory at `out`
        out = str(tmp_path / str(k) / "model")
        _old_model(out)
        with pytest.raises(Killed), _dies_at(k, True, dead_pid):
            hf.save_hf(out, CFG, NEW)
        if not os.path.exists(out):
            break
    assert len(_leftovers(out)) == 2  # the old model set aside, the complete new one
    hf.save_hf(out, CFG, OLD)
    assert _is(out, OLD, 1) and _leftovers(out) == []  # the README came back with the old model


def test_a_full_disk_leaves_the_old_model_and_one_line_naming_the_directory(tmp_path, monkeypatch):
    out = str(tmp_path / "model")
    shards = _old_model(out)
    real_save, calls = hf.save_file, []

    def save_file(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        real_save(tensors, path, metadata)

    monkeypatch.setattr(hf, "save_file", save_file)
    with pytest.raises(atomic_dir.AtomicDirError) as e:
        hf.save_hf(out, CFG, NEW, max_shard_bytes=OLD_SHARDS)
    message = str(e.value)
    assert "\n" not in message and out in message and "No space left" in message
    assert "left as it was" in message
    assert _is(out, OLD, shards) and _leftovers(out) == []


def test_the_users_files_survive_an_export(tmp_path):
    out = str(tmp_path / "model")
    _old_model(out)
    os.makedirs(os.path.join(out, "notes"))
    with open(os.path.join(out, "notes", "run.txt"), "w") as f:
        f.write("lr sweep\n")
    inode = os.stat(out).st_ino
    hf.save_hf(out, CFG, NEW)
    assert os.stat(out).st_ino != inode  # a new directory replaced the old one as a whole
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors", "notes"]
    with open(os.path.join(out, "notes", "run.txt")) as f:
        assert f.read() == "lr sweep\n"
    with open(os.path.join(out, "README.md")) as f:
        assert f.read() == README
    assert _same(out, NEW) and _leftovers(out) == []


def test_stale_temporaries_go_only_once_their_owner_is_dead(tmp_path, dead_pid):
    out = str(tmp_path / "model")
    _old_model(out)
    host = atomic_dir._owner()[0]
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        dead = tmp_path / f".model.export-{host}-{dead_pid}"
        live = tmp_path / f".model.export-{host}-{sleeper.pid}"
        elsewhere = tmp_path / f".model.export-another-host-{dead_pid}"
        ours = tmp_path / f".model.old-{host}-{os.getpid()}"  # a failed attempt of this process
        for d in (dead, live, elsewhere, ours):
            os.makedirs(d / "part")
        hf.save_hf(out, CFG, NEW)
        assert not dead.exists() and live.exists() and elsewhere.exists() and not ours.exists()
        assert _same(out, NEW)
    finally:
        sleeper.kill()
        sleeper.wait()
