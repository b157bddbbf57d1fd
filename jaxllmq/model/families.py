"""The config.json fields particular to some families: which layers attend through a sliding
window (Mistral: all of them; Qwen2/Qwen3: those from max_window_layers on; Gemma 3: its local
layers) and Gemma 3's own (attention scale, local RoPE base, GeGLU), read and written."""

from typing import Any

from jaxllmq.model.checks import ModelConfigError, check_int, check_number, is_int
from jaxllmq.model.rope import RopeScaling, read_rope

SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA3 = "Gemma3ForCausalLM"
GEMMA3_IMAGE_TEXT = "Gemma3ForConditionalGeneration"
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Gemma 3's defaults where its config.json leaves a field out (transformers' Gemma3TextConfig).
GEMMA3_DEFAULTS = dict(
    head_dim=256,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    query_pre_attn_scalar=256.0,
    sliding_window=4096,
    sliding_window_pattern=6,
    max_position_embeddings=131072,
    tie_word_embeddings=True,
)


# What an image-text Gemma 3's text_config may leave out besides GEMMA3_DEFAULTS: transformers'
# Gemma3TextConfig defaults (the 4B/12B/27B configs rely on some of them).
GEMMA3_TEXT_CONFIG_DEFAULTS = dict(
    vocab_size=262_208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    bos_token_id=2,
    eos_token_id=1,
)


def gemma3_text_config(d: dict[str, Any]) -> dict[str, Any]:
    """The config.json of an image-text Gemma 3's language model, as a Gemma3ForCausalLM's:
    its text_config, with the whole model's token ids, then transformers' defaults, where it
    leaves a field out."""
    text = d.get("text_config") or {}
    if not isinstance(text, dict):
        raise ModelConfigError(f"text_config must be an object, got {type(text).__name__}")
    ids = {k: d[k] for k in ("bos_token_id", "eos_token_id") if d.get(k) is not None}
    given = {k: v for k, v in text.items() if v is not None}
    return {**GEMMA3_TEXT_CONFIG_DEFAULTS, **ids, **given, "architectures": [GEMMA3]}


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
    """Gemma 3's interleaving: every `pattern`-th layer global, the others local (sliding)."""
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


def check_layers(cfg: Any) -> None:
    """Refuse a ModelConfig whose layer_types or Gemma 3 fields do not fit its architecture."""
    types = cfg.layer_types
    if types is not None:
        if len(types) != cfg.num_hidden_layers or set(types) - {SLIDING, FULL}:
            raise ModelConfigError(
                f"layer_types must list {cfg.num_hidden_layers} entries, each "
                f"{SLIDING!r} or {FULL!r}"
            )
        if SLIDING in types and cfg.sliding_window is None:
            raise ModelConfigError("layer_types names sliding layers but sliding_window is unset")
        if cfg.architecture == "MistralForCausalLM":
            raise ModelConfigError(
                "layer_types is not read by Mistral (its window is every layer's)"
            )
    for name in ("query_pre_attn_scalar", "rope_local_base_freq"):
        value = getattr(cfg, name)
        if cfg.architecture == GEMMA3 and value is None:
            raise ModelConfigError(f"{name} is required for {GEMMA3}")
        if value is not None:
            if cfg.architecture != GEMMA3:
                raise ModelConfigError(f"{name} is read for {GEMMA3} only")
            check_number(name, value)


def _layer_types(d: dict[str, Any], num_layers: int) -> tuple[str, ...] | None:
    types = d.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != num_layers or set(types) - {SLIDING, FULL}:
        raise ModelConfigError(
            f"layer_types must list {num_layers} entries, each {SLIDING!r} or {FULL!r}"
        )
    return tuple(types)


def read_windows(arch: str, d: dict[str, Any]) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) of a config.json, as transformers reads them: Mistral's
    window on every layer (layer_types None); Qwen's, with use_sliding_window, on the layers its
    layer_types name (else those from max_window_layers on); Gemma 3's on its local layers."""
    layers = d["num_hidden_layers"]
    check_int("num_hidden_layers", layers)
    if arch == "MistralForCausalLM":
        return d.get("sliding_window"), None
    if arch in _QWEN:
        if not d.get("use_sliding_window") or d.get("sliding_window") is None:
            return None, None
        types = _layer_types(d, layers)
        if types is None:
            first = d.get("max_window_layers", 28)
            if not is_int(first) or first < 0:  # 0: every layer sliding
                raise ModelConfigError(f"max_window_layers must be an integer >= 0, got {first!r}")
            types = tuple(SLIDING if i >= first else FULL for i in range(layers))
        return (d["sliding_window"], types) if SLIDING in types else (None, None)
    if arch == GEMMA3:
        types = _layer_types(d, layers)
        if types is None:
            pattern = d.get("sliding_window_pattern") or GEMMA3_DEFAULTS["sliding_window_pattern"]
            check_int("sliding_window_pattern", pattern)
            types = gemma3_layer_types(layers, pattern)
        window = d.get("sliding_window") or GEMMA3_DEFAULTS["sliding_window"]
        return window, types
    return None, None


def read_gemma3(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's fields of ModelConfig from its config.json (rope as transformers 4 writes it,
    rope_theta + rope_scaling + rope_local_base_freq, or as 5 does, rope_parameters per layer
    kind); what it cannot compute is refused."""
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ModelConfigError(
            f"hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)"
        )
    for name in (
        "final_logit_softcapping",
        "attn_logit_softcapping",
        "use_bidirectional_attention",
    ):
        if d.get(name):
            raise ModelConfigError(f"{name}={d[name]!r} is not supported (Gemma 3 has none)")
    params = d.get("rope_parameters")
    if isinstance(params, dict) and FULL in params:
        theta, scaling = read_rope({"rope_parameters": params[FULL]})
        local_theta, local_scaling = read_rope({"rope_parameters": params.get(SLIDING) or {}})
        if params.get(SLIDING) is None or "rope_theta" not in params[SLIDING]:
            local_theta = GEMMA3_DEFAULTS["rope_local_base_freq"]
        if local_scaling is not None:
            raise ModelConfigError("rope scaling of the sliding layers is not supported")
    else:
        theta, scaling = read_rope({"rope_theta": GEMMA3_DEFAULTS["rope_theta"], **d})
        local_theta = d.get("rope_local_base_freq") or GEMMA3_DEFAULTS["rope_local_base_freq"]
    check_number("rope_local_base_freq", local_theta)
    scalar = d.get("query_pre_attn_scalar") or GEMMA3_DEFAULTS["query_pre_attn_scalar"]
    check_number("query_pre_attn_scalar", scalar)
    return dict(
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_base_freq=float(local_theta),
        query_pre_attn_scalar=float(scalar),
    )


def write_family_fields(cfg: Any) -> dict[str, Any]:
    """The config.json fields of `cfg` (a ModelConfig) particular to its family."""
    types = list(cfg.layer_types) if cfg.layer_types is not None else None
    if cfg.architecture == "LlamaForCausalLM":
        return dict(attention_bias=False, mlp_bias=False)
    if cfg.architecture == "MistralForCausalLM":
        return dict(sliding_window=cfg.sliding_window)
    if cfg.architecture in _QWEN:
        out: dict[str, Any] = dict(use_sliding_window=False, sliding_window=None)
        if cfg.architecture == "Qwen3ForCausalLM":
            out.update(attention_bias=False)
        if types is not None:
            out.update(
                use_sliding_window=True,
                sliding_window=cfg.sliding_window,
                max_window_layers=types.index(SLIDING),
                layer_types=types,
            )
        return out
    return dict(
        hidden_activation="gelu_pytorch_tanh",
        attention_bias=False,
        query_pre_attn_scalar=_int_if_whole(cfg.query_pre_attn_scalar),
        sliding_window=cfg.sliding_window,
        layer_types=types,
        rope_local_base_freq=cfg.rope_local_base_freq,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
    )


def _int_if_whole(x: float) -> int | float:
    """transformers types query_pre_attn_scalar as an integer, as Gemma 3's configs give it."""
    return int(x) if float(x).is_integer() else x


def _gemma3(layers: int, window: int, **kw: Any) -> dict[str, Any]:
    base = dict(
        num_hidden_layers=layers,
        head_dim=256,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        query_pre_attn_scalar=256.0,
        sliding_window=window,
        layer_types=gemma3_layer_types(layers),
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        architecture=GEMMA3,
        bos_token_id=2,
        eos_token_id=1,
    )
    return {**base, **kw}


# Gemma 3's published config.json values (the 4B's and 12B's text_config: their text decoder,
# with 64 image tokens past the 1B's vocabulary); ModelConfig's fields by preset name.
GEMMA3_PRESETS: dict[str, dict[str, Any]] = {
    "gemma-3-1b": _gemma3(
        26,
        512,
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=32768,
    ),
    "gemma-3-4b": _gemma3(
        34,
        1024,
        vocab_size=262208,
        hidden_size=2560,
        intermediate_size=10240,
        num_attention_heads=8,
        num_key_value_heads=4,
        rope_scaling=RopeScaling("linear", factor=8.0),
    ),
    "gemma-3-12b": _gemma3(
        48,
        1024,
        vocab_size=262208,
        hidden_size=3840,
        intermediate_size=15360,
        num_attention_heads=16,
        num_key_value_heads=8,
        rope_scaling=RopeScaling("linear", factor=8.0),
    ),
}
