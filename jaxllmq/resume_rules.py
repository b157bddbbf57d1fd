"""What a changed flag means for a resume: the saved settings a resume may not change (they give
the saved state its meaning or structure), and the harmless changes, listed for the log."""

from __future__ import annotations

import json
from typing import Any

from jaxllmq.checkpoint_files import CheckpointError, Saved
from jaxllmq.setting import Resume, entries
from jaxllmq.settings import TrainConfig

# Each setting's resume policy and flag, by its path in TrainConfig (jaxllmq/settings.py).
_SETTINGS = {entry.path: entry for entry in entries(TrainConfig)}


def _flag(key: tuple) -> str:
    entry = _SETTINGS.get(key)
    return f"--{entry.flag if entry else key[-1]}"


def _policy(key: tuple) -> Resume:
    entry = _SETTINGS.get(key)
    return entry.meta.resume if entry else Resume.FREE


def _flatten(d: dict, prefix: tuple = ()) -> dict[tuple, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, (*prefix, k)))
        else:
            out[(*prefix, k)] = v
    return out


def check_resume(saved: Saved, config: dict, model: dict) -> list[str]:
    """Compare a checkpoint's run with this one's (TrainConfig as a dict, the HF model dict).

    Raises CheckpointError on a change of meaning: another model, parameter or moment dtypes,
    an optimizer part switched on or off. Returns the harmless changes (lr, steps, eval
    cadence, data, devices, ...) as "--flag: old -> new" for the log.
    """
    where = f"--continue: checkpoint {saved.path}"
    if saved.model != model:
        keys = sorted(
            k for k in saved.model.keys() | model.keys() if saved.model.get(k) != model.get(k)
        )
        diff = ", ".join(f"{k} {saved.model.get(k)!r} -> {model.get(k)!r}" for k in keys[:4])
        raise CheckpointError(
            f"{where} holds another model ({diff}); resume with the --model it was saved with, "
            "or start a new run from an export of it (python -m jaxllmq.export)"
        )
    old = _flatten(saved.run.get("config", {}))
    new = _flatten(json.loads(json.dumps(config)))
    for key in sorted(old, key=str):
        flag, policy = _flag(key), _policy(key)
        if policy is Resume.MEANING and old[key] != new.get(key):
            raise CheckpointError(
                f"{where} was saved with {flag}={old[key]}, this run has {flag}={new.get(key)}, "
                "which changes what the saved state means; resume with the saved value, or start "
                "a new run from an export of it (python -m jaxllmq.export)"
            )
        if policy is Resume.STRUCTURE and (old[key] > 0) != (new.get(key, 0) > 0):
            on = old[key] > 0
            raise CheckpointError(
                f"{where} was saved with {flag}={old[key]}, this run has {flag}={new.get(key)}: "
                f"switching it {'off' if on else 'on'} changes the optimizer state's structure; "
                f"resume with {flag} {'> 0' if on else '= 0'}"
            )
    return [
        f"{_flag(key)}: {old.get(key)!r} -> {new.get(key)!r}"
        for key in sorted(old.keys() | new.keys(), key=str)
        if _policy(key) is not Resume.SESSION and old.get(key) != new.get(key)
    ]
