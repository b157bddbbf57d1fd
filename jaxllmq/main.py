"""python -m jaxllmq.main --flagfile=configs/X.flags [--flag=value ...]: the training command
(jaxllmq/cli/train.py)."""

from jaxllmq.cli.train import main

if __name__ == "__main__":
    main()
