"""Causal flash attention for Hopper in Mosaic GPU: GQA, packed documents, sliding windows.

The kernels take head dims 64, 128 and 256; a smaller head dim runs at the next of them, its
inputs padded with zero columns (which change no score, output or gradient; at 96, causal, the
padded kernels take 1.00-1.05x cuDNN's time at 96). At 256 dK's and dV's fp32 rows do not fit
a warpgroup's registers together, so the backward's kernels split the warpgroups by role
(backward_wide.py), and causal forward + backward takes 0.88x cuDNN's time at 8 x 2048 and 0.97x
at 2 x 8192 on an H200.

The forward keeps a CTA's 2 x block_q query rows in shared memory, one block_q half per compute
warpgroup, while a memory warpgroup streams key and value tiles through a ring of `stages`
TMA-filled buffers (at head dim 64, plain causal attention of WIDE_KEY_TILES_FROM tokens or more
takes 256-key tiles, half the steps). It is persistent (one CTA per SM takes query blocks in
turn, loading the next block's rows while it finishes the last), which made it 4-11% faster; the
backward's kernels keep a CTA per block, as persistent they were no faster. Each compute
warpgroup issues wgmma for S = Q K^T, runs an online softmax in fp32 registers and issues wgmma
for O += P V with P straight from registers; a barrier shared by the two compute warpgroups
staggers them, so that one's softmax runs while the other's matmuls occupy the tensor cores. At
head dim 128 the forward instead issues each key tile's S together with the tile before's P V,
each warpgroup on its own (FlashBlocks.fwd_overlap; ptxas waits for both before the softmax).
The backward recomputes P per tile from the forward's logsumexp: one kernel accumulates dK and
dV per key tile over the query tiles that see it (all query heads of its GQA group, so K and V
are never repeated in memory), another dQ per query tile. By default the dK/dV kernel adds dQ up
too (FlashBlocks.dq_in_dkv: five matmuls a tile, not seven; at head dim 128 each compute
warpgroup forms half of dQ's columns), by fp32 reduce-adds whose order, and so whose rounding,
varies from run to run; `deterministic` calls keep dQ's own kernel, which writes each tile once.
At 64, deterministic or not, its compute warpgroups also hold their key and value tiles in
registers (FlashBlocks.dkv_kv_in_registers), so that S^T's and dP^T's products read only the
query rows and dO from shared memory; at 128 each compute warpgroup's code is compiled with its
index known (FlashBlocks.per_warpgroup_code), which keeps the addresses of its tiles out of
each thread's registers.

Which keys a query sees is causal, and optionally bounded below by its document's start and its
sliding window: the first key of row r is first_key[r] = max(document start, r - window + 1),
and the last row that sees key j is last_row[j] = min(document end - 1, j + window - 1). Tiles
that no row of a block sees are never loaded or computed, and only tiles that cut a boundary
are masked. Documents must be contiguous runs of equal segment ids (as the data pipeline packs
them). Mosaic GPU's interpreter lacks what the kernels are built from (transposed wgmma operands, P
from registers, accumulators carried across calls), so on CPU the tests lower them for a GPU
(jax.export) and check their masks' arithmetic; on the GPU (tests/gpu) they run against the
pure-JAX `reference_attention`.

Files: tiles.py (the tile settings and their defaults), common.py (layouts, the order of the
work, the kernel launch), forward.py, backward.py and backward_wide.py; here the entry point,
flash_attention, and what it is checked against.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jaxllmq.kernels.flash_attention import backward, forward
from jaxllmq.kernels.flash_attention.common import Visibility
from jaxllmq.kernels.flash_attention.tiles import (
    ANY_WINDOW_FASTER_HEAD_DIMS,
    CAUSAL_FASTER_HEAD_DIMS,
    FASTER_WINDOW_MAX,
    HEAD_DIMS,
    WIDE_KEY_TILES_FROM,
    FlashBlocks,
    default_blocks,
    kernel_device_kind,
    kernel_head_dim,
)

__all__ = [
    "ANY_WINDOW_FASTER_HEAD_DIMS",
    "CAUSAL_FASTER_HEAD_DIMS",
    "FASTER_WINDOW_MAX",
    "HEAD_DIMS",
    "WIDE_KEY_TILES_FROM",
    "FlashBlocks",
    "default_blocks",
    "fits",
    "flash_attention",
    "kernel_device_kind",
    "kernel_head_dim",
    "key_bounds",
    "reference_attention",
]


def fits(head_dim: int, heads: int, kv_heads: int, dtype) -> str | None:
    """Why the kernel cannot take these heads in `dtype` (None: it can). Any sequence length:
    flash_attention pads it to whole tiles; any head dim up to 256: it pads it to 64, 128 or
    256."""
    if kernel_head_dim(head_dim) is None:
        return f"head dim {head_dim} (it takes up to {max(HEAD_DIMS)})"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"{jnp.dtype(dtype).name} (it takes bfloat16 or float16)"
    if heads % kv_heads:
        return f"{heads} query heads over {kv_heads} key heads"
    return None


def _tile_multiple(blocks: FlashBlocks) -> int:
    """The sequence lengths every kernel's tiles divide."""
    tiles = (
        2 * blocks.block_q,
        blocks.block_kv,
        2 * blocks.dkv_block_kv,
        blocks.dkv_block_q,
        2 * blocks.dq_block_q,
        blocks.dq_block_kv,
    )
    return math.lcm(*tiles)


def key_bounds(
    seq_len: int, segment_ids_BxT: jax.Array | None, window: int | None, batch: int
) -> tuple[jax.Array, jax.Array]:
    """(first_key int32[B, T], last_row int32[B, T]): the first key each query sees and the last
    query that sees each key, from documents (contiguous segment ids) and a window."""
    pos = jnp.arange(seq_len, dtype=jnp.int32)
    if segment_ids_BxT is None:
        first = jnp.zeros((batch, seq_len), jnp.int32)
        last = jnp.full((batch, seq_len), seq_len - 1, jnp.int32)
    else:
        seg = segment_ids_BxT
        starts = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], 1)
        first = lax.cummax(jnp.where(starts, pos, 0), axis=1)
        ends = jnp.concatenate([seg[:, 1:] != seg[:, :-1], jnp.ones_like(seg[:, :1], bool)], 1)
        last = lax.cummin(jnp.where(ends, pos, seq_len - 1), axis=1, reverse=True)
    if window is not None:
        first = jnp.maximum(first, pos - (window - 1))
        last = jnp.minimum(last, pos + (window - 1))
    return first.astype(jnp.int32), last.astype(jnp.int32)


def reference_attention(q, k, v, scale, first_key=None):
    """Pure-JAX causal GQA attention in fp32, keys from first_key[B, T] on (the referee)."""
    b, t, hq, d = q.shape
    g = hq // k.shape[2]
    kr = jnp.repeat(k, g, axis=2).astype(jnp.float32)
    vr = jnp.repeat(v, g, axis=2).astype(jnp.float32)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kr) * scale
    pos = jnp.arange(t)
    ok = pos[None, :] <= pos[:, None]
    if first_key is not None:
        ok = ok[None] & (pos[None, None, :] >= first_key[:, :, None])
        ok = ok[:, None]
    s = jnp.where(ok, s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), vr)


# Each kernel behind one jit: every layer's call then lowers to the same function, so a model's
# unrolled layers build each Mosaic GPU kernel once rather than once a layer.
_KERNEL_OPTIONS = ("scale", "vis", "blocks")
_forward = jax.jit(forward.forward, static_argnames=_KERNEL_OPTIONS)
_backward_dkv = jax.jit(backward.backward_dkv, static_argnames=_KERNEL_OPTIONS)
_backward_dq = jax.jit(backward.backward_dq, static_argnames=_KERNEL_OPTIONS)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _flash(q, k, v, first_key, last_row, scale, vis, blocks, checkpoint_as):
    o, _ = _forward(q, k, v, first_key, scale=scale, vis=vis, blocks=blocks)
    return o


def _flash_fwd(q, k, v, first_key, last_row, scale, vis, blocks, checkpoint_as):
    o, lse = _forward(q, k, v, first_key, scale=scale, vis=vis, blocks=blocks)
    if checkpoint_as is not None:
        o, lse = checkpoint_name(o, checkpoint_as), checkpoint_name(lse, checkpoint_as)
    return o, (q, k, v, o, lse, first_key, last_row)


def _flash_bwd(scale, vis, blocks, checkpoint_as, res, do):
    q, k, v, o, lse, first_key, last_row = res
    do = do.astype(q.dtype)
    delta = backward.row_delta(o, do)
    kw = dict(scale=scale, vis=vis, blocks=blocks)
    if blocks.dq_in_dkv:
        dk, dv, dq = _backward_dkv(q, k, v, do, lse, delta, last_row, **kw)
    else:
        dk, dv = _backward_dkv(q, k, v, do, lse, delta, last_row, **kw)
        dq = _backward_dq(q, k, v, do, lse, delta, first_key, **kw)
    none = lambda x: None if x is None else jnp.zeros_like(x)  # noqa: E731 (int inputs)
    return dq, dk, dv, none(first_key), none(last_row)


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    q_BxTxNxH: jax.Array,
    k_BxTxKxH: jax.Array,
    v_BxTxKxH: jax.Array,
    *,
    scale: float,
    segment_ids_BxT: jax.Array | None = None,
    window: int | None = None,
    blocks: FlashBlocks | None = None,
    deterministic: bool = False,
    checkpoint_as: str | None = None,
) -> jax.Array:
    """Causal attention [B, T, Hq, D] of q over k, v [B, T, Hkv, D] (Hq a multiple of Hkv),
    within each document of `segment_ids_BxT` and a sliding `window`, where `fits` says so.
    A T that is not a multiple of the tiles is padded at the end (causal attention keeps the
    padding out of every real query's keys), a D below 64 or between 64 and 128 with zero
    columns (kernel_head_dim), and the output cut back. `blocks`: the tiles (default_blocks for
    the head dim, `deterministic`, the GPU and, for plain causal attention, T when None;
    `deterministic`: the gradients bit-identical from run to run). `checkpoint_as`: a
    jax.ad_checkpoint name for the output and its rows' logsumexp, what the backward keeps
    beside q, k and v; a recompute policy that saves the name then keeps them rather than
    running the forward again, and the output a caller keeps is the same array."""
    b, t, hq, d = q_BxTxNxH.shape
    why = fits(d, hq, k_BxTxKxH.shape[2], q_BxTxNxH.dtype)
    if why:
        raise ValueError(f"flash attention: the kernel does not take {why}")
    vis = Visibility(window=window, documents=segment_ids_BxT is not None)
    blocks = blocks or default_blocks(d, deterministic, 0 if vis.bounded else t)
    pad = -t % _tile_multiple(blocks)
    pad_d = kernel_head_dim(d) - d
    q, k, v, seg = q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT
    if pad or pad_d:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, pad_d))) for x in (q, k, v))
    if pad and seg is not None:  # the padding a document of its own
        seg = jnp.concatenate([seg, jnp.repeat(seg[:, -1:] + 1, pad, axis=1)], axis=1)
    first_key = last_row = None
    if vis.bounded:
        first_key, last_row = key_bounds(t + pad, seg, window, b)
    o = _flash(q, k, v, first_key, last_row, scale, vis, blocks, checkpoint_as)
    return o[:, :t, :, :d] if pad or pad_d else o
