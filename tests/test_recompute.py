"""Recompute switches: the same losses and gradients, less memory kept for the backward pass."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jaxprs import equations

from jaxllmq.model import attention
from jaxllmq.model.architecture import preset
from jaxllmq.model.families import FULL, GEMMA3, SLIDING
from jaxllmq.model.llama import Llama, abstract_model, params_of
from jaxllmq.model.recompute import Recompute

CFG = dataclasses.replace(preset("tiny"), num_hidden_layers=2, vocab_size=256)


def test_llmq_implications():
    assert Recompute(block=True).names() == ("norm", "qkv", "att", "ffn", "swiglu")
    assert Recompute(att=True).names() == ("qkv", "att")
    assert Recompute(ffn=True).names() == ("ffn", "swiglu")
    assert Recompute().names() == ()


@functools.cache
def _value_and_grad(recompute: Recompute, scan: bool, cfg):
    """The jitted loss and gradients of (params, tokens), one a module for each model: the cases
    of test_same_losses_and_grads share their baseline's compiled program (~5 s each)."""
    graphdef, _, _ = abstract_model(cfg, recompute=recompute, scan_layers=scan, attention="xla")

    def loss(p, tokens):
        logits = nnx.merge(graphdef, p).logits(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

    return jax.jit(jax.value_and_grad(loss))


def _loss_and_grads(recompute: Recompute, scan: bool, tokens, cfg=CFG):
    return _value_and_grad(recompute, scan, cfg)(params_of(Llama(cfg, rngs=nnx.Rngs(0))), tokens)


def _temp_bytes(recompute: Recompute, tokens, cfg) -> int:
    """What the compiled loss and gradients of the scanned model keep besides their arguments
    and outputs (compiled only: nothing runs)."""
    params = nnx.eval_shape(lambda: params_of(Llama(cfg, rngs=nnx.Rngs(0))))
    lowered = _value_and_grad(recompute, True, cfg).lower(params, tokens)
    return lowered.compile().memory_analysis().temp_size_in_bytes


QWEN3 = dataclasses.replace(CFG, architecture="Qwen3ForCausalLM")  # q and k normed per head
GEMMA = dataclasses.replace(
    CFG, architecture=GEMMA3, sliding_window=8, layer_types=(SLIDING, FULL),
    query_pre_attn_scalar=16.0, rope_local_base_freq=1e4, tie_word_embeddings=True,
)  # fmt: skip


@pytest.mark.parametrize(
    "flag, scan, cfg",
    [
        (flag, scan, CFG)
        for flag in ("swiglu", "norm", "ffn", "qkv", "att", "block")
        for scan in (True, False)
    ]
    + [("swiglu", True, QWEN3), ("norm", False, QWEN3), ("norm", False, GEMMA)],
)
def test_same_losses_and_grads(flag, scan, cfg):
    # Against the unrolled layers without a policy: scanned ones always recompute some.
    tokens = np.random.default_rng().integers(0, cfg.vocab_size, (2, 65), dtype=np.int32)
    loss0, g0 = _loss_and_grads(Recompute(), False, tokens, cfg)
    loss1, g1 = _loss_and_grads(Recompute(**{flag: True}), scan, tokens, cfg)
    # The same arithmetic, but XLA fuses the checkpointed program differently, so fp32 sums may
    # round differently: the loss by an ulp at most, gradients by ~7e-7 relative per leaf (seen
    # on this model). A wrong recomputation would be off by orders of magnitude more.
    assert abs(float(loss0) - float(loss1)) <= 2e-7 * abs(float(loss0))
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b)


def test_each_switch_keeps_less_memory():
    # Enough layers that what the backward keeps, not one layer's transients, sets the peak.
    deep = dataclasses.replace(CFG, num_hidden_layers=8)
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (8, 65), dtype=np.int32)
    mem = {
        name: _temp_bytes(Recompute(**kw), tokens, deep)
        for name, kw in [
            ("none", {}),
            ("swiglu and norm", {"swiglu": True, "norm": True}),
            ("ffn", {"ffn": True}),
            ("att", {"att": True}),
            ("block", {"block": True}),
        ]
    }
    # Scanned layers recompute the SwiGLU product and the norms without being told.
    assert mem["swiglu and norm"] == mem["none"], mem
    assert mem["block"] < mem["ffn"] < mem["none"], mem
    assert mem["att"] < mem["none"], mem


def _matmuls(recompute: Recompute, cfg) -> int:
    """Matrix products (dots of two-dimensional results: the linears and the LM head, not
    XLA's attention) in the compiled loss-and-gradient of the unrolled model."""
    graphdef, _, _ = abstract_model(cfg, recompute=recompute, scan_layers=False, attention="xla")
    params = params_of(Llama(cfg, rngs=nnx.Rngs(0)))
    tokens = np.zeros((2, 33), np.int32)
    loss = lambda p: nnx.merge(graphdef, p).logits(tokens[:, :-1]).sum()  # noqa: E731
    text = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
    return len(re.findall(r"= f32\[\d+,\d+\]\S* dot\(", text))


@pytest.mark.parametrize("cfg", [CFG, QWEN3, GEMMA], ids=["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("flag", ["norm", "swiglu"])
def test_cheap_switches_recompute_no_matmul(flag, cfg):
    # Recomputing a norm or the SwiGLU product needs only saved activations: the post-attention
    # norm must read the residual under its saved name, not a sum the policy cannot keep (which
    # would recompute the o_proj GEMM to rebuild it); Qwen3's and Gemma 3's q and k norms their
    # projections under theirs (else the backward runs q_proj and k_proj again), and Gemma's
    # norms of the sublayers' outputs the o_proj and down_proj products under theirs.
    assert _matmuls(Recompute(**{flag: True}), cfg) == _matmuls(Recompute(), cfg)


def _tiny_with_our_attention(recompute: Recompute | None = None):
    """A two-layer scanned bf16 model on jaxllmq's flash attention at head dim 64 (its heads
    side by side, 512, wider than the model's 256), and its loss over 2 x 128 tokens."""
    cfg = dataclasses.replace(preset("tiny"), num_hidden_layers=2, vocab_size=256, head_dim=64)
    kw = dict(scan_layers=True, attention="mosaic", dtype=jnp.bfloat16, recompute=recompute)
    graphdef, _, _ = abstract_model(cfg, **kw)
    params = params_of(Llama(cfg, rngs=nnx.Rngs(0), **kw))
    tokens = np.zeros((2, 129), np.int32)
    loss = lambda p: nnx.merge(graphdef, p).logits(tokens[:, :-1]).astype(jnp.float32).sum()  # noqa: E731
    return loss, params


def test_scanned_layers_keep_the_attention_output_once(capsys):
    # The attention's backward keeps its output o, and o_proj's keeps its input. As one array
    # (matmul_heads) a scan stacks it once; as o and its heads side by side it stacked both.
    loss, params = _tiny_with_our_attention()
    jax.ad_checkpoint.print_saved_residuals(loss, params)
    saved = capsys.readouterr().out
    assert saved.count("bf16[2,2,128,8,64] output of scan") == 2  # q and o
    assert "bf16[2,2,128,512] output of scan" not in saved


def test_scanned_layers_keep_no_fp32_copies_of_their_activations(capsys):
    # XLA's RMSNorm computes its statistics from an fp32 copy of its bf16 input. Autodiff kept
    # that copy for the backward, which a scan stacked for every layer (2 GiB of the 1B's peak
    # at 8 x 2048 with --kernels=xla); rms_norm.keeping_inputs keeps the bf16 input instead.
    loss, params = _tiny_with_our_attention()
    jax.ad_checkpoint.print_saved_residuals(loss, params)
    stacked = [line for line in capsys.readouterr().out.splitlines() if "output of scan" in line]
    assert stacked and not [line for line in stacked if line.startswith("f32[2,2,128,256]")]


def test_scanned_gemma_keeps_no_fp32_rows_of_its_norms(capsys):
    # Gemma's four norms a layer work in fp32; autodiff kept their fp32 rows, which a scan
    # stacked for every layer (the 1B at 8 x 2048: 50.83 GiB peak, 42.18 without them).
    cfg = GEMMA
    graphdef, _, _ = abstract_model(cfg, scan_layers=True, attention="xla", dtype=jnp.bfloat16)
    params = params_of(Llama(cfg, rngs=nnx.Rngs(0), attention="xla", dtype=jnp.bfloat16))
    tokens = np.zeros((2, 33), np.int32)
    loss = lambda p: nnx.merge(graphdef, p).logits(tokens[:, :-1]).astype(jnp.float32).sum()  # noqa: E731
    jax.ad_checkpoint.print_saved_residuals(loss, params)
    stacked = [line for line in capsys.readouterr().out.splitlines() if "output of scan" in line]
    assert stacked and not [line for line in stacked if line.startswith("f32[1,2,32,256]")]


def _calls_named(jaxpr, name: str) -> int:
    """How many jitted calls named `name` `jaxpr` makes that return something (tracing leaves
    an empty one behind), inside loops and remat too."""
    return sum(
        e.primitive.name == "jit" and e.params["name"] == name and bool(e.outvars)
        for e in equations(jaxpr)
    )


@pytest.mark.parametrize("switch, forwards", [("swiglu", 1), ("att", 2)])
def test_a_recompute_policy_runs_the_attentions_forward_once_unless_told(switch, forwards):
    # Our attention names its output and logsumexp as the policy's ATT, so a policy that saves
    # ATT keeps them; unnamed, the backward ran the attention's forward again for them.
    recompute = Recompute(**{switch: True})
    recompute.check()
    loss, params = _tiny_with_our_attention(recompute)
    assert _calls_named(jax.make_jaxpr(jax.grad(loss))(params).jaxpr, "forward") == forwards


def test_cudnns_saved_arrays_carry_the_name():
    # What cuDNN's backward keeps beside q, k and v (its output, logsumexp) carries the policy's
    # name, so a policy saving the name runs its forward once. A jitted XLA attention stands in
    # for cuDNN's here (CPU), with a span argument as the packed documents pass theirs.
    @jax.jit
    def stand_in(q, k, v, lengths_B):
        keys = jnp.arange(q.shape[1])[None, None, None, :] < lengths_B[:, None, None, None]
        return jax.nn.dot_product_attention(q, k, v, mask=keys, is_causal=True)

    q = jax.random.normal(jax.random.key(0), (2, 16, 4, 8))
    lengths = jnp.array([16, 9])
    policy = jax.checkpoint_policies.save_only_these_names("att")

    def loss(named_inside):
        def attend(q):
            if named_inside:
                return attention._cudnn_saved_as("att", stand_in, q, q, q, lengths)
            return jax.ad_checkpoint.checkpoint_name(stand_in(q, q, q, lengths), "att")

        return jax.checkpoint(lambda q: jnp.sum(jnp.sin(attend(q))), policy=policy)

    grads = [jax.grad(loss(named)) for named in (False, True)]
    np.testing.assert_array_equal(grads[0](q), grads[1](q))
    # The stand-in's backward is a jitted call of the same name: two forwards before, one now.
    calls = [_calls_named(jax.make_jaxpr(g)(q).jaxpr, "stand_in") for g in grads]
    assert calls == [3, 2]
