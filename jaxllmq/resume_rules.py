"""What a changed flag means for a resume: the saved settings a resume may not change (they give
the saved state its meaning or structure), and the harmless changes, listed for the log."""

from __future__ import annotations

import json
from typing import Any

from jaxllmq.checkpoint_files import CheckpointError, Saved

# Saved values that give the state its meaning: a resume that changes them is refused.
MEANING = {
    ("model", "model_dtype"): "--model_dtype",
    ("optim", "opt_m_dtype"): "--opt_m_dtype",
    ("optim", "opt_v_dtype"): "--opt_v_dtype",
    ("model", "fp8_scaling"): "--fp8_scaling",
}
# On/off switches that add or remove a part of the optimizer state.
STRUCTURE = {("optim", "grad_clip"): "--grad_clip", ("optim", "weight_decay"): "--weight_decay"}
# How this process was asked to resume, and where its peers meet: not a change of the run.
_IGNORED = {("ckpt", "continue_from"), ("ckpt", "new_data"), ("mesh", "coordinator_address")}
_FLAG_NAMES = {"train_files": "train_file", "eval_files": "eval_file"}


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
    for key, flag in MEANING.items():
        if key in old and old[key] != new.get(key):
            raise CheckpointError(
                f"{where} was saved with {flag}={old[key]}, this run has {flag}={new.get(key)}, "
                "which changes what the saved state means; resume with the saved value, or start "
                "a new run from an export of it (python -m jaxllmq.export)"
            )
    for key, flag in STRUCTURE.items():
        if key in old and (old[key] > 0) != (new.get(key, 0) > 0):
            on = old[key] > 0
            raise CheckpointError(
                f"{where} was saved with {flag}={old[key]}, this run has {flag}={new.get(key)}: "
                f"switching it {'off' if on else 'on'} changes the optimizer state's structure; "
                f"resume with {flag} {'> 0' if on else '= 0'}"
            )
    return [
        f"--{_FLAG_NAMES.get(key[-1], key[-1])}: {old.get(key)!r} -> {new.get(key)!r}"
        for key in sorted(old.keys() | new.keys(), key=str)
        if key not in _IGNORED and old.get(key) != new.get(key)
    ]
