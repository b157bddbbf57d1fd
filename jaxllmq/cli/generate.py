"""python -m jaxllmq.generate --model=DIR | --checkpoint=DIR[/STEP] --prompt=TEXT: sample text
(jaxllmq/generate.py)."""

import sys

from absl import app

from jaxllmq import generate
from jaxllmq.checkpoint_files import CheckpointError
from jaxllmq.cli import flags
from jaxllmq.model import CheckpointFormatError, ModelConfigError

# Bad input (a model or checkpoint it cannot read, no tokenizer, a bad prompt): one line, exit 1.
USER_ERRORS = (generate.GenerateError, CheckpointError, ModelConfigError, CheckpointFormatError)


def run(argv: list[str]) -> None:
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]} (flags are --name=value)")
    cfg = flags.build_or_exit(generate.GenerateConfig)
    prompt = cfg.prompt or ""
    try:
        model_cfg, params, tok_dir = generate.load(cfg.model, cfg.checkpoint)
        texts = generate.generate(
            model_cfg,
            params,
            tok_dir,
            prompt,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            seed=cfg.seed,
            num_samples=cfg.num_samples,
            chat=cfg.chat,
        )
    except USER_ERRORS as e:
        sys.exit(f"error: {e}")
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i + 1}")
        print(text if cfg.chat else prompt + text)  # a reply, or the prompt continued


def main(argv: list[str] | None = None) -> None:
    flags.define(generate.GenerateConfig)
    app.run(run, argv, flags_parser=flags.parse_argv)
