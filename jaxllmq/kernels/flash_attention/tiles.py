"""The kernels' tiles: which head dims they take, where they beat cuDNN's, and the tile settings
(FlashBlocks) with each head dim's measured defaults."""

from __future__ import annotations

import dataclasses

import jax

from jaxllmq import peaks

HEAD_DIMS = (64, 128, 256)
# Where causal forward + backward runs faster than cuDNN's on an H200, 8 x 2048 to 2 x 8192:
# 1.16-1.30x at head dim 64, 1.04-1.17x at 128 (the 3B's and Qwen3 1.7B's steps 0.4-1.3% faster
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
# on an H200, sections of a fixed 2, 4 or 8 pairs were 2-7% slower wherever they differ from it;
# on an H100 one pair at 2 x 8192 took the backward 8% longer, though its reads hit the L2 87% of
# the time against 66%.
DKV_SECTION_BYTES = 32 << 20


@dataclasses.dataclass(frozen=True)
class FlashBlocks:
    """Tile sizes (multiples of 64)."""

    block_q: int = 64  # forward: query rows per compute warpgroup (a CTA takes two)
    block_kv: int = 128  # forward: keys per step
    stages: int = 2  # forward: key/value tiles in flight
    # Forward in order: the two compute warpgroups take turns issuing their products (meeting
    # twice a step), so that one's softmax runs under the other's products.
    fwd_turns: bool = True
    # Forward: each compute warpgroup issues a key tile's S together with the tile before's P V,
    # one wait a step fewer, the warpgroups not taking turns (at 128 its unmasked loop takes 472
    # instructions a step, against 499 in order; no spills in its loops; default_blocks' choice
    # there). On an H100 at 128 turns made its forward slower: meeting twice a step 9%, each
    # handing the turn to the other once it had issued 2-7% (through mbarriers; through named
    # barriers, on an H200, no faster: 4.3% faster to 4.7% slower); so did keeping P's registers
    # in use until P V's wait, so that ptxas waits for it after the max rather than before
    # (5-19%). At 64 over 256-key tiles it spills and ptxas serializes its products; over 128-key
    # tiles it was 4-5% slower than in order.
    fwd_overlap: bool = False
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
    (causal, 8 x 2048 to 2 x 8192, 32 query and 8 key heads); `causal_len`: the sequence length of
    plain causal attention (0 with documents or a window); `device_kind`: jax's name of the GPU the
    kernels run on (DQ_BY_HALVES_GPUS; None: kernel_device_kind()). At head dim 64 the forward takes
    256-key tiles from WIDE_KEY_TILES_FROM on (plain causal only: documents and windows skip whole
    key tiles, which 128 keys keep finer). At head dim 64, dQ added up in the dK/dV kernel, whose
    steps overlap (dq_in_dkv, dkv_overlap, 64-row steps: forward + backward 8-12% faster than dQ's
    own kernel since dS^T's ring), its key and value tiles in registers (0.8-4.7% faster again; at
    128 or with 128-row steps they spill, 1.1-1.25x slower), and four stages of its query rows and
    dO in flight (1.0-2.5% faster than two; three were 1.5% slower). Under `deterministic` dQ runs
    in its own kernel, with steps of 128 keys; dK/dV keeps the overlapped 64-row steps, the
    register-held tiles and the four stages (3.4-4.3% faster than its 128-row steps in order,
    themselves 5% faster than 64-row steps in order with dQ's steps of 64; four stages 2% faster
    than two at 8 x 2048, level at the longer shapes). At head dim 128 the forward issues each key
    tile's S together with the tile before's P V (on an H100, plain causal: the forward 4-10%
    faster at 4 x 4096 and 2 x 8192, level at 8 x 2048, forward + backward level, within 3% either
    way; over documents and within a window of 1024 the forward level to 8% faster, forward +
    backward 4.6% faster to 4.2% slower, the spread of two runs of one kernel; on an H200 the
    forward 2-7% faster causal, over documents and within a window, at 8 x 2048 and 4 x 4096).
    128-row steps spill registers (1.3-1.4x slower); for plain causal attention dQ is added up in
    the dK/dV kernel by column halves in overlapped steps, dS^T formed before dV's product, each
    warpgroup's code its own and the mask's offset first, dK/dV's CTAs in sections of
    DKV_SECTION_BYTES (on an H200 in one section level at 8 x 2048 and 3-6% faster at 4 x 4096 and
    2 x 8192 than dQ's own kernel, in sections 2-6% faster again; on the DQ_BY_HALVES_GPUS only;
    under `deterministic` dQ's own kernel, with the last two, 0.3-1% faster), and a step's four
    loads on one barrier (on an H100 the backward 1-6% faster than waiting for each: 479 / 495
    instructions a step against 511 / 531). Over documents or within a window that backward was
    1.09-1.17x and 1.05x slower, so they keep the two kernels, with the last two as well (over
    documents 5-8% faster at 2 x 8192, within a window of 1024 3%, level at 8 x 2048 and
    4 x 4096). The two kernels at 128 run dK/dV's CTAs in one section (0.4-2%
    faster than sections of 32 MiB, which are 1-3% faster at 64) and wait for a step's four loads
    one by one (1.5-2% faster than on one barrier, which is 2.6-2.9% faster at 64). Three forward
    stages were no faster at 64, 192-key forward tiles 1.3-1.8x slower; neither, nor 256-key tiles,
    fits shared memory at 128."""
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
            fwd_overlap=True,
            dkv_section=None if fused else 0,
            dkv_one_ready=fused,
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


def kernel_device_kind() -> str:
    """jax's name of the GPU the kernels run on: this process's first device's, or an H200's
    where that is no GPU (lowering for a GPU on a CPU), as common.resident_ctas does."""
    device = jax.devices()[0]
    return device.device_kind if device.platform == "gpu" else "NVIDIA H200"
