"""`python -m jaxllmq.main` run in the test process: no interpreter, jax and compilation cache to
start (about 8 s of a subprocess's 12 on 2 cores), and what the run prints, as a subprocess's
result. For what only a process shows (signals, the exit of the interpreter, logging handlers
that write to the real stderr) the tests still start one."""

import contextlib
import io
import subprocess
import sys
from unittest import mock

from jaxllmq.cli import train


def train_here(*args: str) -> subprocess.CompletedProcess:
    """Run the training command's main() with `args`; its exit status, stdout and stderr. A
    message given to sys.exit goes to stderr with status 1, as Python itself does."""
    argv = ["jaxllmq.main", *args]
    out, err = io.StringIO(), io.StringIO()
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        mock.patch.object(sys, "argv", argv),  # what the run records and locks under
    ):
        try:
            train.main(argv)
            status = 0
        except SystemExit as e:
            status = e.code or 0
    if isinstance(status, str):
        print(status, file=err)
        status = 1
    return subprocess.CompletedProcess(argv, status, out.getvalue(), err.getvalue())
