"""python -m jaxllmq.plot LOG [LOG ...] --out=curves.png: training curves (jaxllmq/plot.py)."""

import sys

from absl import app

from jaxllmq import plot
from jaxllmq.cli import flags


def run(argv: list[str]) -> None:
    cfg = flags.build_or_exit(plot.PlotConfig)
    try:
        runs = plot.load_runs(argv[1:], cfg.names)
    except plot.PlotError as e:
        sys.exit(f"error: {e}")
    size = (cfg.width, cfg.height)
    plot.plot(runs, cfg.out, x=cfg.x, smooth=cfg.smooth, size=size, dpi=cfg.dpi)
    print(f"wrote {cfg.out}")


def main(argv: list[str] | None = None) -> None:
    flags.define(plot.PlotConfig)
    app.run(run, argv, flags_parser=flags.parse_argv)
