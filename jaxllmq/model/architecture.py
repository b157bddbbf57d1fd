"""ModelConfig: the shape of a Llama-family model, Hugging Face config.json in and out, presets."""

import dataclasses
import json
import os
from typing import Any

from jaxllmq.model import families
from jaxllmq.model.checks import ModelConfigError, check_int, check_number, is_int
from jaxllmq.model.families import GEMMA3, GEMMA3_IMAGE_TEXT, SLIDING
from jaxllmq.model.rope import RopeScaling, inv_freq, read_rope, scaling_dict

# Architectures whose math is this module's: Llama's decoder (Mistral adds a sliding window;
# Qwen2 q/k/v biases; Qwen3 RMS-normalizes each head's q and k before RoPE; Gemma 3 sandwiches
# each block in norms of (1 + w), gates with GELU and interleaves local and global layers).
ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
    GEMMA3,
)
_MODEL_TYPE = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Qwen3ForCausalLM": "qwen3",
    GEMMA3: "gemma3_text",
}
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder's shape, mirroring the fields of Hugging Face config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases: Qwen2's (which always has them) only
    # Keys each query reads (its own among them) in a sliding layer: every layer's when
    # layer_types is None (Mistral), else those marked SLIDING (Qwen2/Qwen3, Gemma 3's local ones).
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    architecture: str = "LlamaForCausalLM"
    # Gemma 3: attention scale query_pre_attn_scalar ** -0.5; the sliding layers' RoPE theta
    # (unscaled; rope_theta and rope_scaling are the global layers').
    query_pre_attn_scalar: float | None = None
    rope_local_base_freq: float | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ModelConfigError(
                f"architecture {self.architecture!r} is not supported (supported: "
                f"{', '.join(ARCHITECTURES)})"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            check_int(name, getattr(self, name))
        for name in ("head_dim", "sliding_window"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name))
        check_number("rms_norm_eps", self.rms_norm_eps, minimum=0.0)
        check_number("rope_theta", self.rope_theta)
        families.check_layers(self)
        for name in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ModelConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.bos_token_id is not None and not is_int(self.bos_token_id):
            raise ModelConfigError(f"bos_token_id must be an integer, got {self.bos_token_id!r}")
        eos = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        if any(i is not None and not is_int(i) for i in eos):
            raise ModelConfigError(
                f"eos_token_id must be an integer or a list of them, got {self.eos_token_id!r}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ModelConfigError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}); set head_dim explicitly"
            )
        # transformers' Llama and Qwen3 bias o_proj too, and its Mistral reads no biases.
        if self.attention_bias and self.architecture != "Qwen2ForCausalLM":
            raise ModelConfigError(
                f"attention_bias=true is not supported for {self.architecture} (only Qwen2's "
                "q/k/v biases are)"
            )
        if self.head_dim is None:  # normalized, so equal shapes compare equal
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.dim_per_head % 2:
            raise ModelConfigError(f"head_dim must be even for RoPE, got {self.dim_per_head}")

    @property
    def is_gemma(self) -> bool:
        """Gemma 3: norms of (1 + w) before and after each block, GeGLU, scaled embeddings."""
        return self.architecture == GEMMA3

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window, or None where it attends to every earlier key."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_hidden_layers
        return tuple(self.sliding_window if t == SLIDING else None for t in self.layer_types)

    def layer_local_rope(self) -> tuple[bool, ...]:
        """Whether each layer ropes with rope_local_base_freq (Gemma 3's sliding layers)."""
        return tuple(self.is_gemma and w is not None for w in self.layer_windows())

    @property
    def dim_per_head(self) -> int:
        """Head dimension Dh, explicit or hidden_size / heads."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def qk_norm(self) -> bool:
        """Whether each head's q and k are RMS-normalized (weights q_norm, k_norm [Dh]) before
        RoPE, as Qwen3 and Gemma 3 do."""
        return self.architecture in ("Qwen3ForCausalLM", GEMMA3)

    @property
    def model_type(self) -> str:
        """HF model_type string for this architecture."""
        return _MODEL_TYPE[self.architecture]

    def num_params(self) -> int:
        """Parameter count, computed from the shapes (embeddings and head included)."""
        D, F, V, L = (
            self.hidden_size,
            self.intermediate_size,
            self.vocab_size,
            self.num_hidden_layers,
        )
        q, kv = (
            self.num_attention_heads * self.dim_per_head,
            self.num_key_value_heads * self.dim_per_head,
        )
        attn = D * q + 2 * D * kv + q * D + (q + 2 * kv if self.attention_bias else 0)
        norms = (4 if self.is_gemma else 2) * D + (2 * self.dim_per_head if self.qk_norm else 0)
        layer = attn + 3 * D * F + norms
        return V * D * (1 if self.tie_word_embeddings else 2) + L * layer + D

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, MFU's numerator: 6 x matmul params (LM head included) + 6 x
        layers x seq_len x query width (causal attention), forward and backward; a layer whose
        window W is shorter than seq_len T reads 2W - W^2/T keys where a causal one reads T."""
        D, F, V, L = (
            self.hidden_size,
            self.intermediate_size,
            self.vocab_size,
            self.num_hidden_layers,
        )
        q, kv = (
            self.num_attention_heads * self.dim_per_head,
            self.num_key_value_heads * self.dim_per_head,
        )
        matmul_params = L * (D * q + 2 * D * kv + q * D + 3 * D * F) + D * V
        T = seq_len
        keys = sum(T if w is None or w >= T else 2 * w - w * w / T for w in self.layer_windows())
        return 6.0 * matmul_params + 6.0 * keys * q

    # ---- Hugging Face config.json ----

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a parsed HF config.json; unknown architectures, unsupported fields and
        values of the wrong type fail, naming `source` and the field."""
        if not isinstance(d, dict):
            raise ModelConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        try:
            return cls._from_hf_fields(d)
        except KeyError as e:
            raise ModelConfigError(f"{source}: missing required field {e.args[0]!r}") from None
        except ModelConfigError as e:
            raise ModelConfigError(f"{source}: {e}") from None

    @classmethod
    def _from_hf_fields(cls, d: dict[str, Any]) -> "ModelConfig":
        if d.get("architectures") == [GEMMA3_IMAGE_TEXT]:  # its language model (hf.py: weights)
            d = families.gemma3_text_config(d)
        archs = d.get("architectures") or []
        if not isinstance(archs, list) or len(archs) != 1:
            raise ModelConfigError(f"expected one entry in 'architectures', got {archs!r}")
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise ModelConfigError(
                f"architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
            )
        gemma = families.read_gemma3(d) if arch == GEMMA3 else {}
        act = d.get("hidden_act", "silu")
        if act != "silu" and not gemma:
            raise ModelConfigError(f"hidden_act {act!r} is not supported (only silu)")
        if d.get("mlp_bias"):
            raise ModelConfigError("mlp_bias=true is not supported")
        defaults = families.GEMMA3_DEFAULTS if gemma else {}

        def get(key: str, default: Any) -> Any:  # absent or null: the default
            return defaults.get(key, default) if d.get(key) is None else d[key]

        theta, scaling = read_rope(d)
        window, layer_types = families.read_windows(arch, d)
        heads = d["num_attention_heads"]
        fields = dict(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads", heads),
            head_dim=get("head_dim", None),
            rms_norm_eps=get("rms_norm_eps", 1e-6 if arch in _QWEN else 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=get("max_position_embeddings", 4096),
            tie_word_embeddings=get("tie_word_embeddings", False),
            attention_bias=arch == "Qwen2ForCausalLM" or get("attention_bias", False),
            sliding_window=window,
            layer_types=layer_types,
            architecture=arch,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
        )
        return cls(**{**fields, **gemma})

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config.json dict (rope_theta + rope_scaling, read by transformers 4 and 5)."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.dim_per_head,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
        }
        if not self.is_gemma:
            d["hidden_act"] = "silu"
        if self.rope_scaling is not None:
            d["rope_scaling"] = scaling_dict(self.rope_scaling)
        d.update(families.write_family_fields(self))
        return d

    @classmethod
    def from_hf_dir(cls, path: str) -> "ModelConfig":
        """Read `path/config.json` of a Hugging Face model directory."""
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ModelConfigError(
                f"{path}: no config.json here; --model must be a Hugging Face model directory "
                f"or, with --from_scratch, a preset ({', '.join(PRESETS)})"
            )
        try:
            with open(cfg_path, encoding="utf-8") as f:
                d = json.load(f)
        except OSError as e:
            raise ModelConfigError(f"{cfg_path}: cannot read it ({e.strerror or e})") from None
        except ValueError as e:  # not JSON, not UTF-8, or an integer too long to parse
            raise ModelConfigError(f"{cfg_path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(d, source=cfg_path)

    def save_hf(self, path: str) -> None:
        """Write `path/config.json`."""
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.to_hf_dict(), f, indent=2)
            f.write("\n")


_LLAMA3_ROPE = dict(
    low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def _llama3(**kw: Any) -> ModelConfig:
    base = dict(
        vocab_size=128256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        bos_token_id=128000,
        eos_token_id=128001,
    )
    return ModelConfig(**{**base, **kw})


def _qwen25(**kw: Any) -> ModelConfig:
    base = dict(
        vocab_size=151936,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
        attention_bias=True,
        tie_word_embeddings=True,
        architecture="Qwen2ForCausalLM",
        bos_token_id=151643,
        eos_token_id=151643,
    )
    return ModelConfig(**{**base, **kw})


def _qwen3(**kw: Any) -> ModelConfig:
    base = dict(
        vocab_size=151936,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        architecture="Qwen3ForCausalLM",
        bos_token_id=151643,
        eos_token_id=151645,
    )
    return ModelConfig(**{**base, **kw})


PRESETS: dict[str, ModelConfig] = {
    # A few M parameters: tests, the quickstart and smoke runs. Vocab fits the quickstart tokenizer.
    "tiny": ModelConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    ),
    "llama-3.2-1b": _llama3(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
        rope_scaling=RopeScaling("llama3", factor=32.0, **_LLAMA3_ROPE),
    ),
    "llama-3.2-3b": _llama3(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        rope_scaling=RopeScaling("llama3", factor=32.0, **_LLAMA3_ROPE),
    ),
    "llama-3.1-8b": _llama3(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_scaling=RopeScaling("llama3", factor=8.0, **_LLAMA3_ROPE),
    ),
    "llama-2-7b": ModelConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen2.5-0.5b": _qwen25(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
    ),
    "qwen2.5-1.5b": _qwen25(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=131072,
    ),
    "qwen2.5-3b": _qwen25(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
    ),
    "qwen2.5-7b": _qwen25(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
    ),
    "qwen2.5-14b": _qwen25(
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=48,
        num_attention_heads=40,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
    ),
    # Qwen3's published config.json values (head_dim 128 whatever hidden_size / heads is).
    "qwen3-0.6b": _qwen3(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16
    ),
    "qwen3-1.7b": _qwen3(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16
    ),
    "qwen3-4b": _qwen3(
        hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32
    ),
    "qwen3-8b": _qwen3(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=False,
    ),
    "qwen3-14b": _qwen3(
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=40,
        tie_word_embeddings=False,
    ),
    **{name: ModelConfig(**fields) for name, fields in families.GEMMA3_PRESETS.items()},
}


def preset(name: str) -> ModelConfig:
    """A named preset; unknown names fail with the list of known ones."""
    if name not in PRESETS:
        raise ModelConfigError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def load_model_config(model: str) -> ModelConfig:
    """An HF model directory's config.json, or a preset by name."""
    return ModelConfig.from_hf_dir(model) if os.path.isdir(model) else preset(model)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> list[float]:
    """Per-pair inverse frequencies (Dh/2 of them): the global layers', with the config's
    scaling applied, or (`local`) Gemma 3's sliding layers' from rope_local_base_freq."""
    if local:
        return inv_freq(cfg.dim_per_head, cfg.rope_local_base_freq, None)
    return inv_freq(cfg.dim_per_head, cfg.rope_theta, cfg.rope_scaling)
