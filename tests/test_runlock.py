"""The run lock: a second run on a held --checkpoint_dir / --out_dir / --log_file is refused in one
line; locks left by dead runs of this host are taken over, another host's are not; released at
the end. One end-to-end case through the training command's main(); the rest at the lock."""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from train_here import train_here

from jaxllmq import runlock
from jaxllmq.data.shards import write_shard
from jaxllmq.runlock import RunLock, RunLockError, lock_file

HOST = socket.gethostname()

# Takes the locks named on its command line (--flag=path ...), says so, and sleeps.
_HOLD = textwrap.dedent(
    """
    import sys, time
    from jaxllmq import runlock
    targets = [tuple(arg.split("=", 1)) for arg in sys.argv[1:]]
    lock = runlock.RunLock(targets, ["python", "-m", "jaxllmq.main", "--name=first"])
    print("held", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def hold():
    """hold(--flag=path, ...) -> a live process of this host holding those locks."""
    procs = []

    def start(*targets: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", _HOLD, *targets], stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        assert proc.stdout.readline() == "held\n"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _write_holder(file: str, **fields) -> None:
    holder = {"host": HOST, "pid": os.getpid(), "pid_start": None, "started": 1.8e9}
    holder.update(argv=["python", "-m", "jaxllmq.main", "--name=old"], **fields)
    os.makedirs(os.path.dirname(file), exist_ok=True)
    with open(file, "w") as f:
        json.dump(holder, f)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_holder_refuses_in_one_line(hold, tmp_path):
    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "log.jsonl")
    holder = hold(f"--checkpoint_dir={ckpt}", f"--log_file={log}")
    with pytest.raises(RunLockError) as e:
        RunLock([("--out_dir", str(tmp_path / "model")), ("--log_file", log)], ["second"])
    message = str(e.value)
    assert message.startswith(f"--log_file {log} is in use by pid {holder.pid} on host {HOST} ")
    assert "(python -m jaxllmq.main --name=first)" in message and "\n" not in message
    assert message.endswith("; wait for it to end or give another --log_file")
    # The lock taken before the refusal is let go again: the out dir is free.
    assert not os.path.exists(lock_file("--out_dir", str(tmp_path / "model")))
    with RunLock([("--out_dir", str(tmp_path / "model"))], ["third"]):
        pass


@pytest.mark.parametrize("how", ["dead pid", "pid reused"])
def test_a_lock_left_by_a_dead_run_of_this_host_is_taken_over(tmp_path, how):
    file = lock_file("--checkpoint_dir", str(tmp_path / "ckpt"))
    if how == "dead pid":
        _write_holder(file, pid=_dead_pid())
    else:  # this very pid, but started at another time: the pid was reused
        _write_holder(file, pid_start=runlock._pid_start(os.getpid()) - 1)
    with open(file) as f:
        old = json.load(f)
    with RunLock([("--checkpoint_dir", str(tmp_path / "ckpt"))], ["new"]) as lock:
        assert lock.notes == [
            f"--checkpoint_dir {tmp_path}/ckpt: taking over the lock of a run that is gone: "
            f"pid {old['pid']} on host {HOST} since 2027-01-15 08:00 UTC "
            "(python -m jaxllmq.main --name=old)"
        ]
        with open(file) as f:
            assert json.load(f)["argv"] == ["new"]
    assert not os.path.exists(file)


def test_another_hosts_lock_is_refused_with_how_to_clear_it(tmp_path):
    out = str(tmp_path / "model")
    file = lock_file("--out_dir", out)
    assert file == f"{tmp_path}/.model.lock"  # beside the out dir, which the export replaces
    _write_holder(file, host="elsewhere", pid=_dead_pid())
    with pytest.raises(RunLockError) as e:
        RunLock([("--out_dir", out)], ["second"])
    assert str(e.value).startswith(f"--out_dir {out} is in use by pid ")
    assert " on host elsewhere " in str(e.value)
    assert str(e.value).endswith(f"if you are sure that run has ended, delete {file}")
    with open(file) as f:
        assert json.load(f)["host"] == "elsewhere"  # left as it was


def test_released_at_the_end_and_only_process_0_locks(tmp_path, monkeypatch):
    ckpt = SimpleNamespace(checkpoint_dir=str(tmp_path / "ckpt"))
    run = SimpleNamespace(ckpt=ckpt, out_dir=None, log_file=str(tmp_path / "log"))
    first = runlock.for_run(run, ["first"])
    with pytest.raises(RunLockError, match="is in use by pid"):  # a second open file: refused
        runlock.for_run(run, ["second"])
    first.release()
    first.release()  # again: nothing
    assert os.listdir(tmp_path / "ckpt") == [] and not os.path.exists(f"{tmp_path}/log.lock")
    runlock.for_run(run, ["second"]).release()
    held = RunLock([("--log_file", str(tmp_path / "log"))], ["held"])
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    runlock.for_run(run, ["other process"]).release()  # touches no lock: neither refused...
    assert os.path.exists(f"{tmp_path}/log.lock")  # ... nor removing process 0's
    held.release()


def test_orbax_lists_and_cleans_up_around_the_lock_file(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    os.makedirs(f"{ckpt}/5.orbax-checkpoint-tmp")
    with RunLock([("--checkpoint_dir", ckpt)], ["run"]):
        options = ocp.CheckpointManagerOptions(cleanup_tmp_directories=True)
        mgr = ocp.CheckpointManager(
            ckpt, options=options, item_handlers=ocp.JsonCheckpointHandler()
        )
        mgr.save(1, args=ocp.args.JsonSave({"a": 1}))
        mgr.wait_until_finished()
        mgr.close()
        assert sorted(os.listdir(ckpt)) == [".jaxllmq.lock", "1"]
        assert ocp.path.step.checkpoint_steps(ckpt) == [1]


def test_a_second_training_run_is_refused_then_takes_over_once_the_first_died(hold, tmp_path):
    write_shard(tmp_path / "train.bin", np.arange(2000, dtype=np.int32) % 256, vocab_size=256)
    ckpt, out, log = tmp_path / "ckpt", tmp_path / "model", tmp_path / "log.jsonl"
    paths = [f"--checkpoint_dir={ckpt}", f"--out_dir={out}", f"--log_file={log}"]
    first = hold(*paths)
    (ckpt / "5.orbax-checkpoint-tmp").mkdir()  # the first run's save in progress
    (ckpt / "5.orbax-checkpoint-tmp" / "params").write_text("being written")
    log.write_text('{"log": "step", "step": 4}\n')
    flags = [
        "--model=tiny",
        "--from_scratch",
        f"--train_file={tmp_path}/train.bin",
        "--seq_len=16",
        "--gpus=1",
        "--batch_size=4",
        "--grad_accumulation=1",
        "--matmul_dtype=float32",
        "--steps=1",
        "--eval_every_n_steps=0",
        "--ckpt_interval=0",
        *paths,
    ]
    refused = train_here(*flags, "--continue=latest")
    assert refused.returncode == 1
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: --checkpoint_dir {ckpt} is in use by pid {first.pid} on ")
    assert line.endswith(
        "UTC (python -m jaxllmq.main --name=first); wait for it to end or give another "
        "--checkpoint_dir"
    )
    assert "Traceback" not in refused.stderr
    # Nothing of the first run was touched: its save in progress, its log, its locks.
    assert sorted(os.listdir(ckpt)) == [".jaxllmq.lock", "5.orbax-checkpoint-tmp"]
    assert (ckpt / "5.orbax-checkpoint-tmp" / "params").read_text() == "being written"
    assert log.read_text() == '{"log": "step", "step": 4}\n'
    assert not out.exists()

    first.send_signal(signal.SIGKILL)  # dies holding its locks: the lock files stay
    first.wait()
    second = train_here(*flags, "--continue=latest")
    assert second.returncode == 0, second.stderr[-3000:]
    for flag, path in [("--checkpoint_dir", ckpt), ("--out_dir", out), ("--log_file", log)]:
        note = f"{flag} {path}: taking over the lock of a run that is gone: pid {first.pid} on"
        assert note in second.stdout
        assert any(note in r.get("message", "") for r in map(json.loads, log.open()))
        assert not os.path.exists(lock_file(flag, str(path)))  # released at the end
    assert (out / "config.json").exists()
