"""Checkpoint integrity: content checksums (and old lists of sizes), a failed save reported in
one line that stops the run (or not, with --ckpt_failure=continue), and a diverged run that names
a checkpoint that verifies. The resumes past damage are in test_checkpoint.py, beside its
reference run.
"""

import errno
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
import test_checkpoint
from orbax.checkpoint import JsonCheckpointHandler
from test_checkpoint import _checkpointing, _flags, _flip_byte, _largest, _state, _steps

from jaxllmq import checkpoint, checkpoint_files
from jaxllmq.checkpoint_files import FILE_LIST

shards = test_checkpoint.shards  # its fixture, for this module

# Fails the save of step 4 as a full disk would: orbax's JSON writes raise ENOSPC for it.
_FULL_DISK = textwrap.dedent(
    """
    import errno, os, runpy, sys
    from orbax.checkpoint import JsonCheckpointHandler
    write = JsonCheckpointHandler._save_fn
    async def full(self, x, directory):
        if f"{os.sep}4.orbax-checkpoint-tmp" in str(directory):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
        await write(self, x, directory)
    JsonCheckpointHandler._save_fn = full
    sys.argv[0] = "jaxllmq.main"
    runpy.run_module("jaxllmq.main", run_name="__main__", alter_sys=True)
    """
)


def test_a_failed_save_stops_the_run_in_one_line(shards, tmp_path):
    out = str(tmp_path)
    ckpt = f"{out}/ckpt"
    args = _flags(shards, out, f"--checkpoint_dir={ckpt}", "--ckpt_interval=2", "--ckpt_keep_n=1")
    proc = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, *args, "--steps=8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    # Found at the first step after the background write failed (5, or 6 on a slow machine).
    assert re.fullmatch(
        rf"error: step [56]: checkpoint {ckpt}/4 could not be saved \(\[Errno 28\] No space left "
        rf"on device\); its temporary directory is removed, the newest complete checkpoint is "
        rf"{ckpt}/2; stopping, .* --ckpt_failure=continue",
        lines[0],
    ), lines[0]
    assert "Traceback" not in proc.stdout and max(_steps(out)) < 8
    # Step 2 is not deleted by --ckpt_keep_n=1 for the failed save, and is whole.
    assert [n for n in os.listdir(ckpt) if not n.startswith(".")] == ["2"]
    assert checkpoint_files.verify(f"{ckpt}/2") == []


@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_a_failed_save_with_ckpt_failure(tmp_path, monkeypatch, policy):
    write = JsonCheckpointHandler._save_fn

    async def full(self, x, directory):
        if f"{os.sep}2.orbax-checkpoint-tmp" in str(directory):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
        await write(self, x, directory)

    monkeypatch.setattr(JsonCheckpointHandler, "_save_fn", full)
    ck = _checkpointing(tmp_path, ckpt_failure=policy, ckpt_keep_n=1)
    ck.save(1, _state(1), data={}, log={})
    ck.save(2, _state(2), data={}, log={})
    deadline = time.time() + 60
    while ck.writing:  # the save of step 2 fails in orbax's background thread
        assert time.time() < deadline
        time.sleep(0.01)
    failure = (
        f"step 3: checkpoint {tmp_path}/2 could not be saved ([Errno 28] No space left on "
        f"device); its temporary directory is removed, the newest complete checkpoint is "
        f"{tmp_path}/1"
    )
    if policy == "stop":
        with pytest.raises(checkpoint.CheckpointSaveError) as e:
            ck.check_saves(3)
        assert str(e.value).startswith(f"{failure}; stopping")
        ck.close()
        assert checkpoint_files.checkpoint_steps(str(tmp_path)) == [1]  # not deleted by keep_n=1
    else:
        ck.check_saves(3)
        assert ck.messages == [f"warning: {failure}; training goes on (--ckpt_failure=continue)"]
        ck.save(4, _state(4), data={}, log={})  # later saves are attempted
        ck.close()
        assert checkpoint_files.checkpoint_steps(str(tmp_path)) == [4]
    assert not [n for n in os.listdir(tmp_path) if "tmp" in n]


def test_verify_checks_content_and_still_reads_lists_of_sizes(tmp_path):
    ck = _checkpointing(tmp_path)
    ck.save(3, _state(3), data={"step": 3}, log={})
    ck.close()
    path = str(tmp_path / "3")
    assert checkpoint_files.verify(path) == []
    file = _largest(f"{path}/params")
    _flip_byte(file)
    rel = os.path.relpath(file, path)
    (problem,) = checkpoint_files.verify(path)
    assert problem.startswith(f"{rel} has changed since it was written (CRC-32 ")
    with pytest.raises(checkpoint_files.DamagedCheckpointError, match=f"{rel} has changed"):
        checkpoint_files.read_json_items(path)
    # A list from before the checksums (sizes only) is checked by size.
    with open(f"{path}/{FILE_LIST}") as f:
        sizes = json.load(f)["files"]
    with open(f"{path}/{FILE_LIST}", "w") as f:
        json.dump({"files": sizes}, f)
    assert checkpoint_files.verify(path) == []
    with open(file, "r+b") as f:
        f.truncate(5)
    assert checkpoint_files.verify(path) == [
        f"{rel} is 5 bytes, {sizes[rel]} were written (truncated)"
    ]


def test_resume_advice_names_the_newest_checkpoint_that_verifies(tmp_path):
    ck = _checkpointing(tmp_path / "ckpt")
    assert (
        ck.resume_advice()
        == f"No checkpoint in {tmp_path}/ckpt verifies: there is none to resume from."
    )
    ck.save(1, _state(1), data={}, log={})
    ck.save(2, _state(2), data={}, log={})
    assert ck.resume_advice() == (  # waits for the save of step 2
        f"The newest checkpoint that verifies is {tmp_path}/ckpt/2: resume with --continue=2."
    )
    _flip_byte(_largest(f"{tmp_path}/ckpt/2/train_state"))
    assert ck.resume_advice() == (
        f"The newest checkpoint that verifies is {tmp_path}/ckpt/1: resume with --continue=1 "
        "(move the damaged newer ones aside first: 2)."
    )
    ck.close()


# Reports 5 non-finite steps in a row at step 3 (the run has checkpoint 2 by then).
_DIVERGE = textwrap.dedent(
    """
    import runpy, sys
    from jaxllmq import optim, trainer
    def diverged(cfg, step, consecutive, total):
        optim.check_nonfinite(cfg, step, cfg.max_nonfinite if step == 3 else consecutive, total)
    trainer.check_nonfinite = diverged
    sys.argv[0] = "jaxllmq.main"
    runpy.run_module("jaxllmq.main", run_name="__main__", alter_sys=True)
    """
)


def test_a_diverged_run_names_a_verified_checkpoint(shards, tmp_path):
    out = str(tmp_path)
    args = _flags(shards, out, f"--checkpoint_dir={out}/ckpt", "--ckpt_interval=2", "--steps=8")
    proc = subprocess.run(
        [sys.executable, "-c", _DIVERGE, *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: step 3: 5 steps in a row had non-finite gradients")
    assert line.endswith(
        f"The newest checkpoint that verifies is {out}/ckpt/2: resume with --continue=2."
    )


def test_an_abandoned_orbax_task_logs_no_traceback(tmp_path):
    # A read orbax abandons when another fails is freed with its exception unretrieved, and
    # asyncio reports it (with a traceback) through the root logger, not absl's: whether it does
    # depends on when the task is collected, so the run's output differed run to run.
    code = textwrap.dedent(
        """
        import asyncio, gc, logging, sys
        from jaxllmq import checkpoint_files
        logging.basicConfig(stream=sys.stderr)
        where = sys.argv[1]
        scope = {}
        exec(compile("async def read():\\n    raise OSError('truncated')\\n", where, "exec"), scope)

        async def main():
            asyncio.get_running_loop().create_task(scope["read"]())
            await asyncio.sleep(0.01)

        asyncio.run(main())
        gc.collect()
        print("done")
        """
    )
    for where, noisy in (
        (f"{os.sep}x{os.sep}orbax{os.sep}serialization.py", False),
        (str(tmp_path / "mine.py"), True),
    ):
        proc = subprocess.run([sys.executable, "-c", code, where], capture_output=True, text=True)
        assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-2000:]
        assert ("Task exception was never retrieved" in proc.stderr) is noisy, proc.stderr
        assert ("Traceback" in proc.stderr) is noisy
