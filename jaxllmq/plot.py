"""Training curves from one or more run logs: `python -m jaxllmq.plot LOG [LOG ...] --out=curves.png`.

Panels: train loss (raw, faint, and an exponential moving average) with eval loss, learning rate,
grad norm and tokens/s, against step (default) or against tokens trained (`--x=tokens`). Several
runs are overlaid, one color each, named by their file (or `--names`).

Reads jaxllmq's JSON Lines log (one record per line, each with `log` (kind), `time` and `step`) and
llmq's log (its TrainingRunLogger's): one JSON array, one record per line, rewritten after each
record so it stays valid. llmq's records carry `log` (kind), `time` (a date string) and `step`; a
"step" record has `loss`, `norm`, `lr`, `step_tokens`, `duration_ms` (and `epoch`; some versions
`lse_max`, `lse_mean`), an "eval" record `loss`, `eval_tokens`, `duration_ms`. Tokens/s is
step_tokens over duration_ms where a record has no `tokens_per_s`. Records of other kinds (cmd,
option, dataset, gpu, ...), and keys a log lacks, are skipped, so a panel a log has no data for is
left without that run's line.
"""

import dataclasses
import json
import math
import os
import re
from collections.abc import Sequence

import numpy as np

from jaxllmq.setting import Settings, setting


class PlotError(ValueError):
    """Logs the plot cannot draw (missing, without step records, more or fewer names)."""


@dataclasses.dataclass(frozen=True)
class PlotConfig(Settings):
    """Plot: where the PNG goes, and how the curves are drawn."""

    out: str = setting("curves.png", "Where to write the PNG.")
    names: tuple[str, ...] = setting(
        (), "Run names for the legend, one per log, comma-separated (default: file)."
    )
    x: str = setting("step", "The x-axis: step or tokens trained.", choices=("step", "tokens"))
    smooth: float = setting(
        0.9, "EMA weight of the smoothed train loss (0 = none).", lower=0.0, upper=1.0
    )
    width: float = setting(12.0, "Figure width in inches.", lower=1.0)
    height: float = setting(8.0, "Figure height in inches.", lower=1.0)
    dpi: int = setting(100, "Dots per inch of the PNG.", lower=10)


@dataclasses.dataclass
class Series:
    """One run's curves, as arrays over its step records (eval over its eval records)."""

    name: str
    step: np.ndarray
    tokens: np.ndarray  # tokens trained up to and including each step
    loss: np.ndarray
    norm: np.ndarray
    lr: np.ndarray
    tokens_per_s: np.ndarray
    eval_step: np.ndarray
    eval_tokens: np.ndarray  # tokens trained at each eval's step
    eval_loss: np.ndarray


def _num(x) -> float:
    """A record's value as a float; NaN for missing or non-numeric ("NaN" strings read back)."""
    if x is None or isinstance(x, bool):
        return math.nan
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


# llmq formats floats with fmt, which writes non-finite ones as bare nan / -nan / inf / -inf: not
# JSON. Values only (after a colon, before , } or ]), so text inside strings is left alone.
_FMT_NONFINITE = re.compile(r"(?<=:)(\s*)(-?)(nan|inf)(?=\s*[,}\]])")


def _json_nonfinite(m: re.Match) -> str:
    space, sign, word = m.groups()
    return space + ("NaN" if word == "nan" else sign + "Infinity")


def read_records(path: str) -> list[dict]:
    """The records of a log: a JSON array (llmq) or JSON Lines (jaxllmq). A line that does not
    parse (a torn last record from a crash) is skipped."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):
        text = _FMT_NONFINITE.sub(_json_nonfinite, text)
        try:
            return [r for r in json.loads(text) if isinstance(r, dict)]
        except json.JSONDecodeError:
            # Cut short by a crash, or a record llmq wrote with an unescaped string (it formats
            # strings into JSON as they are): read it as llmq writes it, a record per line.
            pass
    records = []
    for line in text.splitlines():
        line = line.strip().rstrip(",")
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return records


def load(path: str, name: str | None = None) -> Series:
    """One run's curves from its log; a resumed run's repeated steps keep their last record."""
    steps: dict[int, dict] = {}
    evals: dict[int, float] = {}
    for r in read_records(path):
        if "step" not in r:
            continue
        step = int(r["step"])
        if r.get("log") == "step":
            steps[step] = r
        elif r.get("log") == "eval":
            evals[step] = _num(r.get("loss"))
    order = sorted(steps)
    recs = [steps[s] for s in order]
    step_tokens = np.array([_num(r.get("tokens", r.get("step_tokens"))) for r in recs])
    tokens = np.nancumsum(step_tokens) if len(recs) else np.zeros(0)
    tps = []
    for r, t in zip(recs, step_tokens, strict=True):
        v = _num(r.get("tokens_per_s"))
        if math.isnan(v):
            ms = _num(r.get("duration_ms"))
            v = t / (ms / 1000) if ms > 0 else math.nan
        tps.append(v)
    eval_steps = sorted(evals)
    # Tokens at an eval: those trained by the last step record at or before it.
    idx = np.searchsorted(np.array(order), np.array(eval_steps), side="right") - 1
    eval_tokens = [tokens[i] if i >= 0 else 0.0 for i in idx]
    return Series(
        name=name or _default_names([path])[0],
        step=np.array(order, dtype=float),
        tokens=tokens,
        loss=np.array([_num(r.get("loss")) for r in recs]),
        norm=np.array([_num(r.get("norm")) for r in recs]),
        lr=np.array([_num(r.get("lr")) for r in recs]),
        tokens_per_s=np.array(tps),
        eval_step=np.array(eval_steps, dtype=float),
        eval_tokens=np.asarray(eval_tokens, dtype=float),
        eval_loss=np.array([evals[s] for s in eval_steps]),
    )


def ema(x: np.ndarray, weight: float) -> np.ndarray:
    """Bias-corrected exponential moving average (TensorBoard's smoothing); NaNs are skipped."""
    out = np.full_like(x, np.nan, dtype=float)
    acc, norm = 0.0, 0.0
    for i, v in enumerate(x):
        if math.isfinite(v):
            acc = weight * acc + (1 - weight) * v
            norm = weight * norm + (1 - weight)
        if norm > 0:
            out[i] = acc / norm
    return out


def _default_names(paths: Sequence[str]) -> list[str]:
    """The file name without extension, or its folder's name for the generic `log.jsonl`."""
    names = []
    for p in paths:
        stem = os.path.splitext(os.path.basename(p))[0]
        folder = os.path.basename(os.path.dirname(os.path.abspath(p)))
        names.append(folder if stem in ("log", "train") and folder else stem)
    if len(set(names)) < len(names):
        names = list(paths)  # ambiguous: the paths themselves
    return names


def load_runs(paths: Sequence[str], names: Sequence[str] = ()) -> list[Series]:
    """Each log's curves, named by `names` (default: by their files)."""
    if not paths:
        raise PlotError("give one or more log files: python -m jaxllmq.plot LOG [LOG ...]")
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise PlotError(f"no such log file: {', '.join(missing)}")
    names = names or _default_names(paths)
    if len(names) != len(paths):
        raise PlotError(f"--names has {len(names)} names for {len(paths)} logs")
    runs = [load(p, n) for p, n in zip(paths, names, strict=True)]
    for p, r in zip(paths, runs, strict=True):
        if not len(r.step):
            raise PlotError(f"{p}: no step records")
    return runs


def plot(
    runs: Sequence[Series],
    out: str,
    *,
    x: str = PlotConfig.x,
    smooth: float = PlotConfig.smooth,
    size: tuple[float, float] = (PlotConfig.width, PlotConfig.height),
    dpi: int = PlotConfig.dpi,
) -> None:
    """Draw the runs' curves into a PNG at `out` (matplotlib's Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=size, dpi=dpi, sharex=True)
    ax_loss, ax_lr, ax_norm, ax_tps = axes.flat
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, s in enumerate(runs):
        c = colors[i % len(colors)]
        xs = s.step if x == "step" else s.tokens
        exs = s.eval_step if x == "step" else s.eval_tokens
        raw_alpha = 0.3 if smooth > 0 else 1.0
        ax_loss.plot(xs, s.loss, color=c, alpha=raw_alpha, lw=0.8)
        if smooth > 0:
            ax_loss.plot(xs, ema(s.loss, smooth), color=c, lw=1.5, label=f"{s.name} train")
        else:
            ax_loss.lines[-1].set_label(f"{s.name} train")
        if len(s.eval_loss):
            ax_loss.plot(exs, s.eval_loss, "o--", color=c, ms=4, label=f"{s.name} eval")
        ax_lr.plot(xs, s.lr, color=c, label=s.name)
        ax_norm.plot(xs, s.norm, color=c, lw=0.8, label=s.name)
        ax_tps.plot(xs, s.tokens_per_s, color=c, lw=0.8, label=s.name)
    # Steps right after a compile, an eval or a checkpoint are timed short or long; keep the
    # y-axis on the steady state and say when points fall outside it.
    tps = np.concatenate([s.tokens_per_s[np.isfinite(s.tokens_per_s)] for s in runs])
    tps_title = "tokens/s"
    if len(tps) >= 10:
        top = 1.25 * np.percentile(tps, 90)
        if tps.max() > top:
            ax_tps.set_ylim(0, top)
            tps_title += " (outliers above the axis not shown)"
    titles = {
        ax_loss: "loss (faint: raw; solid: smoothed; dashed: eval)" if smooth > 0 else "loss",
        ax_lr: "learning rate",
        ax_norm: "grad norm (before clipping)",
        ax_tps: tps_title,
    }
    for ax, title in titles.items():
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    for ax in axes[1]:
        ax.set_xlabel("step" if x == "step" else "tokens trained")
    fig.tight_layout()
    parent = os.path.dirname(out)
    if parent:
        os.makedirs(parent, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)


if __name__ == "__main__":
    from jaxllmq.cli.plot import main

    main()
