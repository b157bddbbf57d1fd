"""python -m jaxllmq.export --checkpoint=DIR[/STEP] --out_dir=OUT: a checkpoint as a Hugging Face
model directory (jaxllmq/export.py)."""

import sys

from absl import app

from jaxllmq import export, runlock
from jaxllmq.atomic_dir import AtomicDirError
from jaxllmq.checkpoint_files import CheckpointError
from jaxllmq.cli import flags
from jaxllmq.model import ModelConfigError

# Bad input (checkpoints, an --out_dir in use or unwritable): one line, exit 1.
USER_ERRORS = (CheckpointError, ModelConfigError, AtomicDirError, runlock.RunLockError)


def run(argv: list[str]) -> None:
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]} (flags are --name=value)")
    cfg = flags.build_or_exit(export.ExportConfig)
    try:
        with runlock.RunLock([("--out_dir", cfg.out_dir)], sys.argv) as lock:
            for note in lock.notes:  # stale locks taken over
                print(note)
            path = export.export_checkpoint(
                cfg.checkpoint, cfg.out_dir, tokenizer=cfg.tokenizer_dir, dtype=cfg.dtype
            )
    except USER_ERRORS as e:
        sys.exit(f"error: {e}")
    print(f"exported {path} to {cfg.out_dir}")


def main(argv: list[str] | None = None) -> None:
    flags.define(export.ExportConfig)
    app.run(run, argv, flags_parser=flags.parse_argv)
