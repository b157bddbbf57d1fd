"""Check and time the kernels on a GPU: Pallas vs XLA, RMSNorm, the LM-head loss, fp8 quantize.

    export PYTHONPATH=$PWD; PYTHONUNBUFFERED=1 python3 benchmarks/kernels.py --out $OUT

Checks each kernel in bf16 against an fp32 computation of its reference (relative L2 error), then
times forward+backward (median of batches of back-to-back calls after warm-up) and reads the
compiled program's temporary memory. Prints a table last; --out gets the rows as JSON lines.
Runs on CPU too (tiny shapes, interpret mode) with --smoke, to check the script itself.
--sections picks some of copy, rms, lm, fp8 (default all).
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jaxllmq.kernels import lm_head_mgpu
from jaxllmq.kernels.fp8_quantize import (
    Fp8QuantizeConfig,
    quantize_both_pallas,
    quantize_both_reference,
)
from jaxllmq.kernels.lm_head_loss import lm_head_loss, lm_head_loss_reference
from jaxllmq.kernels.lm_head_pallas import LmHeadPallasConfig, lm_head_tiles
from jaxllmq.kernels.rms_norm import (
    RmsNormConfig,
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)

ROWS: list[dict] = []
T_START = time.time()


def log(**row) -> None:
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def rel(a, b) -> float:
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def timed(fn, args, *, iters: int, batch: int) -> tuple[float, float]:
    """Median and min seconds per call of a compiled fn over `iters` batches of async calls."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(batch):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / batch)
    return statistics.median(times), min(times)


def compile_(fn, args):
    t0 = time.perf_counter()
    c = jax.jit(fn).lower(*args).compile()
    mem = c.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", -1) if mem is not None else -1
    out = getattr(mem, "output_size_in_bytes", -1) if mem is not None else -1
    return c, temp, out, time.perf_counter() - t0


def section(name, fn, *a, **k):
    if time.time() - T_START > ARGS.budget_s:
        log(section=name, skipped="time budget")
        return
    try:
        fn(*a, **k)
    except Exception as e:  # keep going: one broken variant must not cost the whole run
        log(section=name, error=f"{type(e).__name__}: {str(e)[:1500]}")
        traceback.print_exc(limit=4)


# ---- bandwidth ceiling ---------------------------------------------------------------------


def copy_bandwidth():
    n = ARGS.copy_elems
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    c, *_ = compile_(lambda x: x * 2, (x,))
    med, best = timed(c, (x,), iters=10, batch=5)
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


def rms_check(n, d):
    x, w, dy, r = rms_inputs(n, d, seed=n + d)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    y0, vjp0 = jax.vjp(lambda x, w: rms_norm_reference(x, w, 1e-5), f32(x), f32(w))
    dx0, dw0 = vjp0(f32(dy))
    y1, (dx1, dw1) = jax.jit(rms_fwd_bwd("pallas"))(x, w, dy)
    (a0, s0), vjpa = jax.vjp(
        lambda x, r, w: add_rms_norm_reference(x, r, w, 1e-5), f32(x), f32(r), f32(w)
    )
    ga0 = vjpa((f32(dy), f32(dy)))
    (a1, s1), ga1 = jax.jit(add_fwd_bwd("pallas"))(x, r, w, dy)
    yx, (dxx, dwx) = jax.jit(rms_fwd_bwd("xla"))(x, w, dy)
    log(
        section="rms_check",
        shape=[n, d],
        pallas_vs_fp32={"y": rel(y1, y0), "dx": rel(dx1, dx0), "dw": rel(dw1, dw0)},
        xla_bf16_vs_fp32={"y": rel(yx, y0), "dx": rel(dxx, dx0), "dw": rel(dwx, dw0)},
        add_pallas_vs_fp32={
            "y": rel(a1, a0),
            "sum": rel(s1, s0),
            "dx": rel(ga1[0], ga0[0]),
            "dw": rel(ga1[2], ga0[2]),
        },
    )


def rms_time(n, d):
    """Timed on rms_time_stack stacked [n, d] problems: dispatch (~40 us) must not be timed."""
    n = n * ARGS.rms_time_stack
    x, w, dy, r = rms_inputs(n, d, seed=1)
    elem = n * d * 2  # bytes of one [n, d] bf16 tensor
    it = dict(iters=ARGS.iters_small, batch=20)

    def run(name, fn, args, nbytes, **extra):
        c, temp, _, _ = compile_(fn, args)
        med, best = timed(c, args, **it)
        log(
            section="rms_time",
            shape=[n, d],
            variant=name,
            us=med * 1e6,
            best_us=best * 1e6,
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


def lm_check(n, d, v, cfg):
    h, w, t, m = lm_inputs(n, d, v, seed=d + v)

    def ref32(h, w):
        with jax.default_matmul_precision("highest"):
            return lm_head_loss_reference(h, w, t, m, z_loss=1e-4)

    (o0, _), (dh0, dw0) = jax.jit(jax.value_and_grad(ref32, argnums=(0, 1), has_aux=True))(
        h.astype(jnp.float32), w.astype(jnp.float32)
    )
    for name, fn in [
        ("xla", lm_grad("xla")),
        ("xla chunks=4", lm_grad("xla", chunks=4)),
        ("pallas", lm_grad("pallas", cfg=cfg)),
        ("pallas mosaic", lm_grad("pallas", cfg=dataclasses.replace(cfg, lowering="mosaic"))),
    ]:
        o1, _, dh1, dw1 = jax.jit(fn)(h, w, t, m)
        log(
            section="lm_check",
            shape=[n, d, v],
            variant=name,
            vs_fp32={"obj": rel(o1, o0), "dh": rel(dh1, dh0), "dw": rel(dw1, dw0)},
        )


def lm_sweep(d, v):
    """Time the fused kernel alone (with q, one chunk) per tile config; return the fastest."""
    n = ARGS.lm_sweep_tokens
    h, w, t, _ = lm_inputs(n, d, v, seed=2)
    best = (float("inf"), None)
    for bm, bv, bk, nw, ns in ARGS.lm_configs:
        cfg = LmHeadPallasConfig(
            block_m=bm, block_v=bv, block_k=bk, num_warps=nw, num_stages=ns, group_m=4096 // bm
        )
        kcfg = dataclasses.replace(cfg, interpret=jax.default_backend() == "cpu")
        try:
            c, *_ = compile_(lambda h, w, t, c=kcfg: lm_head_tiles(h, w, t, c, True), (h, w, t))
            med, _ = timed(c, (h, w, t), iters=ARGS.iters_big, batch=3)
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
    cpu = jax.default_backend() == "cpu"
    best = (float("inf"), None)
    for tm, tn, tk, stages, cm, sem in ARGS.lmm_configs:
        tiles = lm_head_mgpu.MosaicTiles(
            tile_m=tm, tile_n=tn, tile_k=tk, stages=stages, cluster_m=cm, semantics=sem
        )
        try:
            c, *_ = compile_(
                lambda h, w, t=tiles: lm_head_mgpu.lm_head_tiles(h, w, t, True, cpu), (h, w)
            )
            med, _ = timed(c, (h, w), iters=ARGS.iters_big, batch=3)
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
        med, best = timed(c, (h, w, t, m), iters=ARGS.iters_big, batch=1)
        log(
            section="lm_time",
            shape=[n, d, v],
            variant=name,
            kind=kind,
            ms=med * 1e3,
            best_ms=best * 1e3,
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
        section(f"lm_time {name}", run, name, lm_grad(impl, chunks, c), "fwd+bwd")
    for name, impl, chunks, c in [variants[0], variants[2], variants[3], *variants[5:]]:
        section(f"lm_time {name} fwd", run, name, lm_fwd(impl, chunks, c), "fwd")


# ---- fp8 quantize into both layouts ----------------------------------------------------------


def fp8_time(n, d):
    """x [n, d] bf16 -> fp8 q and q^T: the bytes must equal the reference's; then timed."""
    x = (4 * jax.random.normal(jax.random.key(3), (n, d))).astype(jnp.bfloat16)
    scale, dtype = jnp.float32(2.0**-6), jnp.float8_e4m3fn
    nbytes = 4 * n * d  # read bf16 once, write two fp8 copies
    ref, *_ = compile_(lambda x, s: quantize_both_reference(x, dtype, s), (x, scale))
    want = [np.asarray(a).view(np.uint8) for a in ref(x, scale)]

    def run(name, fn, **extra):
        got = [np.asarray(a).view(np.uint8) for a in fn(x, scale)]
        same = all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
        med, best = timed(fn, (x, scale), iters=ARGS.iters_small, batch=20)
        log(section="fp8_time", shape=[n, d], variant=name, same_bytes=same, us=med * 1e6,
            tb_s=nbytes / med / 1e12, **extra)  # fmt: skip

    run("xla", ref)
    for bm, bn, nw in ARGS.fp8_configs:
        cfg = Fp8QuantizeConfig(block_rows=bm, block_cols=bn, num_warps=nw,
                                interpret=ARGS.smoke)  # fmt: skip
        c, *_ = compile_(lambda x, s, cfg=cfg: quantize_both_pallas(x, dtype, s, cfg), (x, scale))
        run("pallas", c, config=[bm, bn, nw])


# ---- main ----------------------------------------------------------------------------------


def table() -> str:
    lines = ["", "=== kernels summary ==="]
    for r in ROWS:
        if r.get("section") == "copy":
            lines.append(f"copy: {r['tb_s']:.2f} TB/s ({r['bytes'] / 2**30:.1f} GiB moved)")
        if r.get("section") in ("rms_check", "lm_check"):
            lines.append(f"{r['section']} {r['shape']} {r.get('variant', '')}: " + json.dumps(
                {k: v for k, v in r.items() if isinstance(v, dict)}))  # fmt: skip
    lines.append(f"{'rmsnorm [N, D]':<16}{'variant':<28}{'us':>9}{'TB/s':>7}")
    for r in ROWS:
        if r.get("section") == "rms_time":
            cfgs = f" br={r['block_rows']} nw={r['num_warps']}" if "block_rows" in r else ""
            name = r["variant"] + cfgs
            lines.append(f"{str(r['shape']):<16}{name:<28}{r['us']:>9.1f}{r['tb_s']:>7.2f}")
    lines.append(f"{'fp8 quantize [N, D]':<20}{'variant':<22}{'same':>5}{'us':>9}{'TB/s':>7}")
    for r in ROWS:
        if r.get("section") == "fp8_time":
            name = r["variant"] + (f" {r['config']}" if "config" in r else "")
            lines.append(f"{str(r['shape']):<20}{name:<22}{r['same_bytes']!s:>5}{r['us']:>9.1f}"
                         f"{r['tb_s']:>7.2f}")  # fmt: skip
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
        if "error" in r or "skipped" in r:
            lines.append(f"! {r.get('section')}: {r.get('error', r.get('skipped'))[:300]}")
    lines.append(f"total {time.time() - T_START:.0f} s")
    return "\n".join(lines)


def main() -> None:
    dev = jax.devices()[0]
    log(section="env", jax=jax.__version__, device=dev.device_kind, platform=dev.platform,
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"))  # fmt: skip
    want = ARGS.sections.split(",")
    if "copy" in want:
        section("copy", copy_bandwidth)
    if "fp8" in want:
        for n, d in ARGS.fp8_shapes:
            section(f"fp8_time {d}", fp8_time, n, d)
    for n, d in ARGS.rms_shapes if "rms" in want else ():
        section(f"rms_check {d}", rms_check, n, d)
    for _, d, v in ARGS.lm_shapes if "lm" in want else ():
        section(f"lm_check {d}x{v}", lm_check, ARGS.lm_check_tokens, d, v, ARGS.lm_default)
    for n, d, v in ARGS.lm_shapes if "lm" in want else ():
        chosen = []
        section(f"lm_sweep {d}x{v}", lambda d=d, v=v, out=chosen: out.append(lm_sweep(d, v)))
        cfg = (chosen and chosen[0]) or ARGS.lm_default
        log(section="lm_chosen", shape=[n, d, v], config=dataclasses.asdict(cfg))
        tiles = []
        section(f"lmm_sweep {d}x{v}", lambda d=d, v=v, out=tiles: out.append(lm_mosaic_sweep(d, v)))
        lm_time(n, d, v, cfg, mosaic=tiles[0] if tiles else None)
    for n, d in ARGS.rms_shapes if "rms" in want else ():
        section(f"rms_time {d}", rms_time, n, d)
    print(table(), flush=True)
    if ARGS.out:
        os.makedirs(ARGS.out, exist_ok=True)
        with open(os.path.join(ARGS.out, "kernels.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in ROWS)
        with open(os.path.join(ARGS.out, "kernels_table.txt"), "w") as f:
            f.write(table() + "\n")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, for CPU")
    p.add_argument("--budget_s", type=float, default=330.0)
    p.add_argument("--sections", default="copy,rms,lm,fp8")
    a = p.parse_args()
    # fp8 quantize tiles: (rows, cols, warps)
    a.fp8_configs = [(64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8), (32, 128, 4)]
    if a.smoke:
        a.fp8_shapes = [(96, 64)]
        a.fp8_configs = [(32, 32, 4)]
        a.copy_elems = 1 << 16
        a.rms_shapes = [(40, 96)]
        a.rms_block_rows = [2]
        a.rms_time_stack = 2
        a.lm_shapes = [(64, 48, 300), (128, 64, 256)]  # ragged; aligned to the Mosaic tiles
        a.lm_check_tokens, a.lm_sweep_tokens = 64, 64
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
        a.lm_check_tokens, a.lm_sweep_tokens = 2048, 4096
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
    ARGS = parse()
    sys.exit(main())
