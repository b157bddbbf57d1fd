"""Export a checkpoint's parameters as a Hugging Face model directory, without training.

    python -m jaxllmq.export --checkpoint=DIR[/STEP] --out_dir=OUT [--dtype=bfloat16]

DIR alone means its newest complete checkpoint (an older one if the newest is damaged). The
model is rebuilt from the config the checkpoint holds, its parameters are read onto the CPU, and
OUT gets config.json + safetensors + the tokenizer files, as the trainer's --out_dir does.
"""

import dataclasses
import os
import sys
from collections.abc import Sequence

import jax

from jaxllmq import checkpoint_files
from jaxllmq.dtypes import DTYPES
from jaxllmq.memory import check_loadable
from jaxllmq.model import hf
from jaxllmq.model.architecture import ModelConfig
from jaxllmq.model.llama import abstract_model
from jaxllmq.setting import DTYPE_SPELLINGS, SettingError, Settings, setting


@dataclasses.dataclass(frozen=True)
class ExportConfig(Settings):
    """Export: which checkpoint, and where its Hugging Face model directory goes."""

    checkpoint: str = setting(None, "A checkpoint DIR/STEP, or DIR (its newest).")
    out_dir: str = setting(None, "Where the HF model directory goes.")
    tokenizer_dir: str | None = setting(
        None, "Copy tokenizer files from here (default: as the run did)."
    )
    dtype: str | None = setting(
        None, "dtype on disk (default: trained).", choices=tuple(DTYPES), spellings=DTYPE_SPELLINGS
    )

    def check(self) -> None:
        for flag in ("checkpoint", "out_dir"):
            if getattr(self, flag) is None:
                raise SettingError(f"--{flag} is required")


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


if __name__ == "__main__":
    from jaxllmq.cli.export import main

    main()
