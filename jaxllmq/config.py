"""Flags -> one frozen TrainConfig. Only main.py reads absl's FLAGS; everything below takes this."""

import dataclasses
import os
import re
import sys
from collections.abc import Sequence

from absl import flags, logging

from jaxllmq.data.shards import expand_files
from jaxllmq.kernels import parse_kernels
from jaxllmq.model.architecture import PRESETS, ModelConfig
from jaxllmq.model.recompute import Recompute
from jaxllmq.offload import Offload
from jaxllmq.optim import OptimConfig

DTYPES = ("float32", "bfloat16")
# llmq's fp8 matmul dtype: activations in bfloat16, the block linears' GEMMs in fp8.
FP8_MATMUL = ("e4m3",)
FP8_GRADIENT = ("e4m3", "e5m2")
SCHEDULES = ("cosine", "linear", "wsd")
FP8_SCALINGS = ("current", "delayed")

# ---- flag definitions (llmq's names and meanings, absl spelling; the dashed one works too) ----

_model = flags.DEFINE_string(
    "model",
    None,
    "Hugging Face model directory (config.json + safetensors), or with --from_scratch a preset: "
    + ", ".join(PRESETS),
)
_from_scratch = flags.DEFINE_bool(
    "from_scratch", False, "Random init from --model's config (a preset or an HF directory)."
)
_model_dtype = flags.DEFINE_enum(
    "model_dtype", "float32", DTYPES, "dtype of the master weights (what the optimizer updates)."
)
_matmul_dtype = flags.DEFINE_enum(
    "matmul_dtype",
    "bfloat16",
    DTYPES + FP8_MATMUL,
    "dtype of activations and matmuls (fp32 accumulation); e4m3: bfloat16 activations, the "
    "block linears (q/k/v/o/gate/up/down) in fp8 with per-tensor scaling, LM head and "
    "attention in bfloat16.",
)
_gradient_dtype = flags.DEFINE_enum(
    "gradient_dtype",
    None,
    DTYPES + FP8_GRADIENT,
    "dtype of the output gradients in the backward matmuls (default: --matmul_dtype's); with "
    "--matmul_dtype=e4m3, e5m2 trades mantissa for range.",
)
_fp8_scaling = flags.DEFINE_enum(
    "fp8_scaling",
    "current",
    FP8_SCALINGS,
    "With --matmul_dtype=e4m3, where each fp8 operand's per-tensor scale comes from: its own "
    "abs-max this step (current), or the max over the last --fp8_amax_history steps' abs-maxes, "
    "kept in the train state and checkpoints (delayed; the quantize can fuse into the producer).",
)
_fp8_amax_history = flags.DEFINE_integer(
    "fp8_amax_history", 16, "--fp8_scaling=delayed: steps of abs-max history per fp8 operand."
)
_init_proj_to_zero = flags.DEFINE_bool(
    "init_proj_to_zero",
    False,
    "From scratch: zero-init o_proj and down_proj (blocks start as identity).",
)
_scan_layers = flags.DEFINE_bool(
    "scan_layers", True, "Scan over stacked layers (flat compile time) instead of unrolling them."
)
_recompute = {
    name: flags.DEFINE_bool(f"recompute_{name}", False, help)
    for name, help in (
        ("swiglu", "Recompute the SwiGLU product in backward instead of storing it."),
        ("norm", "Recompute the RMSNorm outputs in backward."),
        ("ffn", "Recompute the MLP's gate/up projections (implies --recompute_swiglu)."),
        ("qkv", "Recompute the q/k/v projections in backward."),
        ("att", "Recompute the attention output (implies --recompute_qkv)."),
        ("block", "Recompute whole layers, keeping only their inputs (implies att, ffn, norm)."),
    )
}
_offload = {
    name: flags.DEFINE_bool(f"offload_{name}", False, help)
    for name, help in (
        ("master", "Keep the master weights in pinned host memory, streamed in layer by layer."),
        ("opt_m", "Keep AdamW's first moment in pinned host memory, streamed for the update."),
        ("opt_v", "Keep AdamW's second moment in pinned host memory, streamed for the update."),
        ("residual", "Offload the residual stream kept for the backward pass to host memory."),
    )
}
_attention = flags.DEFINE_enum(
    "attention",
    "auto",
    ("auto", "xla", "cudnn"),
    "Attention kernel; auto = cuDNN on GPU in bf16 (XLA's with --deterministic).",
)
_deterministic = flags.DEFINE_bool(
    "deterministic",
    False,
    "Bit-identical runs on GPU (CPU runs are already): XLA's deterministic ops and XLA's "
    "attention (cuDNN's crashes under them in jax 0.11.2). 2-2.5x slower on the 1B step; "
    "XLA's attention keeps the [batch, heads, seq, seq] scores, so large batches need "
    "--recompute_att (docs/PERFORMANCE.md).",
)
_kernels = flags.DEFINE_string(
    "kernels",
    "auto",
    "Fused Pallas kernels (rms_norm, lm_head_loss, fp8_quantize) or XLA: auto|pallas|xla for "
    "all, or per kernel, e.g. rms_norm=pallas,lm_head_loss=xla; auto = what measured faster on "
    "one GPU, or on several (there the RMSNorm in XLA; all XLA under tensor parallelism). "
    "lm_head_loss=mosaic: its kernel in Mosaic GPU (bf16, tile-aligned shapes), auto's choice on "
    "Hopper GPUs.",
)
_lmhead_chunks = flags.DEFINE_integer(
    "lmhead_chunks",
    1,
    "Compute the LM-head loss over at least this many token chunks (saves memory; the Pallas "
    "loss uses chunks of at most 8192 tokens anyway and never holds the logits).",
    lower_bound=1,
)
_batch_size = flags.DEFINE_integer(
    "batch_size", 4, "Micro-batch size per device (rows of --seq_len tokens).", lower_bound=1
)
_seq_len = flags.DEFINE_integer("seq_len", 1024, "Tokens per row.", lower_bound=1)
_allow_seq_len_beyond_max_position = flags.DEFINE_bool(
    "allow_seq_len_beyond_max_position",
    False,
    "Train with --seq_len above the model's max_position_embeddings (positions it was not made "
    "for); without it such a --seq_len is refused.",
)
_grad_accumulation = flags.DEFINE_integer(
    "grad_accumulation", 1, "Micro-batches per optimizer step.", lower_bound=1
)
_steps = flags.DEFINE_integer(
    "steps", None, "Optimizer steps to train (or use --epochs).", lower_bound=1
)
_epochs = flags.DEFINE_integer(
    "epochs",
    None,
    "Passes over --train_file (or use --steps); partial batches dropped.",
    lower_bound=1,
)
_lr = flags.DEFINE_float("lr", 3e-4, "Peak learning rate.", lower_bound=0.0)
_warmup = flags.DEFINE_integer("warmup", 0, "Linear warmup steps.", lower_bound=0)
_cooldown = flags.DEFINE_integer(
    "cooldown", 0, "1-sqrt anneal over the last N steps.", lower_bound=0
)
_final_lr_fraction = flags.DEFINE_float(
    "final_lr_fraction", 0.0, "Final lr as a fraction of --lr.", lower_bound=0.0, upper_bound=1.0
)
_lr_schedule = flags.DEFINE_enum(
    "lr_schedule", "cosine", SCHEDULES, "Decay after warmup: cosine, linear, or wsd (constant)."
)
_beta_1 = flags.DEFINE_float("beta_1", 0.9, "AdamW beta1.", lower_bound=0.0, upper_bound=1.0)
_beta_2 = flags.DEFINE_float("beta_2", 0.95, "AdamW beta2.", lower_bound=0.0, upper_bound=1.0)
_adam_epsilon = flags.DEFINE_float("adam_epsilon", 1e-8, "AdamW epsilon.", lower_bound=0.0)
_weight_decay = flags.DEFINE_float(
    "weight_decay", 0.1, "Decoupled weight decay, on matrices only.", lower_bound=0.0
)
_grad_clip = flags.DEFINE_float(
    "grad_clip", 1.0, "Clip the global gradient norm to this (0 = off).", lower_bound=0.0
)
_z_loss = flags.DEFINE_float("z_loss", 0.0, "z-loss weight on logsumexp^2.", lower_bound=0.0)
_opt_m_dtype = flags.DEFINE_enum("opt_m_dtype", "float32", DTYPES, "AdamW first-moment dtype.")
_opt_v_dtype = flags.DEFINE_enum("opt_v_dtype", "float32", DTYPES, "AdamW second-moment dtype.")
_max_nonfinite = flags.DEFINE_integer(
    "max_nonfinite", 5, "Stop after this many consecutive non-finite-gradient steps.", lower_bound=1
)
_train_file = flags.DEFINE_string(
    "train_file", None, "Token shards (BIN.TOK) to train on: glob(s), comma-separated."
)
_eval_file = flags.DEFINE_string(
    "eval_file", None, "Token shards to evaluate on: glob(s), comma-separated."
)
_train_seed = flags.DEFINE_integer("train_seed", 42, "Seed for init and the training data order.")
_eval_seed = flags.DEFINE_integer("eval_seed", 0, "Seed for the evaluation data order.")
_eval_every_n_steps = flags.DEFINE_integer(
    "eval_every_n_steps", 100, "Evaluate every N steps (0 = only at the end).", lower_bound=0
)
_eval_num_steps = flags.DEFINE_integer(
    "eval_num_steps", 20, "Batches per periodic evaluation (the final one uses all).", lower_bound=1
)
_sample_every_n_steps = flags.DEFINE_integer(
    "sample_every_n_steps",
    0,
    "Log greedy continuations of --sample_prompts every N steps (0 = never); needs the tokenizer.",
    lower_bound=0,
)
_sample_prompts = flags.DEFINE_string(
    "sample_prompts",
    "def ,import ",
    "Prompts for --sample_every_n_steps: comma-separated, or a file with one prompt per line.",
)
_sample_max_new_tokens = flags.DEFINE_integer(
    "sample_max_new_tokens", 32, "Tokens generated per sample prompt.", lower_bound=1
)
_out_dir = flags.DEFINE_string(
    "out_dir", None, "Where the trained model is exported (HF format); %n = --name."
)
_log_file = flags.DEFINE_string("log_file", None, "JSON Lines log (appended); %n = --name.")
_tensorboard_dir = flags.DEFINE_string(
    "tensorboard_dir",
    None,
    "Also write the step and eval scalars as TensorBoard event files here (needs the "
    "`tensorboard` extra: tensorboardX); %n = --name.",
)
_wandb_project = flags.DEFINE_string(
    "wandb_project",
    None,
    "Also log the step and eval scalars to this Weights & Biases project, the run named --name "
    "(needs the `wandb` extra; `wandb login` or WANDB_MODE=offline first).",
)
_log_gpu_util = flags.DEFINE_integer(
    "log_gpu_util",
    100,
    "Log a `gpu` record (device memory; NVML utilization, clocks, power, temperature where "
    "available) every N steps (0 = only at start).",
    lower_bound=0,
)
_name = flags.DEFINE_string("name", "run", "Run name, substituted for %n in paths.")
_gpus = flags.DEFINE_integer(
    "gpus", 0, "Use this many local devices per process (0 = all).", lower_bound=0
)
_zero_level = flags.DEFINE_enum(
    "zero_level",
    "1",
    ("1", "2", "3"),
    "ZeRO: 1 shards optimizer state over the data-parallel devices, 2 also gradients, 3 also "
    "parameters (FSDP).",
)
_tensor_parallel = flags.DEFINE_integer(
    "tensor_parallel", 1, "Shard attention heads and the MLP over this many devices.", lower_bound=1
)
_data_parallel = flags.DEFINE_integer(
    "data_parallel",
    1,
    "Full replicas (hybrid sharding): ZeRO shards within each of these groups of devices.",
    lower_bound=1,
)
_coordinator_address = flags.DEFINE_string(
    "coordinator_address",
    None,
    "Multi-host: host:port of process 0 (auto-detected under SLURM, Open MPI, Kubernetes).",
)
_num_processes = flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
_process_id = flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.")
_checkpoint_dir = flags.DEFINE_string(
    "checkpoint_dir", None, "Where checkpoints are written, one <dir>/<step>/ each; %n = --name."
)
_ckpt_interval = flags.DEFINE_integer(
    "ckpt_interval",
    1000,
    "Checkpoint every N steps (asynchronously; 0 = only at the end or when stopped by a signal).",
    lower_bound=0,
)
_ckpt_keep_n = flags.DEFINE_integer(
    "ckpt_keep_n",
    3,
    "Keep the newest N checkpoints (0 = all), besides the major ones.",
    lower_bound=0,
)
_ckpt_major = flags.DEFINE_integer(
    "ckpt_major",
    0,
    "Never delete a checkpoint whose step is a multiple of N (0 = none).",
    lower_bound=0,
)
_ckpt_failure = flags.DEFINE_enum(
    "ckpt_failure",
    "stop",
    ["stop", "continue"],
    "When a checkpoint fails to save (a full disk, an I/O error): stop the run with exit 1 (its "
    "last complete checkpoint is then the newest), or continue training and try the next save.",
)
_continue = flags.DEFINE_string(
    "continue",
    None,
    "Resume: latest (the newest complete checkpoint in --checkpoint_dir, or a fresh start if there "
    "is none), a STEP there, or the PATH of a checkpoint (or of a directory of them).",
)
_new_data = flags.DEFINE_bool(
    "new_data",
    False,
    "With --continue: restore weights and optimizer, but start the data pipeline over (new data).",
)
_save_training_state = flags.DEFINE_bool(
    "save_training_state",
    False,
    "Write a checkpoint at the end of training (needs --checkpoint_dir).",
)


def require_training_flags() -> None:
    """Validators that training needs and tools sharing these flags (bench) do not."""
    flags.mark_flags_as_required(["model", "train_file"])
    flags.register_multi_flags_validator(
        ["steps", "epochs"],
        lambda d: (d["steps"] is None) != (d["epochs"] is None),
        message="give exactly one of --steps and --epochs",
    )


# ---- the config tree ----


class ConfigError(ValueError):
    """A flag combination that cannot run, with the flag named."""


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which model, and how it is stored and computed."""

    model: str
    from_scratch: bool = False
    model_dtype: str = "float32"
    matmul_dtype: str = "bfloat16"  # the compute dtype (activations, LM head, attention)
    linear_dtype: str | None = None  # "e4m3": block linears in fp8 (--matmul_dtype=e4m3)
    gradient_dtype: str | None = None  # their backward GEMMs' gradients; None: linear_dtype
    fp8_scaling: str = "current"  # the fp8 scales: this step's abs-max, or a history's max
    fp8_amax_history: int = 16  # delayed scaling's history length (steps)
    init_proj_to_zero: bool = False
    scan_layers: bool = True
    attention: str = "auto"
    deterministic: bool = False  # XLA's deterministic ops, so never cuDNN attention
    recompute: Recompute = Recompute()  # with --offload_residual
    offload: Offload = Offload()  # --offload_master, --offload_opt_m, --offload_opt_v

    def __post_init__(self):
        if self.from_scratch and self.model not in PRESETS and not os.path.isdir(self.model):
            raise ConfigError(
                f"--model={self.model}: not a preset ({', '.join(PRESETS)}) nor a directory"
            )
        if not self.from_scratch and not os.path.isdir(self.model):
            hint = " (a preset needs --from_scratch)" if self.model in PRESETS else ""
            raise ConfigError(f"--model={self.model}: no such Hugging Face model directory{hint}")
        check_dtypes(self.model_dtype, self.matmul_dtype, self.linear_dtype, self.gradient_dtype)
        if self.fp8_scaling not in FP8_SCALINGS:
            raise ConfigError(f"--fp8_scaling={self.fp8_scaling}: not one of {FP8_SCALINGS}")
        if self.fp8_scaling == "delayed" and self.linear_dtype is None:
            raise ConfigError(
                "--fp8_scaling=delayed needs --matmul_dtype=e4m3 (it scales the fp8 block linears; "
                f"--matmul_dtype={self.matmul_dtype} here)"
            )
        if self.fp8_amax_history < 1:
            raise ConfigError(f"--fp8_amax_history={self.fp8_amax_history}: must be >= 1")
        if self.deterministic and self.attention == "cudnn":
            raise ConfigError(
                "--deterministic with --attention=cudnn: cuDNN's attention crashes under XLA's "
                "deterministic ops (jax 0.11.2); use --attention=auto or xla"
            )


def check_dtypes(
    model_dtype: str, matmul_dtype: str, linear_dtype: str | None, gradient_dtype: str | None
) -> None:
    """Refuse dtype combinations the model cannot run, naming the flag."""
    if model_dtype not in DTYPES:
        raise ConfigError(
            f"--model_dtype={model_dtype}: master weights are one of {DTYPES}; fp8 is for "
            "matmuls only (--matmul_dtype=e4m3)"
        )
    if matmul_dtype not in DTYPES:
        raise ConfigError(f"--matmul_dtype={matmul_dtype}: not one of {DTYPES + FP8_MATMUL}")
    if linear_dtype is None:
        if gradient_dtype not in (None, matmul_dtype):
            raise ConfigError(
                f"--gradient_dtype={gradient_dtype} needs --matmul_dtype=e4m3 (only the fp8 "
                f"matmuls take their own gradient dtype; --matmul_dtype={matmul_dtype} here)"
            )
        return
    if linear_dtype not in FP8_MATMUL or matmul_dtype != "bfloat16":
        raise ConfigError(
            f"--matmul_dtype={linear_dtype} (block linears in fp8) computes in bfloat16, "
            f"not {matmul_dtype}; fp8 linear dtypes: {FP8_MATMUL}"
        )
    if gradient_dtype not in (None, *FP8_GRADIENT):
        raise ConfigError(
            f"--gradient_dtype={gradient_dtype} with --matmul_dtype={linear_dtype}: the "
            f"backward matmuls are fp8 too, one of {FP8_GRADIENT}"
        )


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Token shards, batch geometry and data order."""

    train_files: tuple[str, ...]
    eval_files: tuple[str, ...] = ()
    seq_len: int = 1024
    allow_seq_len_beyond_max_position: bool = False
    batch_size: int = 4  # per device
    grad_accumulation: int = 1
    train_seed: int = 42
    eval_seed: int = 0

    def __post_init__(self):
        if not self.train_files:
            raise ConfigError("--train_file matches no files")
        if self.seq_len < 2 or self.batch_size < 1 or self.grad_accumulation < 1:
            raise ConfigError("--seq_len must be >= 2, --batch_size and --grad_accumulation >= 1")


def check_seq_len(data: DataConfig, model_cfg: ModelConfig, model: str) -> None:
    """Refuse a --seq_len beyond the model's max_position_embeddings unless the flag allows it."""
    limit = model_cfg.max_position_embeddings
    if data.seq_len > limit and not data.allow_seq_len_beyond_max_position:
        raise ConfigError(
            f"--seq_len={data.seq_len} exceeds --model={model}'s max_position_embeddings "
            f"({limit}); use --seq_len<={limit}, or --allow_seq_len_beyond_max_position to "
            "train on positions the model was not made for"
        )


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Devices and how the model and batch are split over them."""

    gpus: int = 0
    zero_level: int = 1
    tensor_parallel: int = 1
    data_parallel: int = 1
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    def __post_init__(self):
        if self.zero_level not in (1, 2, 3):
            raise ConfigError(f"--zero_level must be 1, 2 or 3, got {self.zero_level}")
        if (self.num_processes is None) != (self.process_id is None):
            raise ConfigError("--num_processes and --process_id go together")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where and when checkpoints are written, and what to resume from (field names = flags)."""

    checkpoint_dir: str | None = None
    ckpt_interval: int = 1000  # 0 = only at the end (--save_training_state) or on a signal
    ckpt_keep_n: int = 3  # 0 = keep all
    ckpt_major: int = 0
    ckpt_failure: str = "stop"  # a failed save: stop (exit 1) | continue (warn, save again later)
    continue_from: str | None = None  # --continue: latest | STEP | PATH
    new_data: bool = False
    save_training_state: bool = False

    def __post_init__(self):
        if self.ckpt_interval < 0 or self.ckpt_keep_n < 0 or self.ckpt_major < 0:
            raise ConfigError("--ckpt_interval, --ckpt_keep_n and --ckpt_major must be >= 0")
        if self.ckpt_failure not in ("stop", "continue"):
            raise ConfigError(f"--ckpt_failure must be stop or continue, got {self.ckpt_failure!r}")
        c = self.continue_from
        if c is not None and (c == "latest" or c.isdigit()) and not self.checkpoint_dir:
            raise ConfigError(f"--continue={c} needs --checkpoint_dir (where to look)")
        if c is not None and c != "latest" and not c.isdigit() and not os.path.isdir(c):
            raise ConfigError(
                f"--continue={c}: not latest, a step, nor an existing checkpoint directory"
            )
        if self.new_data and c is None:
            raise ConfigError("--new_data needs --continue (it resumes weights, not data)")
        if self.save_training_state and not self.checkpoint_dir:
            raise ConfigError("--save_training_state needs --checkpoint_dir")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs, validated on construction."""

    model: ModelSpec
    data: DataConfig
    optim: OptimConfig
    steps: int | None = None
    epochs: int | None = None
    z_loss: float = 0.0
    kernels: str = "auto"
    lmhead_chunks: int = 1
    sample_every_n_steps: int = 0
    sample_prompts: tuple[str, ...] = ("def ", "import ")
    sample_max_new_tokens: int = 32
    eval_every_n_steps: int = 100
    eval_num_steps: int = 20
    out_dir: str | None = None
    log_file: str | None = None
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    log_gpu_util: int = 100
    name: str = "run"
    mesh: MeshConfig = MeshConfig()
    ckpt: CheckpointConfig = CheckpointConfig()

    def __post_init__(self):
        if (self.steps is None) == (self.epochs is None):
            raise ConfigError("give exactly one of --steps and --epochs")
        if self.sample_every_n_steps > 0 and not self.sample_prompts:
            raise ConfigError("--sample_every_n_steps needs --sample_prompts (none given)")
        try:
            parse_kernels(self.kernels)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def parse_prompts(spec: str) -> tuple[str, ...]:
    """--sample_prompts: a file's non-empty lines, else the comma-separated prompts."""
    if os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            return tuple(line.rstrip("\n") for line in f if line.strip())
    return tuple(p for p in spec.split(",") if p)


def substitute_name(path: str | None, name: str) -> str | None:
    """Replace %n in a path with the run name."""
    return None if path is None else path.replace("%n", name)


def model_spec_from_flags() -> ModelSpec:
    """The ModelSpec from the parsed flags."""
    fp8 = _matmul_dtype.value in FP8_MATMUL
    attention = _attention.value
    if _deterministic.value and attention == "auto":
        attention = "xla"
    return ModelSpec(
        model=_model.value,
        from_scratch=_from_scratch.value,
        model_dtype=_model_dtype.value,
        # --matmul_dtype=e4m3 is two settings: bfloat16 compute, fp8 block linears.
        matmul_dtype="bfloat16" if fp8 else _matmul_dtype.value,
        linear_dtype=_matmul_dtype.value if fp8 else None,
        gradient_dtype=_gradient_dtype.value,
        fp8_scaling=_fp8_scaling.value,
        fp8_amax_history=_fp8_amax_history.value,
        init_proj_to_zero=_init_proj_to_zero.value,
        scan_layers=_scan_layers.value,
        attention=attention,
        deterministic=_deterministic.value,
        recompute=Recompute(
            **{name: holder.value for name, holder in _recompute.items()},
            offload_residual=_offload["residual"].value,
        ),
        offload=Offload(**{k: _offload[k].value for k in ("master", "opt_m", "opt_v")}),
    )


def optim_from_flags() -> OptimConfig:
    """The OptimConfig from the parsed flags."""
    return OptimConfig(
        lr=_lr.value,
        warmup=_warmup.value,
        cooldown=_cooldown.value,
        final_lr_fraction=_final_lr_fraction.value,
        lr_schedule=_lr_schedule.value,
        beta_1=_beta_1.value,
        beta_2=_beta_2.value,
        adam_epsilon=_adam_epsilon.value,
        weight_decay=_weight_decay.value,
        grad_clip=_grad_clip.value,
        opt_m_dtype=_opt_m_dtype.value,
        opt_v_dtype=_opt_v_dtype.value,
        max_nonfinite=_max_nonfinite.value,
    )


def mesh_from_flags() -> MeshConfig:
    """The MeshConfig from the parsed flags."""
    return MeshConfig(
        gpus=_gpus.value,
        zero_level=int(_zero_level.value),
        tensor_parallel=_tensor_parallel.value,
        data_parallel=_data_parallel.value,
        coordinator_address=_coordinator_address.value,
        num_processes=_num_processes.value,
        process_id=_process_id.value,
    )


def checkpoint_from_flags(name: str) -> CheckpointConfig:
    """The CheckpointConfig from the parsed flags (%n in --checkpoint_dir is `name`)."""
    return CheckpointConfig(
        checkpoint_dir=substitute_name(_checkpoint_dir.value, name),
        ckpt_interval=_ckpt_interval.value,
        ckpt_keep_n=_ckpt_keep_n.value,
        ckpt_major=_ckpt_major.value,
        ckpt_failure=_ckpt_failure.value,
        continue_from=substitute_name(_continue.value, name),
        new_data=_new_data.value,
        save_training_state=_save_training_state.value,
    )


def from_flags() -> TrainConfig:
    """Build the TrainConfig from the parsed absl flags (main.py calls this, once)."""
    name = _name.value
    eval_spec = _eval_file.value
    return TrainConfig(
        model=model_spec_from_flags(),
        data=DataConfig(
            train_files=tuple(expand_files(_train_file.value, "--train_file")),
            eval_files=tuple(expand_files(eval_spec, "--eval_file")) if eval_spec else (),
            seq_len=_seq_len.value,
            allow_seq_len_beyond_max_position=_allow_seq_len_beyond_max_position.value,
            batch_size=_batch_size.value,
            grad_accumulation=_grad_accumulation.value,
            train_seed=_train_seed.value,
            eval_seed=_eval_seed.value,
        ),
        optim=optim_from_flags(),
        steps=_steps.value,
        epochs=_epochs.value,
        z_loss=_z_loss.value,
        kernels=_kernels.value,
        lmhead_chunks=_lmhead_chunks.value,
        sample_every_n_steps=_sample_every_n_steps.value,
        sample_prompts=parse_prompts(_sample_prompts.value),
        sample_max_new_tokens=_sample_max_new_tokens.value,
        eval_every_n_steps=_eval_every_n_steps.value,
        eval_num_steps=_eval_num_steps.value,
        out_dir=substitute_name(_out_dir.value, name),
        log_file=substitute_name(_log_file.value, name),
        tensorboard_dir=substitute_name(_tensorboard_dir.value, name),
        wandb_project=_wandb_project.value,
        log_gpu_util=_log_gpu_util.value,
        name=name,
        mesh=mesh_from_flags(),
        ckpt=checkpoint_from_flags(name),
    )


_DASHED = re.compile(r"^--(no)?([a-z0-9]+(?:-[a-z0-9]+)+)(=|$)")


def normalize_dashes(argv: Sequence[str]) -> list[str]:
    """Accept llmq's dashed spellings (--batch-size=8) for our underscore flags (--batch_size=8)."""
    out = []
    for arg in argv:
        m = _DASHED.match(arg)
        if m and m.group(2).replace("-", "_") in flags.FLAGS:
            arg = "--" + (m.group(1) or "") + m.group(2).replace("-", "_") + arg[m.end(2) :]
        out.append(arg)
    return out


def parse_argv(argv: list[str]) -> list[str]:
    """absl flags_parser: flagfiles expanded, dashed spellings normalized; exit 1 on bad flags."""
    try:
        argv = flags.FLAGS.read_flags_from_files(argv, force_gnu=False)
    except flags.CantOpenFlagFileError as e:
        cause = e.__context__  # absl's message lacks the flag; the OSError it wraps has the file
        if isinstance(cause, OSError):
            sys.exit(f"error: --flagfile={cause.filename}: cannot read it ({cause.strerror})")
        sys.exit(f"error: --flagfile: {e}")
    try:
        argv = flags.FLAGS(normalize_dashes(argv))
        if not flags.FLAGS["verbosity"].present:
            # jax's INFO lines (backend probing) would drown the step lines; --verbosity=0 shows them.
            logging.set_verbosity(logging.WARNING)
        return argv
    except flags.Error as e:
        print(f"FATAL Flags parsing error: {e}", file=sys.stderr)
        print("Pass --helpfull to see help on flags.", file=sys.stderr)
        sys.exit(1)
