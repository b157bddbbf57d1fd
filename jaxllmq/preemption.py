"""Preemption: SIGTERM / SIGINT (or, across processes, jax's preemption notice) ends a run
with a checkpoint at the step where every process stops."""

from __future__ import annotations

import signal
import threading
from typing import Any

import jax
from jax.experimental import multihost_utils


class Preemption:
    """SIGTERM / SIGINT: the host loop finishes the current step, checkpoints and exits.

    One process: our own handler notes the signal (a second one stops at once). Several
    processes (jax.distributed initialized): jax's preemption sync point, where every process
    agrees on the step to stop at; it needs `reached(step)` called at every step.
    """

    def __init__(self) -> None:
        self.signal: str | None = None
        self._old: dict[int, Any] = {}
        self._multi = False

    def install(self) -> None:
        """Start listening (the trainer calls this when it can checkpoint)."""
        if jax.process_count() > 1:
            self._multi = True  # jax's preemption notifier owns SIGTERM
            return
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is not None:  # asked twice: stop now, the default way
            self.uninstall()
            signal.raise_signal(signum)
            return
        self.signal = signal.Signals(signum).name

    def reached(self, step: int) -> bool:
        """Whether to stop after `step` (all processes agree on it)."""
        if self._multi:
            if multihost_utils.reached_preemption_sync_point(step):
                self.signal = self.signal or "a preemption notice"
                return True
            return False
        return self.signal is not None

    def uninstall(self) -> None:
        """Give SIGTERM and SIGINT back to the handlers they had."""
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}
