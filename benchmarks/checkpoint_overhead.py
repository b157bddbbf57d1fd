"""What an async checkpoint costs the training loop: llama-3.2-1b, B=8, T=2048, one GPU.

    python3 -m benchmarks.checkpoint_overhead [--out=DIR]

Builds the real state and step (train.build, as the trainer and bench do) on synthetic tokens and
times, each step synchronized:
  - normal steps (median);
  - a checkpointing step as the host loop runs it: the step, then `Checkpointing.save` (which
    holds the loop while orbax copies the state to host memory);
  - the steps that run while orbax writes the files in the background (median), i.e. the
    slowdown the write causes;
  - the save's wall time, from the call until the checkpoint is complete on disk (the files'
    checksums included: they are computed in the save's background thread);
  - the checksums alone: writing files.json for the last save, and verifying it as a resume does.
Prints a table; --out gets it as JSON too. Takes the trainer's flags (--model_dtype, --gpus,
--zero_level, ...); checkpoints go to --checkpoint_dir (default under /tmp) and are deleted
after. --smoke runs the tiny preset on CPU in seconds, to check the script itself.
"""

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import types

try:
    import grain  # noqa: F401  (the trainer's input pipeline; this script never reads data)
except ImportError:  # the GPU machine may lack it: stand in for the names the package imports
    sys.modules["grain"] = types.ModuleType("grain")
    sys.modules["grain.experimental"] = types.SimpleNamespace(index_shuffle=None)

import jax
from absl import app, flags

from jaxllmq.checkpoint import Checkpointing
from jaxllmq.checkpoint_files import verify, write_file_list
from jaxllmq.cli import bench as bench_cli
from jaxllmq.cli import flags as cli_flags
from jaxllmq.settings import CheckpointConfig

_normal_steps = flags.DEFINE_integer("normal_steps", 10, "Timed steps without a save.")
_saves = flags.DEFINE_integer("saves", 2, "Checkpoints to time (one after another).")
_out = flags.DEFINE_string("out", None, "Also write the results as JSON into this directory.")
_smoke = flags.DEFINE_bool("smoke", False, "Tiny preset on CPU: check the script runs.")


def _timed(step, state, batch) -> tuple[object, float]:
    t = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    return state, time.perf_counter() - t


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(p, f)) for p, _, fs in os.walk(path) for f in fs)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]}")
    F = flags.FLAGS
    if _smoke.value:
        F.model, F.batch_size, F.seq_len, F.matmul_dtype = "tiny", 1, 64, "float32"
    t0 = time.perf_counter()
    built, batch, mesh, model_cfg, spec = bench_cli.build_from_flags(argv)
    step, state = built.train_step, built.state
    for _ in range(3):  # compile and warm up
        state, _ = _timed(step, state, batch)
    print(f"built and compiled in {time.perf_counter() - t0:.1f} s", flush=True)

    directory = F.checkpoint_dir or tempfile.mkdtemp(prefix="jaxllmq-ckpt-overhead-")
    shutil.rmtree(directory, ignore_errors=True)
    ckpt = Checkpointing(
        CheckpointConfig(checkpoint_dir=directory, ckpt_keep_n=1),
        run={"argv": sys.argv, "config": {}},
        model=model_cfg.to_hf_dict(),
        info=print,
    )
    normal = []
    for _ in range(_normal_steps.value):
        state, dt = _timed(step, state, batch)
        normal.append(dt)
    saves = []
    n = len(normal) + 3
    for _ in range(_saves.value):
        state, dt = _timed(step, state, batch)
        n += 1
        t = time.perf_counter()
        saved_at = n
        held = ckpt.save(n, state, data={"step": n}, log={})
        during = []
        while ckpt.writing and len(during) < 1000:  # train on while orbax writes
            state, d = _timed(step, state, batch)
            during.append(d)
            n += 1
        ckpt.wait()
        wall = time.perf_counter() - t
        saves.append(
            {
                "step_s": dt,
                "held_s": held,
                "during_median_s": statistics.median(during) if during else None,
                "steps_during": len(during),
                "save_wall_s": wall,
                "bytes": _du(ckpt.path(saved_at)),
            }
        )
    ckpt.close()
    # The checksums alone: what the save's background thread spends listing and hashing the files
    # (page cache warm, as right after a write), and what a resume spends verifying them.
    last = ckpt.path(saved_at)
    t = time.perf_counter()
    write_file_list(last)
    checksum_s = time.perf_counter() - t
    t = time.perf_counter()
    problems = verify(last)
    verify_s = time.perf_counter() - t
    assert not problems, problems
    shutil.rmtree(directory, ignore_errors=True)

    base = statistics.median(normal)
    result = {
        "model": spec.model,
        "device_kind": jax.devices()[0].device_kind,
        "devices": mesh.size,
        "batch_size": F.batch_size,
        "seq_len": F.seq_len,
        "model_dtype": spec.model_dtype,
        "normal_step_median_s": base,
        "saves": saves,
        "checksum_s": checksum_s,
        "verify_s": verify_s,
        "jax": jax.__version__,
    }
    ms = lambda s: f"{1000 * s:9.1f} ms"
    print(f"\n{spec.model}, B={F.batch_size} T={F.seq_len}, {mesh.size} x {result['device_kind']}")
    print(f"{'normal step (median of ' + str(len(normal)) + ')':<44}{ms(base)}")
    for i, s in enumerate(saves, 1):
        size = s["bytes"] / 2**30
        print(f"save {i} ({size:.2f} GiB on disk)")
        print(f"{'  checkpointing step: step + save() held':<44}{ms(s['step_s'] + s['held_s'])}")
        print(f"{'    of which save() held the loop':<44}{ms(s['held_s'])}")
        if s["during_median_s"] is not None:
            label = f"  steps while it writes (median of {s['steps_during']})"
            print(f"{label:<44}{ms(s['during_median_s'])}")
        print(f"{'  save wall time, call to complete on disk':<44}{ms(s['save_wall_s'])}")
    print(f"{'checksums of the last save: write files.json':<44}{ms(checksum_s)}")
    print(f"{'  verify them, as a resume does':<44}{ms(verify_s)}")
    if _out.value:
        os.makedirs(_out.value, exist_ok=True)
        with open(os.path.join(_out.value, "checkpoint_overhead.json"), "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    bench_cli.define_flags()
    flags.FLAGS.set_default("model", "llama-3.2-1b")
    flags.FLAGS.set_default("from_scratch", True)
    flags.FLAGS.set_default("batch_size", 8)
    flags.FLAGS.set_default("seq_len", 2048)
    app.run(main, flags_parser=cli_flags.parse_argv)
