"""Which attention serves packed documents on a GPU, and what it costs against causal attention.

Causal GQA attention forward + backward over windows of documents whose lengths follow a fixed
log-normal mix (--median_document tokens), each document attending to itself only. Variants:
cuDNN's causal kernel over whole windows (the cost without documents), cuDNN's packed layout
(each document a segment, --max_documents segments per window), and XLA's attention with a
per-document mask. Errors are against a float32 XLA reference of the document mask; times are
the median over batches of calls issued back to back.

    python3 -m benchmarks.document_attention --shapes=8x2048,2x8192 --head_dims=64,128
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
from absl import app, flags

from jaxllmq import bench
from jaxllmq.cli import flags as cli_flags
from jaxllmq.model import attention

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", ["8x2048", "2x8192"], "Batch x sequence length pairs.")
flags.DEFINE_list("head_dims", ["64"], "Head dims.")
flags.DEFINE_integer("heads", 32, "Query heads.")
flags.DEFINE_integer("kv_heads", 8, "Key/value heads.")
flags.DEFINE_integer("median_document", bench.DOC_MEDIAN, "Median document length in tokens.")
flags.DEFINE_list("max_documents", ["16", "64"], "Segments per window for cuDNN's packed layout.")
flags.DEFINE_integer("calls", 20, "Calls issued back to back per batch.")
flags.DEFINE_integer("batches", 5, "Timed batches (the median is reported).")


def timed(fn, *args) -> float:
    """Median ms per call (bench.time_calls: --calls back to back, one wait per batch)."""
    return 1e3 * bench.time_calls(lambda: fn(*args), calls=FLAGS.calls, batches=FLAGS.batches)


def forward_backward(attend):
    def loss(q, k, v, do):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * do)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def compare(batch: int, seq_len: int, head_dim: int) -> None:
    """Print one JSON line per variant at this shape: ms, and dq/dk/dv errors against float32."""
    seg = jnp.asarray(bench.document_segment_ids(batch, seq_len, FLAGS.median_document))
    documents = int(jnp.max(seg[:, -1]) + 1)
    keys = jax.random.split(jax.random.key(0), 4)
    q_shape, kv_shape = (
        (batch, seq_len, FLAGS.heads, head_dim),
        (batch, seq_len, FLAGS.kv_heads, head_dim),
    )
    shapes = (q_shape, kv_shape, kv_shape, q_shape)
    q, k, v, do = (
        jax.random.normal(kk, s, jnp.float32) for kk, s in zip(keys, shapes, strict=True)
    )
    mask = attention.same_document(seg)
    masked = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=True, implementation="xla"
    )
    reference = forward_backward(masked)(q, k, v, do)
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    variants = {
        "cudnn causal (no documents)": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn"
        ),
        "xla document mask": masked,
    }
    for m in map(int, FLAGS.max_documents):
        spans = attention.documents_for("cudnn", seg, m)
        variants[f"cudnn packed, {m} segments"] = lambda q, k, v, spans=spans: (
            attention.attend_documents(q, k, v, spans)
        )
    for name, attend in variants.items():
        row = {"shape": f"{batch}x{seq_len}", "head_dim": head_dim, "variant": name}
        row["documents"] = documents
        try:
            fn = forward_backward(attend)
            out = fn(*bf, do)
            if "no documents" not in name:
                row["error"] = {
                    n: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)))
                    for n, a, b in zip(("dq", "dk", "dv"), out[1], reference[1], strict=True)
                }
            row["ms"] = round(timed(fn, *bf, do), 3)
        except Exception as e:  # a variant this jax or cuDNN lacks is reported, not fatal
            row["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(json.dumps(row), flush=True)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    for shape in FLAGS.shapes:
        batch, seq_len = map(int, shape.split("x"))
        for head_dim in map(int, FLAGS.head_dims):
            compare(batch, seq_len, head_dim)


if __name__ == "__main__":
    app.run(main, flags_parser=cli_flags.parse_argv)
