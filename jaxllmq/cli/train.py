"""python -m jaxllmq.main --flagfile=configs/X.flags [--flag=value ...]: train.

Flags -> TrainConfig -> trainer.run(); the logic lives in the libraries.
"""

import sys

from absl import app

from jaxllmq import trainer, xla_flags
from jaxllmq.atomic_dir import AtomicDirError
from jaxllmq.checkpoint_files import CheckpointError
from jaxllmq.cli import flags
from jaxllmq.data.shards import ShardError
from jaxllmq.log import MissingExtraError
from jaxllmq.model import CheckpointFormatError, ModelConfigError
from jaxllmq.offload import OffloadError
from jaxllmq.optim import NonFiniteError
from jaxllmq.parallel.mesh import MeshError, initialize_distributed
from jaxllmq.runlock import RunLockError
from jaxllmq.setting import SettingError
from jaxllmq.settings import TrainConfig

# Bad input (flags, files, model dirs, checkpoints, a diverged run): one line, exit 1.
USER_ERRORS = (
    ShardError,
    ModelConfigError,
    CheckpointFormatError,
    CheckpointError,
    OffloadError,
    MissingExtraError,
    MeshError,
    AtomicDirError,
    RunLockError,
    SettingError,
    NonFiniteError,
)


def train(argv: list[str]) -> None:
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]} (flags are --name=value)")
    cfg = flags.build_or_exit(TrainConfig)
    xla_flags.apply_defaults(deterministic=cfg.model.deterministic)
    initialize_distributed(
        cfg.mesh.coordinator_address, cfg.mesh.num_processes, cfg.mesh.process_id
    )
    try:
        trainer.run(cfg, sys.argv)
    except USER_ERRORS as e:
        sys.exit(f"error: {e}")


def main(argv: list[str] | None = None) -> None:
    flags.define(TrainConfig)
    app.run(train, argv, flags_parser=flags.parse_argv)
