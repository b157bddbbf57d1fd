"""Causal flash attention for Hopper in Mosaic GPU: GQA, packed documents, sliding windows.

The forward keeps a CTA's 2 x block_q query rows in shared memory, one block_q half per compute
warpgroup, while a memory warpgroup streams key and value tiles through a ring of `stages`
TMA-filled buffers. Each compute warpgroup issues wgmma for S = Q K^T, runs an online softmax in
fp32 registers and issues wgmma for O += P V with P straight from registers; a barrier shared by
the two compute warpgroups staggers them, so that one's softmax runs while the other's matmuls
occupy the tensor cores. The backward recomputes P per tile from the forward's logsumexp: one
kernel accumulates dK and dV per key tile over the query tiles that see it (all query heads of
its GQA group, so K and V are never repeated in memory), another dQ per query tile.

Which keys a query sees is causal, and optionally bounded below by its document's start and its
sliding window: the first key of row r is first_key[r] = max(document start, r - window + 1),
and the last row that sees key j is last_row[j] = min(document end - 1, j + window - 1). Tiles
that no row of a block sees are never loaded or computed, and only tiles that cut a boundary
are masked. Documents must be contiguous runs of equal segment ids (as the data pipeline packs
them). On CPU the kernels run in Mosaic GPU's interpret mode (the tests); the pure-JAX
reference is `reference_attention`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

LOG2E = math.log2(math.e)
# Registers per thread of a compute and of the memory warpgroup: (2 x 232 + 40) x 128 threads
# fits an SM's 65,536; asking for more makes setmaxnreg wait forever.
_COMPUTE_REGISTERS, _MEMORY_REGISTERS = 232, 40
# Running maxima start here, not at -inf, so a row with no visible key in a tile stays finite.
_NO_MAX = -1e30
HEAD_DIMS = (64, 128)


@dataclasses.dataclass(frozen=True)
class FlashBlocks:
    """Tile sizes (multiples of 64)."""

    block_q: int = 64  # forward: query rows per compute warpgroup (a CTA takes two)
    block_kv: int = 128  # forward: keys per step
    stages: int = 2  # forward: key/value tiles in flight
    bwd_block_kv: int = 64  # dK/dV: keys per compute warpgroup (a CTA takes two)
    bwd_block_q: int = 64  # dK/dV: query rows per step; dQ: query rows per warpgroup
    bwd_stages: int = 2
    # dQ in the dK/dV kernel: each step's dS^T K goes to an fp32 dQ in memory by TMA's
    # reduce-add, instead of a second kernel recomputing S and dP per query tile.
    fused_dq: bool = False


@dataclasses.dataclass(frozen=True)
class Visibility:
    """Which keys a query sees besides causality: a sliding window (keys j with r - j < window)
    and packed documents (first_key/last_row arrays given at the call)."""

    window: int | None = None
    documents: bool = False

    @property
    def bounded(self) -> bool:
        return self.window is not None or self.documents


def fits(head_dim: int, heads: int, kv_heads: int, dtype) -> str | None:
    """Why the kernel cannot take these heads in `dtype` (None: it can). Any sequence length:
    flash_attention pads it to whole tiles."""
    if head_dim not in HEAD_DIMS:
        return f"head dim {head_dim} (it takes {' or '.join(map(str, HEAD_DIMS))})"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"{jnp.dtype(dtype).name} (it takes bfloat16 or float16)"
    if heads % kv_heads:
        return f"{heads} query heads over {kv_heads} key heads"
    return None


def _tile_multiple(blocks: FlashBlocks) -> int:
    """The sequence lengths every kernel's tiles divide."""
    tiles = (2 * blocks.block_q, blocks.block_kv, 2 * blocks.bwd_block_kv, 2 * blocks.bwd_block_q)
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


def _interpret_params():
    """Mosaic GPU's interpret mode (jax keeps its parameters class private)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def _tile_transforms(dtype) -> tuple:
    """Shared-memory transforms of [rows, D] tiles (D >= 64 elements of 16 bits: 128-byte rows)."""
    return plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)


def _row(ref):
    """A [rows] vector in shared memory, laid out along the rows of a wgmma accumulator."""
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(1))


def _col(ref):
    """A [cols] vector in shared memory, laid out along the columns of a wgmma accumulator."""
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(0))


def _iota(shape, dim, interpret):
    if interpret:  # the interpreter knows no register layouts
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _zeros(shape, interpret, fill=0.0):
    """fp32 registers laid out as a wgmma accumulator ([rows, cols]) or along its rows ([rows])."""
    x = jnp.full(shape, fill, jnp.float32)
    if interpret:
        return x
    layout = plgpu.Layout.WGMMA if len(shape) == 2 else plgpu.Layout.WGMMA.reduce(1)
    return plgpu.layout_cast(x, layout)


def _accumulate(issue, accs: tuple, interpret: bool) -> tuple:
    """accs (fp32 registers) plus the products `issue(refs)` puts into wgmma accumulator refs.
    On a GPU the products accumulate in place (pl.run_state); Mosaic GPU's interpreter has no
    run_state, so there they are taken from zeroed accumulators and added."""
    if interpret:

        def scoped(*refs):
            issue(refs)
            return tuple(r[...] for r in refs)

        products = pl.run_scoped(scoped, *(plgpu.ACC(a.shape, a.dtype) for a in accs))
        return tuple(a + p for a, p in zip(accs, products, strict=True))
    return pl.run_state(issue)(tuple(plgpu.ACC.init(a) for a in accs))


def _kernel_call(body, out_type, grid, grid_names, scratch, interpret, with_refs=False):
    """A kernel of two compute warpgroups and a memory one. with_refs: some operands are jax
    Refs, written in place (pl.kernel aliases them; plgpu.kernel's vmap wrapper takes none)."""

    def entry(*refs):
        pl.run_scoped(lambda *scoped: body(*refs, *scoped), *scratch, collective_axes="wg")

    options = dict(
        out_type=out_type,
        # Lane semantics named: newer jax lowers to warpgroup semantics by default.
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane
        ),
        interpret=_interpret_params() if interpret else False,
    )
    if with_refs:
        mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, num_threads=3, thread_name="wg")
        return pl.kernel(entry, mesh=mesh, **options)
    return plgpu.kernel(
        entry, grid=grid, grid_names=grid_names, num_threads=3, thread_name="wg", **options
    )


def forward(q, k, v, first_key, *, scale, vis: Visibility, blocks: FlashBlocks, interpret):
    """(o [B, T, Hq, D], lse [B, Hq, T] fp32 in log2 units of the scaled scores)."""
    b_, t, hq, d = q.shape
    group = hq // k.shape[2]
    bq, bk, stages = blocks.block_q, blocks.block_kv, blocks.stages
    rows = 2 * bq
    dtype = q.dtype
    c2 = scale * LOG2E
    tr = _tile_transforms(dtype)

    def body(q_ref, k_ref, v_ref, *rest):
        if vis.bounded:
            fk_ref, o_ref, lse_ref, *scoped = rest
        else:
            fk_ref, (o_ref, lse_ref, *scoped) = None, rest
        (q_smem, k_smem, v_smem, fk_smem, lse_smem), ready, free, turn = scoped
        k_ready, v_ready, q_ready = ready
        k_free, v_free = free
        b = lax.axis_index("batch")
        h = lax.axis_index("heads")
        first_row = lax.axis_index("q_blocks") * rows
        wg = lax.axis_index("wg")
        hi = lax.div(first_row + rows + bk - 1, bk)  # causal: the tile of the last row
        lo = lax.div(fk_ref[b, first_row], bk) if vis.bounded else jnp.int32(0)

        def take_turn():
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
            row0 = first_row + wg * bq
            own = pl.ds(row0, bq)
            plgpu.copy_gmem_to_smem(q_ref.at[b, own, h], q_smem.at[wg], q_ready.at[wg])
            if vis.bounded:
                plgpu.copy_gmem_to_smem(fk_ref.at[b, own], fk_smem.at[wg], q_ready.at[2 + wg])
                plgpu.barrier_wait(q_ready.at[2 + wg])
            plgpu.barrier_wait(q_ready.at[wg])
            own_hi = lax.div(row0 + bq + bk - 1, bk)
            # Tiles before `unmasked_end` lie wholly at or below every row's diagonal.
            unmasked_end = lo if vis.bounded else lax.div(row0 + 1, bk)
            m = _zeros((bq,), interpret, _NO_MAX)
            denom = _zeros((bq,), interpret)
            acc = _zeros((bq, d), interpret)
            plgpu.barrier_wait(k_ready.at[0])
            pl.when(wg == 1)(take_turn)

            def step(kb, carry, masked):
                acc, m, denom = carry
                slot = lax.rem(kb - lo, stages)

                def qk(acc_ref):
                    plgpu.wgmma(
                        acc_ref, q_smem.at[wg], plgpu.transpose_ref(k_smem.at[slot], (1, 0))
                    )
                    take_turn()
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                s = s * c2
                if masked:
                    r = _iota((bq, bk), 0, interpret) + row0
                    c = _iota((bq, bk), 1, interpret) + kb * bk
                    ok = c <= r
                    if vis.bounded:
                        first = lax.broadcast_in_dim(_row(fk_smem.at[wg]), (bq, bk), [0])
                        ok = ok & (c >= first)
                    s = jnp.where(ok, s, -jnp.inf)
                m_new = jnp.maximum(m, s.max(axis=1))
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                denom = denom * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                acc, denom, m_new, p16 = lax.optimization_barrier((acc, denom, m_new, p16))
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(turn)

                def pv(refs):
                    plgpu.wgmma(refs[0], p16, v_smem.at[slot])
                    nxt = kb + 1

                    @pl.when(nxt < own_hi)
                    def _():
                        plgpu.barrier_wait(k_ready.at[lax.rem(nxt - lo, stages)])

                (acc,) = _accumulate(pv, (acc,), interpret)
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, denom

            def release(kb, _):
                # Tiles past this warpgroup's rows: free the ring slot, keep the turns paired.
                slot = lax.rem(kb - lo, stages)
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                take_turn()
                take_turn()

            unmasked_end = lax.min(unmasked_end, own_hi)
            carry = lax.fori_loop(
                lo, unmasked_end, functools.partial(step, masked=False), (acc, m, denom)
            )
            acc, m, denom = lax.fori_loop(
                unmasked_end, own_hi, functools.partial(step, masked=True), carry
            )
            lax.fori_loop(own_hi, hi, release, None)
            pl.when(wg == 0)(take_turn)

            o = acc * lax.broadcast_in_dim(1.0 / denom, acc.shape, [0])
            q_smem.at[wg][...] = o.astype(dtype)
            lse_smem.at[wg][...] = m + jnp.log2(denom)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[wg], o_ref.at[b, own, h])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, own])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")
            kv_head = lax.div(h, group)

            @pl.loop(lo, hi)
            def _(kb):
                i = kb - lo
                slot = lax.rem(i, stages)
                tile = (b, pl.ds(kb * bk, bk), kv_head)

                @pl.when(i >= stages)
                def _():
                    plgpu.barrier_wait(k_free.at[slot])

                plgpu.copy_gmem_to_smem(k_ref.at[tile], k_smem.at[slot], k_ready.at[slot])

                @pl.when(i >= stages)
                def _():
                    plgpu.barrier_wait(v_free.at[slot])

                plgpu.copy_gmem_to_smem(v_ref.at[tile], v_smem.at[slot], v_ready.at[slot])

    scratch = [
        (
            plgpu.SMEM((2, bq, d), dtype, transforms=tr),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tr),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tr),
            plgpu.SMEM((2, bq), jnp.int32),
            plgpu.SMEM((2, bq), jnp.float32),
        ),
        (
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=4),
        ),
        (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
        plgpu.Barrier(num_arrivals=2),
    ]
    out_type = (
        jax.ShapeDtypeStruct(q.shape, dtype),
        jax.ShapeDtypeStruct((b_, hq, t), jnp.float32),
    )
    call = _kernel_call(
        body, out_type, (b_, hq, t // rows), ("batch", "heads", "q_blocks"), scratch, interpret
    )
    args = (q, k, v) + ((first_key,) if vis.bounded else ())
    return call(*args)


def backward_dkv(q, k, v, do, lse, delta, last_row, *, scale, vis, blocks, interpret, dq_sum=None):
    """(dK, dV) [B, T, Hkv, D]: a CTA per 2 x bwd_block_kv keys of a key head, over the query
    tiles of every query head of its group that see them. With `dq_sum` (a zeroed fp32 Ref
    [B, T, Hq, D]) each step also adds its dS^T K there (dQ / scale)."""
    fused = dq_sum is not None
    b_, t, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    bq, bk, stages = blocks.bwd_block_q, blocks.bwd_block_kv, blocks.bwd_stages
    keys = 2 * bk
    dtype = q.dtype
    c2 = scale * LOG2E
    tr = _tile_transforms(dtype)

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
        rest = list(rest)
        lr_ref = rest.pop(0) if vis.bounded else None
        dq_ref = rest.pop(0) if fused else None
        dk_ref, dv_ref, smem, ready, free, kv_ready = rest
        k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, lr_smem, ds_smem, dq_smem = smem
        b = lax.axis_index("batch")
        kv_head = lax.axis_index("heads")
        first_key = lax.axis_index("kv_blocks") * keys
        wg = lax.axis_index("wg")
        lo = lax.div(first_key, bq)  # causal: no earlier row sees these keys
        if vis.bounded:
            hi = lax.div(lr_ref[b, first_key + keys - 1] + bq, bq)
        else:
            hi = jnp.int32(t // bq)
        per_head = hi - lo

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
            key0 = first_key + wg * bk
            own = pl.ds(key0, bk)
            plgpu.copy_gmem_to_smem(k_ref.at[b, own, kv_head], k_smem.at[wg], kv_ready.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[b, own, kv_head], v_smem.at[wg], kv_ready.at[2 + wg])
            if vis.bounded:
                plgpu.copy_gmem_to_smem(lr_ref.at[b, own], lr_smem.at[wg], kv_ready.at[4 + wg])
                plgpu.barrier_wait(kv_ready.at[4 + wg])
            plgpu.barrier_wait(kv_ready.at[wg])
            plgpu.barrier_wait(kv_ready.at[2 + wg])
            # Query tiles from `unmasked_from` on lie wholly at or past these keys' diagonal.
            unmasked_from = hi if vis.bounded else lax.min(lax.div(key0 + bk + bq - 1, bq), hi)
            zeros = _zeros((bk, d), interpret)

            def step(i, carry, g, qb, masked):
                dk, dv = carry
                slot = lax.rem(i, stages)
                for barrier in ready:
                    plgpu.barrier_wait(barrier.at[slot])

                def st(acc_ref):
                    plgpu.wgmma(
                        acc_ref, k_smem.at[wg], plgpu.transpose_ref(q_smem.at[slot], (1, 0))
                    )
                    return acc_ref[...]

                s_t = pl.run_scoped(st, plgpu.ACC((bk, bq), jnp.float32)) * c2
                lse_c = lax.broadcast_in_dim(_col(lse_smem.at[slot]), (bk, bq), [1])
                p_t = jnp.exp2(s_t - lse_c)
                if masked:
                    j = _iota((bk, bq), 0, interpret) + key0
                    r = _iota((bk, bq), 1, interpret) + qb * bq
                    ok = j <= r
                    if vis.bounded:
                        ok = ok & (r <= lax.broadcast_in_dim(_row(lr_smem.at[wg]), (bk, bq), [0]))
                    p_t = jnp.where(ok, p_t, 0.0)
                p16 = p_t.astype(dtype)

                def dv_dp(refs):
                    dv_ref, dp_ref = refs
                    plgpu.wgmma(dv_ref, p16, do_smem.at[slot])
                    plgpu.wgmma(
                        dp_ref, v_smem.at[wg], plgpu.transpose_ref(do_smem.at[slot], (1, 0))
                    )

                dv, dp_t = _accumulate(dv_dp, (dv, _zeros((bk, bq), interpret)), interpret)
                delta_c = lax.broadcast_in_dim(_col(delta_smem.at[slot]), (bk, bq), [1])
                ds16 = (p_t * (dp_t - delta_c)).astype(dtype)

                def dk_step(refs):
                    plgpu.wgmma(refs[0], ds16, q_smem.at[slot])

                (dk,) = _accumulate(dk_step, (dk,), interpret)
                plgpu.barrier_arrive(free.at[slot])
                if fused:
                    ds_smem.at[wg][...] = ds16
                    plgpu.commit_smem()

                    def dq_step(acc_ref):
                        ds = plgpu.transpose_ref(ds_smem.at[wg], (1, 0))
                        plgpu.wgmma(acc_ref, ds, k_smem.at[wg])
                        return acc_ref[...]

                    part = pl.run_scoped(dq_step, plgpu.ACC((bq, d), jnp.float32))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last add has read it
                    dq_smem.at[wg][...] = part
                    plgpu.commit_smem()
                    rows = pl.ds(qb * bq, bq)
                    h = kv_head * group + g
                    dst = dq_ref.at[b, rows, h]
                    plgpu.copy_smem_to_gmem(dq_smem.at[wg], dst, reduction_op="add")
                return dk, dv

            def head(g, carry):
                base = g * per_head - lo

                def masked(qb, c):
                    return step(base + qb, c, g, qb, True)

                def plain(qb, c):
                    return step(base + qb, c, g, qb, False)

                carry = lax.fori_loop(lo, unmasked_from, masked, carry)
                return lax.fori_loop(unmasked_from, hi, plain, carry)

            dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
            k_smem.at[wg][...] = (dk * scale).astype(dtype)
            v_smem.at[wg][...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_smem.at[wg], dk_ref.at[b, own, kv_head])
            plgpu.copy_smem_to_gmem(v_smem.at[wg], dv_ref.at[b, own, kv_head])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

            @pl.loop(0, group * per_head)
            def _(i):
                h = kv_head * group + lax.div(i, per_head)
                qb = lo + lax.rem(i, per_head)
                slot = lax.rem(i, stages)
                rows = pl.ds(qb * bq, bq)

                @pl.when(i >= stages)
                def _():
                    plgpu.barrier_wait(free.at[slot])

                q_ready, do_ready, lse_ready, delta_ready = ready
                plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem.at[slot], q_ready.at[slot])
                plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem.at[slot], do_ready.at[slot])
                plgpu.copy_gmem_to_smem(
                    lse_ref.at[b, h, rows], lse_smem.at[slot], lse_ready.at[slot]
                )
                plgpu.copy_gmem_to_smem(
                    delta_ref.at[b, h, rows], delta_smem.at[slot], delta_ready.at[slot]
                )

    scratch = [
        (
            plgpu.SMEM((2, bk, d), dtype, transforms=tr),
            plgpu.SMEM((2, bk, d), dtype, transforms=tr),
            plgpu.SMEM((stages, bq, d), dtype, transforms=tr),
            plgpu.SMEM((stages, bq, d), dtype, transforms=tr),
            plgpu.SMEM((stages, bq), jnp.float32),
            plgpu.SMEM((stages, bq), jnp.float32),
            plgpu.SMEM((2, bk), jnp.int32),
            plgpu.SMEM((2, bk, bq), dtype, transforms=tr) if fused else None,
            plgpu.SMEM((2, bq, d), jnp.float32) if fused else None,
        ),
        tuple(plgpu.Barrier(num_barriers=stages) for _ in range(4)),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_barriers=6),
    ]
    out_type = (jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype))
    grid = (b_, hkv, t // keys)
    names = ("batch", "heads", "kv_blocks")
    call = _kernel_call(body, out_type, grid, names, scratch, interpret, with_refs=fused)
    args = (q, k, v, do, lse, delta) + ((last_row,) if vis.bounded else ())
    return call(*args, *((dq_sum,) if fused else ()))


def backward_dq(q, k, v, do, lse, delta, first_key, *, scale, vis, blocks, interpret):
    """dQ [B, T, Hq, D]: a CTA per 2 x bwd_block_q rows of a query head, over the key tiles
    they see (bwd_block_kv keys a step)."""
    b_, t, hq, d = q.shape
    group = hq // k.shape[2]
    bq, bk, stages = blocks.bwd_block_q, blocks.bwd_block_kv, blocks.bwd_stages
    rows = 2 * bq
    dtype = q.dtype
    c2 = scale * LOG2E
    tr = _tile_transforms(dtype)

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
        if vis.bounded:
            fk_ref, dq_ref, *scoped = rest
        else:
            fk_ref, (dq_ref, *scoped) = None, rest
        (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, fk_smem), ready, free, own_ready = (
            scoped
        )
        k_ready, v_ready = ready
        b = lax.axis_index("batch")
        h = lax.axis_index("heads")
        first_row = lax.axis_index("q_blocks") * rows
        wg = lax.axis_index("wg")
        hi = lax.div(first_row + rows + bk - 1, bk)
        lo = lax.div(fk_ref[b, first_row], bk) if vis.bounded else jnp.int32(0)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
            row0 = first_row + wg * bq
            own = pl.ds(row0, bq)
            copies = [
                (q_ref.at[b, own, h], q_smem.at[wg]),
                (do_ref.at[b, own, h], do_smem.at[wg]),
                (lse_ref.at[b, h, own], lse_smem.at[wg]),
                (delta_ref.at[b, h, own], delta_smem.at[wg]),
            ]
            if vis.bounded:
                copies.append((fk_ref.at[b, own], fk_smem.at[wg]))
            for n, (src, dst) in enumerate(copies):
                plgpu.copy_gmem_to_smem(src, dst, own_ready.at[5 * wg + n])
            for n in range(len(copies)):
                plgpu.barrier_wait(own_ready.at[5 * wg + n])
            own_hi = lax.div(row0 + bq + bk - 1, bk)
            unmasked_end = lo if vis.bounded else lax.min(lax.div(row0 + 1, bk), own_hi)
            lse_r = lax.broadcast_in_dim(_row(lse_smem.at[wg]), (bq, bk), [0])
            delta_r = lax.broadcast_in_dim(_row(delta_smem.at[wg]), (bq, bk), [0])

            def step(kb, dq, masked):
                slot = lax.rem(kb - lo, stages)
                plgpu.barrier_wait(k_ready.at[slot])

                def s_dp(refs):
                    s_ref, dp_ref = refs
                    plgpu.wgmma(s_ref, q_smem.at[wg], plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                    plgpu.barrier_wait(v_ready.at[slot])
                    plgpu.wgmma(
                        dp_ref, do_smem.at[wg], plgpu.transpose_ref(v_smem.at[slot], (1, 0))
                    )

                zero = _zeros((bq, bk), interpret)
                s, dp = _accumulate(s_dp, (zero, zero), interpret)
                p = jnp.exp2(s * c2 - lse_r)
                if masked:
                    r = _iota((bq, bk), 0, interpret) + row0
                    c = _iota((bq, bk), 1, interpret) + kb * bk
                    ok = c <= r
                    if vis.bounded:
                        ok = ok & (c >= lax.broadcast_in_dim(_row(fk_smem.at[wg]), (bq, bk), [0]))
                    p = jnp.where(ok, p, 0.0)
                ds16 = (p * (dp - delta_r)).astype(dtype)

                def dq_step(refs):
                    plgpu.wgmma(refs[0], ds16, k_smem.at[slot])

                (dq,) = _accumulate(dq_step, (dq,), interpret)
                plgpu.barrier_arrive(free.at[slot])
                return dq

            def release(kb, _):
                # A tile past this warpgroup's rows: free its slot once it is loaded. Arriving
                # sooner could complete the slot's previous phase while the other warpgroup
                # still reads the tile there (no turns keep these warpgroups in step).
                slot = lax.rem(kb - lo, stages)
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_arrive(free.at[slot])

            dq = _zeros((bq, d), interpret)
            dq = lax.fori_loop(lo, unmasked_end, functools.partial(step, masked=False), dq)
            dq = lax.fori_loop(unmasked_end, own_hi, functools.partial(step, masked=True), dq)
            lax.fori_loop(own_hi, hi, release, None)
            q_smem.at[wg][...] = (dq * scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[wg], dq_ref.at[b, own, h])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")
            kv_head = lax.div(h, group)

            @pl.loop(lo, hi)
            def _(kb):
                i = kb - lo
                slot = lax.rem(i, stages)
                tile = (b, pl.ds(kb * bk, bk), kv_head)

                @pl.when(i >= stages)
                def _():
                    plgpu.barrier_wait(free.at[slot])

                plgpu.copy_gmem_to_smem(k_ref.at[tile], k_smem.at[slot], k_ready.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[tile], v_smem.at[slot], v_ready.at[slot])

    scratch = [
        (
            plgpu.SMEM((2, bq, d), dtype, transforms=tr),
            plgpu.SMEM((2, bq, d), dtype, transforms=tr),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tr),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tr),
            plgpu.SMEM((2, bq), jnp.float32),
            plgpu.SMEM((2, bq), jnp.float32),
            plgpu.SMEM((2, bq), jnp.int32),
        ),
        (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_barriers=10),
    ]
    call = _kernel_call(
        body,
        jax.ShapeDtypeStruct(q.shape, dtype),
        (b_, hq, t // rows),
        ("batch", "heads", "q_blocks"),
        scratch,
        interpret,
    )
    args = (q, k, v, do, lse, delta) + ((first_key,) if vis.bounded else ())
    return call(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _flash(q, k, v, first_key, last_row, scale, vis, blocks, interpret):
    o, _ = forward(q, k, v, first_key, scale=scale, vis=vis, blocks=blocks, interpret=interpret)
    return o


def _flash_fwd(q, k, v, first_key, last_row, scale, vis, blocks, interpret):
    o, lse = forward(q, k, v, first_key, scale=scale, vis=vis, blocks=blocks, interpret=interpret)
    return o, (q, k, v, o, lse, first_key, last_row)


def _flash_bwd(scale, vis, blocks, interpret, res, do):
    q, k, v, o, lse, first_key, last_row = res
    do = do.astype(q.dtype)
    delta = jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))
    kw = dict(scale=scale, vis=vis, blocks=blocks, interpret=interpret)
    if blocks.fused_dq:
        dq_sum = jax.new_ref(jnp.zeros(q.shape, jnp.float32))
        dk, dv = backward_dkv(q, k, v, do, lse, delta, last_row, dq_sum=dq_sum, **kw)
        dq = (dq_sum[...] * scale).astype(q.dtype)
    else:
        dk, dv = backward_dkv(q, k, v, do, lse, delta, last_row, **kw)
        dq = backward_dq(q, k, v, do, lse, delta, first_key, **kw)
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
    blocks: FlashBlocks = FlashBlocks(),
    interpret: bool = False,
) -> jax.Array:
    """Causal attention [B, T, Hq, D] of q over k, v [B, T, Hkv, D] (Hq a multiple of Hkv),
    within each document of `segment_ids_BxT` and a sliding `window`, where `fits` says so.
    A T that is not a multiple of the tiles is padded at the end (causal attention keeps the
    padding out of every real query's keys) and the output cut back."""
    b, t, hq, d = q_BxTxNxH.shape
    why = fits(d, hq, k_BxTxKxH.shape[2], q_BxTxNxH.dtype)
    if why:
        raise ValueError(f"flash_attention_mgpu: the kernel does not take {why}")
    pad = -t % _tile_multiple(blocks)
    q, k, v, seg = q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segment_ids_BxT
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        if seg is not None:  # the padding a document of its own
            seg = jnp.concatenate([seg, jnp.repeat(seg[:, -1:] + 1, pad, axis=1)], axis=1)
    vis = Visibility(window=window, documents=seg is not None)
    first_key = last_row = None
    if vis.bounded:
        first_key, last_row = key_bounds(t + pad, seg, window, b)
    o = _flash(q, k, v, first_key, last_row, scale, vis, blocks, interpret)
    return o[:, :t] if pad else o
