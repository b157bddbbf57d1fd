"""The plot tool: PNGs from a jaxllmq JSONL log and from an llmq JSON-array log."""

import json
import math
import struct
import subprocess
import sys

import numpy as np
import pytest

from jaxllmq import plot
from jaxllmq.log import RunLog


def png_size(path) -> tuple[int, int]:
    """(width, height) of a PNG, after checking its signature and IHDR chunk."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def write_jaxllmq_log(path, steps=60, eval_every=20):
    rng = np.random.default_rng(0)
    with RunLog(
        str(path), total_steps=steps, flops_per_token=0, stream=open("/dev/null", "w")
    ) as log:
        for s in range(1, steps + 1):
            log.step(
                s,
                loss=5 * math.exp(-s / 30) + 0.1 * rng.standard_normal() + 2,
                norm=1 + 0.1 * rng.standard_normal(),
                lr=1e-3 * min(1, s / 10),
                tokens=2048,
                duration_ms=50.0,
            )
            if s % eval_every == 0:
                log.eval(s, loss=5 * math.exp(-s / 30) + 2.1, tokens=4096)


def llmq_line(kind: str, step: int, **fields) -> str:
    """One record as llmq's TrainingRunLogger formats it: `time` a date string, `, ` and `: `."""
    return "  " + json.dumps({"log": kind, "time": "2025-06-01 12:00:00.000000000", "step": step,
                              **fields})  # fmt: skip


def write_llmq_log(path, steps=40, lines=None):
    """An llmq log as its logger writes one: a JSON array, a record per line, `]` after the last."""
    if lines is None:
        lines = [
            llmq_line("cmd", 0, cmd=["train", "--model", "Qwen2.5-0.5B"]),
            llmq_line("option", 0, name="batch_size", value=8),
            llmq_line("dataset", 0, split="train", files=2, tokens=10**6, file_index=0,
                      chunk_index=0, seed=1),
        ]  # fmt: skip
        for s in range(1, steps + 1):
            lines.append(
                llmq_line("step", s, epoch=s / 100, step_tokens=4096, duration_ms=100, norm=0.8,
                          loss=6 - s / 20, lr=3e-4, lse_max=9.0, lse_mean=8.0)
            )  # fmt: skip
            if s % 20 == 0:
                lines.append(
                    llmq_line("eval", s, epoch=s / 100, eval_tokens=8192, duration_ms=50,
                              loss=6.1 - s / 20)
                )  # fmt: skip
                lines.append(llmq_line("gpu", s, id=0, clock=1980, power=650000, throttle=""))
    path.write_text("[\n" + ",\n".join(lines) + "\n]\n")


def test_loads_jaxllmq_log(tmp_path):
    log = tmp_path / "run" / "log.jsonl"
    write_jaxllmq_log(log)
    s = plot.load(str(log))
    assert s.name == "run"
    assert len(s.step) == 60 and s.step[-1] == 60
    np.testing.assert_allclose(s.tokens[-1], 60 * 2048)
    np.testing.assert_allclose(s.tokens_per_s, 2048 / 0.05)
    assert list(s.eval_step) == [20, 40, 60]
    np.testing.assert_allclose(s.eval_tokens, [20 * 2048, 40 * 2048, 60 * 2048])


def test_loads_llmq_json_array(tmp_path):
    log = tmp_path / "llmq.json"
    write_llmq_log(log)
    s = plot.load(str(log))
    assert len(s.step) == 40
    np.testing.assert_allclose(s.tokens[-1], 40 * 4096)
    # tokens/s from step_tokens and duration_ms when the record has no tokens_per_s
    np.testing.assert_allclose(s.tokens_per_s, 4096 / 0.1)
    np.testing.assert_allclose(s.eval_loss, [6.1 - 1, 6.1 - 2])


def test_llmq_log_nonfinite_torn_and_unescaped(tmp_path):
    """What llmq really writes besides clean records: fmt's bare nan/inf for non-finite floats, a
    string it did not escape, and (after a crash) a last record cut short."""
    log = tmp_path / "llmq.json"
    step = llmq_line("step", 1, step_tokens=4096, duration_ms=100, norm=0.5, loss=7.0, lr=1e-4)
    lines = [
        step,
        step.replace('"step": 1', '"step": 2').replace("0.5", "inf").replace("7.0", "nan"),
        step.replace('"step": 1', '"step": 3').replace("0.5", "-inf").replace("7.0", "-nan"),
        llmq_line("info", 3, type="message", message="x").replace('"x"', '"say "hi": nan"'),
        step.replace('"step": 1', '"step": 4'),
        step.replace('"step": 1', '"step": 5')[:40],
    ]
    log.write_text("[\n" + ",\n".join(lines))  # no closing `]`: torn by a crash
    s = plot.load(str(log))
    assert list(s.step) == [1, 2, 3, 4]
    assert s.loss[0] == 7.0 and math.isnan(s.loss[1]) and math.isnan(s.loss[2])
    assert list(s.norm[1:3]) == [math.inf, -math.inf]
    # The same records, closed but for the unescaped string: one whole-array parse fails.
    log.write_text("[\n" + ",\n".join(lines[:5]) + "\n]\n")
    assert list(plot.load(str(log)).step) == [1, 2, 3, 4]
    # And clean but with bare nan: it parses whole.
    log.write_text("[\n" + ",\n".join(lines[:3]) + "\n]\n")
    assert [r["step"] for r in plot.read_records(str(log))] == [1, 2, 3]


def test_ema_smooths_and_is_bias_corrected():
    x = np.array([1.0, 1.0, math.nan, 1.0])
    np.testing.assert_allclose(plot.ema(x, 0.9), 1.0)
    noisy = np.random.default_rng(0).standard_normal(500)
    assert plot.ema(noisy, 0.9)[100:].std() < 0.5 * noisy.std()


@pytest.mark.parametrize("x", ["step", "tokens"])
def test_png_for_both_formats_overlaid(tmp_path, x):
    a, b = tmp_path / "a" / "log.jsonl", tmp_path / "b.json"
    write_jaxllmq_log(a)
    write_llmq_log(b)
    out = tmp_path / "curves.png"
    runs = [plot.load(str(a), "jaxllmq"), plot.load(str(b), "llmq")]
    plot.plot(runs, str(out), x=x, size=(8, 5), dpi=50)
    assert png_size(out) == (400, 250)


def test_cli_writes_png(tmp_path):
    log = tmp_path / "log.jsonl"
    write_jaxllmq_log(log)
    llmq = tmp_path / "llmq.json"
    write_llmq_log(llmq)
    out = tmp_path / "out" / "c.png"
    cmd = [sys.executable, "-m", "jaxllmq.plot", str(log), str(llmq), f"--out={out}"]
    cmd += ["--names=ours,theirs", "--width=6", "--height=4", "--dpi=50"]
    subprocess.run(cmd, check=True, capture_output=True)
    assert png_size(out) == (300, 200)


def test_cli_names_a_missing_log(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    run = subprocess.run([sys.executable, "-m", "jaxllmq.plot", missing], capture_output=True)
    assert run.returncode == 1
    assert f"no such log file: {missing}" in run.stderr.decode()
    assert b"Traceback" not in run.stderr
