"""Time the kernels on a GPU: Pallas vs XLA, RMSNorm, the LM-head loss, fp8 quantize.

    python3 -m benchmarks.kernels [--sections=copy,rms,lm,fp8] [--out=DIR]

Times forward+backward (bench.time_calls: batches of back-to-back calls, the median) and reads
the compiled program's temporary memory; sweeps the Pallas kernels' tile configurations (a
configuration that does not compile is recorded as such). Prints a table last; --out gets the
rows as JSON lines. Correctness is tests/gpu/test_gpu_kernels.py's. --smoke runs the script on
CPU (tiny shapes, interpret mode), to check the script itself.
"""

import dataclasses
import json
import os
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxllmq.bench import time_calls
from jaxllmq.cli import flags as cli_flags
from jaxllmq.kernels import lm_head_mgpu
from jaxllmq.kernels.fp8_quantize import (
    Fp8QuantizeConfig,
    quantize_both_pallas,
    quantize_both_reference,
)
from jaxllmq.kernels.lm_head_loss import lm_head_loss
from jaxllmq.kernels.lm_head_pallas import LmHeadPallasConfig, lm_head_tiles
from jaxllmq.kernels.rms_norm import RmsNormConfig, add_rms_norm, rms_norm

_sections = flags.DEFINE_list("sections", ["copy", "rms", "lm", "fp8"], "Of copy, rms, lm, fp8.")
_out = flags.DEFINE_string("out", None, "Also write the rows (JSON lines) and the table here.")
_smoke = flags.DEFINE_bool(
    "smoke", False, "Tiny shapes in interpret mode: check the script on CPU."
)

ROWS: list[dict] = []
T_START = time.time()
ARGS = types.SimpleNamespace()  # shapes(), set by main


def log(**row) -> None:
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def compile_(fn, args):
    t0 = time.perf_counter()
    c = jax.jit(fn).lower(*args).compile()
    mem = c.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", -1) if mem is not None else -1
    out = getattr(mem, "output_size_in_bytes", -1) if mem is not None else -1
    return c, temp, out, time.perf_counter() - t0


def timed(fn, args, *, iters: int, batch: int) -> float:
    """Median seconds per call of a compiled fn: `iters` batches of `batch` back-to-back calls."""
    return time_calls(lambda: fn(*args), calls=batch, batches=iters)


# ---- bandwidth ceiling ---------------------------------------------------------------------


def copy_bandwidth():
    n = ARGS.copy_elems
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    c, *_ = compile_(lambda x: x * 2, (x,))
    med = timed(c, (x,), iters=10, batch=5)
    log(section="copy", bytes=4 * n, ms=med * 1e3, tb_s=4 * n / med / 1e12)


# ---- RMSNorm -------------------------------------------------------------------------------


def rms_inputs(n, d, seed):
    k = jax.random.split(jax.random.key(seed), 4)
    x = (3 * jax.random.normal(k[0], (n, d))).astype(jnp.bfloat16)
    w = (1 + 0.1 * jax.random.normal(k[1], (d,))).astype(jnp.bfloat16)
    dy = jax.random.normal(k[2], (n, d), jnp.bfloat16)
    r = jax.random.normal(k[3], (n, d), jnp.bfloat16)
    return x, w, dy, r


def rms_fwd_bwd(impl, cfg=None):
    def f(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: rms_norm(x, w, 1e-5, impl=impl, config=cfg), x, w)
        return y, vjp(dy)

    return f


def add_fwd_bwd(impl, cfg=None):
    def f(x, r, w, dy):
        out, vjp = jax.vjp(
            lambda x, r, w: add_rms_norm(x, r, w, 1e-5, impl=impl, config=cfg), x, r, w
        )
        return out, vjp((dy, dy))

    return f


def rms_time(n, d):
    """Timed on rms_time_stack stacked [n, d] problems: dispatch (~40 us) must not be timed."""
    n = n * ARGS.rms_time_stack
    x, w, dy, r = rms_inputs(n, d, seed=1)
    elem = n * d * 2  # bytes of one [n, d] bf16 tensor
    it = dict(iters=ARGS.iters_small, batch=20)

    def run(name, fn, args, nbytes, **extra):
        c, temp, _, _ = compile_(fn, args)
        med = timed(c, args, **it)
        log(
            section="rms_time",
            shape=[n, d],
            variant=name,
            us=med * 1e6,
            bytes=nbytes,
            tb_s=nbytes / med / 1e12,
            temp_mb=temp / 2**20,
            **extra,
        )
        return med

    fwd = lambda impl, cfg=None: lambda x, w: rms_norm(x, w, 1e-5, impl=impl, config=cfg)  # noqa: E731
    run("xla fwd", fwd("xla"), (x, w), 2 * elem)
    run("xla fwd+bwd", rms_fwd_bwd("xla"), (x, w, dy), 5 * elem)
    run("xla add fwd+bwd", add_fwd_bwd("xla"), (x, r, w, dy), 8 * elem)
    best = (float("inf"), None)
    for br in ARGS.rms_block_rows:
        for nw in (4, 8):
            cfg = RmsNormConfig(block_rows=br, num_warps=nw)
            t = run("pallas fwd+bwd", rms_fwd_bwd("pallas", cfg), (x, w, dy), 5 * elem,
                    block_rows=br, num_warps=nw)  # fmt: skip
            best = min(best, (t, cfg), key=lambda p: p[0])
    cfg = best[1]
    tag = dict(block_rows=cfg.block_rows, num_warps=cfg.num_warps)
    run("pallas fwd", fwd("pallas", cfg), (x, w), 2 * elem, **tag)
    run("pallas add fwd+bwd", add_fwd_bwd("pallas", cfg), (x, r, w, dy), 8 * elem, **tag)
    run("pallas fwd+bwd default", rms_fwd_bwd("pallas"), (x, w, dy), 5 * elem)


# ---- LM head -------------------------------------------------------------------------------


def lm_inputs(n, d, v, seed):
    k = jax.random.split(jax.random.key(seed), 5)
    h = jax.random.normal(k[0], (n, d), jnp.bfloat16)
    w = (jax.random.normal(k[1], (d, v)) * (2.0 / np.sqrt(d))).astype(jnp.bfloat16)
    t = jax.random.randint(k[2], (n,), 0, v)
    m = jax.random.uniform(k[3], (n,)) < 0.9
    t = jnp.where(m, t, jax.random.randint(k[4], (n,), -(2**30), 2**30))  # garbage when masked
    return h, w, t, m


def lm_grad(impl, chunks=1, cfg=None, z_loss=1e-4):
    def f(h, w, t, m):
        def loss(h, w):
            return lm_head_loss(h, w, t, m, z_loss=z_loss, impl=impl, chunks=chunks,
                                pallas_config=cfg)  # fmt: skip

        (obj, aux), (dh, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(h, w)
        return obj, aux, dh, dw

    return f


def lm_fwd(impl, chunks=1, cfg=None, z_loss=1e-4):
    return lambda h, w, t, m: lm_head_loss(
        h, w, t, m, z_loss=z_loss, impl=impl, chunks=chunks, pallas_config=cfg
    )


def lm_sweep(d, v):
    """Time the fused kernel alone (with q, one chunk) per tile config; return the fastest."""
    n = ARGS.lm_sweep_tokens
    h, w, t, _ = lm_inputs(n, d, v, seed=2)
    r = jnp.zeros((n,), jnp.float32)  # q's reference: any value times the same
    best = (float("inf"), None)
    for bm, bv, bk, nw, ns in ARGS.lm_configs:
        cfg = LmHeadPallasConfig(
            block_m=bm, block_v=bv, block_k=bk, num_warps=nw, num_stages=ns, group_m=4096 // bm
        )
        kcfg = dataclasses.replace(cfg, interpret=jax.default_backend() == "cpu")
        try:
            c, *_ = compile_(lambda h, w, t, r, c=kcfg: lm_head_tiles(h, w, t, c, r), (h, w, t, r))
            med = timed(c, (h, w, t, r), iters=ARGS.iters_big, batch=3)
        except Exception as e:
            log(section="lm_sweep", config=[bm, bv, bk, nw, ns], error=str(e)[:800])
            continue
        tflops = 2 * n * d * v / med / 1e12
        log(section="lm_sweep", shape=[n, d, v], config=[bm, bv, bk, nw, ns], ms=med * 1e3,
            tflop_s=tflops)  # fmt: skip
        best = min(best, (med, cfg), key=lambda p: p[0])
    return best[1]


def lm_mosaic_sweep(d, v):
    """Time the Mosaic GPU kernel alone (with q, one chunk) per tile config; return the fastest."""
    n = ARGS.lm_sweep_tokens
    h, w, _, _ = lm_inputs(n, d, v, seed=2)
    r = jnp.zeros((n,), jnp.float32)  # q's reference: any value times the same
    cpu = jax.default_backend() == "cpu"
    best = (float("inf"), None)
    for tm, tn, tk, stages, cm, sem in ARGS.lmm_configs:
        tiles = lm_head_mgpu.MosaicTiles(
            tile_m=tm, tile_n=tn, tile_k=tk, stages=stages, cluster_m=cm, semantics=sem
        )
        try:
            c, *_ = compile_(
                lambda h, w, r, t=tiles: lm_head_mgpu.lm_head_tiles(h, w, t, r, cpu), (h, w, r)
            )
            med = timed(c, (h, w, r), iters=ARGS.iters_big, batch=3)
        except Exception as e:
            log(section="lmm_sweep", config=[tm, tn, tk, stages, cm, sem], error=str(e)[:800])
            continue
        tflops = 2 * n * d * v / med / 1e12
        log(section="lmm_sweep", shape=[n, d, v], config=[tm, tn, tk, stages, cm, sem], ms=med * 1e3,
            tflop_s=tflops)  # fmt: skip
        best = min(best, (med, tiles), key=lambda p: p[0])
    return best[1]


def lm_time(n, d, v, cfg, mosaic=None):
    h, w, t, m = lm_inputs(n, d, v, seed=3)
    flops = 3 * 2 * n * d * v  # model FLOPs of forward + backward

    def run(name, fn, kind):
        c, temp, out, comp_s = compile_(fn, (h, w, t, m))
        med = timed(c, (h, w, t, m), iters=ARGS.iters_big, batch=2)
        log(
            section="lm_time",
            shape=[n, d, v],
            variant=name,
            kind=kind,
            ms=med * 1e3,
            tflop_s=(flops if kind == "fwd+bwd" else flops / 3) / med / 1e12,
            temp_gb=temp / 2**30,
            out_gb=out / 2**30,
            compile_s=comp_s,
        )

    variants = [
        ("xla reference", "xla", 1, None),
        ("xla chunks=4", "xla", 4, None),
        ("xla chunks=8", "xla", 8, None),
        ("pallas", "pallas", 1, cfg),
        ("pallas chunk=4k", "pallas", 1, dataclasses.replace(cfg, chunk_tokens=4096)),
    ]
    if mosaic is not None:
        on_mosaic = dataclasses.replace(cfg, lowering="mosaic", mosaic=mosaic)
        variants.append(("pallas mosaic", "pallas", 1, on_mosaic))
    for name, impl, chunks, c in variants:
        run(name, lm_grad(impl, chunks, c), "fwd+bwd")
    for name, impl, chunks, c in [variants[0], variants[2], variants[3], *variants[5:]]:
        run(name, lm_fwd(impl, chunks, c), "fwd")


# ---- fp8 quantize into both layouts ----------------------------------------------------------


def fp8_time(n, d):
    """x [n, d] bf16 -> fp8 q and q^T, XLA's two passes against the Pallas pass's tiles."""
    x = (4 * jax.random.normal(jax.random.key(3), (n, d))).astype(jnp.bfloat16)
    scale, dtype = jnp.float32(2.0**-6), jnp.float8_e4m3fn
    nbytes = 4 * n * d  # read bf16 once, write two fp8 copies
    ref, *_ = compile_(lambda x, s: quantize_both_reference(x, dtype, s), (x, scale))

    def run(name, fn, **extra):
        med = timed(fn, (x, scale), iters=ARGS.iters_small, batch=20)
        log(section="fp8_time", shape=[n, d], variant=name, us=med * 1e6,
            tb_s=nbytes / med / 1e12, **extra)  # fmt: skip

    run("xla", ref)
    for bm, bn, nw in ARGS.fp8_configs:
        cfg = Fp8QuantizeConfig(block_rows=bm, block_cols=bn, num_warps=nw,
                                interpret=_smoke.value)  # fmt: skip
        c, *_ = compile_(lambda x, s, cfg=cfg: quantize_both_pallas(x, dtype, s, cfg), (x, scale))
        run("pallas", c, config=[bm, bn, nw])


# ---- main ----------------------------------------------------------------------------------


def table() -> str:
    lines = ["", "=== kernels summary ==="]
    for r in ROWS:
        if r.get("section") == "copy":
            lines.append(f"copy: {r['tb_s']:.2f} TB/s ({r['bytes'] / 2**30:.1f} GiB moved)")
    lines.append(f"{'rmsnorm [N, D]':<16}{'variant':<28}{'us':>9}{'TB/s':>7}")
    for r in ROWS:
        if r.get("section") == "rms_time":
            cfgs = f" br={r['block_rows']} nw={r['num_warps']}" if "block_rows" in r else ""
            name = r["variant"] + cfgs
            lines.append(f"{str(r['shape']):<16}{name:<28}{r['us']:>9.1f}{r['tb_s']:>7.2f}")
    lines.append(f"{'fp8 quantize [N, D]':<20}{'variant':<22}{'us':>9}{'TB/s':>7}")
    for r in ROWS:
        if r.get("section") == "fp8_time":
            name = r["variant"] + (f" {r['config']}" if "config" in r else "")
            lines.append(f"{str(r['shape']):<20}{name:<22}{r['us']:>9.1f}{r['tb_s']:>7.2f}")
    lines.append(f"{'lm sweep (mosaic: lmm)':<24}{'config':<40}{'ms':>8}{'TF/s':>7}")
    for r in ROWS:
        if r.get("section") in ("lm_sweep", "lmm_sweep") and "ms" in r:
            tag = "lmm " if r["section"] == "lmm_sweep" else ""
            lines.append(f"{tag + str(r['shape']):<24}{str(r['config']):<40}{r['ms']:>8.2f}"
                         f"{r['tflop_s']:>7.0f}")  # fmt: skip
    lines.append(f"{'lm head [N, D, V]':<24}{'variant':<16}{'kind':<9}{'ms':>8}{'TF/s':>7}"
                 f"{'temp GiB':>10}")  # fmt: skip
    for r in ROWS:
        if r.get("section") == "lm_time":
            lines.append(f"{str(r['shape']):<24}{r['variant']:<16}{r['kind']:<9}{r['ms']:>8.2f}"
                         f"{r['tflop_s']:>7.0f}{r['temp_gb']:>10.2f}")  # fmt: skip
    for r in ROWS:
        if "error" in r:
            lines.append(f"! {r['section']} {r['config']} did not compile: {r['error'][:300]}")
    lines.append(f"total {time.time() - T_START:.0f} s")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    global ARGS
    ARGS = shapes(_smoke.value)
    dev = jax.devices()[0]
    log(section="env", jax=jax.__version__, device=dev.device_kind, platform=dev.platform,
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"))  # fmt: skip
    want = _sections.value
    if "copy" in want:
        copy_bandwidth()
    for n, d in ARGS.fp8_shapes if "fp8" in want else ():
        fp8_time(n, d)
    for n, d, v in ARGS.lm_shapes if "lm" in want else ():
        cfg = lm_sweep(d, v) or ARGS.lm_default
        log(section="lm_chosen", shape=[n, d, v], config=dataclasses.asdict(cfg))
        lm_time(n, d, v, cfg, mosaic=lm_mosaic_sweep(d, v))
    for n, d in ARGS.rms_shapes if "rms" in want else ():
        rms_time(n, d)
    print(table(), flush=True)
    if _out.value:
        os.makedirs(_out.value, exist_ok=True)
        with open(os.path.join(_out.value, "kernels.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in ROWS)
        with open(os.path.join(_out.value, "kernels_table.txt"), "w") as f:
            f.write(table() + "\n")


def shapes(smoke: bool) -> types.SimpleNamespace:
    """The shapes, tile configurations and repetitions: the presets' on a GPU, tiny with smoke."""
    a = types.SimpleNamespace()
    # fp8 quantize tiles: (rows, cols, warps)
    a.fp8_configs = [(64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8), (32, 128, 4)]
    if smoke:
        a.fp8_shapes = [(96, 64)]
        a.fp8_configs = [(32, 32, 4)]
        a.copy_elems = 1 << 16
        a.rms_shapes = [(40, 96)]
        a.rms_block_rows = [2]
        a.rms_time_stack = 2
        a.lm_shapes = [(64, 48, 300), (128, 64, 256)]  # ragged; aligned to the Mosaic tiles
        a.lm_sweep_tokens = 64
        a.lm_configs = [(16, 64, 16, 4, 2)]
        a.lmm_configs = [(64, 64, 64, 2, 1, "lane")]
        a.lm_default = LmHeadPallasConfig(block_m=16, block_v=64, block_k=16, chunk_tokens=32)
        a.iters_small = a.iters_big = 2
    else:
        a.fp8_shapes = [
            (16384, 3072),
            (16384, 8192),
            (16384, 16384),
        ]  # 3B: x, down's x, gate|up's g
        a.copy_elems = 1 << 30
        a.rms_shapes = [(16384, 2048), (16384, 896)]
        a.rms_block_rows = [1, 2, 4]
        a.rms_time_stack = 8
        a.lm_shapes = [(16384, 2048, 128256), (16384, 896, 151936)]
        a.lm_sweep_tokens = 4096
        # (block_m, block_v, block_k, num_warps, num_stages)
        a.lm_configs = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3)]
        # Mosaic GPU kernel: (tile_m, tile_n, tile_k, stages, CTAs per cluster, semantics); a
        # CTA covers 2 * tile_n vocab
        a.lmm_configs = [
            (128, 128, 64, 3, 1, "lane"),
            (128, 128, 64, 3, 2, "lane"),
            (128, 128, 64, 3, 1, "warpgroup"),
            (128, 128, 64, 3, 2, "warpgroup"),
            (64, 128, 64, 4, 2, "lane"),
        ]
        a.lm_default = LmHeadPallasConfig()
        a.iters_small, a.iters_big = 30, 7
    return a


if __name__ == "__main__":
    app.run(main, flags_parser=cli_flags.parse_argv)
