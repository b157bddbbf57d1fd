"""The backward kernels: dK and dV per key tile, and dQ per query tile."""

from __future__ import annotations

import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxllmq.kernels.flash_attention import backward_wide, common

# The head dims dQ in dK/dV (FlashBlocks.dq_in_dkv) runs at. At 64 the warpgroups take turns,
# each forming a step's whole piece of dQ. At 128 (DQ_BY_HALVES_HEAD_DIM) a row's fp32 partial
# of dQ does not fit one warpgroup's registers beside its dK and dV, so both form a piece every
# step, each half of dQ's columns. That beats dQ's own kernel only in overlapped steps with
# each warpgroup's index known at compile time (FlashBlocks.per_warpgroup_code); with the index
# worked out per thread it spilled hundreds of bytes and was 1.03-1.23x slower.
DQ_IN_DKV_HEAD_DIMS = (64, 128)
DQ_BY_HALVES_HEAD_DIM = 128
# The largest head dim these kernels take, each compute warpgroup forming its own rows of dK and
# dV (fp32 [64, D] each, in its 232 registers beside the step's scores) or of dQ; above it,
# backward_wide's kernels, whose warpgroups split the work by role.
MAX_NARROW_HEAD_DIM = 128


def row_delta(o, do):
    """delta [B, Hq, T] fp32: each query row's sum of o * dO, which both backward kernels take
    (dS = P * (dP - delta))."""
    return jnp.einsum("bthd,bthd->bht", o.astype(jnp.float32), do.astype(jnp.float32))


def zeros_after(x, shape):
    """fp32 zeros of `shape` that XLA can make only once `x` exists. Zeros that depend on
    nothing it merges across an unrolled model's layers into one fusion, which allocates every
    layer's buffer at once: for dQ's sums in the Llama 3.2 3B step at 2 x 8192, 2.35 GiB more
    peak memory than with cuDNN's attention. The test below is false for every value of x,
    NaN and infinities included, and XLA cannot fold it away."""
    never = x.ravel()[0] > jnp.inf
    return jnp.broadcast_to(jnp.where(never, 1.0, 0.0).astype(jnp.float32), shape)


def backward_dkv(q, k, v, do, lse, delta, last_row, *, scale, vis, blocks):
    """(dK, dV) [B, T, Hkv, D], and with blocks.dq_in_dkv dQ [B, T, Hq, D] too: a CTA per
    2 x dkv_block_kv keys of a key head, over the query tiles of every query head of its group
    that see them. The CTAs go section by section of (batch, key head) pairs (dkv_section), and
    within a section those of the first keys, which the most queries see, start first. Above
    MAX_NARROW_HEAD_DIM, backward_wide's kernel.

    dQ in dK/dV: each step both warpgroups put their dS^T in shared memory (a ring of
    ds_buffers) and arrive; the warpgroup whose turn it is (the step's parity) waits for both,
    multiplies the step's dS over both key tiles by K in one product and adds the fp32 result
    into dQ / scale by TMA's reduce-add, while the other goes on. At DQ_BY_HALVES_HEAD_DIM both
    do so every step, each for half of dQ's columns. Both meet once at the end, before dK and
    dV overwrite the key tiles."""
    fused = blocks.dq_in_dkv
    b_, t, hq, d = q.shape
    if fused and d not in DQ_IN_DKV_HEAD_DIMS:
        dims = " and ".join(map(str, DQ_IN_DKV_HEAD_DIMS))
        raise ValueError(f"flash attention: dq_in_dkv takes head dims {dims} only, not {d}")
    if d > MAX_NARROW_HEAD_DIM:
        return backward_wide.backward_dkv_wide(
            q, k, v, do, lse, delta, last_row, scale=scale, vis=vis, blocks=blocks
        )
    halves = d == DQ_BY_HALVES_HEAD_DIM  # both warpgroups form a piece every step
    dq_cols = d // 2 if halves else d  # a piece's columns
    hkv = k.shape[2]
    group = hq // hkv
    bq, bk, stages = blocks.dkv_block_q, blocks.dkv_block_kv, blocks.dkv_stages
    ready_per_slot = 1 if blocks.dkv_one_ready else 4  # barriers a step's loads arrive on
    keys = 2 * bk
    # dQ in dK/dV: dS^T in a ring of four buffers, so that no warpgroup waits to write one (the
    # product of step i - 4 read it before either reached step i - 2's meeting), 3.4-4.5% faster
    # forward + backward than two buffers and a wait. An even count: each buffer's barrier is
    # waited by one warpgroup (a thread counts a barrier's phases by its own waits).
    # By halves two, which shared memory has room for. Safe: a warpgroup writing step i's
    # buffer formed step i - 2's piece itself, having waited at step i - 1's meeting, which the
    # other reaches only once its step i - 2 product is done.
    ds_buffers = 2 if halves else 4
    dtype = q.dtype
    c2 = scale * common.LOG2E
    tr = common.TILE_TRANSFORMS
    section = common.dkv_pairs_per_section(blocks, q.shape, group, q.dtype)

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
        rest = list(rest)
        lr_ref = rest.pop(0) if vis.bounded else None
        dq_ref = rest.pop(0) if fused else None
        dk_ref, dv_ref, smem, ready, free, kv_ready, turns = rest
        k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, lr_smem, ds_smem, dq_smem = smem
        # A compute warpgroup's keys where its index is traced, formed before the warpgroups'
        # branch: formed inside it, dK/dV's loops at 64 take 1-3 more instructions a step.
        k_traced = k_smem.at[pl.ds(lax.axis_index("wg") * bk, bk)]
        rank, pair = common.section_order(lax.axis_index("ctas"), t // keys, b_ * hkv, section)
        b, kv_head = lax.div(pair, hkv), lax.rem(pair, hkv)
        first_key = rank * keys
        wg = lax.axis_index("wg")
        lo, hi = common.query_tiles(lr_ref, b, first_key, keys, bq, t, vis)
        per_head = hi - lo

        def compute(wg):
            plgpu.set_max_registers(common.COMPUTE_REGISTERS, action="increase")
            k_own = k_smem.at[pl.ds(wg * bk, bk)] if isinstance(wg, int) else k_traced
            key0 = first_key + wg * bk
            own = pl.ds(key0, bk)
            plgpu.copy_gmem_to_smem(k_ref.at[b, own, kv_head], k_own, kv_ready.at[wg])
            plgpu.copy_gmem_to_smem(v_ref.at[b, own, kv_head], v_smem.at[wg], kv_ready.at[2 + wg])
            if vis.bounded:
                plgpu.copy_gmem_to_smem(lr_ref.at[b, own], lr_smem.at[wg], kv_ready.at[4 + wg])
                plgpu.barrier_wait(kv_ready.at[4 + wg])
            plgpu.barrier_wait(kv_ready.at[wg])
            plgpu.barrier_wait(kv_ready.at[2 + wg])
            unmasked_from, unmasked_to = common.unmasked_query_tiles(
                lr_ref, b, key0, bk, bq, hi, vis
            )
            zeros = common.zeros((bk, d))
            if blocks.dkv_kv_in_registers:  # the S^T and dP^T products' first operands
                k_operand, v_operand = common.tile(k_own), common.tile(v_smem.at[wg])
            else:
                k_operand, v_operand = k_own, v_smem.at[wg]

            def share_ds(i, ds16):
                met, _ = turns
                buf = lax.rem(i, ds_buffers)
                ds_smem.at[buf, pl.ds(wg * bk, bk)][...] = ds16
                plgpu.commit_smem()
                plgpu.barrier_arrive(met.at[buf])

            # The columns of K (and of dQ) this warpgroup's pieces take.
            dq_k = k_smem.at[:, pl.ds(wg * dq_cols, dq_cols)] if halves else k_smem

            def add_dq(i, g, qb):
                """Step i's piece of dQ (its rows of query tile qb of the group's head g) over
                both key tiles at once, once both dS^T are in, reduce-added in fp32: at 64 by
                the warpgroup whose turn it is (the step's parity), by halves by both."""
                met, _ = turns
                buf = lax.rem(i, ds_buffers)

                @pl.when(True if halves else wg == lax.rem(i, 2))
                def _():
                    plgpu.barrier_wait(met.at[buf])

                    def product(acc_ref):
                        plgpu.wgmma(acc_ref, ds_smem.at[buf].transpose((1, 0)), dq_k)
                        return acc_ref[...]

                    part = pl.run_scoped(product, plgpu.ACC((bq, dq_cols), jnp.float32))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last add read it
                    dq_smem.at[wg][...] = part
                    plgpu.commit_smem()
                    cols = pl.ds(wg * dq_cols, dq_cols) if halves else slice(None)
                    dst = dq_ref.at[b, pl.ds(qb * bq, bq), kv_head * group + g, cols]
                    plgpu.copy_smem_to_gmem(dq_smem.at[wg], dst, reduction_op="add")

            def step(i, carry, g, qb, masked):
                dk, dv = carry
                slot = lax.rem(i, stages)
                for n in range(ready_per_slot):
                    plgpu.barrier_wait(ready.at[slot * ready_per_slot + n])

                q_t = q_smem.at[slot].transpose((1, 0))
                do_t = do_smem.at[slot].transpose((1, 0))

                def probabilities(s_t):
                    lr = lr_smem.at[wg] if vis.bounded else None
                    return common.key_probabilities(
                        s_t,
                        lse_smem.at[slot],
                        c2,
                        key0,
                        qb * bq,
                        masked,
                        lr,
                        blocks.dkv_mask_offset_first,
                    )

                def d_scores(p_t, dp_t):
                    delta_c = lax.broadcast_in_dim(common.col(delta_smem.at[slot]), (bk, bq), [1])
                    return (p_t * (dp_t - delta_c)).astype(dtype)

                if blocks.dkv_overlap:
                    # S^T and dP^T issued together, P^T's arithmetic under dP^T's product and
                    # dS^T's under dV's.
                    def st_dpt(s_ref, dp_ref):
                        plgpu.wgmma(s_ref, k_operand, q_t)
                        plgpu.wgmma(dp_ref, v_operand, do_t)
                        s_t = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # dP^T in flight
                        return probabilities(s_t), dp_ref[...]

                    scores = plgpu.ACC((bk, bq), jnp.float32)
                    p_t, dp_t = pl.run_scoped(st_dpt, scores, scores)
                    p16 = p_t.astype(dtype)

                    def dv_dk(refs):
                        if blocks.dkv_ds_before_dv:
                            ds16 = d_scores(p_t, dp_t)
                            plgpu.wgmma(refs[0], p16, do_smem.at[slot])
                        else:
                            plgpu.wgmma(refs[0], p16, do_smem.at[slot])
                            ds16 = d_scores(p_t, dp_t)
                        plgpu.wgmma(refs[1], ds16, q_smem.at[slot])
                        if fused:  # under dK's product
                            share_ds(i, ds16)

                    dv, dk = common.accumulate(dv_dk, (dv, dk))
                else:

                    def st(acc_ref):
                        plgpu.wgmma(acc_ref, k_operand, q_t)
                        return acc_ref[...]

                    p_t = probabilities(pl.run_scoped(st, plgpu.ACC((bk, bq), jnp.float32)))
                    p16 = p_t.astype(dtype)

                    def dv_dp(refs):
                        plgpu.wgmma(refs[0], p16, do_smem.at[slot])
                        plgpu.wgmma(refs[1], v_operand, do_t)

                    dv, dp_t = common.accumulate(dv_dp, (dv, common.zeros((bk, bq))))
                    ds16 = d_scores(p_t, dp_t)

                    def dk_step(refs):
                        plgpu.wgmma(refs[0], ds16, q_smem.at[slot])
                        if fused:  # under dK's product
                            share_ds(i, ds16)

                    (dk,) = common.accumulate(dk_step, (dk,))
                plgpu.barrier_arrive(free.at[slot])
                if fused:
                    add_dq(i, g, qb)
                return dk, dv

            def head(g, carry):
                base = g * per_head - lo

                def masked(qb, c):
                    return step(base + qb, c, g, qb, True)

                def plain(qb, c):
                    return step(base + qb, c, g, qb, False)

                for start, end, mask in common.spans(lo, unmasked_from, unmasked_to, hi):
                    carry = lax.fori_loop(start, end, masked if mask else plain, carry)
                return carry

            dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
            if fused:  # the other's last dQ product has read both key tiles
                plgpu.barrier_arrive(turns[1])
                plgpu.barrier_wait(turns[1])
            k_own[...] = (dk * scale).astype(dtype)
            v_smem.at[wg][...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_own, dk_ref.at[b, own, kv_head])
            plgpu.copy_smem_to_gmem(v_smem.at[wg], dv_ref.at[b, own, kv_head])
            plgpu.wait_smem_to_gmem(0)

        common.each_compute_warpgroup(compute, wg, blocks.per_warpgroup_code)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(common.MEMORY_REGISTERS, action="decrease")

            rows = (q_ref, do_ref, lse_ref, delta_ref), (q_smem, do_smem, lse_smem, delta_smem)
            common.stream_query_tiles(
                *rows,
                ready,
                free,
                b,
                kv_head * group,
                group,
                lo,
                per_head,
                bq,
                stages,
                ready_per_slot,
            )

    scratch = [
        (
            plgpu.SMEM((keys, d), dtype, transforms=tr),
            plgpu.SMEM((2, bk, d), dtype, transforms=tr),
            plgpu.SMEM((stages, bq, d), dtype, transforms=tr),
            plgpu.SMEM((stages, bq, d), dtype, transforms=tr),
            plgpu.SMEM((stages, bq), jnp.float32),
            plgpu.SMEM((stages, bq), jnp.float32),
            plgpu.SMEM((2, bk), jnp.int32) if vis.bounded else None,
            plgpu.SMEM((ds_buffers, keys, bq), dtype, transforms=tr) if fused else None,
            plgpu.SMEM((2, bq, dq_cols), jnp.float32, transforms=common.FP32_TRANSFORMS)
            if fused
            else None,
        ),
        # A slot's query rows, dO, lse and delta in: on one barrier or on one each.
        plgpu.Barrier(num_arrivals=4 // ready_per_slot, num_barriers=stages * ready_per_slot),
        plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        plgpu.Barrier(num_barriers=6),
        (
            plgpu.Barrier(num_arrivals=2, num_barriers=ds_buffers),  # both dS^T of a step are in
            plgpu.Barrier(num_arrivals=2),  # both are done with the key tiles
        )
        if fused
        else None,
    ]
    out_type = (jax.ShapeDtypeStruct(k.shape, dtype),) * 2
    grid = (t // keys * b_ * hkv,)
    name = "flash_attention_dkv_dq" if fused else "flash_attention_dkv"
    call = common.kernel_call(name, body, out_type, grid, ("ctas",), scratch, with_refs=fused)
    args = (q, k, v, do, lse, delta) + ((last_row,) if vis.bounded else ())
    if not fused:
        return call(*args)
    dq_sum = jax.new_ref(zeros_after(delta, q.shape))
    dk, dv = call(*args, dq_sum)
    return dk, dv, (dq_sum[...] * scale).astype(dtype)


def backward_dq(q, k, v, do, lse, delta, first_key, *, scale, vis, blocks):
    """dQ [B, T, Hq, D]: a CTA per 2 x dq_block_q rows of a query head, over the key tiles
    they see (dq_block_kv keys a step). The CTAs of the last rows, which see the most keys,
    start first. Above MAX_NARROW_HEAD_DIM, backward_wide's kernel."""
    if q.shape[-1] > MAX_NARROW_HEAD_DIM:
        return backward_wide.backward_dq_wide(
            q, k, v, do, lse, delta, first_key, scale=scale, vis=vis, blocks=blocks
        )
    b_, t, hq, d = q.shape
    group = hq // k.shape[2]
    bq, bk, stages = blocks.dq_block_q, blocks.dq_block_kv, blocks.dq_stages
    rows = 2 * bq
    dtype = q.dtype
    c2 = scale * common.LOG2E
    tr = common.TILE_TRANSFORMS

    def body(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest):
        if vis.bounded:
            fk_ref, dq_ref, *scoped = rest
        else:
            fk_ref, (dq_ref, *scoped) = None, rest
        (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, fk_smem), ready, free, own_ready = (
            scoped
        )
        k_ready, v_ready = ready
        rank, pair = common.section_order(lax.axis_index("ctas"), t // rows, b_ * hq, 0)
        b, h = lax.div(pair, hq), lax.rem(pair, hq)
        first_row = (t // rows - 1 - rank) * rows
        wg = lax.axis_index("wg")
        hi = lax.div(first_row + rows + bk - 1, bk)
        lo = lax.div(fk_ref[b, first_row], bk) if vis.bounded else jnp.int32(0)

        def compute(wg):
            plgpu.set_max_registers(common.COMPUTE_REGISTERS, action="increase")
            row0 = first_row + wg * bq
            own = pl.ds(row0, bq)
            gmem = (q_ref, do_ref, lse_ref, delta_ref) + ((fk_ref,) if vis.bounded else ())
            smem = [buf.at[wg] for buf in (q_smem, do_smem, lse_smem, delta_smem, fk_smem)]
            common.load_query_rows(gmem, smem, b, own, h, own_ready.at[pl.ds(5 * wg, 5)])
            own_hi = lax.div(row0 + bq + bk - 1, bk)
            last_first_key = fk_ref[b, row0 + bq - 1] if vis.bounded else None
            unmasked = common.unmasked_key_tiles(last_first_key, row0, bk, lo, own_hi)
            lse_r = lax.broadcast_in_dim(common.row(lse_smem.at[wg]), (bq, bk), [0])
            delta_r = lax.broadcast_in_dim(common.row(delta_smem.at[wg]), (bq, bk), [0])

            def step(kb, dq, masked):
                slot = lax.rem(kb - lo, stages)
                plgpu.barrier_wait(k_ready.at[slot])

                def s_dp(refs):
                    s_ref, dp_ref = refs
                    plgpu.wgmma(s_ref, q_smem.at[wg], k_smem.at[slot].transpose((1, 0)))
                    plgpu.barrier_wait(v_ready.at[slot])
                    plgpu.wgmma(dp_ref, do_smem.at[wg], v_smem.at[slot].transpose((1, 0)))

                zero = common.zeros((bq, bk))
                s, dp = common.accumulate(s_dp, (zero, zero))
                fk = fk_smem.at[wg] if vis.bounded else None
                ds16 = common.query_d_scores(
                    s, dp, lse_r, delta_r, c2, row0, kb * bk, masked, fk, dtype
                )
                dq = common.add_product(dq, ds16, k_smem.at[slot])
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

            dq = common.zeros((bq, d))
            for start, end, masked in common.spans(lo, *unmasked, own_hi):
                dq = lax.fori_loop(start, end, functools.partial(step, masked=masked), dq)
            lax.fori_loop(own_hi, hi, release, None)
            q_smem.at[wg][...] = (dq * scale).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem.at[wg], dq_ref.at[b, own, h])
            plgpu.wait_smem_to_gmem(0)

        common.each_compute_warpgroup(compute, wg, blocks.per_warpgroup_code)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(common.MEMORY_REGISTERS, action="decrease")
            rings = ((k_ref, k_smem, k_ready, free), (v_ref, v_smem, v_ready, None))
            common.stream_key_tiles(rings, b, lax.div(h, group), lo, hi, bk, stages)

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
    call = common.kernel_call(
        "flash_attention_dq",
        body,
        jax.ShapeDtypeStruct(q.shape, dtype),
        (t // rows * b_ * hq,),
        ("ctas",),
        scratch,
    )
    args = (q, k, v, do, lse, delta) + ((first_key,) if vis.bounded else ())
    return call(*args)
