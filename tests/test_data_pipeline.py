"""The Grain pipeline: windows, order, per-process rows, resumable state, masks, global arrays."""

import json

import jax
import numpy as np
import pytest
from absl import flags
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxllmq.data.pipeline import TokenBatches, to_global_arrays
from jaxllmq.data.shards import ShardError, write_shard

T = 8  # seq_len: windows of 9 tokens
SIZES = [100, 37, 64]  # tokens per shard: 11 + 4 + 7 = 22 windows, each shard's tail dropped
OFFSET = 1000  # shard k holds OFFSET * k + arange(n): every token names its shard and position


@pytest.fixture
def shards(tmp_path):
    for k, n in enumerate(SIZES):
        write_shard(tmp_path / f"train-{k:03d}.bin", OFFSET * k + np.arange(n), vocab_size=5000)
    return str(tmp_path / "train-*.bin")


def pipeline(files, **kw):
    kw = {"seq_len": T, "batch_size": 2, "process_index": 0, "process_count": 1, **kw}
    return TokenBatches(files, **kw)


def window_starts(batch):
    """(shard, first token) of every row's window, from the self-describing tokens."""
    first = batch["inputs"][..., 0]
    return np.stack([first // OFFSET, first % OFFSET], axis=-1)


def take(batches, n):
    return [next(batches) for _ in range(n)]


def test_windows_and_targets_exactly(shards):
    data = pipeline(shards, batch_size=1, shuffle=False)
    assert (data.num_windows, data.steps_per_epoch) == (22, 22)
    expected = [(k, j * (T + 1)) for k, n in enumerate(SIZES) for j in range(n // (T + 1))]
    for k, start in expected:
        batch = next(data)
        assert batch["inputs"].shape == batch["targets"].shape == (1, 1, T)
        assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
        assert batch["loss_mask"].dtype == bool and batch["loss_mask"].all()
        window = OFFSET * k + np.arange(start, start + T + 1)
        np.testing.assert_array_equal(batch["inputs"][0, 0], window[:-1])
        np.testing.assert_array_equal(batch["targets"][0, 0], window[1:])


def test_same_seed_same_order_new_permutation_each_epoch(shards):
    run = [window_starts(b).reshape(-1, 2) for b in take(pipeline(shards, seed=3), 33)]
    again = [window_starts(b).reshape(-1, 2) for b in take(pipeline(shards, seed=3), 33)]
    other = [window_starts(b).reshape(-1, 2) for b in take(pipeline(shards, seed=4), 11)]
    np.testing.assert_array_equal(np.concatenate(run), np.concatenate(again))
    epochs = [np.concatenate(run[i : i + 11]).tolist() for i in (0, 11, 22)]
    all_windows = sorted([k, j * (T + 1)] for k, n in enumerate(SIZES) for j in range(n // (T + 1)))
    for order in epochs:  # 22 windows = 11 steps x 2 rows: every window once per epoch
        assert sorted(order) == all_windows
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    assert np.concatenate(other).tolist() != epochs[0]
    assert epochs[0] != sorted(epochs[0])  # shuffled across shards, not in file order


@pytest.mark.parametrize("count", [1, 2, 4])
def test_processes_rows_union_is_global_batch(shards, count):
    acc, batch_size = 2, 4
    whole = take(pipeline(shards, batch_size=batch_size, grad_accumulation=acc, seed=7), 5)
    parts = [
        take(
            pipeline(
                shards,
                batch_size=batch_size,
                grad_accumulation=acc,
                seed=7,
                process_index=p,
                process_count=count,
            ),
            5,
        )
        for p in range(count)
    ]
    for step, batch in enumerate(whole):
        assert batch["inputs"].shape == (acc, batch_size, T)
        for key in batch:
            rows = [part[step][key] for part in parts]
            assert all(r.shape == (acc, batch_size // count, T) for r in rows)
            np.testing.assert_array_equal(np.concatenate(rows, axis=1), batch[key])
        starts = window_starts(batch).reshape(-1, 2).tolist()
        assert len(set(map(tuple, starts))) == acc * batch_size  # no window twice in a step


def test_resume_from_state_gives_identical_batches(shards):
    # 22 windows / (2 x 3 rows) = 3 steps per epoch; stopping at 2 and 5 resumes across epochs.
    kw = {"batch_size": 3, "grad_accumulation": 2, "seed": 11}
    reference = take(pipeline(shards, **kw), 12)
    for k in (0, 2, 3, 5):
        first = pipeline(shards, **kw)
        take(first, k)
        state = json.loads(json.dumps(first.get_state()))
        first.close()
        resumed = pipeline(shards, **kw)
        resumed.set_state(state)
        assert resumed.epoch == k // 3
        for got, want in zip(take(resumed, 12 - k), reference[k:], strict=True):
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])


def test_state_from_other_data_is_refused(shards):
    state = pipeline(shards, seed=1).get_state()
    with pytest.raises(ValueError, match=r"seed: saved 1, now 2.*--new_data"):
        pipeline(shards, seed=2).set_state(state)
    with pytest.raises(ValueError, match="rows_per_step: saved 2, now 4"):
        pipeline(shards, seed=1, batch_size=4).set_state(state)


def test_masks_reach_targets_at_the_right_position(tmp_path):
    n = 200
    mask = np.random.default_rng(0).random(n) < 0.6
    write_shard(tmp_path / "sft.bin", np.arange(n), mask, vocab_size=n)
    write_shard(tmp_path / "plain.bin", OFFSET + np.arange(50), vocab_size=OFFSET + 50)
    seen = 0
    for batch in take(pipeline(str(tmp_path / "*.bin"), batch_size=4), 6):
        for start, loss_mask in zip(batch["inputs"][0, :, 0], batch["loss_mask"][0], strict=True):
            if start >= OFFSET:
                assert loss_mask.all()
            else:  # targets are tokens start+1 .. start+T, so the mask is mask[start+1 : ...]
                np.testing.assert_array_equal(loss_mask, mask[start + 1 : start + T + 1])
                seen += 1
    assert seen > 10


def test_eval_is_one_pass_and_restarts_at_the_same_batch(shards):
    data = pipeline(shards, repeat=False, batch_size=4, seed=5)
    first_pass = list(data)
    assert len(first_pass) == data.steps_per_epoch == 5  # 22 // 4: the partial batch is dropped
    with pytest.raises(StopIteration):
        next(data)
    data.reset()
    second_pass = list(data)
    for a, b in zip(first_pass, second_pass, strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])


def test_read_ahead_modes_agree(shards):
    inline = take(pipeline(shards, num_threads=0, prefetch=0, seed=2), 15)
    threaded = take(pipeline(shards, num_threads=3, prefetch=6, seed=2), 15)
    for a, b in zip(inline, threaded, strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])


def test_vocab_size_and_check(shards, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    write_shard(tmp_path / "train-big.bin", np.arange(30), vocab_size=9000)
    data = pipeline(shards)
    assert data.vocab_size == 9000
    assert data.validate(9000, note=lambda message: None) == sum(SIZES) + 30
    with pytest.raises(ShardError, match=r"train-big.bin' has vocab size 9000.*model's 8192"):
        data.validate(8192)


def test_clear_errors_for_bad_setups(shards, tmp_path):
    with pytest.raises(ShardError, match=r"--eval_file: no files match '.*nothing-\*.bin'"):
        pipeline(str(tmp_path / "nothing-*.bin"), flag_name="--eval_file")
    with pytest.raises(ShardError, match=r"hold 22 windows.*fewer than one step needs.*= 24"):
        pipeline(shards, batch_size=12, grad_accumulation=2)
    with pytest.raises(ValueError, match="global batch size 6 .* divisible by .* 4"):
        pipeline(shards, batch_size=6, process_count=4)
    # Comma-separated globs and explicit paths both work; a file named twice is read once.
    listed = pipeline(f"{shards},{tmp_path / 'train-000.bin'}")
    assert listed.num_windows == 22 and len(listed.files) == 3


def test_to_global_arrays_on_8_device_mesh(shards):
    assert jax.device_count() == 8
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "fsdp"))
    sharding = NamedSharding(mesh, P(None, ("data", "fsdp")))
    batch = next(pipeline(shards, batch_size=8, grad_accumulation=2))
    arrays = to_global_arrays(batch, sharding)
    for key, array in arrays.items():
        assert array.shape == (2, 8, T) and array.sharding == sharding
        assert array.addressable_shards[0].data.shape == (2, 1, T)
        np.testing.assert_array_equal(np.asarray(array), batch[key])
    assert arrays["loss_mask"].dtype == bool and arrays["inputs"].dtype == np.int32


def test_worker_processes_give_the_same_batches(shards):
    flags.FLAGS.mark_as_parsed()  # what absl.app does in a command: Grain reads its flags
    inline = take(pipeline(shards, num_threads=0, seed=9), 6)
    workers = pipeline(shards, num_workers=2, seed=9)
    try:
        for a, b in zip(inline, take(workers, 6), strict=True):
            for key in a:
                np.testing.assert_array_equal(a[key], b[key])
    finally:
        workers.close()
