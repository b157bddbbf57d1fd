"""The backward kernels above backward.MAX_NARROW_HEAD_DIM (at 256): warpgroups split by role."""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxllmq.kernels.flash_attention import common

# dS tiles in flight from dQ's scores warpgroup to the other.
DS_BUFFERS = 2
# Head dim 256's dQ CTAs to a cluster: neighbouring query heads of a key head at the same rows
# see the same key tiles, so TMA loads each tile once for the cluster (dQ alone 1.4-3.8% faster
# on an H200 than a CTA each, 8 x 2048 and 2 x 8192).
DQ_CLUSTER = 2
# Tiles of P^T and of dP^T - delta in flight between dK/dV's warpgroups (one each: two of
# each do not fit shared memory beside two stages of query rows and dO).
TRADE_BUFFERS = 1


def _send(i, tile, smem, ready, free):
    """A warpgroup's step i: `tile` into its ring buffer of `smem` (smem.shape[0] of them),
    once the other warpgroup has read what the step a ring before left there."""
    buffers = smem.shape[0]
    buf = lax.rem(i, buffers)

    @pl.when(i >= buffers)
    def _():
        plgpu.barrier_wait(free.at[buf])

    smem.at[buf][...] = tile
    plgpu.commit_smem()
    plgpu.barrier_arrive(ready.at[buf])


def _store(acc, smem, dst):
    """fp32 rows `acc` to `dst` in smem's dtype, through `smem` (whose tile no one reads now)."""
    smem[...] = acc.astype(smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, dst)
    plgpu.wait_smem_to_gmem(0)


def backward_dkv_wide(q, k, v, do, lse, delta, last_row, *, scale, vis, blocks):
    """(dK, dV) [B, T, Hkv, D]: a CTA per dkv_block_kv keys of a key head, over the query
    tiles of every query head of its group that see them, section by section of (batch, key
    head) pairs as backward.backward_dkv's. A compute warpgroup's fp32 dK and dV rows ([64, D]
    each) do not fit its registers together, so the two split the work by role, two products
    a step each: one forms S^T and P^T, and adds dS^T Q into dK; the other forms dP^T and
    adds P^T dO into dV. They trade halves through shared memory: P^T (in bf16, as dV's
    product takes it) to the dV warpgroup, dP^T - delta (in fp32, so dS^T is rounded once, as
    in the other kernels) to the dK warpgroup."""
    b_, t, hq, d = q.shape
    hkv = k.shape[2]
    group = hq // hkv
    bq, bk, stages = blocks.dkv_block_q, blocks.dkv_block_kv, blocks.dkv_stages
    dtype = q.dtype
    c2 = scale * common.LOG2E
    tr = common.TILE_TRANSFORMS
    section = common.dkv_pairs_per_section(blocks, q.shape, group, dtype)

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
        rest = list(rest)
        lr_ref = rest.pop(0) if vis.bounded else None
        dk_ref, dv_ref, smem, ready, free, kv_ready, p_ready, p_free, x_ready, x_free = rest
        k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, lr_smem, p_smem, x_smem = smem
        rank, pair = common.section_order(lax.axis_index("ctas"), t // bk, b_ * hkv, section)
        b, kv_head = lax.div(pair, hkv), lax.rem(pair, hkv)
        key0 = rank * bk
        own = pl.ds(key0, bk)
        wg = lax.axis_index("wg")
        lo, hi = common.query_tiles(lr_ref, b, key0, bk, bq, t, vis)
        per_head = hi - lo
        unmasked = common.unmasked_query_tiles(lr_ref, b, key0, bk, bq, hi, vis)
        zeros = common.zeros((bk, d))

        def head_steps(step):
            """step(i, carry, qb, masked) over every query tile of every head of the group."""

            def head(g, carry):
                base = g * per_head - lo
                for start, end, masked in common.spans(lo, *unmasked, hi):
                    carry = lax.fori_loop(
                        start, end, lambda qb, c, m=masked: step(base + qb, c, qb, m), carry
                    )
                return carry

            return lax.fori_loop(0, group, head, zeros)

        def transposed_scores(a_smem, rows_smem):
            """[keys, rows] fp32: a_smem (this CTA's K or V) times rows_smem (a slot of query
            rows or dO), transposed."""

            def product(acc):
                plgpu.wgmma(acc, a_smem, rows_smem.transpose((1, 0)))
                return acc[...]

            return pl.run_scoped(product, plgpu.ACC((bk, bq), jnp.float32))

        @pl.when(wg == 0)
        def _dk():
            plgpu.set_max_registers(common.COMPUTE_REGISTERS, action="increase")
            plgpu.copy_gmem_to_smem(k_ref.at[b, own, kv_head], k_smem, kv_ready.at[0])
            if vis.bounded:
                plgpu.copy_gmem_to_smem(lr_ref.at[b, own], lr_smem, kv_ready.at[2])
                plgpu.barrier_wait(kv_ready.at[2])
            plgpu.barrier_wait(kv_ready.at[0])

            def step(i, dk, qb, masked):
                slot, buf = lax.rem(i, stages), lax.rem(i, TRADE_BUFFERS)
                plgpu.barrier_wait(ready.at[slot])
                s_t = transposed_scores(k_smem, q_smem.at[slot])
                lr = lr_smem if vis.bounded else None
                p_t = common.key_probabilities(
                    s_t, lse_smem.at[slot], c2, key0, qb * bq, masked, lr
                )
                _send(i, p_t.astype(dtype), p_smem, p_ready, p_free)
                plgpu.barrier_wait(x_ready.at[buf])
                ds16 = (p_t * common.tile(x_smem.at[buf])).astype(dtype)
                plgpu.barrier_arrive(x_free.at[buf])
                dk = common.add_product(dk, ds16, q_smem.at[slot])
                plgpu.barrier_arrive(free.at[slot])
                return dk

            dk = head_steps(step)
            _store(dk * scale, k_smem, dk_ref.at[b, own, kv_head])

        @pl.when(wg == 1)
        def _dv():
            plgpu.set_max_registers(common.COMPUTE_REGISTERS, action="increase")
            plgpu.copy_gmem_to_smem(v_ref.at[b, own, kv_head], v_smem, kv_ready.at[1])
            plgpu.barrier_wait(kv_ready.at[1])

            def step(i, dv, qb, masked):
                del qb, masked
                slot, buf = lax.rem(i, stages), lax.rem(i, TRADE_BUFFERS)
                plgpu.barrier_wait(ready.at[slot])
                delta_c = lax.broadcast_in_dim(common.col(delta_smem.at[slot]), (bk, bq), [1])
                dp_t = transposed_scores(v_smem, do_smem.at[slot])
                _send(i, dp_t - delta_c, x_smem, x_ready, x_free)
                plgpu.barrier_wait(p_ready.at[buf])
                dv = common.add_product(dv, p_smem.at[buf], do_smem.at[slot])
                plgpu.barrier_arrive(p_free.at[buf])
                plgpu.barrier_arrive(free.at[slot])
                return dv

            dv = head_steps(step)
            _store(dv, v_smem, dv_ref.at[b, own, kv_head])

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(common.MEMORY_REGISTERS, action="decrease")

            rows = (q_ref, do_ref, lse_ref, delta_ref), (q_smem, do_smem, lse_smem, delta_smem)
            common.stream_query_tiles(
                *rows, ready, free, b, kv_head * group, group, lo, per_head, bq, stages
            )

    scratch = [
        (
            plgpu.SMEM((bk, d), dtype, transforms=tr),
            plgpu.SMEM((bk, d), dtype, transforms=tr),
            plgpu.SMEM((stages, bq, d), dtype, transforms=tr),
            plgpu.SMEM((stages, bq, d), dtype, transforms=tr),
            plgpu.SMEM((stages, bq), jnp.float32),
            plgpu.SMEM((stages, bq), jnp.float32),
            plgpu.SMEM((bk,), jnp.int32) if vis.bounded else None,
            plgpu.SMEM((TRADE_BUFFERS, bk, bq), dtype, transforms=tr),
            plgpu.SMEM((TRADE_BUFFERS, bk, bq), jnp.float32, transforms=common.FP32_TRANSFORMS),
        ),
        plgpu.Barrier(num_arrivals=4, num_barriers=stages),  # a slot's four loads in
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),  # both warpgroups done with a slot
        plgpu.Barrier(num_barriers=3),
        plgpu.Barrier(num_barriers=TRADE_BUFFERS),  # P^T written
        plgpu.Barrier(num_barriers=TRADE_BUFFERS),  # P^T read
        plgpu.Barrier(num_barriers=TRADE_BUFFERS),  # dP^T - delta written
        plgpu.Barrier(num_barriers=TRADE_BUFFERS),  # dP^T - delta read
    ]
    out_type = (jax.ShapeDtypeStruct(k.shape, dtype),) * 2
    grid = (t // bk * b_ * hkv,)
    call = common.kernel_call("flash_attention_dkv", body, out_type, grid, ("ctas",), scratch)
    args = (q, k, v, do, lse, delta) + ((last_row,) if vis.bounded else ())
    return call(*args)


def backward_dq_wide(q, k, v, do, lse, delta, first_key, *, scale, vis, blocks):
    """dQ [B, T, Hq, D]: a CTA per dq_block_q rows of a query head, over the key tiles they see
    (dq_block_kv keys a step), the CTAs of the last rows first. As in backward_dkv_wide, the
    warpgroups split by role: the scores warpgroup forms S and dP, P and dS, and puts dS in
    shared memory, from which the other adds dS K into dQ; so a CTA holds one warpgroup's rows,
    and two stages of key and value tiles fit beside them."""
    b_, t, hq, d = q.shape
    group = hq // k.shape[2]
    bq, bk, stages = blocks.dq_block_q, blocks.dq_block_kv, blocks.dq_stages
    dtype = q.dtype
    c2 = scale * common.LOG2E
    tr = common.TILE_TRANSFORMS
    cluster = DQ_CLUSTER if group % DQ_CLUSTER == 0 else 1

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
        if vis.bounded:
            fk_ref, dq_ref, *scoped = rest
        else:
            fk_ref, (dq_ref, *scoped) = None, rest
        smem, (k_ready, v_ready), free, own_ready, ds_ready, ds_free = scoped
        q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, fk_smem, ds_smem = smem
        index = lax.axis_index("ctas")
        if cluster > 1:
            index = index * cluster + lax.axis_index("cluster")
        rank, pair = common.section_order(index, t // bq, b_ * hq, 0)
        b, h = lax.div(pair, hq), lax.rem(pair, hq)
        row0 = (t // bq - 1 - rank) * bq
        own = pl.ds(row0, bq)
        wg = lax.axis_index("wg")
        hi = lax.div(row0 + bq + bk - 1, bk)
        lo = lax.div(fk_ref[b, row0], bk) if vis.bounded else jnp.int32(0)
        last_first_key = fk_ref[b, row0 + bq - 1] if vis.bounded else None
        unmasked = common.unmasked_key_tiles(last_first_key, row0, bk, lo, hi)

        def key_steps(step, init):
            for start, end, masked in common.spans(lo, *unmasked, hi):
                init = lax.fori_loop(start, end, functools.partial(step, masked=masked), init)
            return init

        @pl.when(wg == 0)
        def _scores():
            plgpu.set_max_registers(common.COMPUTE_REGISTERS, action="increase")
            gmem = (q_ref, do_ref, lse_ref, delta_ref) + ((fk_ref,) if vis.bounded else ())
            smem = (q_smem, do_smem, lse_smem, delta_smem, fk_smem)
            common.load_query_rows(gmem, smem, b, own, h, own_ready)
            lse_r = lax.broadcast_in_dim(common.row(lse_smem), (bq, bk), [0])
            delta_r = lax.broadcast_in_dim(common.row(delta_smem), (bq, bk), [0])

            def step(kb, carry, masked):
                i = kb - lo
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(k_ready.at[slot])

                def s_dp(refs):
                    s_ref, dp_ref = refs
                    plgpu.wgmma(s_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    plgpu.barrier_wait(v_ready.at[slot])
                    plgpu.wgmma(dp_ref, do_smem, v_smem.at[slot].transpose((1, 0)))

                zero = common.zeros((bq, bk))
                s, dp = common.accumulate(s_dp, (zero, zero))
                fk = fk_smem if vis.bounded else None
                ds16 = common.query_d_scores(
                    s, dp, lse_r, delta_r, c2, row0, kb * bk, masked, fk, dtype
                )
                _send(i, ds16, ds_smem, ds_ready, ds_free)
                plgpu.barrier_arrive(free.at[slot])  # the dQ warpgroup frees it as well
                return carry

            key_steps(step, None)

        @pl.when(wg == 1)
        def _dq():
            plgpu.set_max_registers(common.COMPUTE_REGISTERS, action="increase")

            def step(kb, dq, masked):
                del masked
                i = kb - lo
                slot, buf = lax.rem(i, stages), lax.rem(i, DS_BUFFERS)
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(ds_ready.at[buf])
                dq = common.add_product(dq, ds_smem.at[buf], k_smem.at[slot])
                plgpu.barrier_arrive(ds_free.at[buf])
                plgpu.barrier_arrive(free.at[slot])
                return dq

            dq = key_steps(step, common.zeros((bq, d)))
            # The scores warpgroup's last S (before its last dS) has read the query rows.
            _store(dq * scale, q_smem, dq_ref.at[b, own, h])

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(common.MEMORY_REGISTERS, action="decrease")
            rings = ((k_ref, k_smem, k_ready, free), (v_ref, v_smem, v_ready, None))
            common.stream_key_tiles(
                rings, b, lax.div(h, group), lo, hi, bk, stages, multicast=cluster > 1
            )

    if cluster > 1:  # both warpgroups of every CTA of the cluster done with a slot
        slots_done = plgpu.ClusterBarrier(
            collective_axes=("cluster",), num_arrivals=2, num_barriers=stages
        )
    else:
        slots_done = plgpu.Barrier(num_arrivals=2, num_barriers=stages)
    scratch = [
        (
            plgpu.SMEM((bq, d), dtype, transforms=tr),
            plgpu.SMEM((bq, d), dtype, transforms=tr),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tr),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tr),
            plgpu.SMEM((bq,), jnp.float32),
            plgpu.SMEM((bq,), jnp.float32),
            plgpu.SMEM((bq,), jnp.int32) if vis.bounded else None,
            plgpu.SMEM((DS_BUFFERS, bq, bk), dtype, transforms=tr),
        ),
        (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages)),
        slots_done,
        plgpu.Barrier(num_barriers=5),
        plgpu.Barrier(num_barriers=DS_BUFFERS),  # dS written
        plgpu.Barrier(num_barriers=DS_BUFFERS),  # dS read
    ]
    call = common.kernel_call(
        "flash_attention_dq",
        body,
        jax.ShapeDtypeStruct(q.shape, dtype),
        (t // bq * b_ * hq // cluster,),
        ("ctas",),
        scratch,
        cluster=cluster,
    )
    args = (q, k, v, do, lse, delta) + ((first_key,) if vis.bounded else ())
    return call(*args)
