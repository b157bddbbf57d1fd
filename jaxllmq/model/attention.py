"""Attention: which implementation runs (resolve_attention), causal GQA attention with a sliding
window and a KV cache (attend), and over packed documents XLA's mask, cuDNN's packed layout or
jaxllmq's own Mosaic GPU flash attention (kernels/flash_attention/, "mosaic", which
takes the segment ids as they are and skips the tiles between documents).

cuDNN's fused attention takes a window's documents as segments (offsets and lengths), each
attending causally to itself, so no [T, T] mask is built and the blocks between documents are
never computed. Its segment count per window is static (--max_documents_per_window): the
documents past the last segment are joined to it, which the data pipeline accounts for by not
training on their tokens (data/pipeline.py, `documents`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, PartitionSpec

from jaxllmq.model.kv_cache import KVCache
from jaxllmq.parallel.mesh import BATCH_AXES, TENSOR

ATTENTION_IMPLS = ("auto", "xla", "cudnn", "mosaic")


def same_document(segment_ids_BxT: jax.Array) -> jax.Array:
    """The attention mask [B, 1, T, T] of packed documents: query and key in one segment."""
    return segment_ids_BxT[:, None, :, None] == segment_ids_BxT[:, None, None, :]


def document_spans(segment_ids_BxT: jax.Array, max_documents: int) -> tuple[jax.Array, jax.Array]:
    """(offsets int32[B, M+1], lengths int32[B, M]) of each window's first M = `max_documents`
    documents, -1 where a window has fewer; the M-th span runs to the window's end."""
    B, T = segment_ids_BxT.shape
    first = jnp.ones((B, 1), dtype=bool)
    starts_BxT = jnp.concatenate([first, segment_ids_BxT[:, 1:] != segment_ids_BxT[:, :-1]], 1)

    def row(starts_T):
        return jnp.nonzero(starts_T, size=max_documents, fill_value=-1)[0].astype(jnp.int32)

    starts_BxM = jax.vmap(row)(starts_BxT)
    following = jnp.concatenate([starts_BxM[:, 1:], jnp.full((B, 1), -1, jnp.int32)], 1)
    ends_BxM = jnp.where(following >= 0, following, T)
    lengths_BxM = jnp.where(starts_BxM >= 0, ends_BxM - starts_BxM, -1)
    offsets = jnp.concatenate([starts_BxM, jnp.full((B, 1), -1, jnp.int32)], 1)
    return offsets, lengths_BxM


class Documents(NamedTuple):
    """A batch's packed documents as its attention reads them: XLA's mask [B, 1, T, T], cuDNN's
    spans (document_spans), or the segment ids (the Mosaic GPU kernel)."""

    mask_Bx1xTxT: jax.Array | None = None
    offsets_BxM1: jax.Array | None = None
    lengths_BxM: jax.Array | None = None
    segment_ids_BxT: jax.Array | None = None


def documents_for(implementation: str, segment_ids_BxT: jax.Array, per_window: int) -> Documents:
    """The documents of `segment_ids_BxT` (at most `per_window` a row) for `implementation`."""
    if implementation == "cudnn":
        return Documents(None, *document_spans(segment_ids_BxT, per_window))
    if implementation == "mosaic":
        return Documents(segment_ids_BxT=segment_ids_BxT)
    return Documents(mask_Bx1xTxT=same_document(segment_ids_BxT))


def keys_within(seq_len: int, window: int) -> jax.Array:
    """bool[T, T]: key j is within the sliding window of query i (i - window < j)."""
    return jnp.arange(seq_len) > jnp.arange(seq_len)[:, None] - window


def attend_documents(
    q_BxTxNxH: jax.Array,
    k_BxTxKxH: jax.Array,
    v_BxTxKxH: jax.Array,
    documents: Documents,
    *,
    window: int | None = None,
    scale: float | None = None,
    mesh: Mesh | None = None,
    deterministic: bool = False,
    checkpoint_as: str | None = None,
) -> jax.Array:
    """Causal GQA attention within each document: by XLA's mask, cuDNN's packed layout or our
    kernel (per device of `mesh`, if given; `deterministic` and `checkpoint_as` as
    flash_attention's); each query also within its sliding `window` if one is given, the logits
    scaled by `scale` (default 1/sqrt(H))."""
    T, H = q_BxTxNxH.shape[1], q_BxTxNxH.shape[-1]
    if documents.segment_ids_BxT is not None:
        seg = documents.segment_ids_BxT
        return _mosaic(
            q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, seg, window, scale, mesh, deterministic, checkpoint_as
        )
    if documents.mask_Bx1xTxT is not None:
        mask = documents.mask_Bx1xTxT
        if window is not None:
            mask = mask & keys_within(T, window)[None, None]
        o_BxTxNxH = jax.nn.dot_product_attention(
            q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, mask=mask, scale=scale, is_causal=True,
            implementation="xla",
        )  # fmt: skip
        return _named(o_BxTxNxH, checkpoint_as)
    # jax exposes the packed layout only through its cuDNN module, not jax.nn.
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    def packed(q, k, v, lengths_BxM, offsets_BxM1):
        return cudnn.dot_product_attention(
            q,
            k,
            v,
            q_seqlen=lengths_BxM,
            kv_seqlen=lengths_BxM,
            q_offsets=offsets_BxM1,
            kv_offsets=offsets_BxM1,
            scale=H**-0.5 if scale is None else scale,
            mask_type=cudnn.MaskType.PADDING_CAUSAL,
            sliding_window_length=window,
        )

    spans = (documents.lengths_BxM, documents.offsets_BxM1)
    return _cudnn_saved_as(checkpoint_as, packed, q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, *spans)


def _named(x: jax.Array, name: str | None) -> jax.Array:
    """x named `name` for jax.ad_checkpoint (None: as it is)."""
    return x if name is None else checkpoint_name(x, name)


def _cudnn_saved_as(name: str | None, attention_fn: Callable, q, k, v, *spans) -> jax.Array:
    """cuDNN's attention_fn(q, k, v, *spans), its output named `name` for jax.ad_checkpoint
    (None: not named), and so is the rest of what its backward keeps beside q, k and v (its
    output and logsumexp): a recompute policy that saves `name` keeps them, rather than running
    cuDNN's forward again in the backward pass, and the output the caller keeps is the array
    the backward keeps."""
    if name is None:
        return attention_fn(q, k, v, *spans)
    return _saved_as_named(attention_fn, name, q, k, v, *spans)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _saved_as_named(attention_fn, name, q, k, v, *spans):
    return checkpoint_name(attention_fn(q, k, v, *spans), name)


def _saved_as_forward(attention_fn, name, q, k, v, *spans):
    o, pullback = jax.vjp(lambda q, k, v: attention_fn(q, k, v, *spans), q, k, v)
    named_o = checkpoint_name(o, name)

    def saved(x):
        if x is o:
            return named_o
        return x if any(x is given for given in (q, k, v)) else checkpoint_name(x, name)

    return named_o, (jax.tree.map(saved, pullback), spans)


def _saved_as_backward(attention_fn, name, saved, g):
    pullback, spans = saved
    return (*pullback(g), *(None for _ in spans))


_saved_as_named.defvjp(_saved_as_forward, _saved_as_backward)


def _mosaic(q, k, v, segment_ids, window, scale, mesh, deterministic, checkpoint_as=None):
    """Our flash attention, on each device's rows and heads under shard_map where `mesh` is
    given (a Pallas call has no partitioning rule): the batch split over the batch axes, the
    heads over the tensor axis, which keeps each query head with its key/value head, as
    tensor parallelism requires the key/value heads to divide evenly."""
    from jaxllmq.kernels import flash_attention

    scale = q.shape[-1] ** -0.5 if scale is None else scale

    def run(q, k, v, segment_ids=None):
        return flash_attention.flash_attention(
            q,
            k,
            v,
            scale=scale,
            segment_ids_BxT=segment_ids,
            window=window,
            deterministic=deterministic,
            checkpoint_as=checkpoint_as,
        )

    args = (q, k, v) if segment_ids is None else (q, k, v, segment_ids)
    if mesh is None:
        return run(*args)
    heads, rows = PartitionSpec(BATCH_AXES, None, TENSOR, None), PartitionSpec(BATCH_AXES, None)
    in_specs = (heads, heads, heads, rows)[: len(args)]
    return jax.shard_map(run, mesh=mesh, in_specs=in_specs, out_specs=heads, check_vma=False)(*args)


def resolve_attention(
    attention: str,
    dtype,
    *,
    platform: str | None = None,
    deterministic: bool = False,
    mosaic: bool = False,
    mosaic_faster: bool = False,
) -> str:
    """'auto' -> cuDNN's fused attention on GPU (`platform`, default jax's backend) in
    bf16/fp16, XLA's otherwise. Where jaxllmq's flash attention ("mosaic") can run (`mosaic`: a
    Hopper GPU, its head dims) and was measured faster (`mosaic_faster`: packed documents,
    0.5-0.7x the time of cuDNN's 32 segments at the 1B's heads, with no limit on documents a
    window and less memory; causal attention at head dims 64, 128 and 256; sliding windows of up
    to 2048 keys at 128, 1024 at 256, of any length at 64, on every layer that has one) it runs
    instead of cuDNN's. `deterministic` (XLA's deterministic ops): cuDNN's crashes under them
    and its backward's atomics round differently each run, while ours, asked for determinism,
    writes every output from one place in a fixed order; ours where it can run, else XLA's
    (2-2.5x slower on the 1B step)."""
    if attention not in ATTENTION_IMPLS:
        raise ValueError(f"attention must be one of {ATTENTION_IMPLS}, got {attention!r}")
    if attention != "auto":
        return attention
    on_gpu = (platform or jax.default_backend()) in ("gpu", "cuda")
    fused = on_gpu and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
    if not fused:
        return "xla"
    if mosaic and (mosaic_faster or deterministic):
        return "mosaic"
    return "xla" if deterministic else "cudnn"


def attend(
    q_BxTxNxH: jax.Array,
    k_BxTxKxH: jax.Array,
    v_BxTxKxH: jax.Array,
    cache: KVCache | None,
    *,
    implementation: str,
    documents: Documents | None = None,
    window: int | None = None,
    scale: float | None = None,
    mesh: Mesh | None = None,
    deterministic: bool = False,
    checkpoint_as: str | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Causal GQA attention (K kv heads serve N/K query heads each; cuDNN's fused kernel on GPU),
    and the cache, if any, holding these tokens' keys and values too.

    `documents` (attention.documents_for `implementation`): each query also reads only its own
    document's keys. `window`: the query at position p reads keys p - window < j <= p only
    (transformers' sliding window). `scale`: the logits' (default 1/sqrt(H)). `mesh`: our flash
    attention ("mosaic") runs per device of it (None: one call over the whole batch), and with
    `deterministic` its gradients are bit-identical from run to run (at head dim 64 a little
    slower). With one layer's cache the queries are at positions cache.length.., and each reads
    the cached keys up to its own position. `checkpoint_as` (without a cache): a
    jax.ad_checkpoint name for the output and, under ours and cuDNN's, for the logsumexp their
    backward keeps too, so that a recompute policy saving the name does not run their forward
    again."""
    if implementation == "mosaic" and cache is None and documents is None:
        o = _mosaic(
            q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, None, window, scale, mesh, deterministic, checkpoint_as
        )
        return o, None
    if implementation == "mosaic":  # a KV cache's attention (generation): cuDNN's
        implementation = "cudnn"
    if documents is not None:
        o_BxTxNxH = attend_documents(
            q_BxTxNxH,
            k_BxTxKxH,
            v_BxTxKxH,
            documents,
            window=window,
            scale=scale,
            mesh=mesh,
            deterministic=deterministic,
            checkpoint_as=checkpoint_as,
        )
        return o_BxTxNxH, cache
    if cache is None:
        fused = functools.partial(
            jax.nn.dot_product_attention,
            scale=scale,
            is_causal=True,
            local_window_size=None if window is None else (window - 1, 0),
            implementation=implementation,
        )
        if implementation == "cudnn":
            return _cudnn_saved_as(checkpoint_as, fused, q_BxTxNxH, k_BxTxKxH, v_BxTxKxH), None
        # XLA's backward keeps the softmax too: recomputed under a policy, as before the name.
        return _named(fused(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH), checkpoint_as), None
    T, S = q_BxTxNxH.shape[1], cache.k.shape[1]
    positions_Tx1 = (cache.length + jnp.arange(T))[:, None]
    visible_TxS = jnp.arange(S) <= positions_Tx1
    if window is not None:
        visible_TxS &= jnp.arange(S) > positions_Tx1 - window
    cache = cache.append(k_BxTxKxH, v_BxTxKxH)
    o_BxTxNxH = jax.nn.dot_product_attention(
        q_BxTxNxH,
        cache.k,
        cache.v,
        mask=visible_TxS[None, None],
        scale=scale,
        implementation=implementation,
    )
    return o_BxTxNxH, cache
