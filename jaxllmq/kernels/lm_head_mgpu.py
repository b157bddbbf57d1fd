"""The LM head's logsumexp tiles (and tile softmax q) as a Hopper kernel in Mosaic GPU.

The same function as lm_head_pallas.lm_head_tiles, built the way Hopper matmuls are: TMA copies
of h and w tiles into shared memory, a memory warpgroup that keeps `stages` of them in flight,
and two compute warpgroups issuing wgmma, each on its own [tile_m, tile_n] half of the CTA's
vocabulary tile. The CTAs are persistent (one per SM), each looping over output tiles. On an
H200 at the 1B's shapes it runs at 649 TFLOP/s with its q, where the Triton lowering's runs at
536 and cuBLAS's plain GEMMs at 740 (docs/experiments, kernels). The epilogue folds each
warpgroup's fp32 accumulator into its logsumexp piece and, for the gradient, writes
q = exp(logits - reference) in the weight's dtype (lm_head_pallas says why), both through shared
memory and TMA; each tile's token references come in by TMA while its matmul runs.

Shapes must be tile-aligned (tokens by tile_m, vocab by 2 * tile_n, hidden by tile_k) and
16-bit; the target logit is not picked here (the caller gathers it). On CPU it runs in Mosaic GPU's
interpret mode, which simulates the warpgroups, shared memory and barriers (the tests).
"""

import dataclasses
import functools

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxllmq.kernels.flash_attention import common


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """Tile sizes of the Mosaic GPU kernel (multiples of 64)."""

    tile_m: int = 128  # tokens per CTA
    tile_n: int = 128  # vocabulary per compute warpgroup; a CTA covers 2 * tile_n
    tile_k: int = 64  # hidden-dim step of the pipeline (128 bytes of bf16: one TMA swizzle)
    # h and w tiles in flight: 3 x (16 + 32) KiB, plus 64 KiB of q staging, fits the 227 KiB
    # of shared memory an H200 CTA gets; 4 does not.
    stages: int = 3
    # CTAs, each looping over tiles (persistent: while one tile's epilogue runs, the memory
    # warpgroup already loads the next tile's operands); 0: one per SM.
    ctas: int = 0
    # CTAs per cluster along the tokens (1 or 2): a cluster's CTAs take neighbouring token tiles
    # of the same vocabulary tile, whose w tiles TMA multicasts to both (half the w traffic).
    cluster_m: int = 1
    # Mosaic GPU's lowering semantics: "lane" (per-thread arrays) or "warpgroup". On an H200 at
    # the 1B's shape a 2-CTA cluster or warpgroup semantics ran the kernel 2-3% faster alone,
    # but the step no faster than the spread (docs/experiments, kernels): the defaults stay.
    semantics: str = "lane"

    @property
    def rows(self) -> int:
        """Tokens a cluster takes at once: the multiple of which a call's tokens must be."""
        return self.tile_m * self.cluster_m

    def __post_init__(self):
        if self.cluster_m not in (1, 2) or self.semantics not in ("lane", "warpgroup"):
            raise ValueError(
                f"MosaicTiles: cluster_m must be 1 or 2 and semantics lane or warpgroup: {self}"
            )


def _num_clusters(tiles: MosaicTiles, n_tiles: int) -> int:
    """Persistent clusters (of tiles.cluster_m CTAs), each looping over n_tiles / clusters."""
    ctas = tiles.ctas or getattr(jax.devices()[0], "core_count", 0) or 132
    return min(ctas // tiles.cluster_m, n_tiles)


def fits_head(d: int, v: int, dtype, tiles: MosaicTiles) -> bool:
    """Whether the kernel takes a head [d, v] in `dtype`: its tiles divide d and v, 16-bit
    (wgmma would round fp32 operands to tf32)."""
    aligned = v % (2 * tiles.tile_n) == 0 and d % tiles.tile_k == 0
    return aligned and jnp.dtype(dtype).itemsize == 2


def applies(n: int, d: int, v: int, dtype, tiles: MosaicTiles) -> bool:
    """Whether the kernel takes [n, d] x [d, v] in `dtype`: the head fits and n is a multiple of
    its token tiles (tiles.rows)."""
    return n % tiles.rows == 0 and fits_head(d, v, dtype, tiles)


def _interpret_params():
    """Mosaic GPU's interpret mode (jax keeps its parameters class private)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def _swizzled(minor: int, dtype) -> tuple:
    """Shared-memory transforms for tiles whose minor dim holds `minor` elements of dtype."""
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle)


def lm_head_tiles(
    h_NxD: jax.Array,
    w_DxV: jax.Array,
    tiles: MosaicTiles,
    reference_N: jax.Array | None,
    interpret: bool,
) -> tuple[jax.Array, ...]:
    """Per-tile logsumexp [V / tile_n, N] fp32, and with a reference [N] fp32
    q = exp(logits - reference) [N, V] in w's dtype, where the kernel `applies`."""
    with_q = reference_N is not None
    n, d = h_NxD.shape
    v = w_DxV.shape[1]
    tm, tn, tk = tiles.tile_m, tiles.tile_n, tiles.tile_k
    dtype = w_DxV.dtype
    if not applies(n, d, v, dtype, tiles):
        raise ValueError(f"lm_head_mgpu: [{n}, {d}] x [{d}, {v}] {dtype} does not fit {tiles}")
    in_transforms = _swizzled(tk, dtype)

    cm = tiles.cluster_m
    m_iters, n_iters = n // (tm * cm), v // (2 * tn)

    def make_pipeline(mma, epilogue):
        return plgpu.emit_pipeline_warp_specialized(
            mma,
            grid=(d // tk,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((tm, tk), lambda k: (0, k), transforms=in_transforms),
                plgpu.BlockSpec(
                    (tk, 2 * tn),
                    lambda k: (k, 0),
                    transforms=in_transforms,
                    collective_axes=("cluster",) if cm > 1 else (),
                ),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=tiles.stages,
            compute_context=epilogue,
        )

    def mma(_, h_smem, w_smem, acc_ref):
        wg = lax.axis_index("wg")
        plgpu.wgmma(acc_ref, h_smem, w_smem.at[:, pl.ds(wg * tn, tn)])
        plgpu.wgmma_wait(0)
        return acc_ref

    def kernel(h_gmem, w_gmem, r_gmem, lse_gmem, q_gmem, smem, allocations):
        lse_smem, q_smem, r_smem, r_ready = smem

        # Tiles in token-major order: the CTAs running at once share a few vocabulary tiles
        # (read from memory once) and sweep the chunk's h, which stays in L2.
        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cta")
        def _(info: plgpu.NDLoopInfo):
            (lin,) = info.index
            m_idx = lax.rem(lin, m_iters) * cm + (lax.axis_index("cluster") if cm > 1 else 0)
            rows = pl.ds(m_idx * tm, tm)
            pair = lax.div(lin, m_iters)  # vocabulary tiles 2 * pair and 2 * pair + 1

            def epilogue(eval_pipeline):
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
                def _(acc_ref):
                    wg = lax.axis_index("wg")
                    if with_q:  # the tokens' references, in while the matmul runs
                        plgpu.copy_gmem_to_smem(r_gmem.at[rows], r_smem.at[wg], r_ready.at[wg])
                    eval_pipeline(acc_ref)
                    logits = acc_ref[...]
                    mx = logits.max(axis=1)
                    e = jnp.exp(logits - lax.broadcast_in_dim(mx, logits.shape, [0]))
                    s = e.sum(axis=1)
                    # The previous tile's stores must have read the staging buffers.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    lse_smem.at[wg][...] = mx + jnp.log(s)
                    if with_q:
                        plgpu.barrier_wait(r_ready.at[wg])
                        # Along the accumulator's rows; the interpreter takes no layout.
                        r_ref = r_smem.at[wg]
                        r = r_ref[...] if interpret else common.row(r_ref)
                        q = e * lax.broadcast_in_dim(jnp.exp(mx - r), logits.shape, [0])
                        q_smem.at[wg][...] = q.astype(dtype)
                    plgpu.commit_smem()
                    tile = 2 * pair + wg
                    plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_gmem.at[tile, rows])
                    if with_q:
                        q_dst = q_gmem.at[rows, pl.ds(tile * tn, tn)]
                        plgpu.copy_smem_to_gmem(q_smem.at[wg], q_dst)

            make_pipeline(mma, epilogue)(
                h_gmem.at[rows, :],
                w_gmem.at[:, pl.ds(pair * 2 * tn, 2 * tn)],
                allocations=allocations,
            )

        plgpu.wait_smem_to_gmem(0)

    def entry(h_gmem, w_gmem, *refs):
        r_gmem, lse_gmem, q_gmem = refs if with_q else (None, refs[0], None)
        ignore = lambda *_, **__: None
        scratch = [
            make_pipeline(ignore, ignore).get_allocations(h_gmem, w_gmem),
            plgpu.SMEM((2, tm), jnp.float32),
            plgpu.SMEM((2, tm, tn), dtype, transforms=_swizzled(tn, dtype)) if with_q else None,
            plgpu.SMEM((2, tm), jnp.float32) if with_q else None,
            plgpu.Barrier(num_barriers=2) if with_q else None,
        ]
        pl.run_scoped(
            lambda allocations, *smem: kernel(
                h_gmem, w_gmem, r_gmem, lse_gmem, q_gmem, smem, allocations
            ),
            *scratch,
            collective_axes="wg",
        )

    outs = [jax.ShapeDtypeStruct((v // tn, n), jnp.float32)]
    if with_q:
        outs.append(jax.ShapeDtypeStruct((n, v), dtype))
    # Only the options a config asks for, so the default kernel is launched as it was measured.
    options = dict(cluster=(cm,), cluster_names=("cluster",)) if cm > 1 else {}
    if tiles.semantics == "warpgroup":
        semantics = plgpu.LoweringSemantics.Warpgroup
        options["compiler_params"] = plgpu.CompilerParams(lowering_semantics=semantics)
    return plgpu.kernel(
        entry,
        out_type=tuple(outs),
        grid=(_num_clusters(tiles, m_iters * n_iters),),
        grid_names=("cta",),
        num_threads=3,
        thread_name="wg",
        interpret=_interpret_params() if interpret else False,
        **options,
    )(h_NxD, w_DxV, *([reference_N.astype(jnp.float32)] if with_q else []))
