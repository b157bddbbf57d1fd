"""Every setting of a training run, written once: frozen dataclasses of `setting(...)` fields.

Each field's default, help, flag name, allowed values and resume policy live here; the flags
(jaxllmq/cli/flags.py) and the resume checks (resume_rules.py) are derived from them. A
TrainConfig validates itself on construction and raises SettingError naming the flag.
"""

import dataclasses
import os

from jaxllmq import dtypes
from jaxllmq.data.pack import check_packed_for
from jaxllmq.data.shards import expand_files
from jaxllmq.documents import DOCUMENTS_PER_WINDOW
from jaxllmq.kernels import parse_kernels
from jaxllmq.model.architecture import PRESETS, ModelConfig
from jaxllmq.model.attention import ATTENTION_IMPLS
from jaxllmq.model.recompute import Recompute
from jaxllmq.offload import Offload
from jaxllmq.setting import DTYPE_SPELLINGS, Resume, SettingError, Settings, section, setting
from jaxllmq.tokenizer_files import EOS_FILE, read_eos_id

DTYPES = tuple(dtypes.DTYPES)
# llmq's fp8 matmul dtype: activations in bfloat16, the block linears' GEMMs in fp8.
FP8_MATMUL = ("e4m3",)
FP8_GRADIENT = tuple(dtypes.FP8_DTYPES)
SCHEDULES = ("cosine", "linear", "wsd")
ATTENTIONS = ATTENTION_IMPLS
ZERO_LEVELS = (1, 2, 3)


def _dtype(default: str | None, help: str, choices: tuple[str, ...], **kw) -> str:
    return setting(default, help, choices=choices, spellings=DTYPE_SPELLINGS, **kw)


def _files(flag: str):
    return lambda spec: tuple(expand_files(spec, f"--{flag}")) if spec else ()


def parse_prompts(spec: str) -> tuple[str, ...]:
    """--sample_prompts: a file's non-empty lines, else the comma-separated prompts."""
    if os.path.isfile(spec):
        with open(spec, encoding="utf-8") as f:
            return tuple(line.rstrip("\n") for line in f if line.strip())
    return tuple(p for p in spec.split(",") if p)


@dataclasses.dataclass(frozen=True)
class ModelSpec(Settings):
    """Model: which model, and how it is stored and computed."""

    model: str = setting(
        None,
        "Hugging Face model directory (config.json + safetensors), or with --from_scratch a "
        "preset: " + ", ".join(PRESETS),
    )
    from_scratch: bool = setting(
        False, "Random init from --model's config (a preset or an HF directory)."
    )
    model_dtype: str = _dtype(
        "float32",
        "dtype of the master weights (what the optimizer updates).",
        DTYPES,
        resume=Resume.MEANING,
    )
    matmul_dtype: str = _dtype(
        "bfloat16",
        "dtype of activations and matmuls (fp32 accumulation); e4m3: bfloat16 activations, the "
        "block linears (q/k/v/o/gate/up/down) in fp8 with per-tensor scaling, LM head and "
        "attention in bfloat16.",
        DTYPES + FP8_MATMUL,
    )
    gradient_dtype: str | None = _dtype(
        None,
        "dtype of the output gradients in the backward matmuls (default: --matmul_dtype's); with "
        "--matmul_dtype=e4m3, e5m2 trades mantissa for range.",
        DTYPES + FP8_GRADIENT,
    )
    fp8_scaling: str = setting(
        "current",
        "With --matmul_dtype=e4m3, where each fp8 operand's per-tensor scale comes from: its own "
        "abs-max this step (current), or the max over the last --fp8_amax_history steps' "
        "abs-maxes, kept in the train state and checkpoints (delayed; the quantize can fuse into "
        "the producer).",
        choices=("current", "delayed"),
        resume=Resume.MEANING,
    )
    fp8_amax_history: int = setting(
        16,
        "--fp8_scaling=delayed: steps of abs-max history per fp8 operand.",
        lower=1,
        resume=Resume.MEANING,
    )
    init_proj_to_zero: bool = setting(
        False, "From scratch: zero-init o_proj and down_proj (blocks start as identity)."
    )
    scan_layers: bool = setting(
        True, "Scan over stacked layers (flat compile time) instead of unrolling them."
    )
    attention: str = setting(
        "auto",
        "Attention kernel; auto = cuDNN on GPU in bf16, mosaic on one Hopper GPU at head dims "
        "64, 128 and 256, over packed documents, causal or with windows of up to 2048 keys on "
        "every layer (1024 at 256, any at 64; measured faster), and with --deterministic mosaic "
        "where it runs (else XLA's); mosaic = jaxllmq's own flash attention (Hopper GPUs, head "
        "dims up to 256; per device on several).",
        choices=ATTENTIONS,
    )
    deterministic: bool = setting(
        False,
        "Bit-identical runs on GPU (CPU runs are already): XLA's deterministic ops, and attention "
        "in jaxllmq's flash attention where it runs (the 1B step 9% slower than without), else "
        "XLA's (cuDNN's crashes under them in jax 0.11.2): 2-2.5x slower, and it keeps the "
        "[batch, heads, seq, seq] scores, so large batches need --recompute_att "
        "(docs/PERFORMANCE.md).",
    )
    kernels: str = setting(
        "auto",
        "Fused Pallas kernels (rms_norm, lm_head_loss, fp8_quantize) or XLA: auto|pallas|xla for "
        "all, or per kernel, e.g. rms_norm=pallas,lm_head_loss=xla; auto = what measured faster "
        "on one GPU, or on several (there the RMSNorm in XLA; all XLA under tensor parallelism). "
        "lm_head_loss=mosaic: its kernel in Mosaic GPU (bf16, tile-aligned shapes), auto's choice "
        "on Hopper GPUs.",
    )
    lmhead_chunks: int = setting(
        1,
        "Compute the LM-head loss over at least this many token chunks (saves memory; the Pallas "
        "loss uses chunks of at most 8192 tokens anyway, fewer where a chunk would reach 2^31 "
        "logits, e.g. 4096 at Gemma 3's vocabulary, and never holds the logits).",
        lower=1,
    )
    recompute: Recompute = section(Recompute)
    offload: Offload = section(Offload)

    @property
    def compute_dtype(self) -> str:
        """The dtype of activations, attention and the LM head (bfloat16 under fp8)."""
        return "bfloat16" if self.linear_dtype else self.matmul_dtype

    @property
    def linear_dtype(self) -> str | None:
        """The block linears' fp8 dtype (--matmul_dtype=e4m3), or None."""
        return self.matmul_dtype if self.matmul_dtype in FP8_MATMUL else None

    def check(self) -> None:
        if self.model is None:
            raise SettingError("--model is required: a Hugging Face model directory or a preset")
        if self.from_scratch and self.model not in PRESETS and not os.path.isdir(self.model):
            raise SettingError(
                f"--model={self.model}: not a preset ({', '.join(PRESETS)}) nor a directory"
            )
        if not self.from_scratch and not os.path.isdir(self.model):
            hint = " (a preset needs --from_scratch)" if self.model in PRESETS else ""
            raise SettingError(f"--model={self.model}: no such Hugging Face model directory{hint}")
        if self.model_dtype not in DTYPES:
            raise SettingError(
                f"--model_dtype={self.model_dtype}: master weights are one of {DTYPES}; fp8 is "
                "for matmuls only (--matmul_dtype=e4m3)"
            )
        grad = self.gradient_dtype
        if self.linear_dtype is None and grad not in (None, self.matmul_dtype):
            raise SettingError(
                f"--gradient_dtype={grad} needs --matmul_dtype=e4m3 (only the fp8 matmuls take "
                f"their own gradient dtype; --matmul_dtype={self.matmul_dtype} here)"
            )
        if self.linear_dtype is not None and grad not in (None, *FP8_GRADIENT):
            raise SettingError(
                f"--gradient_dtype={grad} with --matmul_dtype={self.linear_dtype}: the backward "
                f"matmuls are fp8 too, one of {FP8_GRADIENT}"
            )
        if self.fp8_scaling == "delayed" and self.linear_dtype is None:
            raise SettingError(
                "--fp8_scaling=delayed needs --matmul_dtype=e4m3 (it scales the fp8 block "
                f"linears; --matmul_dtype={self.matmul_dtype} here)"
            )
        try:
            parse_kernels(self.kernels)
        except ValueError as e:
            raise SettingError(str(e)) from None
        if self.deterministic and self.attention == "cudnn":
            raise SettingError(
                "--deterministic with --attention=cudnn: cuDNN's attention crashes under XLA's "
                "deterministic ops (jax 0.11.2); use --attention=auto or xla"
            )


@dataclasses.dataclass(frozen=True)
class DataConfig(Settings):
    """Data: token shards, batch geometry and data order."""

    train_files: tuple[str, ...] = setting(
        (),
        "Token shards (BIN.TOK) to train on: glob(s), comma-separated.",
        flag="train_file",
        parse=_files("train_file"),
    )
    eval_files: tuple[str, ...] = setting(
        (),
        "Token shards to evaluate on: glob(s), comma-separated.",
        flag="eval_file",
        parse=_files("eval_file"),
    )
    seq_len: int = setting(1024, "Tokens per row.", lower=2)
    allow_seq_len_beyond_max_position: bool = setting(
        False,
        "Train with --seq_len above the model's max_position_embeddings (positions it was not "
        "made for); without it such a --seq_len is refused.",
    )
    batch_size: int = setting(4, "Micro-batch size per device (rows of --seq_len tokens).", lower=1)
    grad_accumulation: int = setting(1, "Micro-batches per optimizer step.", lower=1)
    train_seed: int = setting(42, "Seed for init and the training data order.")
    eval_seed: int = setting(0, "Seed for the evaluation data order.")
    document_masking: bool = setting(
        False,
        "Each token attends to its own document only (documents end with --eos_id), positions "
        "restart at each document, and the token after an EOS is not trained on. On GPU "
        "cuDNN's attention takes each document as a segment and skips the blocks between "
        "documents (about the causal kernel's time, less with short documents); elsewhere "
        "XLA's attention with a [batch, seq, seq] mask per window.",
    )
    max_documents_per_window: int = setting(
        DOCUMENTS_PER_WINDOW,
        "With --document_masking, the documents a window keeps apart (cuDNN's segments: each "
        "costs time and backward memory, used or not, about 0.1 GiB per 1k tokens of a "
        "micro-batch for the 1B): the tokens of documents past it are not trained on, with a "
        "warning.",
        lower=1,
    )
    eos_id: int | None = setting(
        None,
        f"End-of-document token id for --document_masking (default: {EOS_FILE} that "
        "`python -m jaxllmq.data.prepare` wrote beside the --train_file shards).",
        lower=0,
    )

    @property
    def document_eos_id(self) -> int | None:
        """The end-of-document id with --document_masking (--eos_id, else the train shards'
        directory's record), None without it."""
        if not self.document_masking:
            return None
        if self.eos_id is not None:
            return self.eos_id
        return read_eos_id(os.path.dirname(self.train_files[0])) if self.train_files else None

    @property
    def documents_per_window(self) -> int | None:
        """The documents a window keeps apart with --document_masking, None without it."""
        return self.max_documents_per_window if self.document_masking else None

    def check(self) -> None:
        if self.eos_id is not None and not self.document_masking:
            raise SettingError(f"--eos_id={self.eos_id} needs --document_masking (what it is for)")
        if self.document_masking and self.train_files and self.document_eos_id is None:
            raise SettingError(
                "--document_masking needs the end-of-document id: pass --eos_id, or prepare the "
                f"data with `python -m jaxllmq.data.prepare` (it writes {EOS_FILE} beside the "
                "shards)"
            )
        check_packed_for(self.train_files, self.seq_len, "--train_file")
        check_packed_for(self.eval_files, self.seq_len, "--eval_file")

    def check_seq_len(self, model_cfg: ModelConfig, model: str) -> None:
        """Refuse a --seq_len beyond the model's max_position_embeddings unless allowed."""
        limit = model_cfg.max_position_embeddings
        if self.seq_len > limit and not self.allow_seq_len_beyond_max_position:
            raise SettingError(
                f"--seq_len={self.seq_len} exceeds --model={model}'s max_position_embeddings "
                f"({limit}); use --seq_len<={limit}, or --allow_seq_len_beyond_max_position to "
                "train on positions the model was not made for"
            )


@dataclasses.dataclass(frozen=True)
class OptimConfig(Settings):
    """Optimizer: AdamW and the lr schedule."""

    lr: float = setting(3e-4, "Peak learning rate.", lower=0.0)
    warmup: int = setting(0, "Linear warmup steps.", lower=0)
    cooldown: int = setting(0, "1-sqrt anneal over the last N steps.", lower=0)
    final_lr_fraction: float = setting(0.0, "Final lr as a fraction of --lr.", lower=0.0, upper=1.0)
    lr_schedule: str = setting(
        "cosine",
        "Decay after warmup: cosine, linear, or wsd (constant until the cooldown).",
        choices=SCHEDULES,
    )
    beta_1: float = setting(0.9, "AdamW beta1.", lower=0.0)
    beta_2: float = setting(0.95, "AdamW beta2.", lower=0.0)
    adam_epsilon: float = setting(1e-8, "AdamW epsilon.", lower=0.0)
    weight_decay: float = setting(
        0.1,
        "Decoupled weight decay, on matrices only (see --decay_embeddings).",
        lower=0.0,
        resume=Resume.STRUCTURE,
    )
    decay_embeddings: bool = setting(
        False, "Apply --weight_decay to the embedding table too (it is left out by default)."
    )
    grad_clip: float = setting(
        1.0,
        "Clip the global gradient norm to this (0 = off).",
        lower=0.0,
        resume=Resume.STRUCTURE,
    )
    opt_m_dtype: str = _dtype("float32", "AdamW first-moment dtype.", DTYPES, resume=Resume.MEANING)
    opt_v_dtype: str = _dtype(
        "float32", "AdamW second-moment dtype.", DTYPES, resume=Resume.MEANING
    )
    max_nonfinite: int = setting(
        5, "Stop after this many consecutive non-finite-gradient steps.", lower=1
    )

    def check(self) -> None:
        if self.lr <= 0:
            raise SettingError(f"--lr={self.lr}: must be a positive number")
        for flag, beta in (("beta_1", self.beta_1), ("beta_2", self.beta_2)):
            if beta >= 1.0:
                raise SettingError(f"--{flag}={beta}: must be in [0, 1)")
        if self.adam_epsilon <= 0:
            raise SettingError(f"--adam_epsilon={self.adam_epsilon}: must be > 0")
        if self.lr_schedule == "wsd" and self.cooldown == 0 and self.final_lr_fraction != 1.0:
            raise SettingError(
                "--lr_schedule=wsd holds the lr constant until the cooldown, so "
                f"--final_lr_fraction={self.final_lr_fraction} needs --cooldown > 0"
            )


@dataclasses.dataclass(frozen=True)
class MeshConfig(Settings):
    """Devices: how the model and batch are split over them."""

    gpus: int = setting(0, "Use this many local devices per process (0 = all).", lower=0)
    zero_level: int = setting(
        1,
        "ZeRO: 1 shards optimizer state over the data-parallel devices, 2 also gradients, 3 also "
        "parameters (FSDP).",
        lower=1,
        upper=3,
    )
    tensor_parallel: int = setting(
        1, "Shard attention heads and the MLP over this many devices.", lower=1
    )
    data_parallel: int = setting(
        1,
        "Full replicas (hybrid sharding): ZeRO shards within each of these groups of devices.",
        lower=1,
    )
    coordinator_address: str | None = setting(
        None,
        "Multi-host: host:port of process 0 (auto-detected under SLURM, Open MPI, Kubernetes).",
        resume=Resume.SESSION,
    )
    num_processes: int | None = setting(None, "Multi-host: number of processes.", lower=1)
    process_id: int | None = setting(None, "Multi-host: this process's index.", lower=0)

    def check(self) -> None:
        if (self.num_processes is None) != (self.process_id is None):
            raise SettingError("--num_processes and --process_id go together")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig(Settings):
    """Checkpoints: where and when they are written, and what to resume from."""

    checkpoint_dir: str | None = setting(
        None, "Where checkpoints are written, one <dir>/<step>/ each; %n = --name.", run_path=True
    )
    ckpt_interval: int = setting(
        1000,
        "Checkpoint every N steps (asynchronously; 0 = only at the end or when stopped by a "
        "signal).",
        lower=0,
    )
    ckpt_keep_n: int = setting(
        3, "Keep the newest N checkpoints (0 = all), besides the major ones.", lower=0
    )
    ckpt_major: int = setting(
        0, "Never delete a checkpoint whose step is a multiple of N (0 = none).", lower=0
    )
    ckpt_failure: str = setting(
        "stop",
        "When a checkpoint fails to save (a full disk, an I/O error): stop the run with exit 1 "
        "(its last complete checkpoint is then the newest), or continue training and try the "
        "next save.",
        choices=("stop", "continue"),
    )
    continue_from: str | None = setting(
        None,
        "Resume: latest (the newest complete checkpoint in --checkpoint_dir, or a fresh start if "
        "there is none), a STEP there, or the PATH of a checkpoint (or of a directory of them).",
        flag="continue",
        resume=Resume.SESSION,
        run_path=True,
    )
    new_data: bool = setting(
        False,
        "With --continue: restore weights and optimizer, but start the data pipeline over (new "
        "data).",
        resume=Resume.SESSION,
    )
    save_training_state: bool = setting(
        False, "Write a checkpoint at the end of training (needs --checkpoint_dir)."
    )

    def check(self) -> None:
        c = self.continue_from
        if c is not None and (c == "latest" or c.isdigit()) and not self.checkpoint_dir:
            raise SettingError(f"--continue={c} needs --checkpoint_dir (where to look)")
        if c is not None and c != "latest" and not c.isdigit() and not os.path.isdir(c):
            raise SettingError(
                f"--continue={c}: not latest, a step, nor an existing checkpoint directory"
            )
        if self.new_data and c is None:
            raise SettingError("--new_data needs --continue (it resumes weights, not data)")
        if self.save_training_state and not self.checkpoint_dir:
            raise SettingError("--save_training_state needs --checkpoint_dir")


@dataclasses.dataclass(frozen=True)
class TrainConfig(Settings):
    """Training: steps, kernels, evaluation, samples, outputs and logs."""

    model: ModelSpec = section(ModelSpec, required=True)
    data: DataConfig = section(DataConfig, required=True)
    optim: OptimConfig = section(OptimConfig)
    steps: int | None = setting(None, "Optimizer steps to train (or use --epochs).", lower=1)
    epochs: int | None = setting(
        None, "Passes over --train_file (or use --steps); partial batches dropped.", lower=1
    )
    z_loss: float = setting(0.0, "z-loss weight on logsumexp^2.", lower=0.0)
    eval_every_n_steps: int = setting(100, "Evaluate every N steps (0 = only at the end).", lower=0)
    eval_num_steps: int = setting(
        20, "Batches per periodic evaluation (the final one uses all).", lower=1
    )
    sample_every_n_steps: int = setting(
        0,
        "Log greedy continuations of --sample_prompts every N steps (0 = never); needs the "
        "tokenizer.",
        lower=0,
    )
    sample_prompts: tuple[str, ...] = setting(
        ("def ", "import "),
        "Prompts for --sample_every_n_steps: comma-separated, or a file with one prompt per line.",
        parse=parse_prompts,
    )
    sample_max_new_tokens: int = setting(32, "Tokens generated per sample prompt.", lower=1)
    sample_chat: bool = setting(
        False,
        "Samples reply to --sample_prompts as user messages, rendered with the tokenizer's chat "
        "template (as generate --chat).",
    )
    out_dir: str | None = setting(
        None, "Where the trained model is exported (HF format); %n = --name.", run_path=True
    )
    log_file: str | None = setting(None, "JSON Lines log (appended); %n = --name.", run_path=True)
    tensorboard_dir: str | None = setting(
        None,
        "Also write the step and eval scalars as TensorBoard event files here (needs the "
        "`tensorboard` extra: tensorboardX); %n = --name.",
        run_path=True,
    )
    wandb_project: str | None = setting(
        None,
        "Also log the step and eval scalars to this Weights & Biases project, the run named "
        "--name (needs the `wandb` extra; `wandb login` or WANDB_MODE=offline first).",
    )
    log_gpu_util: int = setting(
        100,
        "Log a `gpu` record (device memory; NVML utilization, clocks, power, temperature where "
        "available) every N steps (0 = only at start).",
        lower=0,
    )
    name: str = setting("run", "Run name, substituted for %n in paths.")
    mesh: MeshConfig = section(MeshConfig)
    ckpt: CheckpointConfig = section(CheckpointConfig)

    def check(self) -> None:
        if not self.data.train_files:
            raise SettingError("--train_file is required: token shards (BIN.TOK) to train on")
        if (self.steps is None) == (self.epochs is None):
            raise SettingError("give exactly one of --steps and --epochs")
        if self.sample_every_n_steps > 0 and not self.sample_prompts:
            raise SettingError("--sample_every_n_steps needs --sample_prompts (none given)")
        if self.sample_chat and self.sample_every_n_steps == 0:
            raise SettingError("--sample_chat needs --sample_every_n_steps (samples are off)")
