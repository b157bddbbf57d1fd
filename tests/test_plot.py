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


def write_llmq_log(path, steps=40):
    records = [{"log": "cmd", "time": 0, "step": 0, "argv": ["train"]}]
    for s in range(1, steps + 1):
        records.append(
            {"log": "step", "time": s, "step": s, "step_tokens": 4096, "duration_ms": 100.0,
             "loss": 6 - s / 20, "norm": 0.8, "lr": 3e-4}
        )  # fmt: skip
        if s % 20 == 0:
            records.append({"log": "eval", "time": s, "step": s, "loss": 6.1 - s / 20})
    path.write_text(json.dumps(records, indent=1))


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
