"""fp8 block linears (model/fp8.py): scaling and saturation, dense's forward and gradients against
bf16, the train step's program, a short training run against bf16, a bit-exact resume."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllmq import train
from jaxllmq.config import ConfigError, ModelSpec
from jaxllmq.data.shards import write_shard
from jaxllmq.model import fp8
from jaxllmq.model.config import preset
from jaxllmq.model.llama import Llama, abstract_model, params_of
from jaxllmq.optim import OptimConfig, lr_schedule, make_optimizer

CFG = dataclasses.replace(
    preset("tiny"),
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
)
# Relative error of one e4m3 (3 mantissa bits) rounding is at most 2^-4, about 3% rms on normal
# data; a matmul's output and gradients land near that. e5m2 gradients have one bit less.
TOL = {"e4m3": 0.06, "e5m2": 0.09}


def _rel(a: jax.Array, b: jax.Array) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _xw(seed: int = 0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (2, 24, 64), jnp.float32).astype(jnp.bfloat16)
    w = (0.02 * jax.random.normal(kw, (64, 80), jnp.float32)).astype(jnp.bfloat16)
    return x, w


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_scale_is_the_power_of_two_that_fits_the_abs_max(name):
    dtype = fp8.fp8_dtype(name)
    fmax = float(jnp.finfo(dtype).max)
    for amax in (fmax, fmax * 1.001, fmax / 2, fmax / 2 * 1.001, 1e-3, 3.7e5, 2.0**-20):
        s = float(fp8.scale_of(jnp.array([0.5 * amax, -amax]), dtype))
        assert np.log2(s) == round(np.log2(s)), (amax, s)
        assert fmax / 2 < amax / s <= fmax, (amax, s)
    assert float(fp8.scale_of(jnp.zeros(4), dtype)) == 1.0


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_quantize_saturates_instead_of_overflowing(name):
    dtype = fp8.fp8_dtype(name)
    fmax = float(jnp.finfo(dtype).max)
    x = jnp.array([1e9, -1e9, fmax * 1.1, 3.0, -0.3, 0.0], jnp.float32)
    q = fp8.quantize(x, dtype, jnp.float32(1.0)).astype(jnp.float32)
    np.testing.assert_array_equal(q[:3], [fmax, -fmax, fmax])  # a plain cast gives NaN or inf
    # In range it is the ordinary round-to-nearest cast; the power-of-two scale adds no rounding.
    np.testing.assert_array_equal(q[3:], x[3:].astype(dtype).astype(jnp.float32))
    q8 = fp8.quantize(x[3:] * 8, dtype, jnp.float32(8.0)).astype(jnp.float32)
    np.testing.assert_array_equal(q8, q[3:])


def test_dense_forward_is_the_scaled_fp8_product_and_near_bf16():
    x, w = _xw()
    y = jax.jit(fp8.dense)(x, w)
    assert y.dtype == jnp.bfloat16 and y.shape == (2, 24, 80)
    e4m3 = fp8.fp8_dtype("e4m3")
    x2 = x.reshape(-1, 64)
    sx, sw = fp8.scale_of(x2, e4m3), fp8.scale_of(w, e4m3)
    dq = lambda a, s: fp8.quantize(a, e4m3, s).astype(jnp.float32) * s
    ref = (dq(x2, sx) @ dq(w, sw)).astype(jnp.bfloat16).reshape(y.shape)
    # fp32 accumulation, one rounding to bf16: equal up to summation order (one bf16 ulp).
    np.testing.assert_allclose(np.float32(y), np.float32(ref), rtol=2**-7, atol=1e-6)
    assert _rel(y, x.astype(jnp.float32) @ w.astype(jnp.float32)) < TOL["e4m3"]


@pytest.mark.parametrize("grad_dtype", ["e4m3", "e5m2"])
def test_dense_gradients_are_near_bf16(grad_dtype):
    x, w = _xw(1)
    t = jax.random.normal(jax.random.key(2), (2, 24, 80), jnp.float32)

    def loss(matmul, x, w):
        return jnp.sum(matmul(x, w).astype(jnp.float32) * t)

    f8 = lambda a, b: fp8.dense(a, b, "e4m3", grad_dtype)
    gx, gw = jax.jit(jax.grad(lambda x, w: loss(f8, x, w), argnums=(0, 1)))(x, w)
    ref = lambda a, b: a.astype(jnp.float32) @ b.astype(jnp.float32)
    rx, rw = jax.grad(lambda x, w: loss(ref, x, w), argnums=(0, 1))(x, w)
    assert gx.dtype == x.dtype and gw.dtype == w.dtype and gx.shape == x.shape
    assert _rel(gx, rx) < TOL[grad_dtype] and _rel(gw, rw) < TOL[grad_dtype]


def test_linear_fn_picks_matmul_or_fp8():
    x, w = _xw()
    assert fp8.linear_fn(None)(x, w).dtype == jnp.bfloat16
    np.testing.assert_array_equal(fp8.linear_fn(None)(x, w), x @ w)
    np.testing.assert_array_equal(fp8.linear_fn("e4m3")(x, w), fp8.dense(x, w))
    with pytest.raises(ValueError, match="e4m2"):
        fp8.linear_fn("e4m3", "e4m2")
    with pytest.raises(ValueError, match="bf16"):
        Llama(CFG, rngs=train.nnx.Rngs(0), linear_dtype="bf16")


def _step(cfg, linear_dtype: str | None, gradient_dtype: str | None = None, scan: bool = True):
    """A bf16 model's (state, jitted train step, graphdef), its block linears in linear_dtype."""
    optim = OptimConfig(lr=3e-3, warmup=10, weight_decay=0.0)
    graphdef, _, axes = abstract_model(
        cfg,
        dtype=jnp.bfloat16,
        attention="xla",
        scan_layers=scan,
        linear_dtype=linear_dtype,
        gradient_dtype=gradient_dtype,
    )
    params = params_of(Llama(cfg, rngs=train.nnx.Rngs(0)))
    opt = make_optimizer(optim, 1000, axes)
    state = train.TrainState(jnp.zeros((), jnp.int32), params, opt.init(params))
    step = jax.jit(train.make_train_step(graphdef, opt, lr_schedule(optim, 1000)))
    return state, step, graphdef


def _markov_batch(rng: np.random.Generator, rows: int, t: int, vocab: int) -> dict:
    """Rows from a fixed sparse bigram chain (about 1.4 nats per token): learnable, not memorable."""
    table = np.random.default_rng(123).dirichlet(np.full(vocab, 0.05), size=vocab).cumsum(1)
    tokens = np.empty((rows, t + 1), np.int32)
    tokens[:, 0] = rng.integers(0, vocab, rows)
    for i in range(t):
        u = rng.random(rows)[:, None]
        tokens[:, i + 1] = np.minimum((u > table[tokens[:, i]]).sum(1), vocab - 1)
    return {
        "inputs": tokens[None, :, :-1],
        "targets": tokens[None, :, 1:],
        "loss_mask": np.ones((1, rows, t), bool),
    }


@pytest.mark.parametrize("scan", [True, False])
def test_train_step_runs_exactly_the_block_linears_in_fp8(scan):
    cfg = CFG
    state, step, _ = _step(cfg, "e4m3", "e5m2", scan=scan)
    batch = _markov_batch(np.random.default_rng(0), 2, 16, cfg.vocab_size)
    text = step.lower(state, batch).as_text()
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    fp8_dots = [d for d in dots if "f8E4M3FN" in d or "f8E5M2" in d]
    layers = 1 if scan else cfg.num_hidden_layers  # a scanned body appears once in the program
    # 7 linears x (forward e4m3 x e4m3, dgrad e5m2 x e4m3, wgrad e4m3 x e5m2) per layer.
    assert len(fp8_dots) == 21 * layers, fp8_dots
    assert sum("f8E5M2" in d for d in fp8_dots) == 14 * layers
    # The LM head (its output has the vocab dim) and attention stay in bf16.
    assert not any(f"x{cfg.vocab_size}x" in d or f"<{cfg.vocab_size}x" in d for d in fp8_dots)
    assert any(re.search(rf"x{cfg.vocab_size}xbf16>", d) for d in dots)


def test_fp8_training_reaches_the_bf16_loss():
    # 100 steps of 1k tokens on the bigram chain (the smallest run that is still honest on CPU):
    # both fall from ln(96) = 4.56 to ~2.4 held-out, 0.25 above the chain's entropy (2.16), and
    # land ~0.1% apart (300 steps: 2.274 vs 2.276). A wrong scale or gradient would not.
    rng = np.random.default_rng(1)
    data = [_markov_batch(rng, 16, 64, CFG.vocab_size) for _ in range(100)]
    eval_batch = _markov_batch(np.random.default_rng(99), 32, 64, CFG.vocab_size)
    finals = {}
    for linear in (None, "e4m3"):
        state, step, graphdef = _step(CFG, linear, "e5m2" if linear else None)
        for batch in data:
            state, _ = step(state, batch)
        ce, tokens = jax.jit(train.make_eval_step(graphdef))(state.params, eval_batch)
        finals[linear] = float(ce) / int(tokens)
    assert finals[None] < 2.6, finals  # it learned
    assert abs(finals["e4m3"] - finals[None]) < 0.02 * finals[None], finals


def test_model_spec_refuses_dtype_combinations_naming_the_flag():
    ok = ModelSpec(model="tiny", from_scratch=True, linear_dtype="e4m3", gradient_dtype="e5m2")
    assert ok.matmul_dtype == "bfloat16"
    bad = [
        (dict(model_dtype="e4m3"), "--model_dtype=e4m3"),
        (dict(matmul_dtype="e4m3"), "--matmul_dtype=e4m3"),
        (dict(matmul_dtype="float32", linear_dtype="e4m3"), "computes in bfloat16"),
        (dict(linear_dtype="e4m3", gradient_dtype="bfloat16"), "--gradient_dtype=bfloat16"),
        (dict(gradient_dtype="e5m2"), "--gradient_dtype=e5m2 needs --matmul_dtype=e4m3"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ConfigError, match=re.escape(message)):
            ModelSpec(model="tiny", from_scratch=True, **kwargs)


def _main(args: list[str], cache: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache)  # the second run compiles nothing
    return subprocess.run(
        [sys.executable, "-m", "jaxllmq.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_fp8_run_resumes_bit_exactly(tmp_path):
    # Current scaling keeps no state: a checkpoint holds what a bf16 run's does, and the run
    # continues as if never stopped.
    rng = np.random.default_rng(0)
    write_shard(
        tmp_path / "train.bin", rng.integers(0, 256, 20 * 17, dtype=np.int32), vocab_size=256
    )
    out = str(tmp_path)

    def flags(*extra):
        return [
            "--model=tiny",
            "--from_scratch",
            f"--train_file={out}/train.bin",
            "--seq_len=16",
            "--gpus=1",
            "--batch_size=4",
            "--matmul_dtype=e4m3",
            "--gradient_dtype=e5m2",
            "--lr_schedule=wsd",
            "--final_lr_fraction=1",
            "--eval_every_n_steps=0",
            "--ckpt_interval=2",
            "--ckpt_keep_n=0",
            *extra,
        ]

    first = _main(
        flags("--steps=4", f"--log_file={out}/a.jsonl", f"--checkpoint_dir={out}/ckpt"),
        f"{out}/cache",
    )
    assert first.returncode == 0, first.stderr[-3000:]
    resume = ["--steps=4", f"--continue={out}/ckpt/2", f"--log_file={out}/b.jsonl"]
    second = _main(flags(*resume, f"--checkpoint_dir={out}/ckpt2"), f"{out}/cache")
    assert second.returncode == 0, second.stderr[-3000:]
    steps = {}
    for name in ("a", "b"):
        with open(os.path.join(out, f"{name}.jsonl")) as f:
            recs = [r for r in map(json.loads, f) if r["log"] == "step"]
        steps[name] = {r["step"]: (r["loss"], r["norm"]) for r in recs}
    assert sorted(steps["b"]) == [3, 4]
    assert steps["b"] == {s: steps["a"][s] for s in (3, 4)}
    options = [json.loads(line) for line in open(os.path.join(out, "a.jsonl"))]
    model = next(r for r in options if r["log"] == "options")["model"]
    assert (model["matmul_dtype"], model["linear_dtype"], model["gradient_dtype"]) == (
        "bfloat16",
        "e4m3",
        "e5m2",
    )
    bad = _main(flags("--steps=1", "--matmul_dtype=float32", "--gradient_dtype=e5m2"), out)
    assert bad.returncode == 1 and "--gradient_dtype=e5m2 needs --matmul_dtype=e4m3" in bad.stderr
