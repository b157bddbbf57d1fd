"""The train step's arithmetic: accumulation, masking, non-finite skips, fine-tune start loss."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_models import tiny_llama

from jaxllmq import train_step
from jaxllmq.model import hf
from jaxllmq.model.architecture import preset
from jaxllmq.model.llama import Llama, abstract_model, params_of
from jaxllmq.optim import lr_schedule, make_optimizer
from jaxllmq.parallel.mesh import make_mesh
from jaxllmq.plan import plan_for
from jaxllmq.settings import ModelSpec, OptimConfig

SMALL = dataclasses.replace(preset("tiny"), num_hidden_layers=2, vocab_size=512)


def _setup(seed: int = 0, optim: OptimConfig | None = None, cfg=SMALL):
    optim = optim or OptimConfig(lr=1e-3, weight_decay=0.1, grad_clip=1.0)
    graphdef, _, axes = abstract_model(cfg)
    params = params_of(Llama(cfg, rngs=train_step.nnx.Rngs(seed)))
    opt = make_optimizer(optim, 10, axes)
    state = train_step.TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=opt.init(params)
    )
    step = jax.jit(train_step.make_train_step(graphdef, opt, lr_schedule(optim, 10)))
    return state, step


def _batch(rng: np.random.Generator, acc: int, b: int, t: int, vocab: int, mask_p: float = 0.0):
    tokens = rng.integers(0, vocab, size=(acc, b, t + 1), dtype=np.int32)
    mask = rng.random((acc, b, t)) >= mask_p
    return {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "loss_mask": mask}


def _max_diff(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def test_grad_accumulation_matches_one_big_batch():
    rng = np.random.default_rng()
    big = _batch(rng, 1, 4, 32, SMALL.vocab_size, mask_p=0.3)
    split = jax.tree.map(lambda x: x.reshape(2, 2, *x.shape[2:]), big)
    # Adam's first update is ~lr * sign(g): with a tiny epsilon, grads near zero turn fp32
    # rounding into full-size differences. A larger epsilon keeps the update proportional to g.
    optim = OptimConfig(lr=1e-3, weight_decay=0.1, adam_epsilon=1e-4)
    state, step = _setup(optim=optim)
    s1, m1 = step(state, big)
    state, step = _setup(optim=optim)
    s2, m2 = step(state, split)
    assert abs(float(m1["loss"]) - float(m2["loss"])) < 1e-5
    assert abs(float(m1["norm"]) - float(m2["norm"])) < 1e-5
    assert _max_diff(s1.params, s2.params) < 1e-6
    assert int(m1["tokens"]) == int(big["loss_mask"].sum())


def test_masked_tokens_contribute_nothing():
    rng = np.random.default_rng(0)
    batch = _batch(rng, 2, 2, 32, SMALL.vocab_size, mask_p=0.5)
    garbage = dict(batch)
    garbage["targets"] = np.where(
        batch["loss_mask"], batch["targets"], (batch["targets"] + 7) % 512
    )
    state, step = _setup()  # one step, compiled once: it does not donate the state
    s1, m1 = step(state, batch)
    s2, m2 = step(state, garbage)
    assert float(m1["loss"]) == float(m2["loss"])
    assert _max_diff(s1.params, s2.params) == 0.0
    # And they would have mattered had they been trained on. (Not by the loss: an untrained
    # model's is about ln(vocab) whatever the targets, and an unseeded batch once left it within
    # 6e-5; the update moves with the targets.)
    s3, _ = step(state, dict(garbage, loss_mask=np.ones_like(batch["loss_mask"])))
    assert _max_diff(s1.params, s3.params) > 1e-4


def test_nonfinite_loss_is_skipped_and_counted(monkeypatch):
    real = train_step.lm_head_loss

    def poisoned(h, w, targets, mask, **kw):
        obj, aux = real(h, w, targets, mask, **kw)
        # Token 0 at the first target position poisons the objective (and so the gradients).
        return obj * jnp.where(targets[0] == 0, jnp.nan, 1.0), aux

    monkeypatch.setattr(train_step, "lm_head_loss", poisoned)
    rng = np.random.default_rng(0)
    good = _batch(rng, 1, 2, 16, SMALL.vocab_size)
    good["targets"][0, 0, 0] = 1
    bad = jax.tree.map(np.copy, good)
    bad["targets"][0, 0, 0] = 0
    state, step = _setup()
    before = jax.tree.map(np.asarray, state.params)
    state, m = step(state, bad)
    assert int(m["nonfinite"]) == 1 and int(m["nonfinite_total"]) == 1
    assert _max_diff(before, state.params) == 0.0
    state, m = step(state, bad)
    assert int(m["nonfinite"]) == 2
    state, m = step(state, good)
    assert int(m["nonfinite"]) == 0 and int(m["nonfinite_total"]) == 2
    assert _max_diff(before, state.params) > 0.0
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(state.params))


def test_finetune_starts_at_the_loss_transformers_computes(tmp_path):
    ref = tiny_llama(str(tmp_path))
    model = hf.from_pretrained(str(tmp_path), attention="xla")
    graphdef, _, _ = abstract_model(model.cfg, attention="xla")
    rng = np.random.default_rng()
    batch = _batch(rng, 1, 2, 24, model.cfg.vocab_size)
    batch["loss_mask"][:] = True
    ce, tokens = jax.jit(train_step.make_eval_step(graphdef))(params_of(model), batch)
    # HF shifts labels itself: the whole window as both input and labels is our (inputs, targets).
    window = np.concatenate([batch["inputs"][0], batch["targets"][0][:, -1:]], axis=1)
    with torch.no_grad():
        out = ref(
            torch.as_tensor(window, dtype=torch.long),
            labels=torch.as_tensor(window, dtype=torch.long),
        )
    assert int(tokens) == 48
    assert abs(float(ce) / int(tokens) - float(out.loss)) < 1e-5


@pytest.mark.parametrize("acc", [1, 3])
def test_loss_falls_on_a_repeated_batch(acc):
    rng = np.random.default_rng()
    batch = _batch(rng, acc, 2, 32, SMALL.vocab_size)
    state, step = _setup(optim=OptimConfig(lr=3e-3, warmup=0))
    losses = []
    for _ in range(6):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0] - 1.0, losses


@pytest.mark.parametrize("lmhead_chunks", [1, 3])
def test_pallas_kernels_and_chunked_loss_match_xla_in_the_step(lmhead_chunks):
    cfg = dataclasses.replace(
        SMALL,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=131,
    )
    rng = np.random.default_rng()
    batch = _batch(rng, 2, 2, 16, cfg.vocab_size, mask_p=0.25)
    results = []
    for impl in ("xla", "pallas"):
        optim = OptimConfig(lr=1e-3, adam_epsilon=1e-4)
        graphdef, _, axes = abstract_model(cfg, norm_impl=impl)
        params = params_of(Llama(cfg, rngs=train_step.nnx.Rngs(0)))
        opt = make_optimizer(optim, 10, axes)
        state = train_step.TrainState(jnp.zeros((), jnp.int32), params, opt.init(params))
        loss = train_step.LmHeadLoss(impl, lmhead_chunks)
        step = train_step.make_train_step(graphdef, opt, lr_schedule(optim, 10), loss=loss)
        results.append(jax.jit(step)(state, batch))
    (s_xla, m_xla), (s_pal, m_pal) = results
    assert abs(float(m_xla["loss"]) - float(m_pal["loss"])) < 1e-5
    assert abs(float(m_xla["norm"]) - float(m_pal["norm"])) < 1e-4 * float(m_xla["norm"])
    assert _max_diff(s_xla.params, s_pal.params) < 1e-6


def test_gradients_are_pinned_row_major():
    # The fp8 weight-gradient GEMM writes [N, K]-major; unpinned, XLA stacked the layers'
    # gradients [K, L, N] and the optimizer read them transposed (docs/experiments, fp8).
    state, step = _setup()
    text = step.lower(state, _batch(np.random.default_rng(0), 1, 2, 16, SMALL.vocab_size)).as_text()
    pinned = re.findall(
        r"@LayoutConstraint\(.*?result_layouts = \[dense<\[?([0-9, ]+)\]?>.*?\(tensor<([0-9x]+)x",
        text,
    )
    leaves = jax.tree.leaves(state.params)
    shapes = {"x".join(map(str, x.shape)) for x in leaves}
    # Each parameter's gradient (and its accumulator) is pinned, minor-to-major [n-1, ..., 0].
    assert shapes <= {shape for _, shape in pinned}
    for layout, shape in pinned:
        ndim = shape.count("x") + 1
        assert [int(d) for d in layout.split(",")] == list(range(ndim))[::-1], (layout, shape)


def test_built_train_step_compiles_once():
    """The state build() returns is placed as the step returns it: a second step with the first's
    output reuses the compiled step (an uncommitted step counter once compiled it twice a run)."""
    mesh = make_mesh(1)
    spec = ModelSpec(model="tiny", from_scratch=True, matmul_dtype="float32", kernels="xla")
    plan = plan_for(SMALL, spec, mesh)
    built = train_step.build(SMALL, spec, OptimConfig(), plan, mesh=mesh, total_steps=2, seed=0)
    batch = jax.device_put(
        _batch(np.random.default_rng(0), 1, 2, 16, SMALL.vocab_size), built.batch_sharding
    )
    state, _ = built.train_step(built.state, batch)
    state, _ = built.train_step(state, batch)
    assert int(state.step) == 2
    assert built.train_step._cache_size() == 1
