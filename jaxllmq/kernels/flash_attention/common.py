"""Tiles, register layouts and the kernel launch shared by the forward and backward."""

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

from jaxllmq import peaks

LOG2E = math.log2(math.e)
# Registers per thread of a compute and of the memory warpgroup: (2 x 232 + 40) x 128 threads
# fits an SM's 65,536; asking for more makes setmaxnreg wait forever. FlashAttention-3's 240 and
# 24 ran 0-1.1% faster, within the spread between calls.
COMPUTE_REGISTERS, MEMORY_REGISTERS = 232, 40
# Running maxima start here, not at -inf, so a row with no visible key in a tile stays finite.
NO_MAX = -1e30
HEAD_DIMS = (64, 128, 256)
# Where causal forward + backward runs faster than cuDNN's on an H200, 8 x 2048 to 2 x 8192:
# 1.16-1.29x at head dim 64, 1.04-1.16x at 128 (the 3B's and Qwen3 1.7B's steps 0.4-1.3% faster
# at the same peak memory) and 1.03-1.14x at 256.
CAUSAL_FASTER_HEAD_DIMS = (64, 128, 256)
# Per head dim, a sliding window of at most this many keys on every layer runs faster than
# cuDNN's windowed attention (8 x 2048 to 2 x 8192): at 128 1.04-1.19x for windows of 512 and
# 1024, 1.03-1.04x at 2048 (4 x 4096 and 2 x 8192), 0.96x at 4096 over 8192; at 256 windows of
# 1024 and less were taken with causal's gain, longer ones not timed. At the
# ANY_WINDOW_FASTER_HEAD_DIMS any window: at 64 1.20-1.38x for windows of 512 to 4096.
FASTER_WINDOW_MAX = {128: 2048, 256: 1024}
ANY_WINDOW_FASTER_HEAD_DIMS = (64,)
# From this sequence length on, causal attention at head dim 64 (no documents, no window) runs
# its forward over 256-key tiles, half the steps of 128-key ones: on an H200 the forward took
# 8% less time at 2 x 8192 (three calls), up to 4% less at 4 x 4096 (one call 0.6% more) and
# 2% more at 8 x 2048.
WIDE_KEY_TILES_FROM = 4096
# The GPU models on which plain causal attention at head dim 128 adds dQ up in the dK/dV kernel
# (by column halves), measured faster there than dQ's own kernel, with dK/dV's CTAs in sections
# of DKV_SECTION_BYTES of queries and dO (FlashBlocks.dkv_section), whose dQ sums fit the L2. In
# one section every CTA adds into dQ's fp32 sums at once (256 MiB at 16,384 tokens and 32 query
# heads, five times an H100's L2): on an H100 that took 1.05-1.33x as long as the two kernels,
# sections 1-6.5% less; on an H200 sections took 2-6% less than one section. Other GPUs,
# measured or not, run the two kernels.
DQ_BY_HALVES_GPUS = ("H200", "H100")
# The query and dO bytes of a dK/dV section: well inside an H200's 50 MB of L2. At head dim 128
# on an H200, sections of a fixed 2, 4 or 8 pairs were 2-7% slower wherever they differ from it.
DKV_SECTION_BYTES = 32 << 20


@dataclasses.dataclass(frozen=True)
class FlashBlocks:
    """Tile sizes (multiples of 64)."""

    block_q: int = 64  # forward: query rows per compute warpgroup (a CTA takes two)
    block_kv: int = 128  # forward: keys per step
    stages: int = 2  # forward: key/value tiles in flight
    dkv_block_kv: int = 64  # dK/dV: keys per compute warpgroup (a CTA takes two)
    dkv_block_q: int = 64  # dK/dV: query rows per step
    dkv_stages: int = 2
    dq_block_q: int = 64  # dQ: query rows per compute warpgroup (a CTA takes two)
    dq_block_kv: int = 64  # dQ: keys per step
    dq_stages: int = 2
    # dK/dV's CTAs run section by section of (batch, key head) pairs, so that those running at
    # once share their pairs' query tiles in L2: pairs per section (0: all in one; None: as many
    # as DKV_SECTION_BYTES of queries and dO hold).
    dkv_section: int | None = None
    # dK/dV: S^T and dP^T issued together, P^T's arithmetic under dP^T's product and dS^T's
    # under dV's (two waits a step, not three; both score tiles live at once).
    dkv_overlap: bool = False
    # dK/dV: a step's four loads (query rows, dO, lse, delta) arrive on one barrier, so a compute
    # warpgroup waits once a step, not four times.
    dkv_one_ready: bool = True
    # dK/dV up to head dim 128: each compute warpgroup holds its key and value tiles in
    # registers, as the S^T and dP^T products' first operands, which otherwise read them from
    # shared memory every step (32 more registers a thread at head dim 64; at 128, or with
    # 128-row steps, they spill). At 256 the warpgroups split by role and read them as before.
    dkv_kv_in_registers: bool = False
    # dQ added up by the dK/dV kernel (fp32, by TMA's reduce-add; not bit-identical from run to
    # run) instead of dQ's own kernel recomputing S and dP. Head dims 64 and 128.
    dq_in_dkv: bool = False
    # Overlapped dK/dV steps: dS^T formed before dV's product is issued, so that P^T's fp32
    # registers and dP^T's are free while that product holds P^T's bf16 ones.
    dkv_ds_before_dv: bool = False
    # dK/dV's masked steps: the causal test written as key index - (row0 - key0) <= row index,
    # which ptxas keeps out of local memory where each warpgroup's code is its own (with
    # per_warpgroup_code its masked loops at 128 load nothing from local memory, against 5-12
    # loads a step).
    dkv_mask_offset_first: bool = False
    # Every kernel: each compute warpgroup's code compiled with its index known (twice over),
    # so that its tiles' addresses and wgmma's descriptors of them sit in uniform registers
    # instead of each thread's (at 128, dQ in dK/dV with overlapped steps spills 140 / 204
    # bytes with it, against 416 / 592; forward + backward at 64 it was 0.6-2.3% slower).
    per_warpgroup_code: bool = False

    def __post_init__(self):
        tiles = (self.block_q, self.block_kv, self.dkv_block_kv, self.dkv_block_q)
        tiles += (self.dq_block_q, self.dq_block_kv)
        stages = (self.stages, self.dkv_stages, self.dq_stages)
        if (
            any(tile <= 0 or tile % 64 for tile in tiles)
            or min(stages) < 1
            or (self.dkv_section is not None and self.dkv_section < 0)
        ):
            raise ValueError(
                "flash attention: tiles are positive multiples of 64 (wgmma's least contraction), "
                f"stages 1 or more and sections 0 or more, not {self}"
            )


def kernel_head_dim(head_dim: int) -> int | None:
    """The head dim the kernels run a head dim at: the least of HEAD_DIMS that holds it (the
    columns past head_dim zeros, which change no score, output or gradient), None above them."""
    return next((d for d in HEAD_DIMS if d >= head_dim), None)


def default_blocks(
    head_dim: int, deterministic: bool = False, causal_len: int = 0, device_kind: str | None = None
) -> FlashBlocks:
    """The tiles for a head dim (those of the kernel head dim it runs at), as measured on an H200
    (causal, 8 x 2048 to 2 x 8192, 32 query and 8 key heads); `causal_len`: the sequence length
    of plain causal attention (0 with documents or a window); `device_kind`: jax's name of the
    GPU the kernels run on (DQ_BY_HALVES_GPUS; None: kernel_device_kind()). At head dim 64 the
    forward takes 256-key tiles from WIDE_KEY_TILES_FROM on (plain causal only: documents and
    windows skip whole key tiles, which 128 keys keep finer). At head dim 64, dQ added up in the
    dK/dV kernel, whose steps overlap (dq_in_dkv, dkv_overlap, 64-row steps: forward + backward
    8-12% faster than dQ's own kernel since dS^T's ring), its key and value tiles in registers
    (0.8-4.7% faster again; at 128 or with 128-row steps they spill, 1.1-1.25x slower), and four
    stages of its query rows and dO in flight (1.0-2.5% faster than two; three were 1.5%
    slower). Under `deterministic` dQ runs in its own kernel, with steps of 128 keys; dK/dV
    keeps the overlapped 64-row steps, the register-held tiles and the four stages (3.4-4.3%
    faster than its 128-row steps in order, themselves 5% faster than 64-row steps in order with
    dQ's steps of 64; four stages 2% faster than two at 8 x 2048, level at the longer shapes).
    At head dim 128, 128-row steps spill registers (1.3-1.4x slower); for plain causal attention
    dQ is added up in the dK/dV kernel by column halves in overlapped steps, dS^T formed before
    dV's product, each warpgroup's code its own and the mask's offset first, dK/dV's CTAs in
    sections of DKV_SECTION_BYTES (on an H200 in one section level at 8 x 2048 and 3-6% faster at
    4 x 4096 and 2 x 8192 than dQ's own kernel, in sections 2-6% faster again; on the
    DQ_BY_HALVES_GPUS only; under `deterministic` dQ's own kernel, with the last two, 0.3-1%
    faster). Over documents or within a window that backward was 1.09-1.17x and 1.05x slower,
    so they keep the two kernels, with the last two as well (over documents 5-8% faster at
    2 x 8192, within a window of 1024 3%, level at 8 x 2048 and 4 x 4096). The two kernels at 128
    run dK/dV's CTAs in one section (0.4-2% faster than sections of 32 MiB, which are 1-3% faster
    at 64) and wait for a step's four loads one by one (1.5-2% faster than on one barrier, which
    is 2.6-2.9% faster at 64). Three forward stages were no faster at 64, 192-key forward tiles
    1.3-1.8x slower; neither, nor 256-key tiles, fits shared memory at 128."""
    kernel_d = kernel_head_dim(head_dim)
    if kernel_d == 64:
        return FlashBlocks(
            block_kv=256 if causal_len >= WIDE_KEY_TILES_FROM else 128,
            dq_in_dkv=not deterministic,
            dq_block_kv=128 if deterministic else 64,  # dQ's own kernel's steps
            dkv_overlap=True,
            dkv_kv_in_registers=True,
            dkv_stages=4,
        )
    if kernel_d == 128:
        kind = kernel_device_kind() if device_kind is None else device_kind
        model = peaks.gpu_model(kind)
        fused = causal_len > 0 and not deterministic and model in DQ_BY_HALVES_GPUS
        return FlashBlocks(
            dkv_section=None if fused else 0,
            dkv_one_ready=False,
            dq_in_dkv=fused,
            dkv_overlap=fused,
            dkv_ds_before_dv=fused,
            dkv_mask_offset_first=True,
            per_warpgroup_code=True,
        )
    # 256: 64-key forward tiles, which fit shared memory (227 KiB) beside the forward's resident
    # [64, 256] query rows (wgmma contracts over 64 elements at least, so tiles cannot shrink
    # below that); the backward's kernels split their warpgroups by role and hold one
    # warpgroup's tiles, so two stages fit (forward + backward: dK/dV single-buffered was
    # 1.09-1.12x slower, dQ's kernel of two warpgroups' rows, single-buffered, 1.13-1.18x).
    return FlashBlocks(block_kv=64, dkv_stages=2, dq_stages=2, dkv_section=0)


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


def kernel_device_kind() -> str:
    """jax's name of the GPU the kernels run on: this process's first device's, or an H200's
    where that is no GPU (lowering for a GPU on a CPU), as resident_ctas assumes."""
    device = jax.devices()[0]
    return device.device_kind if device.platform == "gpu" else "NVIDIA H200"


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
