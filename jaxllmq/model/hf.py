"""Hugging Face safetensors in and out: one name table between HF names and the model's params.

Import reads tensors lazily (one stacked parameter in host RAM at a time), so an 8B model does not
need twice its size in memory; export writes `config.json` + `model.safetensors`, or shards with an
index above `max_shard_bytes`, loadable by `transformers.AutoModelForCausalLM.from_pretrained`.
"""

import json
import os
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxllmq import atomic_dir
from jaxllmq.memory import check_loadable
from jaxllmq.model.architecture import ModelConfig
from jaxllmq.model.llama import Llama, abstract_model, params_of
from jaxllmq.tokenizer_files import copy_tokenizer_files

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
    "q_norm": ("model.layers.{i}.self_attn.q_norm.weight", False),
    "k_norm": ("model.layers.{i}.self_attn.k_norm.weight", False),
    "post_attention_layernorm": ("model.layers.{i}.post_attention_layernorm.weight", False),
    "pre_feedforward_layernorm": ("model.layers.{i}.pre_feedforward_layernorm.weight", False),
    "post_feedforward_layernorm": ("model.layers.{i}.post_feedforward_layernorm.weight", False),
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
# An image-text checkpoint's language model is stored under one of these prefixes (transformers
# saves Gemma 3's as the first, holds it in memory as the second), beside tensors of the vision
# side that a causal LM does not read.
_LANGUAGE_MODEL_PREFIXES = ("language_model.model.", "model.language_model.")
_LANGUAGE_MODEL_HEADS = ("language_model.lm_head.weight",)
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)
_DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


# The safetensors dtypes weights are read from (cast to the model's dtype). Integer and bool
# tensors are not weights, and fp8 ones need scales this reader does not apply.
_WEIGHT_DTYPES = ("F16", "BF16", "F32", "F64")


class CheckpointFormatError(ValueError):
    """An HF model directory whose files or tensors do not fit the config, naming the file."""


def _open(file: str):
    """An open safetensors file (its header read and checked); a damaged one is refused."""
    try:
        return safe_open(file, framework="numpy").__enter__()
    except (OSError, SafetensorError) as e:
        raise CheckpointFormatError(f"{file}: not a readable safetensors file ({e})") from None


def _tensor_index(path: str) -> dict[str, str]:
    """HF tensor name -> the safetensors file that holds it."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
            raise CheckpointFormatError(f"{index}: cannot read it as JSON ({e})") from None
        except (KeyError, TypeError):
            raise CheckpointFormatError(f"{index}: no 'weight_map' in it") from None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise CheckpointFormatError(
                f"{index}: 'weight_map' must map tensor names to shard file names"
            )
        files = {name: os.path.join(path, file) for name, file in weight_map.items()}
        absent = sorted({os.path.basename(f) for f in files.values() if not os.path.isfile(f)})
        if absent:
            raise CheckpointFormatError(
                f"{index}: names shard files that are not in {path}: {', '.join(absent[:3])}"
                + (f" (+{len(absent) - 3} more)" if len(absent) > 3 else "")
            )
        return files
    if os.path.isfile(single):
        f = _open(single)
        try:
            return {name: single for name in f.keys()}
        finally:
            f.__exit__(None, None, None)
    raise CheckpointFormatError(
        f"{path}: neither model.safetensors nor model.safetensors.index.json is here "
        "(only safetensors checkpoints are read; convert .bin files with transformers first)"
    )


def _language_model(files: dict[str, str]) -> tuple[dict[str, str], dict[str, str], int]:
    """`files` under a causal LM's names where they hold an image-text model's language model:
    (name -> file, name -> the name stored in the file, how many vision tensors were left)."""
    if not any(n.startswith(_LANGUAGE_MODEL_PREFIXES) for n in files):
        return files, {}, 0
    named, stored, vision = {}, {}, 0
    for n, file in files.items():
        if n.startswith(_VISION_PREFIXES):
            vision += 1
            continue
        name = "lm_head.weight" if n in _LANGUAGE_MODEL_HEADS else n
        for prefix in _LANGUAGE_MODEL_PREFIXES:
            if n.startswith(prefix):
                name = "model." + n[len(prefix) :]
        named[name], stored[name] = file, n
    return named, stored, vision


def _check_header(
    f, names: set[str], file: str, name: str, transposed: bool, want: tuple[int, ...]
) -> None:
    """Refuse a tensor that is not in `file` (open as `f`, holding `names`), is not floating
    point, or has the wrong shape."""
    if name not in names:
        raise CheckpointFormatError(f"{file}: tensor {name} is not in it (the index says it is)")
    header = f.get_slice(name)
    dtype = header.get_dtype()
    if dtype not in _WEIGHT_DTYPES:
        raise CheckpointFormatError(
            f"{file}: tensor {name} has dtype {dtype}; weights are read from floating point "
            f"({', '.join(_WEIGHT_DTYPES)}) only"
        )
    shape = list(header.get_shape())
    shape = shape[::-1] if transposed else shape
    if shape != list(want):
        raise CheckpointFormatError(
            f"{file}: tensor {name} has shape {shape}"
            f"{' (transposed)' if transposed else ''}, the config implies {list(want)}"
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
    files, stored, vision = _language_model(_tensor_index(path))
    if vision:
        logging.info(
            "%s: an image-text checkpoint: its language model is read, its %d vision tensors "
            "are not (an export is the language model alone, a %s)",
            path,
            vision,
            cfg.architecture,
        )
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

    out: dict = {"layers": {}}
    by_param: dict[tuple[str, ...], list] = {}
    for key, name, transposed, layer in expected:
        by_param.setdefault(key, []).append((name, transposed, layer))
    handles: dict[str, object] = {}
    try:
        # Every header first: a bad tensor is refused before any parameter is read.
        for file in sorted({files[name] for name in wanted}):
            handles[file] = _open(file)
        names = {file: set(h.keys()) for file, h in handles.items()}
        for key, entries in by_param.items():
            spec = abstract[key[0]] if len(key) == 1 else abstract["layers"][key[1]]
            for name, transposed, layer in entries:
                want = spec.shape if layer is None else spec.shape[1:]
                file = files[name]
                _check_header(
                    handles[file], names[file], file, stored.get(name, name), transposed, want
                )
        for key, entries in by_param.items():
            spec = abstract[key[0]] if len(key) == 1 else abstract["layers"][key[1]]
            host = np.empty(spec.shape, _np_dtype(spec.dtype))
            for name, transposed, layer in entries:
                t = handles[files[name]].get_tensor(stored.get(name, name))
                t = t.T if transposed else t
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
    `path` is replaced as a whole by atomic_dir.replace_dir: readers find the complete old model
    or the complete new one (its docstring names the one gap where renameat2 is missing), and the
    old directory's other files (a README, ...) are kept. A failed write raises
    atomic_dir.AtomicDirError naming `path`, and leaves it as it was.
    """
    if not write:
        for _, make in _hf_tensors(cfg, params, dtype):
            make()
        return
    atomic_dir.replace_dir(
        path,
        lambda tmp: _write_hf(tmp, cfg, params, dtype, tokenizer_dir, max_shard_bytes),
        superseded=_is_weights_file,
    )


def _is_weights_file(name: str) -> bool:
    """Whether `name` is a weights file of an HF export (an old one's shards are not kept)."""
    return name.startswith("model") and name.endswith((".safetensors", ".safetensors.index.json"))


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def _write_hf(path, cfg, params, dtype, tokenizer_dir, max_shard_bytes) -> None:
    """save_hf's files, written into the empty directory `path`."""
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
        _write_json(
            os.path.join(path, "model.safetensors.index.json"),
            {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map},
        )
    hf_cfg = cfg.to_hf_dict()
    hf_cfg["torch_dtype"] = _np_dtype(dtype or params["embed_tokens"].dtype).name
    _write_json(os.path.join(path, "config.json"), hf_cfg)
    if tokenizer_dir:
        copy_tokenizer_files(tokenizer_dir, path)


def _hf_shapes(cfg: ModelConfig, params: dict, dtype) -> Iterator[tuple[str, tuple[tuple, object]]]:
    for key, name, transposed, layer in _expected(cfg, params):
        x = params[key[0]] if len(key) == 1 else params["layers"][key[1]]
        shape = x.shape if layer is None else x.shape[1:]
        yield name, (shape[::-1] if transposed else shape, _np_dtype(dtype or x.dtype))


def from_pretrained(path: str, **model_kwargs) -> Llama:
    """A Llama built from an HF model directory's config.json and safetensors."""
    cfg = ModelConfig.from_hf_dir(path)
    dtype = model_kwargs.get("param_dtype", jnp.float32)
    check_loadable(cfg, os.path.join(path, "config.json"), dtype, jax.devices()[0])
    graphdef, abstract, _ = abstract_model(cfg, **model_kwargs)
    return nnx.merge(graphdef, load_hf_params(path, cfg, abstract))


def save_pretrained(path: str, model: Llama, **kwargs) -> None:
    """Export a Llama to an HF model directory (see save_hf for the keyword arguments)."""
    save_hf(path, model.cfg, params_of(model), **kwargs)
