"""jaxllmq's Mosaic GPU flash attention against cuDNN's: forward + backward times and errors.

Causal GQA attention forward + backward (and forward alone) at each shape and head dim, cuDNN's
fused kernel beside ours (`jaxllmq/kernels/flash_attention/`), with the errors of each against a
float32 XLA reference; then ours over packed documents (the bench's log-normal length mix) and
with sliding windows (cuDNN's too) against ours causal at the same shape (with each --blocks
setting, changed from bounded attention's default tiles), ours each with the share of causal's
128 x 128 blocks its queries see (the blocks the kernels compute) beside the share of causal's
time it takes. Times are the median over batches of calls issued back to back, the variants of a
shape and head dim taking their batches in turn (bench.time_calls_in_turn), so that a drift of the
GPU's clock over the run falls on each alike. One JSON line per measurement. With
--jax_linear_attention, also that package's kernel of the same design; with --flash_attn3,
FlashAttention-3's CUDA kernels for Hopper; with --flash_attn4, FlashAttention-4's CuTe DSL kernels
(their Hopper path on an H100 or H200); with --tokamax, tokamax's Pallas Mosaic GPU kernels
(optional extras: the project does not need them). With --spills, no timing: each kernel's
register spills as ptxas reports them, how many sit in its loops of matrix products, and whether
ptxas serialized its matrix products (benchmarks/kernel_code.py), per head dim and --blocks
setting, on a GPU or, with jax's CUDA plugin, on a machine without one. With --profile_calls,
each variant's forward + backward traced after its timing: every kernel's time per call and the
time no kernel runs. With --energy_seconds, each variant's energy per call and the GPU's clock
under sustained load, where a power cap can slow one kernel more than another. With --run_once, no
timing: each variant's forward + backward run once, for a profiler (benchmarks/ncu_summary.py).

    python3 -m benchmarks.flash_attention --shapes=8x2048,4x4096,2x8192 --head_dims=64,128
    python3 -m benchmarks.flash_attention --spills --head_dims=128 --blocks= --blocks=dkv_overlap=1
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import tempfile

import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks import kernel_code
from jaxllmq import bench, profile
from jaxllmq.cli import flags as cli_flags
from jaxllmq.kernels import flash_attention as fa
from jaxllmq.kernels.flash_attention import backward, common, forward
from jaxllmq.model import attention

FLAGS = flags.FLAGS
flags.DEFINE_list("shapes", ["8x2048", "4x4096", "2x8192"], "Batch x sequence length pairs.")
flags.DEFINE_list("head_dims", ["64", "128"], "Head dims.")
flags.DEFINE_integer("heads", 32, "Query heads.")
flags.DEFINE_integer("kv_heads", 8, "Key/value heads.")
flags.DEFINE_list("windows", ["1024"], "Sliding windows to time (tokens).")
flags.DEFINE_bool("documents", True, "Also time packed documents.")
flags.DEFINE_bool("cudnn", True, "Time cuDNN's causal kernel too.")
flags.DEFINE_multi_string(
    "blocks",
    [""],
    "Tile settings to time, each as FlashBlocks fields changed from the head dim's defaults "
    "(e.g. 'dkv_block_q=64,dq_stages=3'); repeat the flag for several; empty: the defaults.",
)
flags.DEFINE_bool("errors", True, "Also measure errors against a float32 reference.")
flags.DEFINE_bool(
    "jax_linear_attention",
    False,
    "Also time jax-linear-attention's flash attention (`pip install jax-linear-attention`; an "
    "FA3-style Mosaic GPU kernel of our design), with its two backward kernels and its fused one.",
)
flags.DEFINE_bool(
    "flash_attn3",
    False,
    "Also time FlashAttention-3's Hopper kernels (`pip install dew-flash-attn-cu13`, which wraps "
    "Dao-AILab's CUDA code for jax), causal and with each of --windows.",
)
flags.DEFINE_bool(
    "flash_attn4",
    False,
    "Also time FlashAttention-4's CuTe DSL kernels (`pip install 'fa4-jax[cu13]'`; on Hopper their "
    "wgmma path, FlashAttention-3's tiles), causal and with each of --windows.",
)
flags.DEFINE_bool(
    "tokamax",
    False,
    "Also time tokamax's Pallas Mosaic GPU flash attention (`pip install tokamax`, a release "
    "built for the installed jax: 0.0.12 calls Pallas by jax 0.10's names; its forward of "
    "FlashAttention-3's design, dQ and dK/dV in two backward kernels, at its own heuristic "
    "tiles), causal and with each of --windows.",
)
flags.DEFINE_bool(
    "kernels_apart",
    False,
    "Also time ours' kernels apart (forward, dK/dV, and dQ unless dK/dV adds it up; causal, "
    "default tiles): where the time goes.",
)
flags.DEFINE_integer(
    "profile_calls",
    0,
    "After timing, trace this many forward + backward calls of each variant and print, per call, "
    "each GPU kernel's ms, their sum and the ms in which no kernel runs (jaxllmq.profile): what "
    "runs beside the attention kernels. 0: no trace.",
    lower_bound=0,
)
flags.DEFINE_float(
    "energy_seconds",
    0.0,
    "After timing, run each variant's forward + backward back to back for about this many "
    "seconds, three times in turn, and add to its row the GPU's joules per call, watts, SM clock "
    "(mean, least), the share of time its power cap held the clock down, and the ms per call over "
    "those runs (sustained_ms), which a power cap can lengthen past the timed batches' (NVML, on "
    "a GPU; bench.energy_in_turn). 0: not measured.",
    lower_bound=0.0,
)
flags.DEFINE_bool(
    "run_once",
    False,
    "Instead of timing, run each variant's forward + backward once, so that a profiler "
    "wrapping the process sees each of its kernels once (Nsight Compute: "
    "benchmarks/ncu_summary.py).",
)
flags.DEFINE_bool(
    "spills",
    False,
    "Instead of timing, compile ours' forward + backward at each head dim and --blocks setting "
    "and print ptxas's version and each kernel's register spills as ptxas reports them (bytes "
    "a thread stores to and loads from local memory), the kernels whose wgmma ptxas "
    "serialized (its C75xx notes: each product then waits for the one before), and, where "
    "nvdisasm is on PATH, each loop of matrix products' instructions, wgmma, local stores and "
    "loads, and named barriers: "
    "a compile each, no timing, the first test of a change to a kernel's live values. Without "
    "a GPU it compiles for an H200 through jax's CUDA plugin. A kernel compiled for an earlier "
    "setting of the same run is not compiled, nor listed, again.",
)


def parse_blocks(spec: str, head_dim: int, seq_len: int = 0) -> fa.FlashBlocks:
    """The default tiles of causal attention at this head dim and sequence length (what the
    model runs) with the fields of 'field=value,...' changed (empty: the defaults; 'none' for
    dkv_section: as many pairs as DKV_SECTION_BYTES of queries and dO hold)."""
    fields = dict(item.split("=") for item in spec.split(",") if item)
    if any(value == "none" and name != "dkv_section" for name, value in fields.items()):
        raise ValueError(f"--blocks={spec}: 'none' is a value of dkv_section only")
    changes = {name: None if value == "none" else int(value) for name, value in fields.items()}
    return dataclasses.replace(fa.default_blocks(head_dim, causal_len=seq_len), **changes)


def _optional(flag: str, module: str, name: str, install: str):
    """`name` from the optional package `module` that --`flag` times, or SystemExit saying how to
    install it."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        raise SystemExit(
            f"--{flag}: the package is not installed ({install}), or leave the flag out"
        ) from None


def jax_linear_attention_kernel(backward_mode: str, scale: float):
    """jax-linear-attention's flash attention with its `backward` mode ("ranged": dQ and dK/dV in
    two kernels; "fused": dQ added up in the dK/dV kernel), or SystemExit if it is not installed."""
    attend = _optional(
        "jax_linear_attention",
        "jla.ops.mosaic_gpu.attention",
        "flash_attention",
        "pip install jax-linear-attention",
    )
    return lambda q, k, v: attend(q, k, v, scale=scale, backward=backward_mode)


def flash_attn3_kernel(scale: float, window: int | None = None):
    """FlashAttention-3's causal attention within `window` (its left bound counts the keys before
    the query: window - 1), or SystemExit if the package is not installed."""
    flash_mha = _optional(
        "flash_attn3", "dew_flash_attn", "flash_mha", "pip install dew-flash-attn-cu13"
    )
    bound = (window - 1, 0) if window else (-1, -1)
    return lambda q, k, v: flash_mha(
        q, k, v, softmax_scale=scale, is_causal=True, window_size=bound
    )


def flash_attn4_kernel(scale: float, window: int | None = None):
    """FlashAttention-4's causal attention within `window` (its left bound counts the keys before
    the query: window - 1), or SystemExit if the package is not installed."""
    flash_attn = _optional("flash_attn4", "fa4_jax", "flash_attn", "pip install 'fa4-jax[cu13]'")
    bound = (window - 1, 0) if window else None
    return lambda q, k, v: flash_attn(q, k, v, causal=True, window_size=bound, scale=scale)


def tokamax_kernel(scale: float, window: int | None = None):
    """tokamax's Mosaic GPU causal attention within `window` (its left bound counts the keys
    before the query: window - 1), or SystemExit if the package is not installed."""
    attend = _optional("tokamax", "tokamax", "dot_product_attention", "pip install tokamax")
    bound = (window - 1, 0) if window else None
    return lambda q, k, v: attend(
        q, k, v, scale=scale, is_causal=True, local_window_size=bound, implementation="mosaic"
    )


# Each other package's causal attention within a window (None: causal): its --flag, its rows'
# name, and the kernel for a scale and a window.
OTHER_KERNELS = (
    ("flash_attn3", "flash-attn3", flash_attn3_kernel),
    ("flash_attn4", "flash-attn4", flash_attn4_kernel),
    ("tokamax", "tokamax", tokamax_kernel),
)


def _grad_fn(attend):
    def loss(q, k, v, do):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _errors(attend, reference, q, k, v, do) -> tuple[dict, dict]:
    """(max abs error, relative L2 error) of o, dq, dk and dv against the fp32 reference: the
    largest error is one element's, the L2 error the whole tensor's."""
    got = jax.vjp(attend, q, k, v)
    grads = got[1](do)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want = jax.vjp(reference, *f32)
    ref_grads = want[1](do.astype(jnp.float32))
    names = ("o", "dq", "dk", "dv")
    largest, l2 = {}, {}
    for n, a, b in zip(names, (got[0], *grads), (want[0], *ref_grads), strict=True):
        err = a.astype(jnp.float32) - b
        largest[n] = float(jnp.max(jnp.abs(err)))
        l2[n] = float(jnp.linalg.norm(err) / jnp.linalg.norm(b))
    return largest, l2


def error_text(e: Exception) -> str:
    """A variant's failure as its row reports it: the exception's type and message, cut short."""
    return f"{type(e).__name__}: {str(e)[:400]}"


def visible_blocks(first_key, block: int = 128) -> int:
    """The block x block tiles of the causal score matrices, over the batch, in which some query
    sees a key: query block i sees key blocks from its first row's first key's up to its
    diagonal (first_key rises with the row). The kernels compute these and skip the rest."""
    t = first_key.shape[1]
    first_blocks = first_key[:, ::block] // block
    return int(jnp.sum(jnp.arange(t // block) - first_blocks + 1))


def _kernels_apart(q, k, v, do, scale) -> dict:
    """ms of each of ours' kernels alone, causal with the default tiles (dK/dV's with its dQ
    buffer's zeroing and rounding where it adds dQ up)."""
    blocks = fa.default_blocks(q.shape[-1], causal_len=q.shape[1])
    kw = dict(scale=scale, vis=common.Visibility(), blocks=blocks)
    fwd = jax.jit(lambda q, k, v: forward.forward(q, k, v, None, **kw))
    o, lse = fwd(q, k, v)
    delta = backward.row_delta(o, do)
    dkv = jax.jit(lambda *a: backward.backward_dkv(*a, None, **kw))
    dq = jax.jit(lambda *a: backward.backward_dq(*a, None, **kw))
    args = (q, k, v, do, lse, delta)
    ms = lambda call: 1e3 * bench.time_calls(call, calls=20)  # noqa: E731
    row = {
        "variant": "mosaic kernels apart",
        "fwd_ms": ms(lambda: fwd(q, k, v)),
        "dkv_ms": ms(lambda: dkv(*args)),
    }
    if not blocks.dq_in_dkv:
        row["dq_ms"] = ms(lambda: dq(*args))
    return row


def _profile(grad, args, calls: int) -> dict:
    """Per call of grad(*args), traced `calls` times back to back: each GPU kernel's ms, their
    sum and the ms in which no kernel runs."""
    found = profile.breakdown_of(lambda: [grad(*args) for _ in range(calls)], calls, top=100)
    return {
        "kernel_ms": {name: round(ms, 4) for name, ms, _ in found["kernels"]},
        "device_ms": round(found["device_ms_per_step"], 4),
        "idle_ms": round(found["idle_ms_per_step"], 4),
    }


def measure(b: int, t: int, d: int) -> None:
    keys = jax.random.split(jax.random.key(0), 4)
    hq, hkv = FLAGS.heads, FLAGS.kv_heads
    q = jax.random.normal(keys[0], (b, t, hq, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, hkv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, hkv, d), jnp.bfloat16)
    do = jax.random.normal(keys[3], (b, t, hq, d), jnp.bfloat16)
    scale = d**-0.5
    shape = {"batch": b, "seq_len": t, "head_dim": d, "heads": hq, "kv_heads": hkv}

    def emit(row):
        print(json.dumps(shape | row), flush=True)

    def cudnn(window=None):
        """cuDNN's fused attention as the model calls it, causal within `window`."""
        return lambda q, k, v: attention.attend(
            q, k, v, None, implementation="cudnn", window=window, scale=scale
        )[0]

    def reference(q, k, v, first_key=None):
        return fa.reference_attention(q, k, v, scale, first_key)

    variants = {"cudnn": (cudnn(), reference)} if FLAGS.cudnn else {}

    def ours(blocks):
        return lambda q, k, v: fa.flash_attention(q, k, v, scale=scale, blocks=blocks)

    for spec in FLAGS.blocks:
        variants[f"mosaic {spec or 'default'}"] = (ours(parse_blocks(spec, d, t)), reference)
    if FLAGS.jax_linear_attention:
        for mode in ("ranged", "fused"):
            variants[f"jax-linear-attention {mode}"] = (
                jax_linear_attention_kernel(mode, scale),
                reference,
            )
    for flag, name, kernel in OTHER_KERNELS:
        if FLAGS[flag].value:
            variants[name] = (kernel(scale), reference)
    # Documents and windows: the share of causal's blocks their queries see, and of its time.
    causal_blocks = visible_blocks(jnp.zeros((b, t), jnp.int32))
    block_shares = {}

    def bounded(name, seg, window):
        """Ours over documents `seg` within `window`, with each --blocks setting (changed from
        the defaults of bounded attention); returns the reference for those bounds."""
        fk, _ = fa.key_bounds(t, seg, window, b)
        bounds_reference = lambda q, k, v: reference(q, k, v, fk)  # noqa: E731
        for spec in FLAGS.blocks:
            row = f"{name} {spec}" if spec else name
            blocks = parse_blocks(spec, d)
            variants[row] = (
                lambda q, k, v, blocks=blocks: fa.flash_attention(
                    q, k, v, scale=scale, segment_ids_BxT=seg, window=window, blocks=blocks
                ),
                bounds_reference,
            )
            block_shares[row] = visible_blocks(fk) / causal_blocks
        return bounds_reference

    if FLAGS.documents:
        bounded("mosaic documents", jnp.asarray(bench.document_segment_ids(b, t)), None)
    for w in map(int, FLAGS.windows):
        windowed_reference = bounded(f"mosaic window {w}", None, w)
        if FLAGS.cudnn:
            variants[f"cudnn window {w}"] = (cudnn(w), windowed_reference)
        for flag, name, kernel in OTHER_KERNELS:
            if FLAGS[flag].value:
                variants[f"{name} window {w}"] = (kernel(scale, w), windowed_reference)
    if FLAGS.kernels_apart and d in fa.HEAD_DIMS:  # padded head dims: not the kernels alone
        emit(_kernels_apart(q, k, v, do, scale))
    built = {}  # the variants that compiled and ran: (forward, forward + backward)
    for name, (attend, _) in variants.items():
        try:
            fwd, grad = jax.jit(attend), _grad_fn(attend)
            if FLAGS.run_once:  # for a profiler: the forward runs only inside the backward's call
                jax.block_until_ready(grad(q, k, v, do))
                emit({"variant": name, "ran_once": True})
                continue
            jax.block_until_ready((fwd(q, k, v), grad(q, k, v, do)))
            built[name] = (fwd, grad)
        except Exception as e:  # one variant's failure must not end the sweep
            emit({"variant": name, "error": error_text(e)})
    if FLAGS.run_once:
        return
    fwd_s = bench.time_calls_in_turn(
        {name: lambda f=fwd: f(q, k, v) for name, (fwd, _) in built.items()}, calls=20
    )
    fwd_bwd_calls = {name: lambda g=grad: g(q, k, v, do) for name, (_, grad) in built.items()}
    fwd_bwd_s = bench.time_calls_in_turn(fwd_bwd_calls, calls=20)
    energy = {name: {} for name in built}
    if FLAGS.energy_seconds:
        energy = bench.energy_in_turn(fwd_bwd_calls, fwd_bwd_s, seconds=FLAGS.energy_seconds)
    causal_ms = None  # ours causal with the default tiles, where timed
    for name in built:
        row = {"variant": name, "fwd_ms": 1e3 * fwd_s[name], "fwd_bwd_ms": 1e3 * fwd_bwd_s[name]}
        row |= energy[name]
        if name == "mosaic default":
            causal_ms = row["fwd_bwd_ms"]
        if name in block_shares:
            row["blocks_vs_causal"] = round(block_shares[name], 4)
            if causal_ms:
                row["fwd_bwd_vs_causal"] = round(row["fwd_bwd_ms"] / causal_ms, 4)
        if FLAGS.errors and t * t * b * hq <= 2**31:  # the fp32 reference's scores fit
            attend, ref = variants[name]
            try:
                row["max_abs_error"], row["rel_l2_error"] = _errors(attend, ref, q, k, v, do)
            except Exception as e:  # the row keeps its times
                row["error"] = error_text(e)
        emit(row)
    if FLAGS.profile_calls:
        for name, (_, grad) in built.items():
            traced = _profile(grad, (q, k, v, do), FLAGS.profile_calls)
            emit({"variant": name, "profile": traced})


def report_spills(d: int, specs: list[str], heads: int, kv_heads: int, device=None) -> None:
    """One JSON line per tile setting (a --blocks spec) at head dim d: the ptxas version and each
    kernel's spills, from compiling ours' causal forward + backward (Mosaic GPU compiles its
    kernels with the jit's compile, and dumps them where MOSAIC_GPU_DUMP_TO says) for `device`
    (None: the GPU jax runs on), with the loops of matrix products where kernel_code can read
    them, or the error that stopped it."""
    sharding = jax.sharding.SingleDeviceSharding(device) if device else None
    q = jax.ShapeDtypeStruct((1, 2048, heads, d), jnp.bfloat16, sharding=sharding)
    kv = jax.ShapeDtypeStruct((1, 2048, kv_heads, d), jnp.bfloat16, sharding=sharding)
    ptxas = kernel_code.ptxas_version()
    for spec in specs:
        row = {"head_dim": d, "variant": f"mosaic {spec or 'default'}", "ptxas": ptxas}
        try:
            blocks = parse_blocks(spec, d, q.shape[1])
            grad = _grad_fn(
                lambda q, k, v, b=blocks: fa.flash_attention(q, k, v, scale=d**-0.5, blocks=b)
            )
            jax.clear_caches()
            with tempfile.TemporaryDirectory() as dump:
                os.environ["MOSAIC_GPU_DUMP_TO"] = dump
                try:
                    grad.lower(q, kv, kv, q).compile()  # dO has the queries' shape
                finally:
                    del os.environ["MOSAIC_GPU_DUMP_TO"]
                row["spills"], serialized, loops = kernel_code.compiled_kernels(dump)
            if serialized:  # every product of these kernels waits for the one before
                row["wgmma_serialized"] = serialized
            if loops:  # [instructions, wgmma, local stores, local loads, barriers] a loop
                row["product_loops"] = loops
        except Exception as e:  # a setting the kernels refuse must not end the sweep
            row["error"] = error_text(e)
        print(json.dumps(row), flush=True)


def main(argv):
    del argv
    if FLAGS.spills:
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # before jax starts
        on_gpu = jax.default_backend() == "gpu"
        devices = None if on_gpu else kernel_code.h200_compile_devices()
        if not on_gpu and devices is None:
            raise SystemExit(
                "--spills: Mosaic GPU compiles its kernels for a GPU; run it on one, or install "
                f'jax\'s CUDA plugin (pip install "jax-cuda13-plugin[with-cuda]=={jax.__version__}")'
                " to compile for an H200 here"
            )
        device = devices[0] if devices else None
        for d in map(int, FLAGS.head_dims):
            report_spills(d, FLAGS.blocks, FLAGS.heads, FLAGS.kv_heads, device)
        return
    if FLAGS.jax_linear_attention:
        jax_linear_attention_kernel("ranged", 1.0)  # not installed: stop before any shape
    for flag, _, kernel in OTHER_KERNELS:
        if FLAGS[flag].value:
            kernel(1.0)  # not installed: stop before any shape
    for shape in FLAGS.shapes:
        b, t = map(int, shape.split("x"))
        for d in map(int, FLAGS.head_dims):
            measure(b, t, d)


if __name__ == "__main__":
    app.run(main, flags_parser=cli_flags.parse_argv)
