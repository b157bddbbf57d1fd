"""The Mosaic GPU flash attention on CPU: which keys each query sees (key_bounds) against the
masks the model builds, its reference against XLA's attention, its refusals, and that every
variant lowers to Mosaic GPU for a GPU (jax.export for cuda needs no GPU). Mosaic GPU's
interpreter lacks what the kernel is built from (transposed wgmma operands, P from registers,
accumulators kept across calls), so its numerics are checked on the GPU (tests/gpu)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export

from jaxllmq.kernels import flash_attention as fa
from jaxllmq.kernels.flash_attention import common
from jaxllmq.model import attention
from jaxllmq.model.architecture import ModelConfigError, preset
from jaxllmq.model.llama import Llama
from jaxllmq.parallel.mesh import make_mesh
from jaxllmq.plan import make_plan
from jaxllmq.settings import ModelSpec

H200 = dict(platform="gpu", device_kind="NVIDIA H200", compute_capability="9.0")
A100 = dict(platform="gpu", device_kind="NVIDIA A100-SXM4-80GB", compute_capability="8.0")
CPU = dict(platform="cpu", device_kind="cpu")
H100_KIND = "NVIDIA H100 80GB HBM3"


def _segments(rows: int, t: int, starts: list[int]) -> jax.Array:
    marks = jnp.zeros((rows, t), jnp.int32).at[:, jnp.array(starts)].set(1)
    return jnp.cumsum(marks, axis=1)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("documents", [False, True])
def test_key_bounds_are_the_models_masks(window, documents):
    t = 40
    seg = _segments(2, t, [7, 8, 23]) if documents else None
    first, last = fa.key_bounds(t, seg, window, 2)
    pos = np.arange(t)
    sees = pos[None, :] <= pos[:, None]  # [query, key]
    if documents:
        sees = sees[None] & np.asarray(attention.same_document(seg))[:, 0]
    else:
        sees = np.broadcast_to(sees, (2, t, t))
    if window is not None:
        sees = sees & np.asarray(attention.keys_within(t, window))
    from_first = pos[None, None, :] >= np.asarray(first)[:, :, None]
    until_last = pos[None, :, None] <= np.asarray(last)[:, None, :]
    causal = pos[None, :] <= pos[:, None]
    np.testing.assert_array_equal(sees, causal & from_first)
    np.testing.assert_array_equal(sees, causal & until_last)


def test_reference_is_xla_attention_over_documents_and_a_window():
    keys = jax.random.split(jax.random.key(0), 3)
    b, t, hq, hkv, d = 2, 32, 4, 2, 16
    q = jax.random.normal(keys[0], (b, t, hq, d))
    k = jax.random.normal(keys[1], (b, t, hkv, d))
    v = jax.random.normal(keys[2], (b, t, hkv, d))
    seg = _segments(b, t, [5, 20])
    first, _ = fa.key_bounds(t, seg, 6, b)
    mask = attention.same_document(seg) & attention.keys_within(t, 6)
    want = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, scale=0.3)
    got = fa.reference_attention(q, k, v, 0.3, first)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_refuses_what_it_does_not_take_in_one_line():
    assert fa.fits(64, 8, 2, jnp.bfloat16) is None
    assert fa.fits(256, 8, 2, jnp.bfloat16) is None
    assert fa.fits(320, 8, 2, jnp.bfloat16) == "head dim 320 (it takes up to 256)"
    assert fa.fits(128, 8, 2, jnp.float32) == "float32 (it takes bfloat16 or float16)"
    assert fa.fits(64, 8, 3, jnp.bfloat16) == "8 query heads over 3 key heads"
    with pytest.raises(ValueError, match="does not take head dim 320"):
        x = jnp.zeros((1, 256, 2, 320), jnp.bfloat16)
        fa.flash_attention(x, x, x, scale=1.0)


@pytest.mark.parametrize(
    "change", [dict(dkv_block_q=32), dict(block_kv=0), dict(dq_stages=0), dict(dkv_section=-1)]
)
def test_tiles_that_no_kernel_takes_are_refused(change):
    with pytest.raises(ValueError, match="tiles are positive multiples of 64"):
        fa.FlashBlocks(**change)


def test_head_dims_below_128_run_at_the_next_kernel_head_dim():
    got = {d: fa.kernel_head_dim(d) for d in (16, 64, 80, 96, 128, 192, 256, 320)}
    assert got == {16: 64, 64: 64, 80: 128, 96: 128, 128: 128, 192: 256, 256: 256, 320: None}
    for d in (16, 80, 96, 128):
        assert fa.fits(d, 8, 2, jnp.bfloat16) is None
    # With the tiles of the head dim they run at.
    for deterministic in (False, True):
        assert fa.default_blocks(32, deterministic) == fa.default_blocks(64, deterministic)
        assert fa.default_blocks(96, deterministic) == fa.default_blocks(128, deterministic)


@pytest.mark.parametrize(
    "t, d, documents, window, blocks",
    [
        (256, 64, False, None, fa.FlashBlocks()),
        (256, 128, True, 100, fa.FlashBlocks()),
        (200, 64, True, None, fa.FlashBlocks(stages=3, dkv_block_q=128, dq_block_kv=128)),
        (256, 128, True, 100, fa.FlashBlocks(dkv_overlap=True)),
        (256, 128, True, 100, fa.FlashBlocks(fwd_overlap=True)),
        (256, 64, True, 100, fa.FlashBlocks(dq_in_dkv=True)),
        (256, 64, True, 100, fa.FlashBlocks(dq_in_dkv=True, dkv_overlap=True)),
        (256, 128, False, None, fa.FlashBlocks(dkv_kv_in_registers=True)),
        (512, 64, False, None, fa.default_blocks(64, causal_len=fa.WIDE_KEY_TILES_FROM)),
        (
            512,
            64,
            False,
            None,
            dataclasses.replace(
                fa.default_blocks(64, causal_len=fa.WIDE_KEY_TILES_FROM), fwd_overlap=True
            ),
        ),
        (256, 128, True, 100, fa.FlashBlocks(dq_in_dkv=True)),
        (256, 64, True, 100, fa.FlashBlocks(dq_in_dkv=True, per_warpgroup_code=True)),
        (256, 128, False, None, fa.default_blocks(128, deterministic=True, causal_len=256)),
        (256, 128, False, None, None),
        (256, 64, True, 100, None),
        (200, 96, True, 100, None),
        (256, 80, False, None, None),
        (256, 256, False, None, None),
        (256, 256, True, 100, None),
    ],
    ids=[
        "causal-64",
        "bounded-128",
        "padded-documents-wide-tiles-64",
        "dkv-overlap-128",
        "bounded-fwd-overlap-128",
        "bounded-dq-in-dkv-64",
        "bounded-dq-in-dkv-overlap-64",
        "kv-in-registers-128",
        "256-key-tiles-64",
        "256-key-tiles-fwd-overlap-64",
        "bounded-dq-in-dkv-by-halves-128",
        "bounded-dq-in-dkv-per-warpgroup-code-64",
        "deterministic-128",
        "causal-default-128",
        "bounded-default-64",
        "padded-bounded-96",
        "80",
        "causal-256",
        "bounded-256",
    ],
)
def test_forward_and_backward_lower_to_mosaic_gpu(t, d, documents, window, blocks):
    """Every kernel lowers at every setting; head dims below 128 as the kernel's at 64 or 128,
    their inputs padded with zero columns."""
    b, hq, hkv = 1, 4, 2
    q = jax.ShapeDtypeStruct((b, t, hq, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, t, hkv, d), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def loss(q, k, v, seg):
        o = fa.flash_attention(
            q,
            k,
            v,
            scale=d**-0.5,
            segment_ids_BxT=seg if documents else None,
            window=window,
            blocks=blocks,
        )
        return jnp.sum(o.astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    module = export.export(grads, platforms=["cuda"])(q, kv, kv, seg).mlir_module()
    # The forward and the backward's kernels (dK/dV, and dQ unless dK/dV adds it up).
    plain_causal_len = t if not documents and window is None else 0
    taken = blocks or fa.default_blocks(d, causal_len=plain_causal_len)
    kernels = 2 if taken.dq_in_dkv else 3
    assert len(re.findall(r"custom_call @mosaic_gpu", module)) == kernels
    assert f"x{fa.kernel_head_dim(d)}xbf16" in module
    # Named for profiles (jax 0.10 names a kernel that writes a Ref in place after its wrapper).
    names = ["forward"] + ([] if kernels == 2 else ["dkv", "dq"])
    for name in names:
        assert f"flash_attention_{name}_mosaic_gpu" in module


@pytest.mark.parametrize("hq, hkv", [(4, 2), (3, 3)], ids=["group-2-cluster", "group-1"])
def test_head_dim_256_dq_lowers_with_and_without_its_cluster(hq, hkv):
    """At 256 dQ's CTAs of two query heads of a key head run as a cluster sharing the key
    tiles' loads; a group of one query head runs a CTA alone."""
    q = jax.ShapeDtypeStruct((1, 256, hq, 256), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, hkv, 256), jnp.bfloat16)

    def loss(q, k, v):
        return jnp.sum(fa.flash_attention(q, k, v, scale=0.0625).astype(jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    module = export.export(grads, platforms=["cuda"])(q, kv, kv).mlir_module()
    assert len(re.findall(r"custom_call @mosaic_gpu", module)) == 3
    # A CTA arrives on its cluster's barriers, in every CTA's shared memory.
    assert ("mbarrier.arrive.shared::cluster" in module) == (hq // hkv % 2 == 0)


def _lowered_gradient(
    cfg, rows: int, scan_layers: bool, mesh=None, deterministic=False
) -> export.Exported:
    """The gradient of a bf16 model with our attention over documents (192 tokens a row),
    lowered for GPUs; `mesh`: the attention per device of it; `deterministic`: the model's
    deterministic_attention."""
    model = Llama(
        cfg,
        rngs=nnx.Rngs(0),
        param_dtype=jnp.bfloat16,
        dtype=jnp.bfloat16,
        attention="mosaic",
        scan_layers=scan_layers,
        attention_mesh=mesh,
        deterministic_attention=deterministic,
    )
    graphdef, params = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((rows, 192), jnp.int32)

    def loss(params, tokens, segments):
        hidden = nnx.merge(graphdef, params)(tokens, segment_ids_BxT=segments)
        return jnp.sum(hidden.astype(jnp.float32))

    return export.export(jax.jit(jax.grad(loss)), platforms=["cuda"])(params, tokens, tokens)


def _mosaic_calls(exported: export.Exported) -> list[str]:
    return [ln for ln in exported.mlir_module().splitlines() if "custom_call @mosaic_gpu" in ln]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("scan_layers", [True, False])
def test_a_model_with_mosaic_attention_over_documents_lowers_each_kernel_once(
    scan_layers, deterministic
):
    cfg = dataclasses.replace(preset("tiny"), num_hidden_layers=2, vocab_size=256, head_dim=64)
    # The forward and dK/dV (which adds dQ up at head dim 64), and deterministic dQ's own
    # kernel, each once: a scan lowers one layer's body, and unrolled layers call one function
    # per kernel rather than building each kernel again.
    exported = _lowered_gradient(cfg, 2, scan_layers, deterministic=deterministic)
    assert len(_mosaic_calls(exported)) == (3 if deterministic else 2)


def test_gemma_3_layers_lower_at_head_dim_256():
    """Gemma 3's head dim: the forward (its local layers' window over documents), dK/dV (by
    role) and dQ, each once, at head dim 256."""
    gemma = preset("gemma-3-1b")
    cfg = dataclasses.replace(
        gemma, num_hidden_layers=2, layer_types=gemma.layer_types[:2], vocab_size=256,
        intermediate_size=256,
    )  # fmt: skip
    assert cfg.head_dim == 256 and cfg.sliding_window is not None
    calls = _mosaic_calls(_lowered_gradient(cfg, 2, scan_layers=False, deterministic=True))
    assert len(calls) == 3 and all("x256xbf16>" in ln for ln in calls)


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_kernel_lowers_per_device_inside_shard_map(deterministic):
    """On 8 devices (data 2, fsdp 2, tensor 2) each of the Mosaic GPU calls (forward, dK/dV and
    deterministic dQ) takes one device's share: q [2 rows, T padded to 256, 2 heads, 64] of
    [8, 192, 4, 64]."""
    cfg = dataclasses.replace(
        preset("tiny"), num_hidden_layers=2, vocab_size=256, head_dim=64,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    mesh = make_mesh(tensor_parallel=2, data_parallel=2)
    exported = _lowered_gradient(cfg, 8, scan_layers=False, mesh=mesh, deterministic=deterministic)
    calls = _mosaic_calls(exported)
    assert exported.nr_devices == 8 and len(calls) == (3 if deterministic else 2)
    assert all(" : (tensor<2x256x2x64xbf16>, tensor<2x256x1x64xbf16>" in ln for ln in calls)


@pytest.mark.parametrize(
    "cfg, hardware, mesh, message",
    [
        ("llama-3.2-1b", CPU, (1, 1, 1), "runs on a Hopper GPU (H100, H200) only, not on cpu"),
        ("llama-3.2-1b", A100, (1, 1, 1), "only, not on this GPU"),
        ("gemma-3-1b", H200, (1, 1, 1), "does not take head dim 320 (it takes up to 256)"),
    ],
)
def test_the_plan_refuses_mosaic_attention_where_it_cannot_run(cfg, hardware, mesh, message):
    spec = ModelSpec(model=cfg, from_scratch=True, matmul_dtype="bfloat16", attention="mosaic")
    spec = dataclasses.replace(spec, scan_layers=False)
    shape = dict(zip(("data", "fsdp", "tensor"), mesh, strict=True))
    model_cfg = preset(cfg)
    if cfg.startswith("gemma"):  # a head dim past the kernel's largest
        model_cfg = dataclasses.replace(model_cfg, head_dim=320)
    with pytest.raises(ModelConfigError, match=re.escape(message)):
        make_plan(model_cfg, spec, mesh_shape=shape, **hardware)


def test_the_plan_runs_mosaic_attention_on_one_hopper_gpu():
    spec = ModelSpec(model="llama-3.2-1b", from_scratch=True, matmul_dtype="bfloat16")
    spec = dataclasses.replace(spec, attention="mosaic")
    mesh = {"data": 1, "fsdp": 1, "tensor": 1}
    plan = make_plan(preset("llama-3.2-1b"), spec, mesh_shape=mesh, **H200, documents_per_window=32)
    assert plan.attention == "mosaic"
    assert "mosaic (documents by segment ids, up to 32 a window)" in plan.describe()


@pytest.mark.parametrize(
    "cfg, hardware, devices, documents, deterministic, chosen",
    [
        ("llama-3.2-1b", H200, 1, 32, False, "mosaic"),  # documents on one Hopper GPU: ours
        ("llama-3.2-1b", H200, 1, None, False, "mosaic"),  # causal at head dim 64: ours
        ("qwen3-1.7b", H200, 1, None, False, "mosaic"),  # causal at head dim 128: ours too
        ("qwen3-1.7b", H200, 1, 32, False, "mosaic"),
        ("llama-3.2-1b", H200, 2, 32, False, "cudnn"),  # ours measured on one GPU only
        ("llama-3.2-1b", H200, 2, None, False, "cudnn"),
        ("llama-3.2-1b", A100, 1, 32, False, "cudnn"),
        ("gemma-3-1b", H200, 1, 32, False, "mosaic"),  # documents at head dim 256 too
        ("gemma-3-1b", H200, 1, None, False, "mosaic"),  # causal at head dim 256: ours
        ("llama-3.2-1b", CPU, 1, 32, False, "xla"),
        # Deterministic: ours wherever it runs (per device on several), else XLA's.
        ("llama-3.2-1b", H200, 1, None, True, "mosaic"),
        ("llama-3.2-1b", H200, 2, 32, True, "mosaic"),
        ("llama-3.2-1b", A100, 1, None, True, "xla"),
        ("gemma-3-1b", H200, 1, None, True, "mosaic"),
        ("gemma-3-1b", CPU, 1, None, True, "xla"),
    ],
)
def test_auto_attention_runs_mosaic_where_it_was_measured_faster_or_for_determinism(
    cfg, hardware, devices, documents, deterministic, chosen
):
    spec = ModelSpec(model=cfg, from_scratch=True, matmul_dtype="bfloat16")
    spec = dataclasses.replace(spec, scan_layers=False, deterministic=deterministic)
    mesh = {"data": devices, "fsdp": 1, "tensor": 1}
    plan = make_plan(preset(cfg), spec, mesh_shape=mesh, **hardware, documents_per_window=documents)
    assert plan.attention == chosen


@pytest.mark.parametrize(
    "documents, deterministic, chosen",
    [(32, False, "mosaic"), (None, False, "cudnn"), (None, True, "mosaic")],
)
def test_auto_attention_at_head_dim_96_runs_ours_padded_where_it_would_at_128(
    documents, deterministic, chosen
):
    cfg = dataclasses.replace(preset("qwen3-1.7b"), head_dim=96)
    spec = ModelSpec(model="qwen3-1.7b", from_scratch=True, matmul_dtype="bfloat16")
    spec = dataclasses.replace(spec, scan_layers=False, deterministic=deterministic)
    mesh = {"data": 1, "fsdp": 1, "tensor": 1}
    plan = make_plan(cfg, spec, mesh_shape=mesh, **H200, documents_per_window=documents)
    assert plan.attention == chosen


@pytest.mark.parametrize("key_tile", [64, 128])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("documents", [False, True])
def test_the_tiles_left_unmasked_are_those_seen_whole(window, documents, key_tile):
    """The tile ranges the kernels compute without a mask are exactly the tiles whose every key
    every query of the block sees (forward and dQ by query blocks, dK/dV by key blocks)."""
    t, rows, tile = 1024, 64, 64
    seg = _segments(1, t, [130, 131, 300, 777]) if documents else None
    vis = common.Visibility(window=window, documents=documents)
    first, last = fa.key_bounds(t, seg, window, 1)
    pos = np.arange(t)
    sees = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= np.asarray(first)[0][:, None])
    whole = sees.reshape(t // tile, tile, t // tile, tile).all(axis=(1, 3))  # [query, key] tiles
    by_keys = sees.reshape(t // rows, rows, t // key_tile, key_tile).all(axis=(1, 3))
    for block in range(t // rows):
        row0 = block * rows
        hi = (row0 + rows + key_tile - 1) // key_tile
        lo = int(first[0, row0]) // key_tile
        last_first_key = first[0, row0 + rows - 1] if vis.bounded else None
        start, end = common.unmasked_key_tiles(last_first_key, row0, key_tile, lo, hi)
        assert lo <= int(start) <= int(end) <= hi
        want = [kb for kb in range(lo, hi) if by_keys[block, kb]]
        assert list(range(int(start), int(end))) == want, ("keys", row0)
        start, end = common.unmasked_query_tiles(last, 0, row0, rows, tile, t // tile, vis)
        want = [qb for qb in range(block, t // tile) if whole[qb, block]]
        assert list(range(int(start), int(end))) == want, ("queries", row0)


def test_dq_in_dkv_is_refused_above_head_dim_128():
    q = jax.ShapeDtypeStruct((1, 256, 4, 256), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 2, 256), jnp.bfloat16)
    blocks = fa.FlashBlocks(dq_in_dkv=True)

    def loss(q, k, v):
        return jnp.sum(fa.flash_attention(q, k, v, scale=1.0, blocks=blocks).astype(jnp.float32))

    with pytest.raises(ValueError, match="dq_in_dkv takes head dims 64 and 128 only, not 256"):
        export.export(jax.jit(jax.grad(loss)), platforms=["cuda"])(q, kv, kv)


@pytest.mark.parametrize(
    ("head_dim", "t", "documents", "window", "key_tile"),
    [
        (64, 4096, False, None, 256),
        (32, 8192, False, None, 256),
        (64, 4000, False, None, 128),
        (64, 4096, True, None, 128),
        (64, 4096, False, 1024, 128),
        (128, 8192, False, None, 128),
    ],
    ids=["64-4096", "32-8192", "64-4000", "64-documents", "64-window", "128-8192"],
)
def test_the_forward_takes_256_key_tiles_for_long_plain_causal_attention_at_head_dim_64(
    monkeypatch, head_dim, t, documents, window, key_tile
):
    """The default tiles for a call: 256-key forward tiles from WIDE_KEY_TILES_FROM tokens on,
    at kernel head dim 64 and without documents or a window (which skip whole key tiles)."""
    taken = []

    def kernels(q, k, v, first_key, last_row, scale, vis, blocks, checkpoint_as):
        taken.append(blocks)
        return q

    monkeypatch.setattr(fa, "_flash", kernels)
    q = jnp.zeros((1, t, 2, head_dim), jnp.bfloat16)
    kv = jnp.zeros((1, t, 1, head_dim), jnp.bfloat16)
    seg = _segments(1, t, [0, t // 2]) if documents else None
    fa.flash_attention(q, kv, kv, scale=1.0, segment_ids_BxT=seg, window=window)
    [blocks] = taken
    assert blocks.block_kv == key_tile
    plain_causal = not documents and window is None
    assert blocks == fa.default_blocks(head_dim, causal_len=t if plain_causal else 0)


def test_dq_is_added_up_in_dkv_at_128_only_on_the_gpus_where_that_was_faster():
    def blocks(kind, head_dim=128, **kw):
        return fa.default_blocks(head_dim, causal_len=2048, device_kind=kind, **kw)

    def fused(kind, head_dim=128, **kw):
        return blocks(kind, head_dim, **kw).dq_in_dkv

    assert fused("NVIDIA H200") and fused("NVIDIA H200 NVL") and fused(H100_KIND)
    assert not fused("NVIDIA GH200 480GB") and not fused("cpu")
    assert not fused("NVIDIA H200", deterministic=True) and not fused(H100_KIND, deterministic=True)
    assert fused("NVIDIA A100-SXM4-80GB", head_dim=64)  # at 64 on every GPU
    # dQ in dK/dV in sections of DKV_SECTION_BYTES on both; the two kernels in one section.
    assert blocks("NVIDIA H200").dkv_section is None and blocks(H100_KIND).dkv_section is None
    # The two GPUs' tiles are the same, so the kernel tests run them once (as an H200's).
    assert blocks("NVIDIA H200") == blocks(H100_KIND)
    assert blocks(H100_KIND, deterministic=True).dkv_section == 0
    # Lowered on a CPU for a GPU, the kernels take an H200's tiles, as for its SM count.
    assert fa.kernel_device_kind() == "NVIDIA H200"
    assert fa.default_blocks(128, causal_len=2048) == fa.default_blocks(
        128, causal_len=2048, device_kind="NVIDIA H200"
    )


def test_the_forward_overlaps_its_products_at_kernel_head_dim_128_only():
    """S issued with the tile before's P V where that was measured faster: at 128, plain causal,
    over documents and in a window alike (causal_len 0), deterministic or not; in order at 64
    and 256."""
    for deterministic in (False, True):
        for causal_len in (0, 2048, 8192):
            for head_dim, overlapped in ((32, False), (64, False), (96, True), (128, True)):
                blocks = fa.default_blocks(head_dim, deterministic, causal_len)
                assert blocks.fwd_overlap == overlapped, (head_dim, causal_len, deterministic)
            assert not fa.default_blocks(256, deterministic, causal_len).fwd_overlap


@pytest.mark.parametrize(
    ("ranks", "batch", "heads"), [(16, 8, 32), (64, 2, 32), (3, 2, 5), (7, 1, 1)]
)
def test_the_persistent_forward_takes_every_item_once_and_evens_out_the_work(ranks, batch, heads):
    """Work: over the CTAs (vmapped as the kernel's "ctas" axis) and each one's items, every
    item comes exactly once, and where an item's work falls with its rank (causal: ranks - rank
    key tiles), no CTA has more than the mean plus one item's most."""
    work = common.Work(ranks, batch, heads)
    most = max(work.count // work.ctas + 1, 2)

    def items_of_a_cta(_):
        mine = work.mine()
        n = jnp.arange(most)
        rank, b, h = jax.vmap(work.place)(n)
        return jnp.where(n < mine, (rank * batch + b) * heads + h, -1), jnp.where(
            n < mine, ranks - rank, 0
        )

    items, lengths = jax.vmap(items_of_a_cta, axis_name="ctas")(jnp.arange(work.ctas))
    items = np.asarray(items)
    assert sorted(items[items >= 0].tolist()) == list(range(work.count))
    load = np.asarray(lengths).sum(axis=1)
    assert load.max() <= load.mean() + ranks


@pytest.mark.parametrize(("ranks", "pairs", "section"), [(16, 64, 16), (16, 64, 0), (5, 7, 3)])
def test_the_section_order_takes_every_block_once_section_by_section(ranks, pairs, section):
    """Each (rank, pair) comes once; the CTAs of a section all start before the next section's,
    and inside a section ranks go in order (the longest first) over the section's pairs."""
    index = jnp.arange(ranks * pairs)
    rank, pair = (np.asarray(x) for x in common.section_order(index, ranks, pairs, section))
    assert sorted((rank * pairs + pair).tolist()) == list(range(ranks * pairs))
    size = section or pairs
    assert (np.diff(pair // size) >= 0).all()
    for s in range(-(-pairs // size)):
        assert (np.diff(rank[pair // size == s]) >= 0).all()
