"""Packed documents (--document_masking): a window of documents computes what each document
computes alone from position 0, in the model, the sharded steps and the data pipeline."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_tokenizer import write_tiny_tokenizer
from train_here import train_here

from jaxllmq import train_step
from jaxllmq.cli.prepare import main
from jaxllmq.data import pipeline
from jaxllmq.data.pipeline import TokenBatches, documents
from jaxllmq.data.shards import write_shard
from jaxllmq.model.architecture import preset
from jaxllmq.model.attention import document_spans
from jaxllmq.model.families import FULL, GEMMA3, SLIDING
from jaxllmq.model.llama import Llama, params_of
from jaxllmq.model.recompute import Recompute
from jaxllmq.parallel.mesh import make_mesh
from jaxllmq.plan import make_plan, plan_for
from jaxllmq.setting import SettingError
from jaxllmq.settings import DataConfig, ModelSpec, OptimConfig
from jaxllmq.tokenizer_files import EOS_FILE, write_eos_id

CFG = dataclasses.replace(
    preset("tiny"),
    num_hidden_layers=2,
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
)
SPEC = ModelSpec(model="tiny", from_scratch=True, matmul_dtype="float32", kernels="xla")
EOS = 3
T = 24


def _window(lengths: list[int], seed: int) -> np.ndarray:
    """T + 1 tokens: documents of `lengths` tokens, each ending with EOS (the last one cut at the
    window's end), no other EOS."""
    rng = np.random.default_rng(seed)
    tokens = [t for n in lengths for t in [*rng.integers(EOS + 1, CFG.vocab_size, n - 1), EOS]]
    return np.asarray(tokens[: T + 1], np.int32)


# A window starting mid-document (its last 4 tokens), documents of 7 and 1 tokens, and one cut
# by the window's end; a window of one document (no EOS).
WINDOWS = np.stack([_window([4, 7, 1, 20], 0), _window([40], 1)])


def _batch(windows: np.ndarray) -> dict[str, np.ndarray]:
    """What the pipeline gives for these windows (inputs, targets, masks, segments, positions)."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    segment_ids, positions, trained = documents(inputs, EOS, per_window=16)
    return dict(
        inputs=inputs,
        targets=targets,
        loss_mask=trained,
        segment_ids=segment_ids,
        positions=positions,
    )


def _model(scan_layers: bool = True, recompute: Recompute | None = None):
    """(graphdef, params) of a Llama of CFG in fp32 with XLA's attention."""
    model = Llama(
        CFG, rngs=nnx.Rngs(0), scan_layers=scan_layers, attention="xla", recompute=recompute
    )
    graphdef, _ = nnx.split(model)
    return graphdef, params_of(model)


def _ce_sum(logits_NxV, targets_N, mask_N):
    lse = jax.nn.logsumexp(logits_NxV, axis=-1)
    picked = jnp.take_along_axis(logits_NxV, targets_N[:, None], axis=-1)[:, 0]
    return jnp.sum(jnp.where(mask_N, lse - picked, 0.0))


def _alone(graphdef, params, batch) -> tuple[jax.Array, jax.Array]:
    """Logits [B, T, V] and the mean loss with each document run alone from position 0."""
    model = nnx.merge(graphdef, params)
    rows, loss = [], 0.0
    for b, segments in enumerate(batch["segment_ids"]):
        parts = []
        for s in np.unique(segments):
            idx = np.flatnonzero(segments == s)
            logits = model.logits(jnp.asarray(batch["inputs"][b, idx])[None])[0]
            parts.append(logits)
            loss += _ce_sum(logits, batch["targets"][b, idx], batch["loss_mask"][b, idx])
        rows.append(jnp.concatenate(parts))
    return jnp.stack(rows), loss / batch["loss_mask"].sum()


def _packed(graphdef, params, batch) -> tuple[jax.Array, jax.Array]:
    model = nnx.merge(graphdef, params)
    logits = model.logits(batch["inputs"], batch["positions"], batch["segment_ids"])
    V = logits.shape[-1]
    loss = _ce_sum(
        logits.reshape(-1, V), batch["targets"].reshape(-1), batch["loss_mask"].reshape(-1)
    )
    return logits, loss / batch["loss_mask"].sum()


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert np.max(np.abs(np.asarray(x) - np.asarray(y))) < 1e-5


def test_the_pipelines_documents(capsys):
    pipeline._joined_warned.clear()  # the warning is once a process
    inputs = np.array([[5, 3, 6, 7, 3, 3, 8], [9, 9, 9, 9, 9, 9, 9]], np.int32)
    segment_ids, positions, trained = documents(inputs, 3, per_window=4)
    np.testing.assert_array_equal(segment_ids, [[0, 0, 1, 1, 1, 2, 3], [0] * 7])
    np.testing.assert_array_equal(positions, [[0, 1, 0, 1, 2, 0, 0], list(range(7))])
    np.testing.assert_array_equal(trained, inputs != 3)
    assert capsys.readouterr().err == ""
    # Two documents a window: the third and fourth join the second, untrained.
    segment_ids, positions, trained = documents(inputs, 3, per_window=2)
    np.testing.assert_array_equal(segment_ids, [[0, 0, 1, 1, 1, 1, 1], [0] * 7])
    np.testing.assert_array_equal(positions, [[0, 1, 0, 1, 2, 0, 0], list(range(7))])
    np.testing.assert_array_equal(trained, [[1, 0, 1, 1, 0, 0, 0], [1] * 7])
    err = capsys.readouterr().err
    assert "a window holds 4 documents, more than --max_documents_per_window=2" in err
    pipeline._joined_warned.clear()
    # Joined documents with nothing to train (a packed window's padding): no warning.
    documents(inputs, 3, per_window=2, loss_mask_NxT=segment_ids < 1)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("scan_layers, recompute", [(True, None), (False, Recompute(block=True))])
def test_a_packed_window_computes_each_document_alone(scan_layers, recompute):
    graphdef, params = _model(scan_layers, recompute)
    batch = _batch(WINDOWS)
    assert len(np.unique(batch["segment_ids"][0])) == 4
    run = lambda forward: jax.jit(
        jax.value_and_grad(lambda p: forward(graphdef, p, batch)[::-1], has_aux=True)
    )(params)
    packed, alone = run(_packed), run(_alone)
    _close(packed, alone)  # loss, logits and gradients
    # Without the documents the window is one sequence: its logits differ.
    plain = jax.jit(lambda p: nnx.merge(graphdef, p).logits(batch["inputs"]))(params)
    assert np.max(np.abs(plain[0] - alone[0][1][0])) > 1e-3


# Windows of 5 keys, shorter than the documents of 7 and 20 tokens: Mistral's on every layer
# (a static window), Gemma 3's on its local layer (scanned: in a group of the two kinds).
WINDOWED = {
    "mistral": dataclasses.replace(CFG, architecture="MistralForCausalLM", sliding_window=5),
    "gemma3": dataclasses.replace(
        CFG,
        architecture=GEMMA3,
        sliding_window=5,
        layer_types=(SLIDING, FULL),
        query_pre_attn_scalar=16.0,
        rope_local_base_freq=1e4,
        tie_word_embeddings=True,
    ),
}


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_windows_and_documents_together_compute_each_document_alone(name):
    graphdef, params = nnx.split(Llama(WINDOWED[name], rngs=nnx.Rngs(0), attention="xla"))
    batch = _batch(WINDOWS)
    run = lambda forward: jax.jit(lambda p: forward(graphdef, p, batch))(params)
    _close(run(_packed), run(_alone))


_ALONE: dict = {}  # the last parameters _alone_loss_and_grads saw, and its result for them


def _alone_loss_and_grads(params) -> tuple[jax.Array, dict]:
    """The loss of WINDOWS with each document alone, and its gradients, at `params`. The sharded
    cases build the same initial parameters: computed once for them (~16 s of compiling)."""
    seen = _ALONE.get("params")
    same = lambda a, b: all(
        np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
    if seen is None or not same(seen, params):
        graphdef, _ = _model()
        result = jax.jit(jax.value_and_grad(lambda p: _alone(graphdef, p, _batch(WINDOWS))[1]))(
            params
        )
        _ALONE.update(params=params, result=result)
    return _ALONE["result"]


@pytest.mark.parametrize("zero_level, tp", [(3, 1), (1, 2)])
def test_the_sharded_steps_compute_each_document_alone(zero_level, tp):
    """On 8 devices (ZeRO-3; tensor parallelism 2 x 4 data): the loss and gradients of packed
    windows, and the train step (2 micro-batches) and eval step over them."""
    mesh = make_mesh(8, tensor_parallel=tp)
    plan = plan_for(CFG, SPEC, mesh, zero_level=zero_level, documents_per_window=16)
    assert plan.documents_per_window == 16 and plan.attention == "xla"
    optim = OptimConfig(grad_clip=0.0)
    built = train_step.build(CFG, SPEC, optim, plan, mesh=mesh, total_steps=2, seed=0)
    micro = _batch(np.concatenate([WINDOWS] * 4))  # 8 rows
    n = micro["loss_mask"].sum()
    on_mesh = lambda acc: jax.device_put(
        jax.tree.map(lambda x: np.stack([x] * acc), micro), built.batch_sharding
    )
    summed = lambda p, batch: train_step._micro_loss(
        p,
        built.graphdef,
        jax.tree.map(lambda x: x[0], batch),
        loss=train_step.LmHeadLoss(),
        z_loss=0.0,
    )[0]
    loss, grads = jax.jit(jax.value_and_grad(lambda p, b: summed(p, b) / n))(
        built.state.params, on_mesh(1)
    )
    ref_loss, ref_grads = _alone_loss_and_grads(jax.device_get(built.state.params))
    _close((loss, grads), (ref_loss, ref_grads))
    ce, tokens = built.eval_step(built.state.params, on_mesh(1))
    assert int(tokens) == n
    np.testing.assert_allclose(ce / n, ref_loss, rtol=1e-6)
    _, metrics = built.train_step(built.state, on_mesh(2))  # the same micro-batch twice
    assert int(metrics["tokens"]) == 2 * n
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-6)
    norm = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(ref_grads)))
    np.testing.assert_allclose(metrics["norm"], norm, rtol=1e-5)


def test_the_plan_takes_documents_as_cudnn_segments_on_gpu_and_a_mask_elsewhere():
    spec = ModelSpec(model="tiny", from_scratch=True, matmul_dtype="bfloat16")
    # Not Hopper: there `auto` runs jaxllmq's flash attention over documents.
    a100 = dict(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0")
    mesh = {"data": 1, "fsdp": 1, "tensor": 1}
    plan = make_plan(CFG, spec, mesh_shape=mesh, **a100, documents_per_window=32)
    assert plan.attention == "cudnn" and plan.to_record()["documents_per_window"] == 32
    assert "attention cudnn (documents as segments, up to 32 a window)" in plan.describe()
    plan = make_plan(CFG, spec, mesh_shape=mesh, platform="cpu", documents_per_window=16)
    assert "attention xla (documents by a mask, up to 16 a window)" in plan.describe()
    assert make_plan(CFG, spec, mesh_shape=mesh, platform="cpu").documents_per_window is None


def test_cudnn_spans_of_a_window():
    segment_ids = jnp.array([[0, 0, 0, 1, 1, 2, 2, 2], [0] * 8, list(range(8))])
    offsets, lengths = document_spans(segment_ids, 4)
    np.testing.assert_array_equal(
        offsets, [[0, 3, 5, -1, -1], [0, -1, -1, -1, -1], [0, 1, 2, 3, -1]]
    )
    np.testing.assert_array_equal(lengths, [[3, 2, 3, -1], [8, -1, -1, -1], [1, 1, 1, 5]])


def test_the_pipeline_gives_documents_from_a_shard(tmp_path):
    # Windows of 4 + 1 tokens in file order: one from a document's start, one from its EOS, one
    # from its middle.
    tokens = np.array([5, 6, 3, 7, 9, 3, 8, 3, 10, 11, 12, 3, 13, 14, 15], np.int32)
    mask = np.ones(len(tokens), bool)
    mask[1] = False  # a prompt token: its loss mask stays 0
    write_shard(tmp_path / "train.bin", tokens, mask, vocab_size=16)
    read = lambda **kw: next(
        TokenBatches(
            str(tmp_path / "train.bin"),
            seq_len=4,
            batch_size=3,
            shuffle=False,
            process_count=1,
            **kw,
        )
    )
    batch = read(eos_id=3)
    np.testing.assert_array_equal(
        batch["inputs"][0], [[5, 6, 3, 7], [3, 8, 3, 10], [12, 3, 13, 14]]
    )
    np.testing.assert_array_equal(
        batch["segment_ids"][0], [[0, 0, 0, 1], [0, 1, 1, 2], [0, 0, 1, 1]]
    )
    np.testing.assert_array_equal(batch["positions"][0], [[0, 1, 2, 0], [0, 0, 1, 0], [0, 1, 0, 1]])
    np.testing.assert_array_equal(batch["loss_mask"][0], [[0, 1, 0, 1], [0, 1, 0, 1], [1, 0, 1, 1]])
    assert sorted(read()) == ["inputs", "loss_mask", "targets"]  # without documents: as before


def test_prepare_records_the_eos_id_and_the_run_finds_it(tmp_path):
    tok = write_tiny_tokenizer(tmp_path, ["alpha beta gamma.", "delta epsilon."] * 20, "</s>")
    (tmp_path / "docs.txt").write_text("alpha beta.\n\ngamma delta epsilon.\n" * 30)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as done:
        main(["prepare", f"--input={tmp_path / 'docs.txt'}", f"--tokenizer={tmp_path}",
              f"--out_dir={out}", "--eval_fraction=0", "--workers=1"])  # fmt: skip
    assert done.value.code is None
    eos = tok.token_to_id("</s>")
    shard = str(out / "train-000.bin")
    assert DataConfig(train_files=(shard,), document_masking=True).document_eos_id == eos
    assert DataConfig(train_files=(shard,), document_masking=True, eos_id=7).document_eos_id == 7
    assert DataConfig(train_files=(shard,)).document_eos_id is None  # no masking, no id
    with pytest.raises(SettingError, match="^--eos_id=7 needs --document_masking"):
        DataConfig(train_files=(shard,), eos_id=7)
    os.remove(out / EOS_FILE)
    with pytest.raises(SettingError, match="^--document_masking needs the end-of-document id"):
        DataConfig(train_files=(shard,), document_masking=True)
    assert DataConfig(train_files=(shard,), document_masking=True, eos_id=eos).eos_id == eos


def test_documents_per_window(tmp_path):
    files = (str(tmp_path / "train.bin"),)
    data = lambda **kw: DataConfig(train_files=files, eos_id=3, document_masking=True, **kw)
    assert data(seq_len=8192).documents_per_window == data().documents_per_window == 32
    assert data(max_documents_per_window=5).documents_per_window == 5
    assert DataConfig(train_files=files, max_documents_per_window=5).documents_per_window is None
    with pytest.raises(SettingError, match="^--max_documents_per_window=0: must be >= 1"):
        data(max_documents_per_window=0)


def test_a_tiny_model_trains_on_documents_through_the_cli(tmp_path):
    rng = np.random.default_rng(0)
    docs = [np.r_[rng.integers(1, 64, rng.integers(2, 20)), 0] for _ in range(600)]
    tokens = np.concatenate(docs).astype(np.int32)
    write_shard(tmp_path / "train-000.bin", tokens, vocab_size=64)
    write_shard(tmp_path / "eval.bin", tokens[:2000], vocab_size=64)
    flags = [
        "--model=tiny",
        "--from_scratch",
        f"--train_file={tmp_path}/train-*.bin",
        f"--eval_file={tmp_path}/eval.bin",
        "--seq_len=32",
        "--batch_size=1",
        "--grad_accumulation=2",
        "--matmul_dtype=float32",
        "--steps=4",
        "--eval_every_n_steps=2",
        "--eval_num_steps=1",
        "--document_masking",
        f"--log_file={tmp_path}/log.jsonl",
    ]
    refused = train_here(*flags)  # no eos.json beside the shards, no --eos_id
    assert refused.returncode == 1
    assert "--document_masking needs the end-of-document id" in refused.stderr.strip()
    write_eos_id(str(tmp_path), 0)
    proc = train_here(*flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "log.jsonl") as f:
        records = [json.loads(line) for line in f]
    plan = next(r for r in records if r["log"] == "info" and "plan" in r)["plan"]
    assert plan["documents_per_window"] == 32 and plan["attention"] == "xla"
    steps = [r for r in records if r["log"] == "step"]
    assert len(steps) == 4 and all(np.isfinite(r["loss"]) for r in steps)
    # The token after each EOS is not trained on: fewer tokens than the windows hold.
    assert all(r["trained_tokens"] < r["tokens"] == 2 * 8 * 32 for r in steps)
    assert [r["step"] for r in records if r["log"] == "eval"] == [2, 4]
