"""Register layouts, the order of the work and the kernel launch shared by the forward and
backward kernels."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from jaxllmq.kernels.flash_attention.tiles import DKV_SECTION_BYTES, FlashBlocks

LOG2E = math.log2(math.e)
# Registers per thread of a compute and of the memory warpgroup: (2 x 232 + 40) x 128 threads
# fits an SM's 65,536; asking for more makes setmaxnreg wait forever. FlashAttention-3's 240 and
# 24 ran 0-1.1% faster, within the spread between calls.
COMPUTE_REGISTERS, MEMORY_REGISTERS = 232, 40
# Running maxima start here, not at -inf, so a row with no visible key in a tile stays finite.
NO_MAX = -1e30


@dataclasses.dataclass(frozen=True)
class Visibility:
    """Which keys a query sees besides causality: a sliding window (keys j with r - j < window)
    and packed documents (first_key/last_row arrays given at the call)."""

    window: int | None = None
    documents: bool = False

    @property
    def bounded(self) -> bool:
        return self.window is not None or self.documents


def each_compute_warpgroup(compute, warpgroup, separate):
    """Runs compute(w) on compute warpgroup w (0 or 1). separate: w a Python int, the
    code compiled once per warpgroup, so that what depends on w (its tiles' shared-memory
    addresses, wgmma's descriptors of them) is fixed at compile time and held in uniform
    registers, where worked out from the thread index it takes each thread's registers."""
    if not separate:
        pl.when(warpgroup < 2)(lambda: compute(warpgroup))
        return
    for w in range(2):
        pl.when(warpgroup == w)(functools.partial(compute, w))


# Shared-memory transforms of [rows, D] tiles (D >= 64 elements of 16 bits: 128-byte rows).
TILE_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
# And of fp32 tiles, 32 elements to a 128-byte swizzled row, so that stores from wgmma
# accumulators hit every bank once.
FP32_TRANSFORMS = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))


# jax 0.10's plgpu.load takes an index (here none: the whole ref); later versions deprecate it.
_LOAD_INDEX_PARAM = inspect.signature(plgpu.load).parameters.get("idx")
_LOAD_INDEX = (
    ((),)
    if _LOAD_INDEX_PARAM is not None and _LOAD_INDEX_PARAM.default is inspect.Parameter.empty
    else ()
)


def row(ref):
    """A [rows] vector in shared memory, laid out along the rows of a wgmma accumulator."""
    return plgpu.load(ref, *_LOAD_INDEX, layout=plgpu.Layout.WGMMA.reduce(1))


def col(ref):
    """A [cols] vector in shared memory, laid out along the columns of a wgmma accumulator."""
    return plgpu.load(ref, *_LOAD_INDEX, layout=plgpu.Layout.WGMMA.reduce(0))


def tile(ref):
    """A [rows, cols] tile in shared memory, laid out as a wgmma accumulator (or, 16-bit, as
    wgmma's first operand from registers)."""
    return plgpu.load(ref, *_LOAD_INDEX, layout=plgpu.Layout.WGMMA)


def iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def zeros(shape, fill=0.0):
    """fp32 registers laid out as a wgmma accumulator ([rows, cols]) or along its rows ([rows])."""
    layout = plgpu.Layout.WGMMA if len(shape) == 2 else plgpu.Layout.WGMMA.reduce(1)
    return plgpu.layout_cast(jnp.full(shape, fill, jnp.float32), layout)


def accumulate(issue, accs: tuple) -> tuple:
    """accs (fp32 registers) plus the products `issue(refs)` puts into wgmma accumulator refs,
    accumulated in place."""
    return pl.run_state(issue)(tuple(plgpu.ACC.init(a) for a in accs))


def add_product(acc, a, b):
    """acc (fp32 registers) plus the product a b (a in registers or shared memory, b in
    shared memory), once it is done."""
    (acc,) = accumulate(lambda refs: plgpu.wgmma(refs[0], a, b), (acc,))
    return acc


def resident_ctas() -> int:
    """CTAs resident at once: one per SM (each takes all of an SM's registers); an H200's 132
    where the device does not say (lowering for a GPU on a CPU)."""
    return getattr(jax.devices()[0], "core_count", None) or 132


@dataclasses.dataclass(frozen=True)
class Work:
    """A persistent kernel's work: `ranks` x `batch` x `heads` items over one CTA per SM, each
    CTA taking its items in turn (so it can load the next item's tiles while it finishes the
    last, where a CTA per item waits for its first loads and its stores). Items go by rank (the
    kernel maps rank 0 to the block with the most work), then batch, then head (neighbours
    share K/V in L2). CTA c takes the c-th item of each even round of `ctas` items and the
    (ctas - 1 - c)-th of each odd one, so that the lengths, falling with the rank, even out."""

    ranks: int
    batch: int
    heads: int

    @property
    def count(self) -> int:
        return self.ranks * self.batch * self.heads

    @property
    def ctas(self) -> int:
        return min(self.count, resident_ctas())

    def _seat(self, round_):
        """This CTA's place in a round of items (round_ traced or not)."""
        cta = lax.axis_index("ctas")
        return cta + lax.rem(round_, 2) * (self.ctas - 1 - 2 * cta)

    def mine(self):
        """How many items this CTA takes."""
        rounds, rest = divmod(self.count, self.ctas)
        return rounds + (self._seat(jnp.int32(rounds)) < rest).astype(jnp.int32)

    def place(self, n):
        """(rank, b, h) of this CTA's n-th item."""
        item = n * self.ctas + self._seat(n)
        per_rank = self.batch * self.heads
        rest = lax.rem(item, per_rank)
        return lax.div(item, per_rank), lax.div(rest, self.heads), lax.rem(rest, self.heads)


def kernel_call(name, body, out_type, grid, grid_names, scratch, with_refs=False, cluster=1):
    """A kernel of two compute warpgroups and a memory one; the grid's last axis varies fastest
    as CTAs start. `name` names it in profiles (as name + "_mosaic_gpu_kernel"). with_refs: the
    last operands are jax Refs, written in place (pl.kernel aliases them; plgpu.kernel's wrapper
    takes none). cluster > 1: the grid counts clusters of that many CTAs, which the body tells
    apart by lax.axis_index("cluster")."""

    def entry(*refs):
        pl.run_scoped(lambda *scoped: body(*refs, *scoped), *scratch, collective_axes="wg")

    entry.__name__ = entry.__qualname__ = name

    options = dict(
        out_type=out_type,
        # Lane semantics named: newer jax lowers to warpgroup semantics by default.
        compiler_params=plgpu.CompilerParams(
            approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane
        ),
    )
    threads = dict(num_threads=3, thread_name="wg")
    if cluster > 1:
        options.update(cluster=(cluster,), cluster_names=("cluster",))
    if with_refs:
        mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, **threads)
        return pl.kernel(entry, mesh=mesh, name=name, **options)
    return plgpu.kernel(entry, grid=grid, grid_names=grid_names, **threads, **options)


def section_order(index, ranks: int, pairs: int, section: int):
    """(rank, pair) of the index-th CTA of a 1D grid of ranks x pairs (CTAs start in index
    order): the pairs cut into sections of `section` (0: all), run one section after the other,
    and inside a section rank by rank (rank 0, the longest, first), every pair of the section
    at each rank."""
    section = section or pairs
    per_section = section * ranks
    first_pair = lax.div(index, per_section) * section
    size = lax.min(section, pairs - first_pair)  # the last section may be short
    within = lax.rem(index, per_section)
    return lax.div(within, size), first_pair + lax.rem(within, size)


def dkv_pairs_per_section(blocks: FlashBlocks, q_shape, group: int, dtype) -> int:
    """The (batch, key head) pairs of a dK/dV kernel's section: blocks.dkv_section, or (None)
    as many as DKV_SECTION_BYTES of their queries and dO hold."""
    if blocks.dkv_section is not None:
        return blocks.dkv_section
    _, t, _, d = q_shape
    return max(1, DKV_SECTION_BYTES // (2 * group * t * d * jnp.dtype(dtype).itemsize))


def stream_key_tiles(rings, b, kv_head, lo, hi, bk, stages, before=0, multicast=False):
    """The memory warpgroup's loop of the forward and dQ kernels: key tiles lo.. hi - 1 of
    (b, kv_head), bk keys each, by TMA into rings of `stages` slots. `before`: the tiles streamed
    for earlier items (the rings carry on from them). `rings`: per tensor (K, V)
    its (gmem ref, smem slots, ready barriers, free barriers); a slot is refilled once its free
    barrier says the compute warpgroups are done with it (free None: the one before it in
    `rings` frees both). multicast: the CTAs of a cluster stream the same tiles, TMA loading
    each once and writing it to every CTA's slots; the free barriers are cluster barriers, and
    the loop ends once every CTA is done with the last tiles, whose slots it writes to."""

    @pl.loop(lo, hi)
    def _(kb):
        i = before + kb - lo
        slot = lax.rem(i, stages)
        tile = (b, pl.ds(kb * bk, bk), kv_head)
        for ref, smem, ready, free in rings:
            if free is not None:

                @pl.when(i >= stages)
                def _(free=free):
                    plgpu.barrier_wait(free.at[slot])

            collective = ("cluster",) if multicast else None
            plgpu.copy_gmem_to_smem(
                ref.at[tile], smem.at[slot], ready.at[slot], collective_axes=collective
            )

    if multicast:
        frees = [free for _, _, _, free in rings if free is not None]

        @pl.loop(lax.max(lo, hi - stages), hi)
        def _(kb):
            for free in frees:
                plgpu.barrier_wait(free.at[lax.rem(before + kb - lo, stages)])


def key_probabilities(s_t, lse_ref, c2, key0, row0, masked, last_row_ref, offset_first=False):
    """P^T [keys, rows] fp32 of the scores S^T of keys key0.. and query rows row0.. (lse_ref:
    the rows' logsumexp); `masked`: zero where a row does not see a key, causally and (with
    last_row_ref, the keys' last rows) past the key's last row. offset_first: the causal test
    written as FlashBlocks.dkv_mask_offset_first says."""
    keys, rows = s_t.shape
    lse_c = lax.broadcast_in_dim(col(lse_ref), (keys, rows), [1])
    p_t = jnp.exp2(s_t * c2 - lse_c)
    if masked:
        r = iota((keys, rows), 1) + row0
        if offset_first:
            ok = iota((keys, rows), 0) - (row0 - key0) <= iota((keys, rows), 1)
        else:
            ok = iota((keys, rows), 0) + key0 <= r
        if last_row_ref is not None:
            last = lax.broadcast_in_dim(row(last_row_ref), (keys, rows), [0])
            ok = ok & (r <= last)
        p_t = jnp.where(ok, p_t, 0.0)
    return p_t


def stream_query_tiles(
    gmem, smem, ready, free, b, first_head, heads, lo, per_head, bq, stages, ready_per_slot=1
):
    """The memory warpgroup's loop of the dK/dV kernels: query tiles lo.. lo + per_head - 1 of
    `heads` query heads from first_head, bq rows each: per tile its rows of each of `gmem` (the
    queries and dO [B, T, H, D], then lse and delta [B, H, T]) into a ring of `stages` slots of
    `smem`, onto a slot's ready_per_slot barriers in turn; a slot refilled once its free barrier
    says so."""

    @pl.loop(0, heads * per_head)
    def _(i):
        h = first_head + lax.div(i, per_head)
        rows = pl.ds((lo + lax.rem(i, per_head)) * bq, bq)
        slot = lax.rem(i, stages)

        @pl.when(i >= stages)
        def _():
            plgpu.barrier_wait(free.at[slot])

        for n, (src, dst) in enumerate(zip(gmem, smem, strict=True)):
            tile = src.at[b, rows, h] if n < 2 else src.at[b, h, rows]
            barrier = ready.at[slot * ready_per_slot + n % ready_per_slot]
            plgpu.copy_gmem_to_smem(tile, dst.at[slot], barrier)


def load_query_rows(gmem, smem, b, rows, h, barriers):
    """A dQ kernel's own rows of `gmem` (the queries and dO [B, T, H, D], lse and delta
    [B, H, T], and first_key [B, T] if there is one) into `smem`, each onto one of `barriers`;
    waits for them all."""
    for n, (src, dst) in enumerate(zip(gmem, smem[: len(gmem)], strict=True)):
        tile = src.at[b, rows, h] if n < 2 else src.at[b, h, rows] if n < 4 else src.at[b, rows]
        plgpu.copy_gmem_to_smem(tile, dst, barriers.at[n])
    for n in range(len(gmem)):
        plgpu.barrier_wait(barriers.at[n])


def query_d_scores(s, dp, lse_r, delta_r, c2, row0, key0, masked, first_key_ref, dtype):
    """dS [rows, keys] in `dtype` from the scores S and dP of query rows row0.. and keys
    key0.. (lse_r, delta_r: the rows' logsumexp and delta broadcast along the keys); `masked`:
    zero where a row does not see a key, causally and (with first_key_ref, the rows' first
    keys) before the row's first key."""
    p = jnp.exp2(s * c2 - lse_r)
    if masked:
        r = iota(s.shape, 0) + row0
        c = iota(s.shape, 1) + key0
        ok = c <= r
        if first_key_ref is not None:
            ok = ok & (c >= lax.broadcast_in_dim(row(first_key_ref), s.shape, [0]))
        p = jnp.where(ok, p, 0.0)
    return (p * (dp - delta_r)).astype(dtype)


def unmasked_key_tiles(last_first_key, row0, bk, lo, hi):
    """(start, end): the key tiles in [lo, hi) that the rows from row0 on all see whole, wholly
    at or below every row's diagonal and, bounded, at or past every row's first key (first_key
    rises with the row, so the last row's, last_first_key, bounds them all; None unbounded)."""
    end = lax.min(lax.div(row0 + 1, bk), hi)
    if last_first_key is None:
        return lo, end
    first = lax.div(last_first_key + bk - 1, bk)
    return lax.min(lax.max(lo, first), end), end


def query_tiles(lr_ref, b, key0, keys, bq, t, vis: Visibility):
    """(lo, hi): the query tiles of bq rows that see any of keys key0.. key0 + keys - 1: none
    before the first key's (causal), and, bounded, none past the last key's last row."""
    lo = lax.div(key0, bq)
    if not vis.bounded:
        return lo, jnp.int32(t // bq)
    return lo, lax.div(lr_ref[b, key0 + keys - 1] + bq, bq)


def unmasked_query_tiles(lr_ref, b, key0, keys, bq, hi, vis: Visibility):
    """(start, end): the query tiles below `hi` whose rows all see keys key0.. key0 + keys - 1,
    wholly past their diagonal and, bounded, up to the last row that sees the first key
    (last_row rises with the key, so the first key's bounds them all)."""
    start = lax.min(lax.div(key0 + keys + bq - 1, bq), hi)
    if not vis.bounded:
        return start, hi
    return start, lax.max(lax.min(lax.div(lr_ref[b, key0] + 1, bq), hi), start)


def spans(lo, unmasked_start, unmasked_end, hi):
    """The steps [lo, hi) as (start, end, masked) around the unmasked span, in order."""
    return (
        (lo, unmasked_start, True),
        (unmasked_start, unmasked_end, False),
        (unmasked_end, hi, True),
    )
