"""LM head + softmax cross-entropy (+ z-loss) over [tokens, vocab], with logsumexp statistics.

Three ways to compute the same function:
- lm_head_loss_reference: XLA autodiff, holds the fp32 [N, V] logits (8 GB at 16k tokens x
  128k vocab) and their gradient, and runs the backward matmuls in fp32. The referee only.
- "xla": a scan over token chunks (chunks=1: one) under a custom_vjp. The forward computes each
  chunk's logits, loss terms *and* its gradients at once (the loss is a scalar, so its cotangent
  only scales them), keeping d/dh [N, D] and d/dw [D, V] in fp32; the backward multiplies by the
  cotangent. Three matmuls as in the reference, all on cuBLAS, and only one chunk's logits live.
- "pallas": the same scan, with each chunk's logits never written: a fused Pallas kernel
  (lm_head_pallas) reduces logit tiles to logsumexp pieces in registers and writes the tile-local
  softmax for the backward matmuls. Without a gradient it is one kernel over all tokens.
  "mosaic": the same with the kernel in Mosaic GPU (lm_head_mgpu, Hopper) where it applies.

Chunks take every chunks-th token (chunk j = tokens j, j+chunks, ...), so a token axis sharded
over devices stays sharded inside each chunk. A Pallas call has no SPMD partitioning rule, so
under a multi-device mesh "pallas" belongs inside shard_map. Masked-out tokens may carry any
target. Measured on H200: docs/PERFORMANCE.md.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxllmq.kernels import _pallas as P
from jaxllmq.kernels import lm_head_mgpu, lm_head_pallas
from jaxllmq.kernels.lm_head_pallas import LmHeadPallasConfig


def _sanitize_targets(targets_N, mask_N, vocab):
    """Targets of masked-out tokens -> 0; whether each target indexes the vocabulary."""
    t = jnp.where(mask_N != 0, targets_N, 0).astype(jnp.int32)
    return t, (t >= 0) & (t < vocab)


def _finish(lse_N, target_logit_N, mask_N, z_loss):
    """Objective and log statistics from per-token logsumexp and target logit (fp32)."""
    m = mask_N.astype(jnp.float32)
    ce_N = lse_N - target_logit_N
    objective = jnp.sum(m * (ce_N + z_loss * lse_N * lse_N))
    aux = {
        "ce_sum": jnp.sum(m * ce_N),
        "lse_max": jnp.max(jnp.where(mask_N != 0, lse_N, -jnp.inf)),
        "lse_sum": jnp.sum(m * lse_N),
    }
    return objective, jax.tree.map(jax.lax.stop_gradient, aux)


def lm_head_loss_reference(
    h_NxD: jax.Array,
    w_DxV: jax.Array,
    targets_N: jax.Array,
    mask_N: jax.Array,
    *,
    z_loss: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Materializes the logits. Returns (objective sum, aux) over the masked-in tokens.

    objective = sum(mask * (ce + z_loss * lse^2)), differentiable, fp32.
    aux = {ce_sum, lse_max, lse_sum}: fp32 statistics for the log, without gradients.
    A masked-in target outside [0, V) makes the loss NaN; masked-out targets are ignored.
    """
    # fp32 logits: the softmax over 128k entries in bf16 loses the small probabilities.
    logits_NxV = jnp.dot(h_NxD, w_DxV, preferred_element_type=jnp.float32)
    lse_N = jax.nn.logsumexp(logits_NxV, axis=-1)
    t_N, valid_N = _sanitize_targets(targets_N, mask_N, w_DxV.shape[1])
    target_logit_N = jnp.take_along_axis(logits_NxV, jnp.clip(t_N, 0)[:, None], axis=-1)[:, 0]
    target_logit_N = jnp.where(valid_N, target_logit_N, jnp.nan)
    return _finish(lse_N, target_logit_N, mask_N, z_loss)


# ---- chunked paths -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static description of a chunked call (hashable: a custom_vjp non-diff argument)."""

    impl: str
    chunks: int
    chunk_len: int  # tokens per chunk, padding included
    n_tokens: int
    z_loss: float
    h_dtype: jnp.dtype
    w_dtype: jnp.dtype
    pallas: LmHeadPallasConfig | None


def _to_chunks(a, plan):
    """[N, ...] -> [chunks, chunk_len, ...], zero-padded, chunk j = tokens j, j+chunks, ..."""
    pad = plan.chunks * plan.chunk_len - a.shape[0]
    if pad:
        a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
    return a.reshape(plan.chunk_len, plan.chunks, *a.shape[1:]).swapaxes(0, 1)


def _from_chunks(a, plan):
    return a.swapaxes(0, 1).reshape(-1, *a.shape[2:])[: plan.n_tokens]


def _xla_chunk_logits(h_c, w, t_c):
    logits = jnp.dot(h_c, w, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    tl = jnp.take_along_axis(logits, t_c[:, None], axis=-1)[:, 0]
    return logits, lse, tl


def _xla_chunk_stats(h_c, w, t_c):
    _, lse, tl = _xla_chunk_logits(h_c, w, t_c)
    return lse, tl


def _xla_chunk_grads(h_c, w, t_c, m_c, dw_acc, z_loss):
    logits, lse, tl = _xla_chunk_logits(h_c, w, t_c)
    c = m_c.astype(jnp.float32)
    p = jnp.exp(logits - lse[:, None]) * (c * (1.0 + 2.0 * z_loss * lse))[:, None]
    onehot = jnp.arange(w.shape[1])[None, :] == t_c[:, None]
    # dlogits in the weight's dtype: the backward matmuls run at bf16 rate, fp32 accumulation.
    dlogits = (p - jnp.where(onehot, c[:, None], 0.0)).astype(w.dtype)
    dh = jnp.dot(dlogits, w.T, preferred_element_type=jnp.float32)
    dw = jnp.dot(h_c.T, dlogits, preferred_element_type=jnp.float32)
    return lse, tl, dh, dw_acc + dw


def _stats(h, w, t, plan):
    """Per-token (lse, target logit) over all tokens, without gradient work."""
    if plan.impl == "pallas":  # one launch; no chunk state to bound
        n_pad = P.cdiv(plan.n_tokens, plan.pallas.rows) * plan.pallas.rows
        pad = n_pad - plan.n_tokens
        lse, tl = lm_head_pallas.chunk_stats(
            jnp.pad(h, ((0, pad), (0, 0))), w, jnp.pad(t, (0, pad)), plan.pallas
        )
        return lse[: plan.n_tokens], tl[: plan.n_tokens]

    def body(_, xs):
        return None, _xla_chunk_stats(xs[0], w, xs[1])

    _, (lse, tl) = jax.lax.scan(body, None, (_to_chunks(h, plan), _to_chunks(t, plan)))
    return _from_chunks(lse, plan), _from_chunks(tl, plan)


def _stats_and_grads(h, w, t, m, plan):
    if plan.impl == "pallas":
        chunk = functools.partial(lm_head_pallas.chunk_grads, z_loss=plan.z_loss, cfg=plan.pallas)
    else:
        chunk = functools.partial(_xla_chunk_grads, z_loss=plan.z_loss)

    def body(dw_acc, xs):
        lse, tl, dh, dw_acc = chunk(xs[0], w, xs[1], xs[2], dw_acc)
        return dw_acc, (lse, tl, dh)

    dw0 = jnp.zeros(w.shape, jnp.float32)
    xs = (_to_chunks(h, plan), _to_chunks(t, plan), _to_chunks(m, plan))
    dw, (lse, tl, dh) = jax.lax.scan(body, dw0, xs)
    return _from_chunks(lse, plan), _from_chunks(tl, plan), _from_chunks(dh, plan), dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _chunked_loss(h, w, t, valid, m, plan):
    lse, tl = _stats(h, w, t, plan)
    return _finish(lse, jnp.where(valid, tl, jnp.nan), m, plan.z_loss)


def _chunked_loss_fwd(h, w, t, valid, m, plan):
    lse, tl, dh, dw = _stats_and_grads(h, w, t, m, plan)
    return _finish(lse, jnp.where(valid, tl, jnp.nan), m, plan.z_loss), (dh, dw)


def _chunked_loss_bwd(plan, res, cts):
    dh, dw = res
    g = cts[0]  # aux carries no gradient
    return (g * dh).astype(plan.h_dtype), (g * dw).astype(plan.w_dtype), None, None, None


_chunked_loss.defvjp(_chunked_loss_fwd, _chunked_loss_bwd)


IMPLS = ("xla", "pallas", "mosaic")


def kernel_used(impl: str, d: int, v: int, dtype, pallas_config=None) -> str:
    """What lm_head_loss(impl=impl, pallas_config=...) runs on a head [d, v] in `dtype` (h's
    and w's result type): "xla"; "mosaic" (lm_head_mgpu's kernel) where impl "mosaic" or the
    config's lowering asks for it and its tiles fit the head (lm_head_mgpu.fits_head); else
    "pallas" (the Triton kernel). A run's plan reports it (jaxllmq/plan.py)."""
    if impl not in IMPLS:
        raise ValueError(
            f"lm_head_loss: unknown impl {impl!r} (expected 'xla', 'pallas' or 'mosaic')"
        )
    if impl == "xla":
        return "xla"
    cfg = pallas_config or LmHeadPallasConfig()
    asked = impl == "mosaic" or cfg.lowering == "mosaic"
    return "mosaic" if asked and lm_head_mgpu.fits_head(d, v, dtype, cfg.mosaic) else "pallas"


def lm_head_loss(
    h_NxD: jax.Array,
    w_DxV: jax.Array,
    targets_N: jax.Array,
    mask_N: jax.Array,
    *,
    z_loss: float = 0.0,
    impl: str = "xla",
    chunks: int = 1,
    pallas_config: LmHeadPallasConfig | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """LM-head loss through the chosen implementation; see lm_head_loss_reference.

    impl "xla" scans over `chunks` token chunks and never holds more than one chunk's logits
    (chunks=1: all of them at once); its backward matmuls run in the compute dtype, where the
    reference's autodiff runs them in fp32 (TF32 on GPU: 65 of 280 ms of a 1B step on an H200).
    impl "pallas" never writes logits; its gradient uses at least `chunks` chunks, of at most
    pallas_config.tokens_per_chunk(V) tokens. impl "mosaic" is "pallas" with the kernel's Mosaic
    GPU lowering (lm_head_mgpu) where its tiles fit the head (kernel_used). The gradient flows
    to h and w only.
    """
    dtype = jnp.result_type(h_NxD, w_DxV)
    (n, d), v = h_NxD.shape, w_DxV.shape[1]
    kernel = kernel_used(impl, d, v, dtype, pallas_config)
    if chunks < 1:
        raise ValueError(f"lm_head_loss: chunks must be >= 1, got {chunks}")
    cfg = None
    if kernel == "xla":
        chunk_len = P.cdiv(n, chunks)
    else:
        cfg = dataclasses.replace(
            pallas_config or LmHeadPallasConfig(),
            lowering="mosaic" if kernel == "mosaic" else "triton",
            interpret=P.default_interpret() if interpret is None else interpret,
        )
        chunks = max(chunks, P.cdiv(n, cfg.tokens_per_chunk(v)))
        chunk_len = P.cdiv(P.cdiv(n, chunks), cfg.rows) * cfg.rows
    plan = _Plan(
        impl="xla" if kernel == "xla" else "pallas",
        chunks=chunks,
        chunk_len=chunk_len,
        n_tokens=n,
        z_loss=float(z_loss),
        h_dtype=dtype,
        w_dtype=dtype,
        pallas=cfg,
    )
    t, valid = _sanitize_targets(targets_N, mask_N, w_DxV.shape[1])
    t = jnp.where(valid, t, 0)  # the kernels need in-range indices; `valid` restores the NaN
    return _chunked_loss(h_NxD.astype(dtype), w_DxV.astype(dtype), t, valid, mask_N, plan)


def lm_head_loss_sharded(
    h_NxD: jax.Array,
    w_DxV: jax.Array,
    targets_N: jax.Array,
    mask_N: jax.Array,
    *,
    mesh: jax.sharding.Mesh,
    token_axes: tuple[str, ...],
    **kwargs,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """lm_head_loss on each device's tokens under shard_map, the sums and max combined after.

    A Pallas call has no SPMD partitioning rule; inside shard_map each device runs the kernel on
    its own tokens (N sharded over `token_axes`) against the whole head weight (gathered where it
    is sharded), so the fused loss keeps its memory saving on a multi-device mesh. The gradient
    of the replicated weight is summed over the token axes by shard_map's transpose.
    """
    tokens = jax.sharding.PartitionSpec(token_axes)
    replicated = jax.sharding.PartitionSpec()

    def body(h, w, t, m):
        obj, aux = lm_head_loss(h, w, t, m, **kwargs)
        psum = lambda x: jax.lax.psum(x, token_axes)
        aux = {
            "ce_sum": psum(aux["ce_sum"]),
            "lse_sum": psum(aux["lse_sum"]),
            "lse_max": jax.lax.pmax(jax.lax.stop_gradient(aux["lse_max"]), token_axes),
        }
        return psum(obj), aux

    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(tokens, replicated, tokens, tokens),
        out_specs=(
            replicated,
            {"ce_sum": replicated, "lse_sum": replicated, "lse_max": replicated},
        ),
        check_vma=False,
    )(h_NxD, w_DxV, targets_N, mask_N)
