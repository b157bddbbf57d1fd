"""Entry point: python -m jaxllmq.main --flagfile=configs/X.flags [--flag=value ...].

Intentionally short: flags -> TrainConfig -> trainer.run(); the logic lives in the libraries.
"""

import sys

from absl import app

from jaxllmq import config, trainer, xla_flags
from jaxllmq.atomic_dir import AtomicDirError
from jaxllmq.checkpoint_files import CheckpointError
from jaxllmq.data.shards import ShardError
from jaxllmq.log import MissingExtraError
from jaxllmq.model import CheckpointFormatError, ModelConfigError
from jaxllmq.offload import OffloadError
from jaxllmq.optim import NonFiniteError
from jaxllmq.parallel.mesh import MeshError, initialize_distributed
from jaxllmq.runlock import RunLockError


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]} (flags are --name=value)")
    # Bad input (flags, files, model dirs, checkpoints, a diverged run): one line, exit 1.
    user_errors = (
        config.ConfigError,
        ShardError,
        ModelConfigError,
        CheckpointFormatError,
        CheckpointError,
        OffloadError,
        MissingExtraError,
        MeshError,
        AtomicDirError,
        RunLockError,
    )
    try:
        cfg = config.from_flags()  # every config dataclass validates itself: ValueError
    except ValueError as e:
        sys.exit(f"error: {e}")
    xla_flags.apply_defaults(deterministic=cfg.model.deterministic)
    initialize_distributed(
        cfg.mesh.coordinator_address, cfg.mesh.num_processes, cfg.mesh.process_id
    )
    try:
        trainer.run(cfg, sys.argv)
    except (*user_errors, NonFiniteError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    config.require_training_flags()
    app.run(main, flags_parser=config.parse_argv)
