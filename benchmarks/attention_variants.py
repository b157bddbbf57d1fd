"""GPU: causal attention's forward and backward, as the model calls it and the other ways at hand,
timed alone at the presets' shapes (bf16, q [B, T, N, H], k and v [B, T, K, H]).

    python3 -m benchmarks.attention_variants             # every shape and variant
    python3 -m benchmarks.attention_variants --shapes=1b   # the 1B's only

Rows, per shape: cuDNN's fused kernel with GQA (jax.nn.dot_product_attention, the model's call);
the same with k and v repeated to N heads first (cuDNN's MHA kernels; the repeat's backward sums
the heads' gradients); on the 1B's shape also cuDNN with the heads-major BNTH layout, jax's
Pallas (Triton) flash attention on repeated k and v, and the forward alone, cuDNN's against
jax's Mosaic GPU kernel (in float16, the dtype its kernel stages through; its backward has no
causal mask). Each row gives the median ms of a call (bench.time_calls), TFLOP/s (causal:
half the square; backward 2.5x the forward), and its largest difference from the model's call.
"""

import jax
import jax.numpy as jnp
from absl import app, flags

from jaxllmq.bench import time_calls
from jaxllmq.cli import flags as cli_flags

SHAPES = {  # name: (B, T, N, K, H), 16384 tokens each
    "1b": (8, 2048, 32, 8, 64),
    "3b": (8, 2048, 24, 8, 128),
    "0.5b": (8, 2048, 14, 2, 64),
    "1b-8192": (2, 8192, 32, 8, 64),
    "8b-8192": (2, 8192, 32, 8, 128),
}


def cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def repeat_kv(attn):
    def f(q, k, v):
        r = q.shape[2] // k.shape[2]
        return attn(q, jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2))

    return f


def cudnn_bnth(q, k, v):
    """cuDNN with [B, N, T, H] operands (the transposes are outside the timed call's kernel, but
    inside its jit: the row is the layout's whole cost to a caller holding BTNH)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    t = lambda x: x.transpose(0, 2, 1, 3)
    o = fa.dot_product_attention(
        t(q), t(k), t(v), scale=q.shape[-1] ** -0.5, mask_type=fa.MaskType.CAUSAL,
        qkv_layout="BNTH",
    )  # fmt: skip
    return t(o)


def pallas_triton(q, k, v):
    from jax.experimental.pallas.ops.gpu import attention as pa

    blocks = pa.BlockSizes(
        block_q=128, block_k=64, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64
    )
    return pa.mha(
        q, k, v, segment_ids=None, sm_scale=q.shape[-1] ** -0.5, causal=True,
        block_sizes=blocks, num_warps=4, num_stages=3,
    )  # fmt: skip


def mosaic_forward(q, k, v):
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am

    cfg = am.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=3, causal=True)
    f16 = lambda x: x.astype(jnp.float16)
    q = q * q.shape[-1] ** -0.5  # the kernel takes no softmax scale
    return am.attention(f16(q), f16(k), f16(v), cfg).astype(k.dtype)


def forward_backward(attn):
    def f(q, k, v, do):
        o, vjp = jax.vjp(attn, q, k, v)
        return o, *vjp(do)

    return f


_shapes = flags.DEFINE_list("shapes", list(SHAPES), f"Of {', '.join(SHAPES)}.")
_reps = flags.DEFINE_integer("reps", 20, "Calls per timed batch (the median of 5 batches).")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    if jax.default_backend() != "gpu":
        raise SystemExit("attention_variants: needs a GPU (cuDNN's fused attention)")
    names = _shapes.value
    if unknown := sorted(set(names) - set(SHAPES)):
        raise SystemExit(f"--shapes: unknown {unknown}; choose from {', '.join(SHAPES)}")
    diff = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
    rows = []
    for name in names:
        B, T, N, K, H = SHAPES[name]
        keys = jax.random.split(jax.random.key(0), 4)
        q, do = (jax.random.normal(k, (B, T, N, H), jnp.bfloat16) for k in keys[:2])
        k, v = (jax.random.normal(k, (B, T, K, H), jnp.bfloat16) for k in keys[2:])
        fwd_flop = 2 * 2 * B * N * T * T * H / 2
        variants = [("cuDNN, GQA (the model's)", cudnn, False), ("cuDNN, k/v repeated", repeat_kv(cudnn), False)]  # fmt: skip
        if name == "1b":
            variants += [
                ("cuDNN, BNTH layout", cudnn_bnth, False),
                ("Pallas Triton, k/v repeated", repeat_kv(pallas_triton), False),
                ("cuDNN, forward", cudnn, True),
                ("Mosaic GPU, forward, float16", mosaic_forward, True),
            ]
        ref = ref_fwd = None
        for label, attn, fwd_only in variants:
            f = jax.jit(attn if fwd_only else forward_backward(attn))
            operands = (q, k, v) if fwd_only else (q, k, v, do)
            try:
                out = f(*operands)
            except Exception as e:  # a variant this jax or GPU lacks: say so, go on
                rows.append((name, label, float("nan"), 0.0, f"failed: {str(e)[:120]}"))
                continue
            if fwd_only:
                ref_fwd = out if ref_fwd is None else ref_fwd
                err = diff(out, ref_fwd)
            else:
                ref = out if ref is None else ref
                err = max(diff(a, b) for a, b in zip(out, ref, strict=True))
            ms = 1e3 * time_calls(lambda f=f, operands=operands: f(*operands), calls=_reps.value)
            flop = fwd_flop * (1 if fwd_only else 3.5)
            rows.append((name, label, ms, flop / ms / 1e9, f"max diff {err:.3g}"))
            print(f"{name} {label}: {ms:.3f} ms", flush=True)
    print(f"\n{'shape':8} {'variant':32} {'ms':>8} {'TFLOP/s':>8}")
    for name, label, ms, tflops, note in rows:
        print(f"{name:8} {label:32} {ms:8.3f} {tflops:8.1f}  {note}")


if __name__ == "__main__":
    app.run(main, flags_parser=cli_flags.parse_argv)
