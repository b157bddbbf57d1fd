"""Export a checkpoint's parameters as a Hugging Face model directory, without training.

    python -m jaxllmq.export --checkpoint=DIR[/STEP] --out_dir=OUT [--dtype=bfloat16]

DIR alone means its newest complete checkpoint (an older one if the newest is damaged). The
model is rebuilt from the config the checkpoint holds, its parameters are read onto the CPU, and
OUT gets config.json + safetensors + the tokenizer files, as the trainer's --out_dir does.
"""

import os
import sys
from collections.abc import Sequence

import jax
from absl import app, flags

from jaxllmq import checkpoint_files, runlock
from jaxllmq.atomic_dir import AtomicDirError
from jaxllmq.dtypes import DTYPES
from jaxllmq.memory import check_loadable
from jaxllmq.model import ModelConfigError, hf
from jaxllmq.model.architecture import ModelConfig
from jaxllmq.model.llama import abstract_model


def tokenizer_dir(model: str, train_files: Sequence[str]) -> str | None:
    """Where a run's tokenizer files are: its source model's directory, else its data's."""
    source = model if os.path.isdir(model) else None
    if source is None or not os.path.isfile(os.path.join(source, "tokenizer.json")):
        data_dir = os.path.dirname(train_files[0]) if train_files else ""
        if data_dir and os.path.isfile(os.path.join(data_dir, "tokenizer.json")):
            source = data_dir
    return source


def load_checkpoint(spec: str) -> tuple[str, ModelConfig, dict, dict]:
    """(path, model config, params on the CPU, run config) of checkpoint `spec` (DIR[/STEP])."""
    root, steps, fallback = checkpoint_files.resolve_path(spec)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    for i, step in enumerate(steps):
        path = os.path.join(root, str(step))
        try:
            saved = checkpoint_files.read_json_items(path)
            model_cfg = ModelConfig.from_hf_dict(saved.model, source=f"{path}/model")
            run = saved.run["config"]
            dtype = DTYPES[run["model"]["model_dtype"]]
            check_loadable(model_cfg, f"{path}/model", dtype, jax.devices("cpu")[0])
            _, abstract, _ = abstract_model(model_cfg, param_dtype=dtype)
            target = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu), abstract
            )
            return path, model_cfg, checkpoint_files.restore_params(path, target), run
        except checkpoint_files.DamagedCheckpointError as e:
            if not fallback or i == len(steps) - 1:
                raise
            print(f"{e}; reading the checkpoint before it", file=sys.stderr)
    raise AssertionError("unreachable: resolve_path returns at least one step")


def export_checkpoint(
    spec: str, out_dir: str, *, tokenizer: str | None = None, dtype: str | None = None
) -> str:
    """Write checkpoint `spec` (DIR or DIR/STEP) to `out_dir` in HF format; returns its path."""
    path, model_cfg, params, run = load_checkpoint(spec)
    source = tokenizer or tokenizer_dir(run["model"]["model"], run["data"]["train_files"])
    hf.save_hf(
        out_dir, model_cfg, params, dtype=DTYPES[dtype] if dtype else None, tokenizer_dir=source
    )
    return path


def _define_flags() -> dict[str, flags.FlagHolder]:
    # Only when run as the CLI: the trainer imports this module beside its own --out_dir flag.
    return {
        "checkpoint": flags.DEFINE_string(
            "checkpoint", None, "A checkpoint DIR/STEP, or DIR (its newest)."
        ),
        "out_dir": flags.DEFINE_string("out_dir", None, "Where the HF model directory goes."),
        "tokenizer_dir": flags.DEFINE_string(
            "tokenizer_dir", None, "Copy tokenizer files from here (default: as the run did)."
        ),
        "dtype": flags.DEFINE_enum(
            "dtype", None, list(DTYPES), "dtype on disk (default: trained)."
        ),
    }


def main(argv: list[str], flag: dict[str, flags.FlagHolder]) -> None:
    if len(argv) > 1:
        sys.exit(f"error: unexpected arguments {argv[1:]} (flags are --name=value)")
    out_dir = flag["out_dir"].value
    try:
        with runlock.RunLock([("--out_dir", out_dir)], sys.argv) as lock:
            for note in lock.notes:  # stale locks taken over
                print(note)
            path = export_checkpoint(
                flag["checkpoint"].value,
                out_dir,
                tokenizer=flag["tokenizer_dir"].value,
                dtype=flag["dtype"].value,
            )
    except (
        checkpoint_files.CheckpointError,
        ModelConfigError,
        AtomicDirError,
        runlock.RunLockError,
    ) as e:
        sys.exit(f"error: {e}")
    print(f"exported {path} to {out_dir}")


if __name__ == "__main__":
    _flag = _define_flags()
    flags.mark_flags_as_required(["checkpoint", "out_dir"])
    app.run(lambda argv: main(argv, _flag))
