"""fp8 block linears (model/fp8.py, fp8_delayed.py): scaling and saturation, dense's forward and
gradients against bf16 (current and delayed scaling), the amax histories, the train step's
program, a short training run against bf16, the histories' checkpoint and a bit-exact resume."""

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_here import train_here

from jaxllmq import checkpoint, checkpoint_files, resume_rules, train_step
from jaxllmq.data.shards import write_shard
from jaxllmq.kernels.rms_norm import rms_norm
from jaxllmq.model import fp8, fp8_delayed
from jaxllmq.model.architecture import preset
from jaxllmq.model.llama import Llama, abstract_model, params_of
from jaxllmq.optim import lr_schedule, make_optimizer
from jaxllmq.setting import SettingError
from jaxllmq.settings import CheckpointConfig, ModelSpec, OptimConfig

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
        Llama(CFG, rngs=train_step.nnx.Rngs(0), linear_dtype="bf16")


def _step(
    cfg,
    linear_dtype: str | None,
    gradient_dtype: str | None = None,
    scan: bool = True,
    delayed: bool = False,
):
    """A bf16 model's (state, jitted train step, graphdef), its block linears in linear_dtype
    (with delayed scaling: amax histories of 4 steps in the state)."""
    optim = OptimConfig(lr=3e-3, warmup=10, weight_decay=0.0)
    graphdef, _, axes = abstract_model(
        cfg,
        dtype=jnp.bfloat16,
        attention="xla",
        scan_layers=scan,
        linear_dtype=linear_dtype,
        gradient_dtype=gradient_dtype,
    )
    params = params_of(Llama(cfg, rngs=train_step.nnx.Rngs(0)))
    opt = make_optimizer(optim, 1000, axes)
    L = cfg.num_hidden_layers
    history = fp8_delayed.init_history(L, 4, params["layers"], jnp.bfloat16) if delayed else {}
    state = train_step.TrainState(jnp.zeros((), jnp.int32), params, opt.init(params), history)
    step = jax.jit(train_step.make_train_step(graphdef, opt, lr_schedule(optim, 1000)))
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


@pytest.mark.parametrize("scan, delayed", [(True, False), (False, False), (True, True)])
def test_train_step_runs_exactly_the_block_linears_in_fp8(scan, delayed):
    cfg = CFG
    state, step, _ = _step(cfg, "e4m3", "e5m2", scan=scan, delayed=delayed)
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


def _assert_recorded(
    before: train_step.TrainState, after: train_step.TrainState, batch: dict
) -> None:
    """after's amax histories are before's shifted by one, the newest the step's amaxes."""
    for kind, histories in before.fp8.items():
        for name, h_LxA in histories.items():
            new_LxA = np.asarray(after.fp8[kind][name])
            np.testing.assert_array_equal(new_LxA[:, 1:], h_LxA[:, :-1], err_msg=f"{kind}/{name}")
            assert np.all(new_LxA[:, 0] > 0) and np.all(np.isfinite(new_LxA[:, 0])), (kind, name)
    layers = before.params["layers"]
    for name in fp8_delayed.INPUTS:  # the bf16 weights the step multiplied by
        w = jnp.abs(layers[name].astype(jnp.bfloat16)).max(axis=(1, 2)).astype(jnp.float32)
        np.testing.assert_array_equal(after.fp8["w"][name][:, 0], w)
    # Layer 0's q/k/v input: the first RMSNorm of the embeddings (bf16, up to one ulp of fusion).
    x = before.params["embed_tokens"][batch["inputs"][0]].astype(jnp.bfloat16)
    norm0 = layers["input_layernorm"][0].astype(jnp.bfloat16)
    h = rms_norm(x, norm0, CFG.rms_norm_eps, impl="xla")
    got = float(after.fp8["x"]["input_layernorm"][0, 0])
    np.testing.assert_allclose(got, float(jnp.abs(h).max()), rtol=2**-7)


def test_fp8_training_reaches_the_bf16_loss():
    # 100 steps of 1k tokens on the bigram chain (the smallest run that is still honest on CPU):
    # both fall from ln(96) = 4.56 to ~2.4 held-out, 0.25 above the chain's entropy (2.16), and
    # land ~0.1% apart (300 steps: 2.274 vs 2.276). A wrong scale or gradient would not. Delayed
    # scaling too (its first step scales activations and gradients by 1); its last step's
    # histories are checked against that step's tensors.
    rng = np.random.default_rng(1)
    data = [_markov_batch(rng, 16, 64, CFG.vocab_size) for _ in range(100)]
    eval_batch = _markov_batch(np.random.default_rng(99), 32, 64, CFG.vocab_size)
    finals = {}
    for linear, delayed in ((None, False), ("e4m3", False), ("e4m3", True)):
        state, step, graphdef = _step(CFG, linear, "e5m2" if linear else None, delayed=delayed)
        # 100 steps: LLVM's -O1 (not the suite's -O0, conftest.py) runs CPU's fp8 emulation 3-4x
        # as fast, as fast as -O3, which takes twice as long to compile (7-11 s against 13-19).
        step = step.lower(state, data[0]).compile({"xla_backend_optimization_level": 1})
        for batch in data[:-1]:
            state, _ = step(state, batch)
        before = state
        state, _ = step(state, data[-1])
        if delayed:
            _assert_recorded(before, state, data[-1])
        ce, tokens = jax.jit(train_step.make_eval_step(graphdef))(state.params, eval_batch)
        finals[linear, delayed] = float(ce) / int(tokens)
    bf16 = finals[None, False]
    assert bf16 < 2.6, finals  # it learned
    for key in (("e4m3", False), ("e4m3", True)):
        assert abs(finals[key] - bf16) < 0.02 * bf16, finals


def test_delayed_dense_after_a_warmup_call_is_near_bf16_and_reports_amaxes():
    x, w = _xw(1)
    t = jax.random.normal(jax.random.key(2), (2, 24, 80), jnp.float32)

    def loss(ref, x, w, report_x=True):
        y = fp8_delayed.dense(x, w, ref, "e4m3", "e5m2", report_x=report_x)
        return jnp.sum(y.astype(jnp.float32) * t), y

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    # Warm-up: no history (scale 1); the references' gradient is this call's amaxes, exactly:
    # of x, of w, and of the output gradient (t in y's dtype).
    zero = (jnp.float32(0.0),) * 3
    (amax, _, _), _ = grad(zero, x, w)
    want = [jnp.abs(a).max().astype(jnp.float32) for a in (x, w, t.astype(jnp.bfloat16))]
    np.testing.assert_array_equal(amax, want)
    (amax_k, _, _), _ = grad(zero, x, w, False)  # k/v/up: q's (gate's) call reports x
    np.testing.assert_array_equal(amax_k, [0.0, want[1], want[2]])
    # Scaled from those, forward and gradients are as near bf16 as current scaling's.
    (_, gx, gw), y = grad(tuple(amax), x, w)
    f32 = lambda a, b: a.astype(jnp.float32) @ b.astype(jnp.float32)
    rx, rw = jax.grad(lambda x, w: jnp.sum(f32(x, w) * t), argnums=(0, 1))(x, w)
    assert y.dtype == jnp.bfloat16 and gx.dtype == x.dtype and gw.dtype == w.dtype
    assert _rel(y, f32(x, w)) < TOL["e4m3"]
    assert _rel(gx, rx) < TOL["e5m2"] and _rel(gw, rw) < TOL["e5m2"]
    # A tensor past its history saturates at the fp8 max instead of overflowing.
    (_, gx, gw), y = grad(tuple(a / 1000 for a in amax), x, w)
    assert bool(jnp.all(jnp.isfinite(y))) and bool(jnp.all(jnp.isfinite(gx)))


def test_amax_histories_shift_in_the_newest_and_forget_nonfinite():
    layers = {n: jnp.full((2, 4, 4), -0.5 * (i + 1)) for i, n in enumerate(fp8_delayed.INPUTS)}
    assert fp8_delayed.init_history(2, 3)["w"]["k_proj"].tolist() == [[0.0] * 3] * 2
    h = fp8_delayed.init_history(2, 3, layers, jnp.bfloat16)
    assert set(h["x"]) == {"input_layernorm", "attention", "post_attention_layernorm", "swiglu"}
    assert set(h["w"]) == set(h["g"]) == set(fp8_delayed.INPUTS)
    assert fp8_delayed.REPORTS_X == {"q_proj", "o_proj", "gate_proj", "down_proj"}
    # Only the weights are known before the first step.
    np.testing.assert_array_equal(h["w"]["k_proj"], [[1.0, 0, 0], [1.0, 0, 0]])
    assert all(float(jnp.abs(a).max()) == 0 for a in jax.tree.leaves([h["x"], h["g"]]))
    steps = [jax.tree.map(lambda r, k=k: r * 0 + k, fp8_delayed.reference(h)) for k in (3, 2)]
    steps[1]["g"]["q_proj"] = jnp.array([jnp.inf, jnp.nan])
    for amax in steps:
        h = fp8_delayed.record(h, amax)
    np.testing.assert_array_equal(h["w"]["k_proj"], [[2.0, 3, 1], [2.0, 3, 1]])
    np.testing.assert_array_equal(h["g"]["q_proj"], [[0.0, 3, 0], [0.0, 3, 0]])
    np.testing.assert_array_equal(fp8_delayed.reference(h)["x"]["swiglu"], [3.0, 3.0])


def test_histories_survive_a_checkpoint_and_old_checkpoints_still_restore(tmp_path):
    keys = jax.random.split(jax.random.key(0), len(fp8_delayed.INPUTS))
    layers = {
        n: jax.random.normal(k, (2, 4, 4)) for n, k in zip(fp8_delayed.INPUTS, keys, strict=True)
    }
    empty = fp8_delayed.init_history(2, 3, layers, jnp.bfloat16)
    amax = jax.tree.map(lambda r: r + 0.37, fp8_delayed.reference(empty))
    history = fp8_delayed.record(empty, amax)

    def state(fp8_state, k=1.0):
        return train_step.TrainState(
            jnp.asarray(int(k), jnp.int32), {"w": jnp.full((3,), k)}, {"m": jnp.zeros(3)}, fp8_state
        )

    def save(directory, s):
        ck = checkpoint.Checkpointing(
            CheckpointConfig(checkpoint_dir=str(directory)),
            run={"argv": [], "config": {}},
            model={},
            info=print,
        )
        ck.save(5, s, data={}, log={})
        ck.close()
        return str(directory / "5")

    delayed = save(tmp_path / "delayed", state(history, 5.0))
    zeros = jax.tree.map(jnp.zeros_like, history)
    restored = checkpoint_files.restore_arrays(
        delayed, checkpoint_files.abstract_like(state(zeros, 0.0))
    )
    jax.tree.map(np.testing.assert_array_equal, restored.fp8, history)
    assert int(restored.step) == 5
    # Without delayed scaling the state saves what checkpoints from before the field did:
    # they restore, and a delayed run refuses them naming the flag.
    old = save(tmp_path / "old", state({}, 5.0))
    assert checkpoint_files.restore_arrays(old, checkpoint_files.abstract_like(state({}))).fp8 == {}
    with pytest.raises(
        checkpoint_files.CheckpointError, match="amax histories of --fp8_scaling=delayed"
    ):
        checkpoint_files.restore_arrays(old, checkpoint_files.abstract_like(state(zeros)))
    saved = checkpoint_files.Saved(
        delayed, {}, {}, {"config": {"model": {"fp8_scaling": "delayed"}}}, {}
    )
    with pytest.raises(checkpoint_files.CheckpointError, match="--fp8_scaling=delayed"):
        resume_rules.check_resume(saved, {"model": {"fp8_scaling": "current"}}, {})


def test_model_spec_refuses_dtype_combinations_naming_the_flag():
    ok = ModelSpec(model="tiny", from_scratch=True, matmul_dtype="e4m3", gradient_dtype="e5m2")
    assert (ok.compute_dtype, ok.linear_dtype) == ("bfloat16", "e4m3")
    bad = [
        (dict(model_dtype="e4m3"), "--model_dtype=e4m3"),
        (dict(matmul_dtype="e5m2"), "--matmul_dtype=e5m2"),
        (dict(matmul_dtype="e4m3", gradient_dtype="bfloat16"), "--gradient_dtype=bfloat16"),
        (dict(gradient_dtype="e5m2"), "--gradient_dtype=e5m2 needs --matmul_dtype=e4m3"),
    ]
    for kwargs, message in bad:
        with pytest.raises(SettingError, match=re.escape(message)):
            ModelSpec(model="tiny", from_scratch=True, **kwargs)


def test_fp8_run_resumes_bit_exactly(tmp_path):
    # Delayed scaling's amax histories are train state: the checkpoint holds them and the run
    # continues as if never stopped (resumed with fresh histories, steps 3-4 would scale by 1
    # and differ). Current scaling keeps no state, so its checkpoints are a bf16 run's.
    rng = np.random.default_rng(0)
    write_shard(
        tmp_path / "train_step.bin", rng.integers(0, 256, 20 * 17, dtype=np.int32), vocab_size=256
    )
    out = str(tmp_path)

    def flags(*extra):
        return [
            "--model=tiny",
            "--from_scratch",
            f"--train_file={out}/train_step.bin",
            "--seq_len=16",
            "--gpus=1",
            "--batch_size=4",
            "--matmul_dtype=e4m3",
            "--gradient_dtype=e5m2",
            "--fp8_scaling=delayed",
            "--fp8_amax_history=3",
            "--lr_schedule=wsd",
            "--final_lr_fraction=1",
            "--eval_every_n_steps=0",
            "--ckpt_interval=2",
            "--ckpt_keep_n=0",
            *extra,
        ]

    first = train_here(
        *flags("--steps=4", f"--log_file={out}/a.jsonl", f"--checkpoint_dir={out}/ckpt")
    )
    assert first.returncode == 0, first.stderr[-3000:]
    resume = ["--steps=4", f"--continue={out}/ckpt/2", f"--log_file={out}/b.jsonl"]
    second = train_here(*flags(*resume, f"--checkpoint_dir={out}/ckpt2"))
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
    dtypes = ("matmul_dtype", "gradient_dtype", "fp8_scaling")
    assert tuple(model[k] for k in dtypes) == ("e4m3", "e5m2", "delayed")
    bad = train_here(*flags("--steps=1", "--matmul_dtype=float32", "--gradient_dtype=e5m2"))
    assert bad.returncode == 1 and "--gradient_dtype=e5m2 needs --matmul_dtype=e4m3" in bad.stderr
