"""python -m jaxllmq.data.prepare --input=GLOBS --tokenizer=PATH --out_dir=DIR | --quickstart
--out_dir=DIR: text into token shards (jaxllmq/data/prepare.py)."""

import sys

from absl import app

from jaxllmq.cli import flags
from jaxllmq.data import chat, prepare
from jaxllmq.data.shards import ShardError


def run(argv: list[str]) -> None:
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]} (flags are --name=value)")
    cfg = flags.build_or_exit(prepare.PrepareConfig)
    try:
        prepare.run(cfg)
    except (prepare.PrepareError, ShardError, chat.ChatTemplateError) as e:
        sys.exit(f"error: {e}")


def main(argv: list[str] | None = None) -> None:
    flags.define(prepare.PrepareConfig)
    app.run(run, argv, flags_parser=flags.parse_argv)
