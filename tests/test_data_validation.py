"""Training data checked before it trains: token ids inside the model's vocab, tokens to train
on, the per-file cache of the scan, and a resume refused onto other files."""

import json
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest

from jaxllmq.checkpoint_files import CheckpointError
from jaxllmq.data import validate
from jaxllmq.data.pipeline import TokenBatches
from jaxllmq.data.shards import HEADER_BYTES, ShardError, write_shard
from jaxllmq.trainer import Trainer

VOCAB = 256
T = 8


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    """Each test its own user cache directory."""
    home = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


def pipeline(files, **kw):
    kw = {"seq_len": T, "batch_size": 2, "process_index": 0, "process_count": 1, **kw}
    return TokenBatches(files, **kw)


def write(path, n=100, mask=None, first=0):
    write_shard(path, (first + np.arange(n)) % VOCAB, mask, vocab_size=VOCAB)
    return str(path)


def poke(path, offset, token):
    """Overwrite token `offset` of a shard in place (write_shard refuses ids outside the vocab)."""
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 4 * offset)
        f.write(np.array([token], dtype="<i4").tobytes())


def check(data, vocab=VOCAB, **kw):
    notes = []
    scored = data.validate(vocab, note=notes.append, **kw)
    return scored, notes


@pytest.mark.parametrize("chunk", [16, validate.CHUNK])
@pytest.mark.parametrize("bad, vocab", [(-5, VOCAB), (VOCAB, VOCAB), (9000, 8192)])
def test_id_outside_the_vocab_is_refused_naming_shard_offset_and_id(
    tmp_path, monkeypatch, chunk, bad, vocab
):
    monkeypatch.setattr(validate, "CHUNK", chunk)  # 16: the bad id is found in a later chunk
    write(tmp_path / "a.bin")
    bad_path = write(tmp_path / "b.bin", 203)
    poke(bad_path, 77, bad)
    poke(bad_path, 150, -1)  # a later bad id: not the one named
    data = pipeline(str(tmp_path / "*.bin"))
    with pytest.raises(ShardError) as e:
        check(data, vocab)
    message = str(e.value)
    assert f"token shard {bad_path!r} holds token id {bad} at token offset 77, " in message
    assert f"outside the model's vocab [0, {vocab})" in message
    assert "python -m jaxllmq.data.prepare" in message and "\n" not in message


@pytest.mark.parametrize("chunk", [16, validate.CHUNK])
def test_scan_finds_min_max_and_scored_tokens(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(validate, "CHUNK", chunk)
    mask = np.random.default_rng(0).random(203) < 0.3  # 203: the last mask byte is partial
    masked = write(tmp_path / "m.bin", 203, mask, first=40)
    with open(masked, "r+b") as f:  # padding bits past the last token set: still not tokens
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last | 0xF8]))
    data = pipeline([masked, write(tmp_path / "p.bin")])
    scored, notes = check(data)
    assert scored == mask.sum() + 100
    assert validate.scan(data._loader.reader.shards[0]) == validate.ShardStats(40, 242, mask.sum())
    assert notes[-1].startswith("--train_file: 2 shard(s), 303 tokens (")


def test_second_check_reads_the_cache_and_a_changed_file_is_rescanned(
    tmp_path, monkeypatch, cache_home
):
    paths = [write(tmp_path / f"t{k}.bin", first=k) for k in range(3)]
    poke(paths[0], 50, 300)  # fits a model of 8192 tokens, not the header's 256
    scanned = []
    real_scan = validate.scan
    monkeypatch.setattr(
        validate, "scan", lambda shard, *a: scanned.append(shard.path) or real_scan(shard, *a)
    )
    check(pipeline(paths), vocab=8192)
    assert scanned == paths
    cache = json.loads((cache_home / "jaxllmq" / "shard_stats.json").read_text())
    assert cache["version"] == validate.CACHE_VERSION
    assert set(cache["shards"]) == {os.path.abspath(p) for p in paths}

    scanned.clear()
    _, notes = check(pipeline(paths), vocab=8192)
    assert scanned == []  # nothing read but the headers
    assert notes[-1].endswith("(3 from the cache)")
    # Another model's bound is checked against the cached min/max: no rescan.
    with pytest.raises(ShardError, match="t0.bin' holds token id 300 at token offset 50"):
        check(pipeline(paths))
    assert scanned == []

    st = os.stat(paths[1])
    os.utime(paths[1], ns=(st.st_atime_ns, st.st_mtime_ns + 1000))  # same size, newer
    write(tmp_path / "t2.bin", 120)  # another size
    check(pipeline(paths), vocab=8192)
    assert scanned == paths[1:]


def test_an_unwritable_cache_is_one_note_and_no_failure(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    scored, notes = check(pipeline(write(tmp_path / "a.bin")))
    assert scored == 100
    assert len(notes) == 2 and notes[0].startswith("cannot write the token-id cache")


def test_long_scans_show_progress(tmp_path, monkeypatch):
    monkeypatch.setattr(validate, "CHUNK", 16)
    monkeypatch.setattr(validate, "_PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(validate, "_PROGRESS_EVERY_S", 0.0)
    _, notes = check(pipeline(write(tmp_path / "a.bin")))
    progress = [n for n in notes if n.startswith("checking token ids:")]
    assert len(progress) == 7  # 100 tokens, 16 a chunk
    assert progress[-1].startswith("checking token ids: 0.0 of 0.0 GB scanned in")


def test_masks_all_zero_refused_one_zero_shard_warned(tmp_path):
    zero = write(tmp_path / "zero.bin", mask=np.zeros(100, bool))
    zero2 = write(tmp_path / "zero2.bin", mask=np.zeros(100, bool))
    with pytest.raises(ShardError) as e:
        check(pipeline([zero, zero2]))
    assert str(e.value) == (
        f"no token to train on: every loss mask in --train_file ({zero}, {zero2}) is zero; "
        "give data with tokens to train on (a prompt/response record trains on its response)"
    )
    scored, notes = check(pipeline([zero, write(tmp_path / "good.bin")]))
    assert scored == 100
    assert notes[0] == (
        f"--train_file: token shard {zero!r} has no scored token (every loss mask is zero): it "
        "adds nothing to the loss"
    )


def _bare_trainer(**attrs) -> Trainer:
    """A Trainer with only the attributes a method under test reads."""
    trainer = Trainer.__new__(Trainer)
    trainer.__dict__.update(attrs)
    return trainer


def test_eval_without_scored_tokens_warns_and_reports_no_loss(tmp_path, monkeypatch):
    zero = write(tmp_path / "eval.bin", mask=np.zeros(100, bool))
    scored, notes = check(pipeline(zero, flag_name="--eval_file"), need_scored=False)
    assert scored == 0
    assert notes[0] == (
        f"--eval_file: no token to evaluate on: every loss mask in {zero} is zero; no eval loss "
        "is reported"
    )
    cfg = types.SimpleNamespace(
        eval_every_n_steps=10, data=types.SimpleNamespace(eval_files=[zero])
    )
    trainer = _bare_trainer(cfg=cfg, eval_scored=False)
    assert trainer.evaluate(None) is None and not trainer._eval_due(10)
    # Eval batches that happen to score no token give no loss rather than 0.
    monkeypatch.setattr("jaxllmq.trainer.to_global_arrays", lambda batch, sharding: batch)
    trainer = _bare_trainer(
        eval_scored=True,
        _eval_batches=lambda: iter([{}]),
        compiled=types.SimpleNamespace(eval_step=lambda params, batch: (0.0, 0)),
        state=types.SimpleNamespace(params=None),
        batch_sharding=None,
    )
    loss, tokens = trainer.evaluate(None)
    assert np.isnan(loss) and tokens == 0


def test_resume_onto_other_files_is_refused_unless_new_data(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    old = [write(tmp_path / "a" / f"{k}.bin", 100) for k in range(2)]
    new = [write(tmp_path / "b" / f"{k}.bin", 100, first=7) for k in range(2)]
    saved = pipeline(old)
    next(saved)
    state = json.loads(json.dumps(saved.get_state()))  # as a checkpoint stores it
    saved.close()
    other = pipeline(new)
    assert other.num_windows == saved.num_windows  # only the files tell them apart

    ckpt = types.SimpleNamespace(resume=types.SimpleNamespace(data=state))
    trainer = _bare_trainer(
        cfg=types.SimpleNamespace(ckpt=types.SimpleNamespace(new_data=False)),
        train_data=other,
        ckpt=ckpt,
    )
    with pytest.raises(CheckpointError) as e:
        trainer._resume_data()
    assert str(e.value) == (
        "--continue: the saved data position is in other files (saved 2 files, now 2; file 1 "
        f"was {os.path.abspath(old[0])!r} (100 tokens, 1424 bytes), now "
        f"{os.path.abspath(new[0])!r} (100 tokens, 1424 bytes)); resume with the same "
        "--train_file, or pass --new_data to start this data from its beginning"
    )
    with pytest.raises(ValueError, match=r"saved 2 files, now 1; file 2 was .*, now none"):
        pipeline(old[0]).set_state(state)
    trainer.cfg.ckpt.new_data = True
    trainer._resume_data()  # --new_data: the position is not used
    assert other.get_state()["step"] == 0

    same = pipeline(old)
    same.set_state(state)
    assert same.get_state()["step"] == 1
    # The same files copied elsewhere (a moved data directory, new mtimes) resume.
    (tmp_path / "moved").mkdir()
    moved = [str(tmp_path / "moved" / os.path.basename(f)) for f in old]
    for src, dst in zip(old, moved, strict=True):
        shutil.copyfile(src, dst)
    copied = pipeline(moved)
    copied.set_state(state)
    assert copied.get_state()["step"] == 1
    # A state saved before the files were recorded still resumes.
    before = {k: v for k, v in state.items() if k != "files"}
    other.set_state(before)
    assert other.get_state()["step"] == 1


def test_main_refuses_a_negative_id_in_one_line(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    path = write(data / "train.bin", 2000)
    poke(path, 1234, -7)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg-cache")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxllmq.main",
            "--model=tiny",
            "--from_scratch",
            f"--train_file={path}",
            "--seq_len=32",
            "--batch_size=1",
            "--steps=2",
            f"--log_file={tmp_path}/log.jsonl",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        f"error: token shard {path!r} holds token id -7 at token offset 1234, outside the "
        "model's vocab [0, 8192): it was tokenized for another model, or is corrupt; re-tokenize "
        "the data with the model's tokenizer (`python -m jaxllmq.data.prepare`)"
    ]
    assert "Traceback" not in proc.stderr
