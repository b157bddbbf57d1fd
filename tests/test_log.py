"""Run log: JSONL records, MFU, the console line and progress bar, outlier messages, resume."""

import io
import json
import math
import sys
import types

import numpy as np
import pytest

from jaxllmq.log import MissingExtraError, RunLog, mfu


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _records(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    return [json.loads(line) for line in lines]


def _log(tmp_path, **kw) -> tuple[RunLog, io.StringIO]:
    out = kw.pop("stream", io.StringIO())
    kw.setdefault("total_steps", 500)
    kw.setdefault("flops_per_token", 6e9)
    return RunLog(str(tmp_path / "logs" / "run.jsonl"), stream=out, **kw), out


def test_records_are_whole_json_lines(tmp_path):
    log, _ = _log(tmp_path)
    log.record("cmd", 0, argv=["python", "-m", "jaxllmq.main"])
    log.record(
        "options",
        0,
        shape=(2, 3),
        arr=np.arange(3),
        scalar=np.float32(1.5),
        count=np.int64(7),
        flag=np.bool_(True),
    )
    log.step(1, loss=float("nan"), norm=float("inf"), lr=0.0, tokens=1024, duration_ms=10.0)
    log.eval(1, loss=3.0, tokens=2048)
    log.info(1, "hello")
    log.close()
    recs = _records(tmp_path / "logs" / "run.jsonl")
    assert [r["log"] for r in recs] == ["cmd", "options", "step", "eval", "info"]
    for r in recs:
        assert isinstance(r["time"], float) and abs(r["time"] - recs[0]["time"]) < 60
        assert isinstance(r["step"], int)
    opts = recs[1]
    assert opts["shape"] == [2, 3] and opts["arr"] == [0, 1, 2]
    assert opts["scalar"] == 1.5 and opts["count"] == 7 and opts["flag"] is True
    # Plain JSON has no NaN: non-finite floats are strings that float() reads back.
    assert math.isnan(float(recs[2]["loss"])) and float(recs[2]["norm"]) == math.inf
    assert recs[3]["loss"] == 3.0 and recs[3]["tokens"] == 2048
    assert recs[4]["message"] == "hello"


def test_append_and_partial_line(tmp_path):
    path = tmp_path / "logs" / "run.jsonl"
    log, _ = _log(tmp_path)
    log.record("cmd", 0, argv=["a"])
    log.close()
    # A crash mid-write leaves a last line without its newline.
    with open(path, "a") as f:
        f.write('{"log": "step", "ti')
    log, _ = _log(tmp_path)
    log.record("checkpoint", 10, path="/ckpt/10")
    log.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and lines[1] == '{"log": "step", "ti'
    assert json.loads(lines[0])["log"] == "cmd" and json.loads(lines[2])["step"] == 10


def test_step_record_and_mfu(tmp_path):
    log, _ = _log(tmp_path, peak_flops=8 * 989e12, flops_per_token=1.2e10)
    log.step(3, loss=2.5, norm=0.75, lr=3e-4, tokens=65536, duration_ms=500.0, lse_max=9.0)
    log.close()
    (rec,) = _records(tmp_path / "logs" / "run.jsonl")
    want_tps = 65536 / 0.5
    assert rec["tokens_per_s"] == pytest.approx(want_tps)
    assert rec["mfu"] == pytest.approx(1.2e10 * want_tps / (8 * 989e12))
    for key, val in dict(loss=2.5, norm=0.75, lr=3e-4, tokens=65536, duration_ms=500.0).items():
        assert rec[key] == val
    assert rec["lse_max"] == 9.0
    assert "mfu_fp8" not in rec  # a bf16 run
    assert mfu(6e9, 41.2e12 / 6e9, 100e12) == pytest.approx(0.412)
    assert mfu(6e9, 1e4, 0.0) == 0.0


def test_console_line(tmp_path):
    log, out = _log(tmp_path, flops_per_token=6e9, peak_flops=989e12, total_steps=500)
    # 1e5 tok/s * 6e9 FLOP/token = 6e14 FLOP/s = 60.7% of 989 TFLOP/s.
    log.step(12, loss=3.21044, norm=0.8123, lr=3e-4, tokens=123_400, duration_ms=1000.0)
    log.step(13, loss=3.2, norm=0.8, lr=3e-4, tokens=100_000, duration_ms=1000.0)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith(
        "step 12/500 | loss 3.2104 | norm 0.812 | lr 3.00e-04 | 123.4k tok/s"
    )
    assert "| MFU 74.9% |" in lines[0]
    # 488 steps left at a median of 1 s each.
    assert lines[0].endswith("ETA 8m08s")
    assert "100.0k tok/s | MFU 60.7% | ETA 8m07s" in lines[1]
    assert "\r" not in out.getvalue()  # not a terminal: plain lines, no redraws


def test_fp8_run_reports_mfu_against_both_peaks(tmp_path):
    log, _ = _log(tmp_path, peak_flops=1e15, peak_flops_fp8=2e15, flops_per_token=1e10)
    log.step(1, loss=1.0, norm=1.0, lr=1e-3, tokens=50_000, duration_ms=1000.0)
    log.close()
    (rec,) = _records(tmp_path / "logs" / "run.jsonl")
    assert rec["mfu"] == pytest.approx(0.5) and rec["mfu_fp8"] == pytest.approx(0.25)


def test_no_peak_omits_mfu(tmp_path):
    log, out = _log(tmp_path, peak_flops=0.0)
    log.step(1, loss=1.0, norm=1.0, lr=1e-3, tokens=10, duration_ms=1.0)
    log.close()
    assert "MFU" not in out.getvalue()
    assert _records(tmp_path / "logs" / "run.jsonl")[0]["mfu"] is None


def test_progress_bar_on_terminal(tmp_path):
    log, out = _log(tmp_path, stream=_Tty(), total_steps=10)
    log.step(5, loss=1.0, norm=1.0, lr=1e-3, tokens=10, duration_ms=1.0)
    log.info(5, "a message")
    log.step(6, loss=1.0, norm=1.0, lr=1e-3, tokens=10, duration_ms=1.0)
    log.close()
    text = out.getvalue()
    assert text.startswith("\r[##########..........] step 5/10 |")
    # The message gets a line of its own above the bar, which is redrawn after it.
    assert "\r\x1b[Ka message\n[##########..........] step 5/10" in text
    assert "\r[############........] step 6/10" in text
    assert text.endswith("\n") and text.count("\n") == 2


def _noisy(rng, n):
    return [
        (3.0 + 0.05 * rng.standard_normal(), 1.0 + 0.1 * rng.standard_normal()) for _ in range(n)
    ]


def _outliers(path) -> list[dict]:
    return [r for r in _records(path) if r["log"] == "info"]


def test_outlier_flags_spike_not_noise(tmp_path):
    log, out = _log(tmp_path)
    rng = np.random.default_rng(0)
    for i, (loss, norm) in enumerate(_noisy(rng, 200), start=1):
        log.step(i, loss=loss, norm=norm, lr=1e-3, tokens=10, duration_ms=1.0)
    assert _outliers(tmp_path / "logs" / "run.jsonl") == []  # Gaussian noise never reaches 4 sigma
    log.step(201, loss=4.5, norm=1.0, lr=1e-3, tokens=10, duration_ms=1.0)
    log.step(202, loss=3.0, norm=25.0, lr=1e-3, tokens=10, duration_ms=1.0)
    log.close()
    (loss_rec, norm_rec) = _outliers(tmp_path / "logs" / "run.jsonl")
    assert loss_rec["step"] == 201 and loss_rec["metric"] == "loss" and loss_rec["value"] == 4.5
    assert loss_rec["z"] == pytest.approx((4.5 - loss_rec["mean"]) / loss_rec["std"])
    assert loss_rec["z"] > 20 and abs(loss_rec["mean"] - 3.0) < 0.02
    assert norm_rec["step"] == 202 and norm_rec["metric"] == "norm" and norm_rec["z"] > 20
    assert "loss outlier 4.5 (z-score +" in out.getvalue()


def test_outlier_waits_for_warmup(tmp_path):
    log, _ = _log(tmp_path, outlier_warmup=20)
    for i in range(1, 11):
        log.step(
            i, loss=3.0 + 0.01 * (i % 2), norm=1.0 + 0.01 * (i % 2), lr=0, tokens=1, duration_ms=1
        )
    log.step(11, loss=100.0, norm=1.0, lr=0, tokens=1, duration_ms=1)  # too early to judge
    log.close()
    assert _outliers(tmp_path / "logs" / "run.jsonl") == []


def test_state_dict_round_trip_continues_identically(tmp_path):
    rng = np.random.default_rng(1)
    values = _noisy(rng, 150)
    spikes = {130: (4.0, 1.0), 140: (4.5, 3.0)}
    values = [spikes.get(i, v) for i, v in enumerate(values, start=1)]

    whole, _ = _log(tmp_path / "a")
    for i, (loss, norm) in enumerate(values, start=1):
        whole.step(i, loss=loss, norm=norm, lr=0, tokens=1, duration_ms=1)
    whole.close()

    first, _ = _log(tmp_path / "b")
    for i, (loss, norm) in enumerate(values[:120], start=1):
        first.step(i, loss=loss, norm=norm, lr=0, tokens=1, duration_ms=1)
    saved = json.loads(json.dumps(first.state_dict()))  # it goes through a checkpoint as JSON
    first.close()
    resumed, _ = _log(tmp_path / "b")
    resumed.load_state_dict(saved)
    for i, (loss, norm) in enumerate(values[120:], start=121):
        resumed.step(i, loss=loss, norm=norm, lr=0, tokens=1, duration_ms=1)
    resumed.close()

    def key(recs):
        return [(r["step"], r["metric"], r["z"]) for r in recs]

    want = _outliers(tmp_path / "a" / "logs" / "run.jsonl")
    assert [r["step"] for r in want] == [130, 140, 140]
    assert key(_outliers(tmp_path / "b" / "logs" / "run.jsonl")) == key(want)
    assert resumed.state_dict() == whole.state_dict()


def test_non_main_process_writes_nothing(tmp_path):
    out = io.StringIO()
    log = RunLog(
        str(tmp_path / "run.jsonl"), total_steps=5, flops_per_token=1.0, is_main=False, stream=out
    )
    log.record("cmd", 0, argv=[])
    log.step(1, loss=1.0, norm=1.0, lr=1e-3, tokens=10, duration_ms=1.0)
    log.eval(1, loss=1.0, tokens=10)
    log.info(1, "x")
    log.close()
    assert out.getvalue() == ""
    assert not (tmp_path / "run.jsonl").exists()


def test_no_log_file_still_prints(tmp_path):
    out = io.StringIO()
    log = RunLog(None, total_steps=5, flops_per_token=1.0, stream=out)
    log.record("cmd", 0, argv=[])
    log.step(1, loss=1.0, norm=1.0, lr=1e-3, tokens=10, duration_ms=1.0)
    log.close()
    assert out.getvalue().startswith("step 1/5 | loss 1.0000")
    assert list(tmp_path.iterdir()) == []


def read_tensorboard_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from the event files under `logdir` (TFRecord framing:
    u64 length, u32 crc, the Event proto, u32 crc)."""
    import glob
    import struct

    from tensorboardX.proto import event_pb2

    out: dict[str, list[tuple[int, float]]] = {}
    files = sorted(glob.glob(f"{logdir}/**/events.out.tfevents.*", recursive=True))
    assert files, f"no event files under {logdir}"
    for path in files:
        data = open(path, "rb").read()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
            pos += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_tensorboard_sink_has_the_scalars(tmp_path):
    tb = tmp_path / "tb"
    log = RunLog(
        str(tmp_path / "log.jsonl"),
        total_steps=3,
        flops_per_token=1e9,
        peak_flops=1e12,
        stream=io.StringIO(),
        tensorboard_dir=str(tb),
    )
    for s in (1, 2, 3):
        log.step(s, loss=4.0 - s, norm=0.5 * s, lr=1e-3 * s, tokens=1000, duration_ms=100.0)
    log.step(4, loss=math.nan, norm=1.0, lr=1e-3, tokens=1000, duration_ms=100.0)
    log.eval(3, loss=2.5, tokens=512)
    log.close()
    scalars = read_tensorboard_scalars(tb)
    assert scalars["train/loss"] == [(1, 3.0), (2, 2.0), (3, 1.0)]  # NaN left to the JSONL
    assert [s for s, _ in scalars["train/norm"]] == [1, 2, 3, 4]
    np.testing.assert_allclose(
        [v for _, v in scalars["train/lr"]], [1e-3, 2e-3, 3e-3, 1e-3], rtol=1e-6
    )
    np.testing.assert_allclose([v for _, v in scalars["train/tokens_per_s"]], 1e4, rtol=1e-6)
    np.testing.assert_allclose([v for _, v in scalars["train/mfu"]], 1e9 * 1e4 / 1e12, rtol=1e-6)
    assert scalars["eval/loss"] == [(3, 2.5)]


def test_tensorboard_missing_names_the_extra(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboardx(name, *args, **kwargs):
        if name.startswith("tensorboardX"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboardx)
    with pytest.raises(MissingExtraError, match=r"jaxllmq\[tensorboard\]"):
        RunLog(None, total_steps=1, flops_per_token=0, tensorboard_dir=str(tmp_path))


class _FakeWandbRun:
    def __init__(self, **init):
        self.init, self.logged, self.finished = init, [], False

    def log(self, data: dict, step: int) -> None:
        self.logged.append((step, data))

    def finish(self) -> None:
        self.finished = True


def test_wandb_sink_logs_the_scalars(monkeypatch):
    runs = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: runs.append(_FakeWandbRun(**kw)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    kw = dict(total_steps=2, flops_per_token=0, peak_flops=0, stream=io.StringIO())
    RunLog(None, **kw, is_main=False, wandb_project="p").close()
    assert not runs  # only the main process logs
    log = RunLog(None, **kw, wandb_project="p", run_name="r", run_config={"lr": (1e-3,)})
    log.step(1, loss=3.0, norm=0.5, lr=1e-3, tokens=1000, duration_ms=100.0)
    log.step(2, loss=math.nan, norm=0.5, lr=1e-3, tokens=1000, duration_ms=100.0)
    log.eval(2, loss=2.5, tokens=512)
    log.close()
    (run,) = runs
    assert run.init == {"project": "p", "name": "r", "config": {"lr": [1e-3]}}
    train = {"train/norm": 0.5, "train/lr": 1e-3, "train/tokens_per_s": 1e4}
    assert run.logged == [
        (1, {"train/loss": 3.0, **train}),
        (2, train),  # the NaN loss is left to the JSONL
        (2, {"eval/loss": 2.5}),
    ]
    assert run.finished
