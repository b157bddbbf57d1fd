"""Parity with transformers in float32, HF import/export round trips and bad checkpoints."""

import dataclasses
import functools
import json
import os

import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_models import hf_logits, tiny_llama, tiny_qwen2, tiny_qwen3
from safetensors.numpy import load_file, save_file

from jaxllmq.model import hf
from jaxllmq.model.architecture import ModelConfig, ModelConfigError
from jaxllmq.model.llama import abstract_model, params_of

BUILDERS = {
    "llama": tiny_llama,
    "qwen2": tiny_qwen2,
    "qwen3": tiny_qwen3,
    "qwen3-tied": functools.partial(tiny_qwen3, tie=True),
}


@pytest.fixture(params=sorted(BUILDERS), scope="module")
def hf_dir(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    return path, BUILDERS[request.param](path)


def _tokens(vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=(2, 37), dtype=np.int32)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_logits_match_transformers(hf_dir, scan_layers):
    path, ref = hf_dir
    model = hf.from_pretrained(path, scan_layers=scan_layers, attention="xla")
    tokens = _tokens(model.cfg.vocab_size, seed=np.random.SeedSequence().entropy % 2**31)
    ours = np.asarray(model.logits(tokens))
    theirs = hf_logits(ref, tokens)
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() < 1e-4


def test_per_layer_hidden_states_match(hf_dir):
    path, ref = hf_dir
    model = hf.from_pretrained(path, scan_layers=False, attention="xla")
    tokens = _tokens(model.cfg.vocab_size, seed=1)
    with torch.no_grad():
        out = ref(torch.as_tensor(tokens, dtype=torch.long), output_hidden_states=True)
    # hidden_states[0] is the embedding, then each layer's output (the last one also normed):
    # run the first n layers, normalize without a weight, compare with HF's n-th state normed.
    params = params_of(model)
    for n in range(1, model.cfg.num_hidden_layers):
        cut_cfg = dataclasses.replace(model.cfg, num_hidden_layers=n)
        graphdef, _, _ = abstract_model(cut_cfg, scan_layers=False, attention="xla")
        cut = dict(params, layers={k: v[:n] for k, v in params["layers"].items()})
        cut["norm"] = np.ones_like(cut["norm"])
        x = np.asarray(nnx.merge(graphdef, cut)(tokens)).astype(np.float64)
        h = out.hidden_states[n].double().numpy()
        h_normed = h / np.sqrt((h * h).mean(-1, keepdims=True) + model.cfg.rms_norm_eps)
        assert np.abs(x - h_normed).max() < 1e-4, f"layer {n - 1} diverges"


def test_round_trip_bytes_and_transformers_loads(hf_dir, tmp_path):
    path, ref = hf_dir
    model = hf.from_pretrained(path, attention="xla")
    out = str(tmp_path / "export")
    hf.save_pretrained(out, model)
    # Unchanged model: the same tensors, byte for byte, as transformers wrote.
    theirs = load_file(os.path.join(path, "model.safetensors"))
    ours = load_file(os.path.join(out, "model.safetensors"))
    if model.cfg.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert (
            ours[name].dtype == theirs[name].dtype
            and ours[name].tobytes() == theirs[name].tobytes()
        ), name
    # Exporting again gives the same file, byte for byte.
    hf.save_pretrained(str(tmp_path / "again"), hf.from_pretrained(out, attention="xla"))
    with open(os.path.join(out, "model.safetensors"), "rb") as a:
        with open(str(tmp_path / "again" / "model.safetensors"), "rb") as b:
            assert a.read() == b.read()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype="float32")
    tokens = _tokens(model.cfg.vocab_size, seed=2)
    assert np.abs(hf_logits(loaded, tokens) - hf_logits(ref, tokens)).max() < 1e-5


def test_sharded_export_with_index(hf_dir, tmp_path):
    path, ref = hf_dir
    model = hf.from_pretrained(path, attention="xla")
    out = str(tmp_path / "sharded")
    hf.save_pretrained(out, model, max_shard_bytes=20_000, dtype="bfloat16")
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    files = set(index["weight_map"].values())
    assert len(files) > 2 and not os.path.exists(os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    back = hf.from_pretrained(out, attention="xla")  # reads the index, bf16 on disk -> fp32
    tokens = _tokens(model.cfg.vocab_size, seed=3)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype="float32")
    np.testing.assert_allclose(
        np.asarray(back.logits(tokens)), hf_logits(loaded, tokens), atol=1e-4
    )


def test_missing_config_is_a_clear_error(tmp_path):
    with pytest.raises(ModelConfigError, match="no config.json"):
        hf.from_pretrained(str(tmp_path))


def test_unknown_architecture_is_a_clear_error(hf_dir, tmp_path):
    path, _ = hf_dir
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f)
    d["architectures"] = ["GPTNeoXForCausalLM"]
    with pytest.raises(ModelConfigError, match="GPTNeoXForCausalLM.*not supported"):
        ModelConfig.from_hf_dict(d)


def test_wrong_shape_names_the_tensor(hf_dir, tmp_path):
    path, _ = hf_dir
    tensors = load_file(os.path.join(path, "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = tensors[name][:-1]
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(tensors, str(bad / "model.safetensors"), {"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        (bad / "config.json").write_text(f.read())
    with pytest.raises(hf.CheckpointFormatError, match=name.replace(".", r"\.") + ".*shape"):
        hf.from_pretrained(str(bad))


def test_missing_and_extra_tensors_are_named(hf_dir, tmp_path):
    path, _ = hf_dir
    tensors = load_file(os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config_text = f.read()
    for label, edit, pattern in [
        ("missing", lambda t: t.pop("model.norm.weight"), r"missing tensors: model\.norm\.weight"),
        ("extra", lambda t: t.update(extra_tensor=t["model.norm.weight"]), "extra_tensor"),
    ]:
        bad = tmp_path / label
        bad.mkdir()
        t = dict(tensors)
        edit(t)
        save_file(t, str(bad / "model.safetensors"))
        (bad / "config.json").write_text(config_text)
        with pytest.raises(hf.CheckpointFormatError, match=pattern):
            hf.from_pretrained(str(bad))


def test_no_safetensors_is_a_clear_error(hf_dir, tmp_path):
    path, _ = hf_dir
    with open(os.path.join(path, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    with pytest.raises(hf.CheckpointFormatError, match="neither model.safetensors"):
        hf.from_pretrained(str(tmp_path))
