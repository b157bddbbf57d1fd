"""Pallas kernel for the LM head: logits tile by tile, reduced to logsumexp pieces on the spot.

One program computes a [block_m tokens, block_v vocab] tile of h @ w with an inner loop over the
hidden dim, then folds the tile into its logsumexp (max + log-sum-exp of the tile) and picks the
target logit if it falls in the tile. The [tokens, vocab] logits never reach memory; what does is
one fp32 per (token, vocab tile): 1/256 of the fp32 logits at block_v 256. The pieces are combined
in XLA (a logsumexp over vocab tiles). Programs are ordered in groups of `group_m` token blocks
that sweep the vocabulary together, so those tokens' hidden states stay in L2 while each weight
tile is read from memory once per group.

For the gradient the kernel can also write q = softmax within the tile (in the weight's dtype):
the full softmax is q * exp(tile_lse - lse), so the backward's dlogits come from one elementwise
pass over q instead of recomputing h @ w, and the two backward matmuls (dh = dlogits @ w^T,
dw = h^T @ dlogits) run on cuBLAS. q is written for one chunk of tokens at a time.
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


def _kernel(h_ref, w_ref, t_ref, *out_refs, n_m, n_v, d, v, cfg, with_q):
    lse_ref, tl_ref = out_refs[:2]
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
        (q_ref,) = out_refs[2:]
        q = e * (1.0 / s)[:, None]
        P.store(q_ref, (rows[:, None], cols[None, :]), q.astype(q_ref.dtype), None)


def lm_head_tiles(
    h_NxD: jax.Array, w_DxV: jax.Array, targets_N: jax.Array, cfg: LmHeadPallasConfig, with_q: bool
) -> tuple[jax.Array, ...]:
    """Per-tile logsumexp [n_v, N] fp32, target logits [N] fp32, and optionally q [N, n_v*block_v].

    N must be a multiple of block_m; targets must lie in [0, V).
    """
    n, d = h_NxD.shape
    v = w_DxV.shape[1]
    bm, bv = cfg.block_m, cfg.block_v
    if n % bm:
        raise ValueError(f"lm_head_tiles: {n} tokens is not a multiple of block_m={bm}")
    n_m, n_v = n // bm, P.cdiv(v, bv)
    outs = [
        jax.ShapeDtypeStruct((n_v, n), jnp.float32),
        jax.ShapeDtypeStruct((n,), jnp.float32),
    ]
    if with_q:
        outs.append(jax.ShapeDtypeStruct((n, n_v * bv), w_DxV.dtype))
    kernel = functools.partial(_kernel, n_m=n_m, n_v=n_v, d=d, v=v, cfg=cfg, with_q=with_q)
    return P.call(
        kernel,
        tuple(outs),
        (n_m * n_v,),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        interpret=cfg.interpret,
        name="lm_head_lse_q" if with_q else "lm_head_lse",
    )(h_NxD, w_DxV, targets_N.astype(jnp.int32))


def _tiles(h_c, w, t_c, cfg: LmHeadPallasConfig, with_q: bool) -> tuple[jax.Array, ...]:
    """lm_head_tiles through the configured lowering: (lse_part, target logit[, q])."""
    if cfg.lowering == "mosaic":
        lse_part, *q = lm_head_mgpu.lm_head_tiles(h_c, w, cfg.mosaic, with_q, cfg.interpret)
        # The target logit: each token's row of h against its target's column of w.
        w_t = jnp.take(w, t_c, axis=1).T
        tl = jnp.einsum("nd,nd->n", h_c, w_t, preferred_element_type=jnp.float32)
        return lse_part, tl, *q
    return lm_head_tiles(h_c, w, t_c, cfg, with_q)


def chunk_stats(h_c, w, t_c, cfg: LmHeadPallasConfig):
    """(lse, target logit) of one chunk of tokens, no gradient work."""
    lse_part, tl = _tiles(h_c, w, t_c, cfg, with_q=False)
    return jax.nn.logsumexp(lse_part, axis=0), tl


def chunk_grads(h_c, w, t_c, m_c, z_loss: float, cfg: LmHeadPallasConfig):
    """(lse, target logit, d obj/dh [C, D] fp32, d obj/dw [D, V] fp32) of one chunk."""
    v = w.shape[1]
    lse_part, tl, q = _tiles(h_c, w, t_c, cfg, with_q=True)
    lse = jax.nn.logsumexp(lse_part, axis=0)
    c = m_c.astype(jnp.float32)
    # softmax = q * exp(tile_lse - lse); d obj/d logits = m * (softmax * (1 + 2 z lse) - onehot).
    scale = (c * (1.0 + 2.0 * z_loss * lse))[None, :] * jnp.exp(lse_part - lse[None, :])
    n_c, n_v = h_c.shape[0], lse_part.shape[0]
    p = (q.reshape(n_c, n_v, -1) * scale.T[:, :, None]).reshape(n_c, -1)[:, :v]
    onehot = jnp.arange(v)[None, :] == t_c[:, None]
    dlogits = (p - jnp.where(onehot, c[:, None], 0.0)).astype(w.dtype)
    dh = jnp.dot(dlogits, w.T, preferred_element_type=jnp.float32)
    dw = jnp.dot(h_c.T, dlogits, preferred_element_type=jnp.float32)
    return lse, tl, dh, dw
