"""The forward kernel: O and the logsumexp per query tile (see __init__)."""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxllmq.kernels.flash_attention import common, tiles


def forward(q, k, v, first_key, *, scale, vis: common.Visibility, blocks: tiles.FlashBlocks):
    """(o [B, T, Hq, D], lse [B, Hq, T] fp32 in log2 units of the scaled scores)."""
    b_, t, hq, d = q.shape
    group = hq // k.shape[2]
    bq, bk, stages = blocks.block_q, blocks.block_kv, blocks.stages
    rows = 2 * bq
    dtype = q.dtype
    c2 = scale * common.LOG2E
    tr = common.TILE_TRANSFORMS
    work = common.Work(t // rows, b_, hq)
    # The next item's rows load into a second pair of buffers during this item's steps, where
    # they fit beside the key/value ring (up to head dim 128); at 256 into the same buffers,
    # once this item's output has left them.
    prefetch = d <= 128
    row_buffers = 4 if prefetch else 2

    def body(q_ref, k_ref, v_ref, *rest):
        if vis.bounded:
            fk_ref, o_ref, lse_ref, *scoped = rest
        else:
            fk_ref, (o_ref, lse_ref, *scoped) = None, rest
        (q_smem, k_smem, v_smem, fk_smem, lse_smem), ready, free, turn = scoped
        k_ready, v_ready, rows_ready = ready
        k_free, v_free = free
        wg = lax.axis_index("wg")
        mine = work.mine()

        def item_at(n):
            """(b, h, first row, last + 1 key tile) of this CTA's n-th item: the last rows,
            which see the most keys, first."""
            rank, b, h = work.place(n)
            first_row = (work.ranks - 1 - rank) * rows
            hi = lax.div(first_row + rows + bk - 1, bk)  # causal: the tile of the last row
            return b, h, first_row, hi

        def first_keys_ahead(n, offsets):
            """Bounded: the first keys of the n-th item's first row + each offset, read from
            global memory an item ahead and carried by the items' loop, so that each read's
            latency hides under the steps of the item before instead of stalling every item's
            start (unbounded: none). n may be past this CTA's items (the rows clamped)."""
            if not vis.bounded:
                return ()
            b, _, first_row, _ = item_at(n)
            return tuple(fk_ref[b, jnp.clip(first_row + o, 0, t - 1)] for o in offsets)

        def first_tile(first_keys):
            """An item's first key tile: that of its first row's first key (0 unbounded)."""
            return lax.div(first_keys[0], bk) if vis.bounded else jnp.int32(0)

        # In order, the warpgroups meet twice a step, so that they take turns issuing their
        # products; overlapped, they issue as they come (FlashBlocks.fwd_turns).
        turns = blocks.fwd_turns and not blocks.fwd_overlap

        def arrive_turn():
            if turns:
                plgpu.barrier_arrive(turn)

        def wait_turn():
            if turns:
                plgpu.barrier_wait(turn)

        def take_turn():
            arrive_turn()
            wait_turn()

        def compute(wg):
            plgpu.set_max_registers(common.COMPUTE_REGISTERS, action="increase")

            def row_buffer(n):
                """The buffer of this warpgroup's rows of its n-th item."""
                return 2 * lax.rem(n, 2) + wg if prefetch else wg

            def load_rows(n):
                """The n-th item's query rows (and their first keys) into its buffer."""
                b, h, first_row, _ = item_at(n)
                own = pl.ds(first_row + wg * bq, bq)
                buf = row_buffer(n)
                plgpu.copy_gmem_to_smem(q_ref.at[b, own, h], q_smem.at[buf], rows_ready.at[buf])
                if vis.bounded:
                    plgpu.copy_gmem_to_smem(
                        fk_ref.at[b, own], fk_smem.at[buf], rows_ready.at[4 + buf]
                    )

            # The first keys an item's bounds need: its first row's and this warpgroup's last.
            own_first_keys = (0, wg * bq + bq - 1)

            def item(n, carry):
                before, *first_keys = carry
                ahead = first_keys_ahead(n + 1, own_first_keys)
                b, h, first_row, hi = item_at(n)
                lo = first_tile(first_keys)
                buf = row_buffer(n)
                row0 = first_row + wg * bq
                own = pl.ds(row0, bq)
                if vis.bounded:
                    plgpu.barrier_wait(rows_ready.at[4 + buf])
                plgpu.barrier_wait(rows_ready.at[buf])
                own_hi = lax.div(row0 + bq + bk - 1, bk)
                last_first_key = first_keys[1] if vis.bounded else None
                unmasked = common.unmasked_key_tiles(last_first_key, row0, bk, lo, own_hi)

                def ring(kb):
                    return lax.rem(before + kb - lo, stages)

                m = common.zeros((bq,), common.NO_MAX)
                denom = common.zeros((bq,))
                acc = common.zeros((bq, d))
                plgpu.barrier_wait(k_ready.at[ring(lo)])
                pl.when(wg == 1)(take_turn)

                def prefetch_rows():
                    # Once this warpgroup's stores of the item before have left the other
                    # buffer, the next item's rows load there.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    pl.when(n + 1 < mine)(lambda: load_rows(n + 1))

                def probabilities(s, kb, masked, m, denom):
                    """Tile kb's scores s as probabilities relative to the new running max:
                    (p, the new max, alpha that rescales what came before, the new sum)."""
                    if masked:
                        r = common.iota((bq, bk), 0) + row0
                        c = common.iota((bq, bk), 1) + kb * bk
                        ok = c <= r
                        if vis.bounded:
                            first = lax.broadcast_in_dim(common.row(fk_smem.at[buf]), (bq, bk), [0])
                            ok = ok & (c >= first)
                        s = jnp.where(ok, s, -jnp.inf)
                    # The scale inside exp2's argument (one fused multiply-add an element, where
                    # scaling S first costs a multiply more): 5-6% faster at head dim 64.
                    m_new = jnp.maximum(m, s.max(axis=1) * c2)
                    alpha = jnp.exp2(m - m_new)
                    p = jnp.exp2(s * c2 - lax.broadcast_in_dim(m_new, s.shape, [0]))
                    return p, m_new, alpha, denom * alpha + p.sum(axis=1)

                def scores(kb):
                    def qk(acc_ref):
                        plgpu.wgmma(acc_ref, q_smem.at[buf], k_smem.at[ring(kb)].transpose((1, 0)))
                        take_turn()
                        return acc_ref[...]

                    return pl.run_scoped(qk, plgpu.ACC((bq, bk), jnp.float32))

                def rescaled(acc, alpha):
                    return acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

                def overlapped(kb, carry, masked):
                    """Tile kb's S issued with tile kb - 1's P V, then its softmax, the output
                    rescaled once both are done (ptxas, taking P's registers as free once P V is
                    issued, reuses them for the new max, so it waits for P V before the softmax
                    begins)."""
                    acc, m, denom, p16 = carry
                    slot, prev = ring(kb), ring(kb - 1)
                    plgpu.barrier_wait(k_ready.at[slot])

                    def products(s_ref, o_ref):
                        o_ref[...] = acc
                        plgpu.wgmma(s_ref, q_smem.at[buf], k_smem.at[slot].transpose((1, 0)))
                        plgpu.barrier_wait(v_ready.at[prev])
                        plgpu.wgmma(o_ref, p16, v_smem.at[prev])
                        s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # P V in flight
                        plgpu.barrier_arrive(k_free.at[slot])
                        p, m_new, alpha, denom_new = probabilities(s, kb, masked, m, denom)
                        return o_ref[...], m_new, alpha, denom_new, p.astype(dtype)

                    acc, m_new, alpha, denom, p16 = pl.run_scoped(
                        products, plgpu.ACC((bq, bk), jnp.float32), plgpu.ACC((bq, d), jnp.float32)
                    )
                    plgpu.barrier_arrive(v_free.at[prev])
                    return rescaled(acc, alpha), m_new, denom, p16

                def step(kb, carry, masked):
                    acc, m, denom = carry
                    slot = ring(kb)
                    s = scores(kb)
                    plgpu.barrier_arrive(k_free.at[slot])
                    if prefetch:
                        pl.when(kb == lo)(prefetch_rows)
                    p, m_new, alpha, denom = probabilities(s, kb, masked, m, denom)
                    acc = rescaled(acc, alpha)
                    p16 = p.astype(dtype)
                    acc, denom, m_new, p16 = lax.optimization_barrier((acc, denom, m_new, p16))
                    arrive_turn()
                    plgpu.barrier_wait(v_ready.at[slot])
                    wait_turn()

                    def pv(refs):
                        plgpu.wgmma(refs[0], p16, v_smem.at[slot])
                        nxt = kb + 1

                        @pl.when(nxt < own_hi)
                        def _():
                            plgpu.barrier_wait(k_ready.at[ring(nxt)])

                    (acc,) = common.accumulate(pv, (acc,))
                    plgpu.barrier_arrive(v_free.at[slot])
                    return acc, m_new, denom

                def release(kb, _):
                    # Tiles past this warpgroup's rows: free the ring slot once loaded (a thread
                    # counts a barrier's phases by its own waits), keep the turns paired.
                    slot = ring(kb)
                    plgpu.barrier_wait(k_ready.at[slot])
                    plgpu.barrier_arrive(k_free.at[slot])
                    plgpu.barrier_wait(v_ready.at[slot])
                    plgpu.barrier_arrive(v_free.at[slot])
                    take_turn()
                    take_turn()

                if blocks.fwd_overlap:
                    # The first tile's scores alone (masked: right wherever it lies), the
                    # last tile's P V alone after the loop.
                    p, m, _, denom = probabilities(scores(lo), lo, True, m, denom)
                    plgpu.barrier_arrive(k_free.at[ring(lo)])
                    if prefetch:
                        prefetch_rows()
                    carry = (acc, m, denom, p.astype(dtype))
                    for start, end, masked in common.spans(lo, *unmasked, own_hi):
                        body = functools.partial(overlapped, masked=masked)
                        carry = lax.fori_loop(jnp.maximum(start, lo + 1), end, body, carry)
                    acc, m, denom, p16 = carry
                    last = ring(own_hi - 1)
                    plgpu.barrier_wait(v_ready.at[last])
                    acc = common.add_product(acc, p16, v_smem.at[last])
                    plgpu.barrier_arrive(v_free.at[last])
                else:
                    carry = (acc, m, denom)
                    for start, end, masked in common.spans(lo, *unmasked, own_hi):
                        body = functools.partial(step, masked=masked)
                        carry = lax.fori_loop(start, end, body, carry)
                    acc, m, denom = carry
                lax.fori_loop(own_hi, hi, release, None)
                pl.when(wg == 0)(take_turn)

                o = acc * lax.broadcast_in_dim(1.0 / denom, acc.shape, [0])
                q_smem.at[buf][...] = o.astype(dtype)
                lse_smem.at[wg][...] = m + jnp.log2(denom)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(q_smem.at[buf], o_ref.at[b, own, h])
                plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, own])
                if not prefetch:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    pl.when(n + 1 < mine)(lambda: load_rows(n + 1))
                return (before + hi - lo, *ahead)

            load_rows(0)
            first = (jnp.int32(0), *first_keys_ahead(0, own_first_keys))
            lax.fori_loop(0, mine, item, first)
            plgpu.wait_smem_to_gmem(0)

        common.each_compute_warpgroup(compute, wg, blocks.per_warpgroup_code)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(common.MEMORY_REGISTERS, action="decrease")
            rings = ((k_ref, k_smem, k_ready, k_free), (v_ref, v_smem, v_ready, v_free))

            def item(n, carry):
                before, *first_keys = carry
                ahead = first_keys_ahead(n + 1, (0,))
                b, h, _, hi = item_at(n)
                lo = first_tile(first_keys)
                common.stream_key_tiles(rings, b, lax.div(h, group), lo, hi, bk, stages, before)
                return (before + hi - lo, *ahead)

            lax.fori_loop(0, mine, item, (jnp.int32(0), *first_keys_ahead(0, (0,))))

    scratch = [
        (
            plgpu.SMEM((row_buffers, bq, d), dtype, transforms=tr),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tr),
            plgpu.SMEM((stages, bk, d), dtype, transforms=tr),
            plgpu.SMEM((4, bq), jnp.int32),
            plgpu.SMEM((2, bq), jnp.float32),
        ),
        (
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=8),
        ),
        (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
        plgpu.Barrier(num_arrivals=2),
    ]
    out_type = (
        jax.ShapeDtypeStruct(q.shape, dtype),
        jax.ShapeDtypeStruct((b_, hq, t), jnp.float32),
    )
    call = common.kernel_call(
        "flash_attention_forward", body, out_type, (work.ctas,), ("ctas",), scratch
    )
    args = (q, k, v) + ((first_key,) if vis.bounded else ())
    return call(*args)
