"""Hugging Face safetensors in and out: one name table between HF names and the model's params.

Import reads tensors lazily (one stacked parameter in host RAM at a time), so an 8B model does not
need twice its size in memory; export writes `config.json` + `model.safetensors`, or shards with an
index above `max_shard_bytes`, loadable by `transformers.AutoModelForCausalLM.from_pretrained`.
"""

import json
import os
import shutil
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxllmq.model.config import ModelConfig
from jaxllmq.model.llama import Llama, abstract_model, params_of

# Our parameter path -> (HF tensor name, stored transposed). HF stores Linear weights [out, in],
# we store [in, out]. Per-layer names carry {i} and are stacked on our leading [L] axis.
LAYER_NAMES: dict[str, tuple[str, bool]] = {
    "input_layernorm": ("model.layers.{i}.input_layernorm.weight", False),
    "q_proj": ("model.layers.{i}.self_attn.q_proj.weight", True),
    "k_proj": ("model.layers.{i}.self_attn.k_proj.weight", True),
    "v_proj": ("model.layers.{i}.self_attn.v_proj.weight", True),
    "o_proj": ("model.layers.{i}.self_attn.o_proj.weight", True),
    "q_bias": ("model.layers.{i}.self_attn.q_proj.bias", False),
    "k_bias": ("model.layers.{i}.self_attn.k_proj.bias", False),
    "v_bias": ("model.layers.{i}.self_attn.v_proj.bias", False),
    "post_attention_layernorm": ("model.layers.{i}.post_attention_layernorm.weight", False),
    "gate_proj": ("model.layers.{i}.mlp.gate_proj.weight", True),
    "up_proj": ("model.layers.{i}.mlp.up_proj.weight", True),
    "down_proj": ("model.layers.{i}.mlp.down_proj.weight", True),
}
TOP_NAMES: dict[str, tuple[str, bool]] = {
    "embed_tokens": ("model.embed_tokens.weight", False),
    "norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}
# Buffers some older checkpoints carry that hold no parameters.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
_DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


class CheckpointFormatError(ValueError):
    """An HF model directory whose tensors do not fit the config, naming the tensor."""


def _tensor_index(path: str) -> dict[str, str]:
    """HF tensor name -> the safetensors file that holds it."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    if os.path.isfile(single):
        with safe_open(single, framework="numpy") as f:
            return {name: single for name in f.keys()}
    raise CheckpointFormatError(
        f"{path}: neither model.safetensors nor model.safetensors.index.json is here "
        "(only safetensors checkpoints are read; convert .bin files with transformers first)"
    )


def _expected(
    cfg: ModelConfig, abstract: dict
) -> Iterator[tuple[tuple[str, ...], str, bool, int | None]]:
    """(our path, HF name, transposed, layer or None) for every tensor the config implies."""
    for key, (name, transposed) in TOP_NAMES.items():
        if key in abstract:
            yield (key,), name, transposed, None
    for key, (name, transposed) in LAYER_NAMES.items():
        if key in abstract["layers"]:
            for i in range(cfg.num_hidden_layers):
                yield ("layers", key), name.format(i=i), transposed, i


def load_hf_params(
    path: str,
    cfg: ModelConfig,
    abstract: dict,
    place: Callable[[tuple[str, ...], np.ndarray], jax.Array] | None = None,
) -> dict:
    """Read an HF model directory's tensors into a pure-dict params tree shaped like `abstract`.

    `abstract` is the model's pure-dict tree of ShapeDtypeStructs (from jax.eval_shape); each
    parameter is assembled on the host in its dtype, then handed to `place` (default:
    jax.device_put), so a caller can put it straight into its sharding.
    """
    place = place or (lambda _, x: jax.device_put(x))
    files = _tensor_index(path)
    expected = list(_expected(cfg, abstract))
    wanted = {name for _, name, _, _ in expected}
    extra = [
        n
        for n in files
        if n not in wanted
        and not n.endswith(_IGNORED_SUFFIXES)
        and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
    ]
    if extra:
        raise CheckpointFormatError(
            f"{path}: tensors not in a {cfg.architecture} of this config: {', '.join(sorted(extra)[:5])}"
            + (f" (+{len(extra) - 5} more)" if len(extra) > 5 else "")
        )
    missing = [n for n in wanted if n not in files]
    if missing:
        raise CheckpointFormatError(
            f"{path}: missing tensors: {', '.join(sorted(missing)[:5])}"
            + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        )

    handles: dict[str, object] = {}

    def read(name: str) -> np.ndarray:
        file = files[name]
        if file not in handles:
            handles[file] = safe_open(file, framework="numpy").__enter__()
        return handles[file].get_tensor(name)

    out: dict = {"layers": {}}
    by_param: dict[tuple[str, ...], list] = {}
    for key, name, transposed, layer in expected:
        by_param.setdefault(key, []).append((name, transposed, layer))
    try:
        for key, entries in by_param.items():
            spec = abstract[key[0]] if len(key) == 1 else abstract["layers"][key[1]]
            host = np.empty(spec.shape, _np_dtype(spec.dtype))
            for name, transposed, layer in entries:
                t = read(name)
                t = t.T if transposed else t
                want = spec.shape if layer is None else spec.shape[1:]
                if t.shape != tuple(want):
                    raise CheckpointFormatError(
                        f"{files[name]}: tensor {name} has shape {list(t.shape)}"
                        f"{' (transposed)' if transposed else ''}, the config implies {list(want)}"
                    )
                if layer is None:
                    host[...] = t.astype(host.dtype)
                else:
                    host[layer] = t.astype(host.dtype)
            target = out if len(key) == 1 else out["layers"]
            target[key[-1]] = place(key, host)
            del host
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    return out


def _np_dtype(dtype) -> np.dtype:
    return np.dtype(jnp.dtype(dtype))  # jnp knows "bfloat16" and jnp.bfloat16 (ml_dtypes)


def _to_host(x: jax.Array) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.sharding.is_fully_replicated:  # every process holds it whole
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def _hf_tensors(
    cfg: ModelConfig, params: dict, dtype
) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
    """(HF name, a thunk giving the tensor) in HF's order, unstacking layers lazily."""
    cache: dict[tuple[str, ...], np.ndarray] = {}

    def get(key: tuple[str, ...]) -> np.ndarray:
        if key not in cache:
            cache.clear()  # one stacked parameter on the host at a time
            x = params[key[0]] if len(key) == 1 else params["layers"][key[1]]
            cache[key] = _to_host(x)
        return cache[key]

    def thunk(key, transposed, layer):
        def make():
            t = get(key) if layer is None else get(key)[layer]
            t = t.T if transposed else t
            return np.ascontiguousarray(t.astype(_np_dtype(dtype) if dtype else t.dtype))

        return make

    for key, name, transposed, layer in _expected(cfg, params):
        yield name, thunk(key, transposed, layer)


def save_hf(
    path: str,
    cfg: ModelConfig,
    params: dict,
    *,
    dtype=None,
    tokenizer_dir: str | None = None,
    max_shard_bytes: int = _DEFAULT_MAX_SHARD_BYTES,
    write: bool = True,
) -> None:
    """Export params to `path` as HF config.json + safetensors (sharded with an index if large).

    dtype: the dtype on disk (default: the params' own). Tokenizer files found in
    `tokenizer_dir` are copied beside the weights. With several processes every one must call
    this (gathering a sharded parameter is collective); only the one with `write` writes.
    """
    if not write:
        for _, make in _hf_tensors(cfg, params, dtype):
            make()
        return
    os.makedirs(path, exist_ok=True)
    for stale in os.listdir(path):
        if stale.startswith("model") and stale.endswith(
            (".safetensors", ".safetensors.index.json")
        ):
            os.remove(os.path.join(path, stale))
    tensors = list(_hf_tensors(cfg, params, dtype))
    sizes = {
        name: int(np.prod(shape)) * np.dtype(dt).itemsize
        for name, (shape, dt) in _hf_shapes(cfg, params, dtype)
    }
    shards: list[list[str]] = [[]]
    acc = 0
    for name, _ in tensors:
        if shards[-1] and acc + sizes[name] > max_shard_bytes:
            shards.append([])
            acc = 0
        shards[-1].append(name)
        acc += sizes[name]
    thunks = dict(tensors)
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(
            {n: thunks[n]() for n in shards[0]}, os.path.join(path, "model.safetensors"), meta
        )
    else:
        weight_map = {}
        for k, names in enumerate(shards):
            file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: thunks[n]() for n in names}, os.path.join(path, file), meta)
            weight_map.update({n: file for n in names})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump(
                {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map},
                f,
                indent=2,
            )
    hf_cfg = cfg.to_hf_dict()
    hf_cfg["torch_dtype"] = _np_dtype(dtype or params["embed_tokens"].dtype).name
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)
        f.write("\n")
    if tokenizer_dir:
        copy_tokenizer_files(tokenizer_dir, path)


def _hf_shapes(cfg: ModelConfig, params: dict, dtype) -> Iterator[tuple[str, tuple[tuple, object]]]:
    for key, name, transposed, layer in _expected(cfg, params):
        x = params[key[0]] if len(key) == 1 else params["layers"][key[1]]
        shape = x.shape if layer is None else x.shape[1:]
        yield name, (shape[::-1] if transposed else shape, _np_dtype(dtype or x.dtype))


def copy_tokenizer_files(src: str, dst: str) -> list[str]:
    """Copy the tokenizer files present in `src` into `dst`; returns the names copied."""
    copied = []
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)) and os.path.abspath(src) != os.path.abspath(dst):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
            copied.append(name)
    return copied


def from_pretrained(path: str, **model_kwargs) -> Llama:
    """A Llama built from an HF model directory's config.json and safetensors."""
    cfg = ModelConfig.from_hf_dir(path)
    graphdef, abstract, _ = abstract_model(cfg, **model_kwargs)
    return nnx.merge(graphdef, load_hf_params(path, cfg, abstract))


def save_pretrained(path: str, model: Llama, **kwargs) -> None:
    """Export a Llama to an HF model directory (see save_hf for the keyword arguments)."""
    save_hf(path, model.cfg, params_of(model), **kwargs)
