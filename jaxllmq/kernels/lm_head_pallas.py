"""Pallas kernel for the LM head: logits tile by tile, reduced to logsumexp pieces on the spot.

One program computes a [block_m tokens, block_v vocab] tile of h @ w with an inner loop over the
hidden dim, then folds the tile into its logsumexp (max + log-sum-exp of the tile) and picks the
target logit if it falls in the tile. The [tokens, vocab] logits never reach memory; what does is
one fp32 per (token, vocab tile): 1/256 of the fp32 logits at block_v 256. The pieces are combined
in XLA (a logsumexp over vocab tiles). Programs are ordered in groups of `group_m` token blocks
that sweep the vocabulary together, so those tokens' hidden states stay in L2 while each weight
tile is read from memory once per group.

For the gradient the kernel can also write q = exp(logits - r) (in the weight's dtype) for a
reference r per token given to it, the token's target logit: the softmax is then q times a
per-token scale, exp(r - lse), so the two backward matmuls (dh = dlogits @ w^T, dw = h^T @
dlogits, on cuBLAS) take q itself, the scale applied to h and to dh and the target's -1 written
into q, with no pass over the [tokens, vocab] values between them. Where a token's target logit
lies more than REFERENCE_RANGE below its logsumexp (a per-token loss above it), q could
overflow: such tokens' rows of q are made again in XLA, exact, with the logsumexp as the
reference. q is written for one chunk of tokens at a time.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxllmq.kernels import _pallas as P
from jaxllmq.kernels import lm_head_mgpu


@dataclasses.dataclass(frozen=True)
class LmHeadPallasConfig:
    """Tile sizes (powers of two) and launch parameters of the fused LM-head kernel."""

    # Tiles: fastest of the H200 sweep (docs/experiments, kernels), 560 TFLOP/s at hidden 2048.
    block_m: int = 128  # tokens per tile
    block_v: int = 256  # vocabulary entries per tile
    block_k: int = 64  # hidden-dim step of the inner matmul loop
    group_m: int = 32  # token blocks that sweep the vocabulary together (L2 reuse of h)
    num_warps: int = 8
    num_stages: int = 3
    # Most tokens whose q (softmax tiles) is held at once in the gradient. Each chunk's weight
    # gradient GEMM adds into the fp32 [D, V] accumulator, so fewer chunks read and write it
    # less: on the 1B step (H200) 8192 against 2048 gave +0.8% tokens/s on each of two GPUs for
    # 3 GiB (docs/experiments, kernels). --lmhead_chunks splits further where memory is short.
    chunk_tokens: int = 8192
    # Most q entries (tokens x vocabulary) of a chunk, a power of two of tokens under it: at
    # Gemma 3's 262,144-entry vocabulary 4096 tokens (2 GiB of bf16 q), whose 1B step on an H200
    # ran as fast as with 8192 (83,153 against 82,609 tokens/s) at 4 GiB less peak memory.
    chunk_entries: int = (1 << 31) - 1
    # "triton": the kernel below; "mosaic": lm_head_mgpu's Hopper kernel (lm_head_loss.kernel_used
    # keeps it to heads its tiles fit, the Triton kernel elsewhere).
    lowering: str = "triton"
    mosaic: lm_head_mgpu.MosaicTiles = lm_head_mgpu.MosaicTiles()
    interpret: bool = False

    @property
    def rows(self) -> int:
        """The multiple a call's tokens are padded to: block_m, and the Mosaic kernel's token
        tiles too under its lowering (so that only the head decides which kernel runs)."""
        if self.lowering == "mosaic":
            return math.lcm(self.block_m, self.mosaic.rows)
        return self.block_m

    def tokens_per_chunk(self, vocab: int) -> int:
        """chunk_tokens, or the largest power of two of tokens within chunk_entries if less."""
        return min(self.chunk_tokens, 1 << (max(1, self.chunk_entries // vocab).bit_length() - 1))


def _kernel(h_ref, w_ref, t_ref, *refs, n_m, n_v, d, v, cfg, with_q):
    r_ref, lse_ref, tl_ref, *q_ref = refs if with_q else (None, *refs)
    bm, bv, bk = cfg.block_m, cfg.block_v, cfg.block_k
    # Grouped order: group_m token blocks x all vocab tiles, token block fastest.
    pid = pl.program_id(0)
    per_group = cfg.group_m * n_v
    first_m = (pid // per_group) * cfg.group_m
    size_m = jnp.minimum(n_m - first_m, cfg.group_m)
    local = pid % per_group
    i = first_m + local % size_m
    j = local // size_m

    rows = i * bm + jnp.arange(bm)
    cols = j * bv + jnp.arange(bv)
    col_ok = cols < v if v % bv else None

    def body(k, acc):
        ks = k * bk + jnp.arange(bk)
        k_ok = ks < d if d % bk else None
        a_mask = P.bcast(None if k_ok is None else k_ok[None, :], (bm, bk))
        b_mask = P.bcast(
            P.and_masks(
                None if k_ok is None else k_ok[:, None],
                None if col_ok is None else col_ok[None, :],
            ),
            (bk, bv),
        )
        a = P.load(h_ref, (rows[:, None], ks[None, :]), a_mask)
        b = P.load(w_ref, (ks[:, None], cols[None, :]), b_mask)
        return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)

    logits = lax.fori_loop(0, P.cdiv(d, bk), body, jnp.zeros((bm, bv), jnp.float32))
    if col_ok is not None:
        logits = jnp.where(col_ok[None, :], logits, -jnp.inf)
    mx = jnp.max(logits, axis=1)
    e = jnp.exp(logits - mx[:, None])
    s = jnp.sum(e, axis=1)
    P.store(lse_ref, (j, rows), mx + jnp.log(s), None)

    # Each token's (sanitized, in-range) target lies in exactly one tile: that one writes it.
    t = P.load(t_ref, (rows,), None)
    hit = (t >= j * bv) & (t < j * bv + bv)
    tl = jnp.sum(jnp.where(cols[None, :] == t[:, None], logits, 0.0), axis=1)
    P.store(tl_ref, (rows,), tl, hit)
    if with_q:
        q = e * jnp.exp(mx - P.load(r_ref, (rows,), None))[:, None]  # exp(logits - r)
        q_mask = P.block_mask(None, col_ok, (bm, bv))
        P.store(q_ref[0], (rows[:, None], cols[None, :]), q.astype(q_ref[0].dtype), q_mask)


def lm_head_tiles(
    h_NxD: jax.Array,
    w_DxV: jax.Array,
    targets_N: jax.Array,
    cfg: LmHeadPallasConfig,
    reference_N: jax.Array | None,
) -> tuple[jax.Array, ...]:
    """Per-tile logsumexp [n_v, N] fp32, target logits [N] fp32, and with a reference [N] fp32
    q = exp(logits - reference) [N, V] in w's dtype.

    N must be a multiple of block_m; targets must lie in [0, V).
    """
    n, d = h_NxD.shape
    v = w_DxV.shape[1]
    bm, bv = cfg.block_m, cfg.block_v
    if n % bm:
        raise ValueError(f"lm_head_tiles: {n} tokens is not a multiple of block_m={bm}")
    n_m, n_v = n // bm, P.cdiv(v, bv)
    with_q = reference_N is not None
    outs = [
        jax.ShapeDtypeStruct((n_v, n), jnp.float32),
        jax.ShapeDtypeStruct((n,), jnp.float32),
    ]
    args = [h_NxD, w_DxV, targets_N.astype(jnp.int32)]
    if with_q:
        outs.append(jax.ShapeDtypeStruct((n, v), w_DxV.dtype))
        args.append(reference_N.astype(jnp.float32))
    kernel = functools.partial(_kernel, n_m=n_m, n_v=n_v, d=d, v=v, cfg=cfg, with_q=with_q)
    return P.call(
        kernel,
        tuple(outs),
        (n_m * n_v,),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        interpret=cfg.interpret,
        name="lm_head_lse_q" if with_q else "lm_head_lse",
    )(*args)


def _target_logits(h_c, w, t_c):
    """Each token's row of h against its target's column of w, fp32."""
    w_t = jnp.take(w, t_c, axis=1).T
    return jnp.einsum("nd,nd->n", h_c, w_t, preferred_element_type=jnp.float32)


def _tiles(h_c, w, t_c, cfg: LmHeadPallasConfig, reference=None) -> tuple[jax.Array, ...]:
    """lm_head_tiles through the configured lowering: (lse_part, target logit[, q])."""
    if cfg.lowering == "mosaic":
        lse_part, *q = lm_head_mgpu.lm_head_tiles(h_c, w, cfg.mosaic, reference, cfg.interpret)
        return lse_part, _target_logits(h_c, w, t_c), *q
    return lm_head_tiles(h_c, w, t_c, cfg, reference)


def chunk_stats(h_c, w, t_c, cfg: LmHeadPallasConfig):
    """(lse, target logit) of one chunk of tokens, no gradient work."""
    lse_part, tl = _tiles(h_c, w, t_c, cfg)
    return jax.nn.logsumexp(lse_part, axis=0), tl


# How far below its logsumexp a token's q reference may lie: q = exp(logits - reference) stays
# within exp(64) (bf16's and fp32's range end near exp(88)), so that the backward matmuls'
# fp32 sums over the vocabulary cannot overflow either, and a token's softmax entries that
# matter (within exp(-24) of its largest) stay above exp(-87), where bf16's normal range ends.
REFERENCE_RANGE = 64.0


# Tokens past the range get their q rows again, exact, this many at a time (an XLA matmul of
# their rows, [FAR_ROWS, vocab] fp32 at once). The rows are written over q in a loop, which
# updates it in place: the branch that ran the chunk's kernel again held a second q and a second
# fp32 weight gradient beside the first (conditionals give their outputs buffers of their own),
# 2.7 GiB more peak for the 8B under ZeRO-3 on four GPUs.
FAR_ROWS = 64


def _far_rows_relative_to_lse(q, reference, lse, h_c, w):
    """(q, reference) with every token past REFERENCE_RANGE given its exact softmax row and its
    logsumexp as its reference, FAR_ROWS tokens an iteration (none: no iteration)."""
    n = q.shape[0]

    def remaining(state):
        _, reference = state
        return jnp.any(lse - reference > REFERENCE_RANGE)

    def next_rows(state):
        q, reference = state
        # The first FAR_ROWS tokens still past the range; the rest of the index filled with n,
        # past the rows, which the gather clamps and the scatters drop.
        (rows,) = jnp.nonzero(lse - reference > REFERENCE_RANGE, size=FAR_ROWS, fill_value=n)
        h_rows = jnp.take(h_c, rows, axis=0, mode="clip")
        lse_rows = jnp.take(lse, rows, mode="clip")
        logits = jnp.dot(h_rows, w, preferred_element_type=jnp.float32)
        softmax = jnp.exp(logits - lse_rows[:, None]).astype(q.dtype)
        q = q.at[rows].set(softmax, mode="drop")
        return q, reference.at[rows].set(lse_rows, mode="drop")

    return lax.while_loop(remaining, next_rows, (q, reference))


def chunk_grads(h_c, w, t_c, m_c, dw_acc, z_loss: float, cfg: LmHeadPallasConfig):
    """(lse, target logit, d obj/dh [C, D] fp32, dw_acc + d obj/dw [D, V] fp32) of one chunk."""
    reference = _target_logits(h_c, w, t_c)
    lse_part, tl, q = _tiles(h_c, w, t_c, cfg, reference)
    lse = jax.nn.logsumexp(lse_part, axis=0)
    q, reference = _far_rows_relative_to_lse(q, reference, lse, h_c, w)
    # d obj/d logits = m * (softmax * (1 + 2 z lse) - onehot), softmax = q * exp(reference -
    # lse): a scale per token times q, with the onehot divided by it added at the target.
    c = m_c.astype(jnp.float32)
    z_factor = 1.0 + 2.0 * z_loss * lse
    scale = c * z_factor * jnp.exp(reference - lse)
    at_target = jnp.where(c != 0, -jnp.exp(lse - reference) / z_factor, 0.0)
    target = (jnp.arange(q.shape[0]), t_c)
    q = q.at[target].set((q[target].astype(jnp.float32) + at_target).astype(q.dtype))
    dh = jnp.dot(q, w.T, preferred_element_type=jnp.float32) * scale[:, None]
    h_scaled = (h_c.astype(jnp.float32) * scale[:, None]).astype(w.dtype)
    return lse, tl, dh, dw_acc + jnp.dot(h_scaled.T, q, preferred_element_type=jnp.float32)
