"""Entry point: python -m jaxllmq.main --flagfile=configs/X.flags [--flag=value ...].

Intentionally short: flags -> TrainConfig -> train.run(); the logic lives in the libraries.
"""

import sys

from absl import app, flags

from jaxllmq import config


def _parse(argv: list[str]) -> list[str]:
    # Expand flagfiles first so their dashed llmq spellings are normalized too; later flags win.
    argv = flags.FLAGS.read_flags_from_files(argv, force_gnu=False)
    try:
        return flags.FLAGS(config.normalize_dashes(argv))
    except flags.Error as e:
        print(f"FATAL Flags parsing error: {e}", file=sys.stderr)
        print("Pass --helpfull to see help on flags.", file=sys.stderr)
        sys.exit(1)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]} (flags are --name=value)")
    from jaxllmq import train  # after flag parsing: --help need not import jax
    from jaxllmq.data.shards import ShardError
    from jaxllmq.model import CheckpointFormatError, ModelConfigError
    from jaxllmq.optim import NonFiniteError

    # Bad input (flags, files, model dirs, a diverged run) ends with one line, exit 1.
    user_errors = (config.ConfigError, ShardError, ModelConfigError, CheckpointFormatError)
    try:
        train.run(config.from_flags(), sys.argv)
    except (*user_errors, NonFiniteError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    app.run(main, flags_parser=_parse)
