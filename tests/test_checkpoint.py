"""Checkpoints through the real entry point: bit-exact resume, signals, kill -9 mid-save, damage,
refusals, resharding, export; retention and the pieces in-process.

One module-scoped reference run (8 steps, checkpoints at 2, 4, 6, 8) is what the resumed runs
must reproduce. The runs go through main() in this process (train_here), but for what only a real
process shows: a signal, kill -9, what the interpreter prints on its way out.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
from train_here import train_here

from jaxllmq import checkpoint, checkpoint_files, resume_rules
from jaxllmq.data.shards import write_shard
from jaxllmq.model.architecture import preset
from jaxllmq.setting import SettingError
from jaxllmq.settings import CheckpointConfig

SEQ = 16
WINDOWS = 56  # 3 steps per epoch of 16 rows (8 x grad_accumulation 2): step 4 is mid-epoch


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, WINDOWS * (SEQ + 1), dtype=np.int32)
    write_shard(d / "train.bin", tokens, vocab_size=256)
    (d / "tokenizer.json").write_text("{}")  # stands for the data's tokenizer
    return str(d)


def _flags(shards: str, out: str, *extra: str, gpus: int = 1) -> list[str]:
    # wsd without cooldown: the lr does not depend on --steps, so a run of 4 steps then 4 more
    # sees the lr a run of 8 does.
    return [
        "--model=tiny",
        "--from_scratch",
        f"--train_file={shards}/train.bin",
        f"--seq_len={SEQ}",
        f"--gpus={gpus}",
        f"--batch_size={8 // gpus}",
        "--grad_accumulation=2",
        "--matmul_dtype=float32",
        "--lr=1e-3",
        "--lr_schedule=wsd",
        "--final_lr_fraction=1",
        "--warmup=2",
        "--eval_every_n_steps=0",
        "--ckpt_interval=0",
        f"--log_file={out}/log.jsonl",
        *extra,
    ]


def _cmd(module: str = "jaxllmq.main") -> list[str]:
    return [sys.executable, "-m", module]


def run_module(args: list[str], module: str = "jaxllmq.main"):
    """`python -m module args` in a subprocess (sharing this process's compilation cache)."""
    return subprocess.run(_cmd(module) + args, capture_output=True, text=True, timeout=300)


def _records(out: str, kind: str = "step") -> list[dict]:
    with open(os.path.join(out, "log.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["log"] == kind]


def _steps(out: str) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["norm"]) for r in _records(out)}


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory) -> dict:
    """8 uninterrupted steps: losses, grad norms, checkpoints 2-8, the trainer's export."""
    out = str(tmp_path_factory.mktemp("reference"))
    extra = [
        f"--checkpoint_dir={out}/ckpt",
        "--ckpt_interval=2",
        "--ckpt_keep_n=0",
        "--save_training_state",
        f"--out_dir={out}/model",
        "--steps=8",
    ]
    proc = train_here(*_flags(shards, out, *extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = _steps(out)
    assert sorted(steps) == list(range(1, 9))
    assert checkpoint_files.checkpoint_steps(f"{out}/ckpt") == [2, 4, 6, 8]
    return {"dir": out, "ckpt": f"{out}/ckpt", "steps": steps}


def test_resume_is_bit_exact(shards, reference, tmp_path):
    out = str(tmp_path)
    ck = f"--checkpoint_dir={out}/ckpt"
    first = train_here(*_flags(shards, out, ck, "--steps=4", "--save_training_state"))
    assert first.returncode == 0, first.stderr[-3000:]
    second = train_here(*_flags(shards, out, ck, "--steps=8", "--continue=latest"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "--steps: 4 -> 8" in second.stdout
    # Exact float equality of every step's loss and grad norm, across a mid-epoch resume with
    # grad accumulation.
    assert [r["step"] for r in _records(out)] == list(range(1, 9))
    assert _steps(out) == reference["steps"]
    assert [r["step"] for r in _records(out, "checkpoint")] == [4]


def test_new_data_is_needed_to_resume_onto_other_data(shards, reference, tmp_path):
    args = _flags(shards, str(tmp_path), "--steps=9", f"--continue={reference['ckpt']}/8")
    refused = train_here(*args, "--train_seed=7")
    assert refused.returncode == 1
    assert "error: --continue: the saved data position does not fit" in refused.stderr
    assert "seed: saved 42, now 7" in refused.stderr and "Traceback" not in refused.stderr
    resumed = train_here(*args, "--train_seed=7", "--new_data")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "--new_data: the data pipeline starts from its beginning" in resumed.stdout
    assert "--train_seed: 42 -> 7" in resumed.stdout
    assert list(_steps(str(tmp_path))) == [9]


def test_sigterm_leaves_a_checkpoint_and_resuming_matches(shards, reference, tmp_path):
    out = str(tmp_path)
    args = _flags(shards, out, f"--checkpoint_dir={out}/ckpt", "--steps=8")
    proc = subprocess.Popen(
        _cmd() + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    log = os.path.join(out, "log.jsonl")
    deadline = time.time() + 120
    while not (os.path.exists(log) and _records(out)) and proc.poll() is None:
        assert time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    line = next(x for x in stdout.splitlines() if x.startswith("stopped by SIGTERM"))
    stopped = int(line.split("after step ")[1].split(":")[0])
    assert 1 <= stopped < 8, line
    assert f"{out}/ckpt/{stopped}" in line
    assert checkpoint_files.checkpoint_steps(f"{out}/ckpt") == [stopped]

    resumed = train_here(*args, "--continue=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _steps(out) == reference["steps"]


# Holds the save of step 4 between writing its files and renaming its directory, so the test
# can kill the process while that save is in flight.
_HOLD_SAVE = textwrap.dedent(
    """
    import os, runpy, sys, time
    from jaxllmq import checkpoint
    write = checkpoint.write_file_list
    def held(directory):
        if os.path.basename(directory).startswith("4."):
            open(os.environ["HELD_MARKER"], "w").close()
            time.sleep(300)
        write(directory)
    checkpoint.write_file_list = held
    sys.argv[0] = "jaxllmq.main"
    runpy.run_module("jaxllmq.main", run_name="__main__", alter_sys=True)
    """
)


def test_kill_9_during_an_async_save_resumes_from_the_last_complete(shards, reference, tmp_path):
    out = str(tmp_path)
    args = _flags(shards, out, f"--checkpoint_dir={out}/ckpt", "--ckpt_interval=2", "--steps=8")
    marker = tmp_path / "held"
    env = dict(os.environ, HELD_MARKER=str(marker))
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD_SAVE, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    deadline = time.time() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline
        time.sleep(0.01)
    proc.kill()  # SIGKILL: no handler, no cleanup
    proc.wait()
    names = os.listdir(f"{out}/ckpt")
    assert "2" in names and "4" not in names
    assert any(n.startswith("4.") for n in names)  # the save in flight: never renamed
    assert checkpoint_files.checkpoint_steps(f"{out}/ckpt") == [2]

    resumed = train_here(*args, "--continue=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out}/ckpt/2 (step 2)" in resumed.stdout
    steps = _steps(out)
    assert all(steps[s] == reference["steps"][s] for s in range(3, 9))
    assert checkpoint_files.checkpoint_steps(f"{out}/ckpt") == [4, 6, 8]  # --ckpt_keep_n=3
    assert not any(n.startswith("4.") for n in os.listdir(f"{out}/ckpt"))


def test_damaged_checkpoint_is_named_and_latest_falls_back(shards, reference, tmp_path):
    out = str(tmp_path)
    ckpt = f"{out}/ckpt"
    shutil.copytree(reference["ckpt"], ckpt)
    missing = "params/manifest.ocdbt"
    os.remove(f"{ckpt}/8/{missing}")
    big = max(
        (os.path.getsize(f"{ckpt}/6/train_state/{p}"), p)
        for p in os.listdir(f"{ckpt}/6/train_state")
        if os.path.isfile(f"{ckpt}/6/train_state/{p}")
    )[1]
    with open(f"{ckpt}/6/train_state/{big}", "r+b") as f:
        f.truncate(10)
    args = _flags(shards, out, f"--checkpoint_dir={ckpt}")

    explicit = train_here(*args, "--steps=9", "--continue=8")
    assert explicit.returncode == 1
    assert f"checkpoint {ckpt}/8 is damaged: {missing} is missing" in explicit.stderr
    assert "Traceback" not in explicit.stderr

    latest = train_here(*args, "--steps=5", "--continue=latest")
    assert latest.returncode == 0, latest.stderr[-3000:]
    assert f"{ckpt}/8 is damaged: {missing} is missing" in latest.stdout
    assert f"{ckpt}/6 is damaged: train_state/{big} is 10 bytes" in latest.stdout
    assert "falling back" in latest.stdout
    assert f"resumed from {ckpt}/4 (step 4)" in latest.stdout
    assert _steps(out)[5] == reference["steps"][5]
    assert {"6.damaged", "8.damaged"} <= set(os.listdir(ckpt))


def _largest(directory: str) -> str:
    """The biggest file under `directory` (an item's array data)."""
    files = [os.path.join(p, n) for p, _, names in os.walk(directory) for n in names]
    return max(files, key=os.path.getsize)


def _flip_byte(file: str, offset: int | None = None) -> None:
    """Flip the lowest bit of one byte of `file` (by default, its middle one)."""
    with open(file, "r+b") as f:
        f.seek(os.path.getsize(file) // 2 if offset is None else offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def _copy(reference: dict, ckpt: str, *steps: int) -> None:
    for step in steps:
        shutil.copytree(f"{reference['ckpt']}/{step}", f"{ckpt}/{step}")


@pytest.mark.parametrize("item", ["params", "train_state", "data"])
def test_a_flipped_byte_is_named_and_latest_falls_back(shards, reference, tmp_path, item):
    out, ckpt = str(tmp_path), f"{tmp_path}/ckpt"
    _copy(reference, ckpt, 6, 8)
    if item == "data":  # the data position's step, 8 -> 9: still valid JSON, of the same size
        file = f"{ckpt}/8/data/metadata"
        with open(file, "rb") as f:
            _flip_byte(file, f.read().index(b'"step": 8') + len(b'"step": '))
    else:
        file = _largest(f"{ckpt}/8/{item}")
        _flip_byte(file)
    rel = os.path.relpath(file, f"{ckpt}/8")
    args = _flags(shards, out, f"--checkpoint_dir={ckpt}", "--steps=7", "--continue=latest")
    proc = train_here(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint {ckpt}/8 is damaged: {rel} has changed since it was written" in proc.stdout
    assert f"resumed from {ckpt}/6 (step 6)" in proc.stdout
    assert "8.damaged" in os.listdir(ckpt)
    assert _steps(out)[7] == reference["steps"][7]


def test_damage_found_by_reading_prints_no_asyncio_noise(shards, reference, tmp_path):
    # Without files.json nothing is checked up front: reading the truncated array fails, and
    # orbax's abandoned reads used to print "Event loop is closed" tracebacks by the dozen.
    out, ckpt = str(tmp_path), f"{tmp_path}/ckpt"
    _copy(reference, ckpt, 6, 8)
    os.remove(f"{ckpt}/8/files.json")
    with open(_largest(f"{ckpt}/8/params"), "r+b") as f:
        f.truncate(10)
    args = _flags(shards, out, f"--checkpoint_dir={ckpt}", "--steps=7", "--continue=latest")
    proc = run_module(args)  # what the interpreter prints as it exits, too
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint {ckpt}/8 is damaged" in proc.stdout
    assert f"resumed from {ckpt}/6 (step 6)" in proc.stdout
    assert "Event loop is closed" not in proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr


def _other_model(tmp_path) -> str:
    d = tmp_path / "tiny-2-layers"
    d.mkdir()
    cfg = preset("tiny").to_hf_dict()
    cfg["num_hidden_layers"] = 2
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.mark.parametrize(
    "change, message",
    [
        ("--opt_m_dtype=bfloat16", "--opt_m_dtype=float32, this run has --opt_m_dtype=bfloat16"),
        ("--grad_clip=0", "--grad_clip=1.0, this run has --grad_clip=0.0"),
        ("OTHER_MODEL", "holds another model (num_hidden_layers 4 -> 2)"),
    ],
)
def test_resume_refuses_a_change_of_meaning(shards, reference, tmp_path, change, message):
    if change == "OTHER_MODEL":
        change = f"--model={_other_model(tmp_path)}"
    args = _flags(shards, str(tmp_path), "--steps=9", f"--continue={reference['ckpt']}/8", change)
    proc = train_here(*args)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: --continue: checkpoint") and message in lines[-1]
    assert "Traceback" not in proc.stderr


def test_a_directory_of_another_runs_checkpoints_is_refused(shards, reference, tmp_path):
    args = _flags(shards, str(tmp_path), "--steps=9", f"--checkpoint_dir={reference['ckpt']}")
    proc = train_here(*args)
    assert proc.returncode == 1
    assert "already holds checkpoints (steps 2, 4, 6, 8)" in proc.stderr
    assert "--continue=latest" in proc.stderr


def test_restore_onto_fewer_devices(shards, reference, tmp_path):
    # Saved on 8 devices under ZeRO-1, restored on 4 under ZeRO-3 and on 1.
    src = str(tmp_path / "on8")
    args8 = _flags(shards, src, f"--checkpoint_dir={src}/ckpt", "--steps=3", gpus=8)
    proc = train_here(*args8, "--save_training_state", "--ckpt_interval=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    on8 = _steps(src)
    for gpus, extra in [(4, ["--zero_level=3"]), (1, [])]:
        out = str(tmp_path / f"on{gpus}")
        args = _flags(shards, out, f"--continue={src}/ckpt/2", "--steps=3", *extra, gpus=gpus)
        proc = train_here(*args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (loss, norm), (loss8, norm8) = _steps(out)[3], on8[3]
        assert loss == pytest.approx(loss8, rel=1e-5) and norm == pytest.approx(norm8, rel=1e-4)
    # The 8-device run itself agrees with the 1-device reference.
    for s in (1, 2, 3):
        assert on8[s][0] == pytest.approx(reference["steps"][s][0], rel=1e-5)


def test_export_cli_matches_the_trainers_export(reference, tmp_path):
    out = str(tmp_path / "exported")
    proc = run_module([f"--checkpoint={reference['ckpt']}", f"--out_dir={out}"], "jaxllmq.export")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"exported {reference['ckpt']}/8 to {out}" in proc.stdout
    theirs = f"{reference['dir']}/model"
    assert sorted(os.listdir(out)) == sorted(os.listdir(theirs))
    with open(f"{out}/config.json") as a, open(f"{theirs}/config.json") as b:
        assert json.load(a) == json.load(b)
    mine, ref = load_file(f"{out}/model.safetensors"), load_file(f"{theirs}/model.safetensors")
    assert mine.keys() == ref.keys()
    assert all(np.array_equal(mine[k], ref[k]) for k in ref)


def test_export_cli_one_line_error(tmp_path):
    proc = run_module([f"--checkpoint={tmp_path}", f"--out_dir={tmp_path}/x"], "jaxllmq.export")
    assert proc.returncode == 1
    assert "neither a complete checkpoint" in proc.stderr and "Traceback" not in proc.stderr


# ---- in-process: retention, verification, the rules of a resume ----


@flax.struct.dataclass
class _State:
    step: jax.Array
    params: dict
    opt_state: dict


def _state(step: int) -> _State:
    return _State(
        step=jnp.asarray(step, jnp.int32),
        params={"w": jnp.full((4, 3), float(step))},
        opt_state={"m": jnp.zeros((4, 3), jnp.bfloat16)},
    )


def _checkpointing(directory, **kw) -> checkpoint.Checkpointing:
    messages = []
    c = checkpoint.Checkpointing(
        CheckpointConfig(checkpoint_dir=str(directory), **kw),
        run={"argv": [], "config": {"optim": {"lr": 1.0}}},
        model={"hidden_size": 4},
        info=messages.append,
    )
    c.messages = messages
    return c


def test_keep_n_and_major_retention(tmp_path):
    ck = _checkpointing(tmp_path, ckpt_keep_n=2, ckpt_major=5)
    for s in range(1, 14):
        ck.save(s, _state(s), data={"step": s}, log={})
    ck.close()
    assert checkpoint_files.checkpoint_steps(str(tmp_path)) == [5, 10, 12, 13]
    # A resumed run goes on with the same policy over the same directory.
    ck = _checkpointing(tmp_path, ckpt_keep_n=2, ckpt_major=5, continue_from="latest")
    assert ck.resume.step == 13 and ck.resume.data == {"step": 13}
    restored = ck.restore(_state(0))
    assert int(restored.step) == 13 and float(restored.params["w"][0, 0]) == 13.0
    assert restored.opt_state["m"].dtype == jnp.bfloat16
    for s in range(14, 17):
        ck.save(s, restored, data={}, log={})
    ck.close()
    assert checkpoint_files.checkpoint_steps(str(tmp_path)) == [5, 10, 15, 16]


def test_verify_names_missing_and_truncated_files(tmp_path):
    ck = _checkpointing(tmp_path)
    ck.save(3, _state(3), data={}, log={})
    ck.close()
    path = str(tmp_path / "3")
    assert checkpoint_files.verify(path) == []
    os.remove(f"{path}/data/metadata")
    with open(f"{path}/params/manifest.ocdbt", "r+b") as f:
        f.truncate(5)
    problems = checkpoint_files.verify(path)
    assert "data/metadata is missing" in problems
    assert any(p.startswith("params/manifest.ocdbt is 5 bytes") for p in problems)
    with pytest.raises(checkpoint_files.DamagedCheckpointError, match="data/metadata is missing"):
        checkpoint_files.read_json_items(path)


def test_check_resume_allows_harmless_changes_and_logs_them():
    saved = checkpoint_files.Saved(
        "/x/10",
        data={},
        log={},
        run={"config": {"optim": {"lr": 1e-3, "opt_m_dtype": "float32", "grad_clip": 1.0}}},
        model={"hidden_size": 4},
    )
    now = {"optim": {"lr": 3e-4, "opt_m_dtype": "float32", "grad_clip": 0.5}, "steps": 9}
    changes = resume_rules.check_resume(saved, now, {"hidden_size": 4})
    assert changes == ["--grad_clip: 1.0 -> 0.5", "--lr: 0.001 -> 0.0003", "--steps: None -> 9"]
    with pytest.raises(checkpoint_files.CheckpointError, match="--opt_m_dtype=float32"):
        resume_rules.check_resume(
            saved, {"optim": dict(now["optim"], opt_m_dtype="bfloat16")}, {"hidden_size": 4}
        )
    with pytest.raises(checkpoint_files.CheckpointError, match="another model"):
        resume_rules.check_resume(saved, now, {"hidden_size": 8})


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"continue_from": "latest"}, "needs --checkpoint_dir"),
        ({"continue_from": "12"}, "needs --checkpoint_dir"),
        ({"continue_from": "/nonexistent/5"}, "not latest, a step, nor an existing"),
        ({"new_data": True, "checkpoint_dir": "/tmp/x"}, "--new_data needs --continue"),
        ({"save_training_state": True}, "--save_training_state needs --checkpoint_dir"),
    ],
)
def test_checkpoint_config_validation(kw, message):
    with pytest.raises(SettingError, match=message):
        CheckpointConfig(**kw)
