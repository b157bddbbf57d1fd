"""Benchmark the token data path on this host (not a test): pipeline tokens/s and prepare tokens/s.

    python -m benchmarks.data_pipeline                 # both parts
    python -m benchmarks.data_pipeline --skip_prepare  # pipeline only

Pipeline: random int32 shards (4 x 32M tokens, 512 MB, in the page cache as just written) read as
TokenBatches with B=8, T=2048: the rate at which `next()` hands out batches, i.e. the most the
trainer could draw from one host. Each configuration is timed after a warm-up, over steps whose
windows are mostly first touches of their memmap pages (which is included in the figure).

Prepare: runs `python -m jaxllmq.data.prepare --quickstart` (stdlib corpus, trained BPE tokenizer)
end to end, then tokenizes the same corpus as a .jsonl file with that tokenizer through the normal
--input path; both report prepare's own tokenizing rate (tokens/s of the tokenize-and-write loop).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

from jaxllmq.cli import flags as cli_flags
from jaxllmq.data.pipeline import TokenBatches
from jaxllmq.data.prepare import stdlib_sources
from jaxllmq.data.shards import write_shard

_dir = flags.DEFINE_string("dir", None, "Scratch directory (default: a temporary one).")
_steps = flags.DEFINE_integer("steps", 5000, "Timed steps per configuration.")
_skip_prepare = flags.DEFINE_bool("skip_prepare", False, "Time the pipeline only.")

B, T = 8, 2048


def write_shards(directory: str, num_shards: int, tokens_per_shard: int, masks: bool) -> str:
    rng = np.random.default_rng(0)
    name = "masked" if masks else "plain"
    for k in range(num_shards):
        tokens = rng.integers(0, 128256, tokens_per_shard, dtype=np.int32)
        mask = rng.random(tokens_per_shard) < 0.7 if masks else None
        write_shard(f"{directory}/{name}-{k:03d}.bin", tokens, mask, vocab_size=128256)
    return f"{directory}/{name}-*.bin"


def time_pipeline(files: str, steps: int, **options) -> float:
    """Tokens per second that next() delivers, after a warm-up."""
    data = TokenBatches(files, seq_len=T, batch_size=B, process_index=0, process_count=1, **options)
    try:
        for _ in range(100):
            next(data)
        start = time.perf_counter()
        for _ in range(steps):
            next(data)
        return steps * B * T / (time.perf_counter() - start)
    finally:
        data.close()


def run_prepare(*flags: str) -> tuple[float, float, str]:
    """(wall seconds, tokenizing tokens/s from prepare's summary, summary line)."""
    cmd = [sys.executable, "-m", "jaxllmq.data.prepare", *flags]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - start
    summary = done.stdout.strip().splitlines()[-1]
    rate = float(re.search(r"tokenizing ([\d,]+) tokens/s", summary)[1].replace(",", ""))
    return seconds, rate, summary


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    with tempfile.TemporaryDirectory(dir=_dir.value) as scratch:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"{os.cpu_count()} cores, load average {load} (other work shares the cores)")
        print(f"pipeline: B={B}, T={T}, {_steps.value} steps per row, one process")
        plain = write_shards(scratch, 4, 32 << 20, masks=False)
        masked = write_shards(scratch, 2, 16 << 20, masks=True)
        configurations = [
            ("default: 1 read-ahead thread, 8 steps buffered", plain, {}),
            ("inline: no read-ahead (num_threads=0)", plain, {"num_threads": 0, "prefetch": 0}),
            ("4 read-ahead threads", plain, {"num_threads": 4, "prefetch": 16}),
            ("2 Grain worker processes", plain, {"num_workers": 2}),
            ("default, shards with masks", masked, {}),
        ]
        for label, files, options in configurations:
            rate = time_pipeline(files, _steps.value, **options)
            print(f"  {label:<48} {rate / 1e6:8.1f} M tokens/s")
        if _skip_prepare.value:
            return
        quick = os.path.join(scratch, "quickstart")
        seconds, rate, summary = run_prepare("--quickstart", f"--out_dir={quick}")
        print(f"prepare --quickstart: {seconds:.1f} s wall, tokenizing {rate:,.0f} tokens/s")
        print(f"  {summary}")
        corpus = os.path.join(scratch, "stdlib.jsonl")
        with open(corpus, "w") as f:
            for text in stdlib_sources(32_000_000):
                f.write(json.dumps({"text": text}) + "\n")
        for workers in (1, 2):
            seconds, rate, _ = run_prepare(
                f"--input={corpus}",
                f"--tokenizer={quick}",
                f"--out_dir={os.path.join(scratch, f'jsonl-{workers}')}",
                f"--workers={workers}",
            )
            print(f"prepare --input=stdlib.jsonl --workers={workers}: {seconds:.1f} s wall, "
                  f"tokenizing {rate:,.0f} tokens/s")  # fmt: skip


if __name__ == "__main__":
    app.run(main, flags_parser=cli_flags.parse_argv)
