"""Run logging: the JSON Lines log (one record per line, each with its kind, time and step), the
console line per step with a progress bar on a terminal, MFU, and loss / grad-norm outlier
messages by running z-score.

Dependency-free on purpose (stdlib + numpy): the host loop calls it with Python floats, and tools
(plot, bench) can read what it writes without jax. The optional TensorBoard and W&B sinks import
tensorboardX / wandb only when asked for.
"""

import collections
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from typing import IO, Any

import numpy as np

OUTLIER_METRICS = ("loss", "norm")


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float) -> float:
    """Model FLOPs utilization: flops_per_token * tokens_per_s / peak_flops (0 if no peak)."""
    if peak_flops <= 0:
        return 0.0
    return flops_per_token * tokens_per_s / peak_flops


def _clean(x: Any) -> Any:
    """A JSON-ready copy of `x`: numpy/jax scalars and arrays to Python values, tuples to lists,
    dataclasses to dicts, and non-finite floats to the strings "NaN", "Infinity", "-Infinity"
    (plain JSON has no NaN; Python's float() reads these strings back)."""
    if isinstance(x, bool | int | str) or x is None:
        return x
    if isinstance(x, float):
        if math.isfinite(x):
            return x
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple | set | frozenset):
        return [_clean(v) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _clean(dataclasses.asdict(x))
    if isinstance(x, np.generic) or hasattr(x, "__array__"):
        return _clean(np.asarray(x).tolist())
    if isinstance(x, os.PathLike):
        return os.fspath(x)
    return str(x)


def _fmt_rate(tokens_per_s: float) -> str:
    if tokens_per_s >= 1e6:
        return f"{tokens_per_s / 1e6:.2f}M"
    if tokens_per_s >= 1e3:
        return f"{tokens_per_s / 1e3:.1f}k"
    return f"{tokens_per_s:.0f}"


def _fmt_duration(seconds: float) -> str:
    s = max(int(round(seconds)), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


class _ZScore:
    """Running mean and std of the last `window` finite values; scores a new value against them."""

    def __init__(self, window: int):
        self.values: collections.deque[float] = collections.deque(maxlen=window)

    def score(self, x: float) -> tuple[float, float, float] | None:
        """(z, mean, std) of x against the history before it, or None if that says nothing."""
        if len(self.values) < 2:
            return None
        mean = statistics.fmean(self.values)
        std = statistics.pstdev(self.values, mean)
        # A constant history (std ~ 0) would make any change infinitely surprising: no score.
        if std <= 1e-12 * max(1.0, abs(mean)):
            return None
        return (x - mean) / std, mean, std


class MissingExtraError(ImportError):
    """A flag needs an optional package that is not installed; the message says what to install."""


def _tensorboard_writer(logdir: str) -> Any:
    """A tensorboardX SummaryWriter on `logdir`, or an error that says what to install."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError as e:
        raise MissingExtraError(
            "--tensorboard_dir needs tensorboardX: pip install 'jaxllmq[tensorboard]' "
            "(or pip install tensorboardX)"
        ) from e
    # Flush every 30 s: TensorBoard shows a live run, and a crash loses at most that much.
    return SummaryWriter(logdir=logdir, flush_secs=30)


def _wandb_run(project: str, name: str | None, config: dict | None) -> Any:
    """A W&B run in `project`, or an error that says what to install."""
    try:
        import wandb
    except ImportError as e:
        raise MissingExtraError(
            "--wandb_project needs wandb: pip install 'jaxllmq[wandb]' (or pip install wandb)"
        ) from e
    return wandb.init(project=project, name=name, config=_clean(config or {}))


class RunLog:
    """The run's console output and JSON Lines log; only the main process writes either.

    `step` is the number of the step just finished, counted from 1, so `step == total_steps` is
    the last. The JSONL file is opened for append (a resumed run continues it), and each record
    is one whole line written with a single write, so the file stays valid after a crash.
    `peak_flops` is all devices' dense bf16 peak (jaxllmq/peaks.py), 0 where it is unknown (no
    MFU then); `peak_flops_fp8` their fp8 peak for an fp8 run (its steps also get `mfu_fp8`).
    """

    def __init__(
        self,
        log_file: str | None,
        *,
        total_steps: int,
        flops_per_token: float,
        peak_flops: float = 0.0,
        peak_flops_fp8: float = 0.0,
        is_main: bool = True,
        stream: IO[str] | None = None,
        outlier_window: int = 100,
        outlier_warmup: int = 20,
        outlier_z: float = 4.0,
        eta_window: int = 20,
        tensorboard_dir: str | None = None,
        wandb_project: str | None = None,
        run_name: str | None = None,
        run_config: dict | None = None,
    ):
        self.total_steps = total_steps
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.peak_flops_fp8 = peak_flops_fp8
        self.is_main = is_main
        self.stream = sys.stdout if stream is None else stream
        self.outlier_warmup = max(outlier_warmup, 2)
        self.outlier_z = outlier_z
        self._detectors = {m: _ZScore(outlier_window) for m in OUTLIER_METRICS}
        # Median of recent step times: robust to the first step's compile and to eval pauses.
        self._durations: collections.deque[float] = collections.deque(maxlen=eta_window)
        isatty = getattr(self.stream, "isatty", None)
        self._tty = bool(isatty and isatty())
        self._bar: str | None = None  # the progress line now on the terminal, if any
        self._fd: int | None = None
        if is_main and log_file:
            parent = os.path.dirname(log_file)
            if parent:
                os.makedirs(parent, exist_ok=True)
            self._fd = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            self._end_partial_line(log_file)
        self._tb = _tensorboard_writer(tensorboard_dir) if is_main and tensorboard_dir else None
        self._wandb = None
        if is_main and wandb_project:
            self._wandb = _wandb_run(wandb_project, run_name, run_config)

    def _end_partial_line(self, path: str) -> None:
        # A crash in the middle of a write (or a copy cut short) can leave a last line without
        # its newline; end it so the records this run appends stay on lines of their own.
        size = os.path.getsize(path)
        if size:
            with open(path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    self._write(b"\n")

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    # --- records ------------------------------------------------------------------------------

    def record(self, kind: str, step: int, **fields: Any) -> None:
        """Append one JSON record {"log": kind, "time": unix seconds, "step": step, **fields}."""
        if self._fd is None:
            return
        rec = {"log": kind, "time": time.time(), "step": step, **fields}
        line = json.dumps(_clean(rec), allow_nan=False, ensure_ascii=False) + "\n"
        self._write(line.encode())

    def step(
        self,
        step: int,
        *,
        loss: float,
        norm: float,
        lr: float,
        tokens: int,
        duration_ms: float,
        **extra: Any,
    ) -> None:
        """Log one training step: the JSONL `step` record, the console line, outlier messages."""
        if not self.is_main:
            return
        tokens_per_s = tokens / (duration_ms / 1000) if duration_ms > 0 else 0.0
        util = mfu(self.flops_per_token, tokens_per_s, self.peak_flops)
        if self.peak_flops_fp8 > 0:  # fp8 runs: against the fp8 peak too
            extra["mfu_fp8"] = mfu(self.flops_per_token, tokens_per_s, self.peak_flops_fp8)
        self.record(
            "step",
            step,
            loss=loss,
            norm=norm,
            lr=lr,
            tokens=tokens,
            duration_ms=duration_ms,
            tokens_per_s=tokens_per_s,
            mfu=util if self.peak_flops > 0 else None,
            **extra,
        )
        scalars = {"loss": loss, "norm": norm, "lr": lr, "tokens_per_s": tokens_per_s}
        if self.peak_flops > 0:
            scalars["mfu"] = util
        self._scalars("train", step, scalars)
        if duration_ms > 0:
            self._durations.append(duration_ms / 1000)
        eta = statistics.median(self._durations) * max(self.total_steps - step, 0)
        parts = [
            f"step {step}/{self.total_steps}",
            f"loss {loss:.4f}",
            f"norm {norm:.3f}",
            f"lr {lr:.2e}",
            f"{_fmt_rate(tokens_per_s)} tok/s",
        ]
        if self.peak_flops > 0:
            parts.append(f"MFU {100 * util:.1f}%")
        parts.append(f"ETA {_fmt_duration(eta)}" if self._durations else "ETA ?")
        line = " | ".join(parts)
        if self._tty:
            frac = min(max(step / max(self.total_steps, 1), 0.0), 1.0)
            filled = int(round(20 * frac))
            self._bar = f"[{'#' * filled}{'.' * (20 - filled)}] {line}"
            self.stream.write(f"\r{self._bar}\x1b[K")
            self.stream.flush()
        else:
            self._print(line)
        self._check_outliers(step, loss=loss, norm=norm)

    def _check_outliers(self, step: int, **values: float) -> None:
        for metric, value in values.items():
            if not math.isfinite(value):
                continue  # skipped steps are the trainer's message; keep them out of the stats
            det = self._detectors[metric]
            scored = det.score(value) if len(det.values) >= self.outlier_warmup else None
            # The value joins the history either way: a lasting shift stops being flagged once
            # the window has absorbed it.
            det.values.append(float(value))
            if scored is None or abs(scored[0]) <= self.outlier_z:
                continue
            z, mean, std = scored
            n = len(det.values) - 1
            message = (
                f"step {step}: {metric} outlier {value:.4g} (z-score {z:+.1f} against "
                f"mean {mean:.4g}, std {std:.3g} of the last {n} steps)"
            )
            self.info(step, message, metric=metric, value=value, z=z, mean=mean, std=std)

    def eval(self, step: int, *, loss: float, tokens: int, **extra: Any) -> None:
        """Log an evaluation: the JSONL `eval` record and a console line."""
        self.record("eval", step, loss=loss, tokens=tokens, **extra)
        self._scalars("eval", step, {"loss": loss})
        if self.is_main:
            self._print(f"eval step {step}/{self.total_steps} | loss {loss:.4f} | {tokens} tokens")

    def sample(self, step: int, *, prompt: str, text: str) -> None:
        """Log a sampled continuation: the JSONL `sample` record and a console line."""
        self.record("sample", step, prompt=prompt, text=text)
        if self.is_main:
            self._print(f"sample step {step} | {prompt + text!r}")

    def info(self, step: int, message: str, **extra: Any) -> None:
        """Log a message: the JSONL `info` record and a console line."""
        self.record("info", step, message=message, **extra)
        if self.is_main:
            self._print(message)

    def _scalars(self, prefix: str, step: int, values: dict[str, float]) -> None:
        # Charts break on NaN/inf; the JSONL keeps them.
        finite = {f"{prefix}/{k}": v for k, v in values.items() if math.isfinite(v)}
        if self._tb is not None:
            for tag, value in finite.items():
                self._tb.add_scalar(tag, value, step)
        if self._wandb is not None and finite:
            self._wandb.log(finite, step=step)

    def _print(self, text: str) -> None:
        # On a terminal, a permanent line goes above the progress bar, which is then redrawn.
        if self._tty and self._bar is not None:
            self.stream.write(f"\r\x1b[K{text}\n{self._bar}")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    # --- checkpointed state -------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The outlier detector's history (JSON-serializable), for checkpoints."""
        return {m: list(d.values) for m, d in self._detectors.items()}

    def load_state_dict(self, d: dict) -> None:
        """Restore what `state_dict` returned, so a resumed run flags outliers as the first would."""
        for m, det in self._detectors.items():
            det.values.clear()
            det.values.extend(float(v) for v in d.get(m, []))

    def close(self) -> None:
        """End the progress line and close the log file."""
        if self._tty and self._bar is not None:
            self.stream.write("\n")
            self.stream.flush()
            self._bar = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> "RunLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
