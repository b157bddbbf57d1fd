"""Check that the compiled train step runs the block linears as fp8 GEMMs (--matmul_dtype=e4m3).

    python benchmarks/fp8_check.py --model=llama-3.2-1b --matmul_dtype=e4m3 --batch_size=8 \
        --seq_len=2048 [--noscan_layers] [--gradient_dtype=e5m2] [--fp8_scaling=delayed] \
        [--hlo_dir=DIR]

Takes the trainer's flags and builds the state and step through train.build, as a run and
jaxllmq.bench do. Then:

1. The lowered program (StableHLO, any backend): dot_generals on float8 operands, 21 per layer
   body (7 linears x forward, dgrad, wgrad; a scanned body appears once, unrolled layers L times).
2. On GPU, the optimized HLO: every GEMM (cuBLASLt fp8 custom call `__cublas$lt$matmul$f8`,
   cuBLAS/cuBLASLt bf16 calls, dots left in Triton or cuDNN fusions, fp8 or not) with its FLOPs.
   The fp8 cuBLASLt calls must carry all the block linears' FLOPs (6 x tokens x block-linear
   parameters per layer body). FLOPs, not call counts: XLA may merge dots that share an operand
   (q/k/v, gate/up) into one GEMM. --allow_triton also accepts fp8 GEMMs XLA gave to Triton.
3. Also on GPU, for information: the fusions that write fp8 tensors (the quantize passes), and
   how many of them write something else too (the quantize fused with the op producing the
   tensor, or with its abs-max): what --fp8_scaling=delayed is meant to change.

Prints a summary; exits 1 when the GPU check fails. On CPU there is no cuBLAS (XLA upcasts fp8
dots there): it runs step 1, says so, and exits 0.
"""

import collections
import json
import math
import os
import re
import sys

import jax
from absl import app, flags

from jaxllmq.cli import bench as bench_cli
from jaxllmq.cli import flags as cli_flags
from jaxllmq.model.architecture import ModelConfig

_hlo_dir = flags.DEFINE_string("hlo_dir", None, "Write the lowered and optimized HLO text here.")
_allow_triton = flags.DEFINE_bool(
    "allow_triton", False, "Count fp8 GEMMs in Triton/cuDNN fusions as fp8 too."
)

CUBLAS_F8 = "__cublas$lt$matmul$f8"
CUBLAS = ("__cublas$gemm", "__cublas$lt$matmul", CUBLAS_F8)
_ARRAY = re.compile(r"\b(\w+)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def _type_and_rest(rest: str) -> tuple[str, str]:
    """Split 'TYPE opcode(...)...' where TYPE may be a parenthesized tuple."""
    if not rest.startswith("("):
        head, _, tail = rest.partition(" ")
        return head, tail
    depth = 0
    for i, c in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth == 0:
            return rest[: i + 1], rest[i + 1 :].lstrip()
    return rest, ""


def _array(type_str: str) -> tuple[str, tuple[int, ...]]:
    m = _ARRAY.search(type_str)
    if m is None:
        return "", ()
    return m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)


def hlo_gemms(text: str) -> list[dict]:
    """Every GEMM in optimized HLO text: kind, fp8 or not, output shape, FLOPs."""
    shapes, instrs = {}, []
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m is None:
            continue
        type_str, rest = _type_and_rest(m.group(2))
        op = re.match(r"([\w\-]+)\((.*?)\)(.*)$", rest)
        if op is None:
            continue
        shapes[m.group(1)] = _array(type_str)
        operands = re.findall(r"%([\w.\-]+)", op.group(2))
        instrs.append((type_str, op.group(1), operands, op.group(3)))
    gemms = []
    for type_str, opcode, operands, attrs in instrs:
        target = re.search(r'custom_call_target="([^"]+)"', attrs)
        if opcode == "custom-call" and target and target.group(1) in CUBLAS:
            dims = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', attrs)
            contract = [int(d) for d in re.findall(r"\d+", dims.group(1))] if dims else []
            kind, fp8 = target.group(1), target.group(1) == CUBLAS_F8
        elif opcode == "dot":
            dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
            contract = [int(d) for d in dims.group(1).split(",") if d] if dims else []
            types = [shapes.get(o, ("", ()))[0] for o in operands[:2]]
            kind, fp8 = "dot in a fusion", any(t.startswith("f8") for t in types)
        else:
            continue
        lhs = shapes.get(operands[0], ("", ()))[1] if operands else ()
        k = math.prod(lhs[d] for d in contract if d < len(lhs))
        dtype, out = _array(type_str)
        flops = 2 * math.prod(out) * k
        gemms.append({"kind": kind, "fp8": fp8, "out": f"{dtype}{list(out)}", "flops": flops})
    return gemms


def quantize_fusions(text: str) -> dict:
    """Fusions in optimized HLO text that write fp8 arrays: count, elements, multi-output ones."""
    out = {"fusions": 0, "fp8_elements": 0, "multi_output": 0}
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m is None:
            continue
        type_str, rest = _type_and_rest(m.group(2))
        if not rest.startswith("fusion(") or "f8" not in type_str:
            continue
        arrays = _ARRAY.findall(type_str)
        out["fusions"] += 1
        out["fp8_elements"] += sum(
            math.prod(int(d) for d in dims.split(",") if d)
            for t, dims in arrays
            if t.startswith("f8")
        )
        out["multi_output"] += any(not t.startswith("f8") for t, _ in arrays)
    return out


def block_linear_flops(cfg: ModelConfig, tokens: int, tensor_parallel: int) -> float:
    """Forward + dgrad + wgrad FLOPs of one layer's 7 linears over `tokens` rows, per device."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    NH = cfg.num_attention_heads * cfg.dim_per_head
    KH = cfg.num_key_value_heads * cfg.dim_per_head
    params = 2 * D * NH + 2 * D * KH + 3 * D * F
    return 6 * tokens * params / tensor_parallel


def main(argv: list[str]) -> None:
    F = flags.FLAGS
    if F.matmul_dtype != "e4m3":
        sys.exit("error: give --matmul_dtype=e4m3 (this checks the fp8 path)")
    built, batch, mesh, model_cfg, spec = bench_cli.build_from_flags(
        argv
    )  # the trainer's XLA flags
    lowered = built.train_step.lower(built.state, batch)
    stablehlo = lowered.as_text()
    bodies = 1 if spec.scan_layers else model_cfg.num_hidden_layers
    dots = [ln for ln in stablehlo.splitlines() if "stablehlo.dot_general" in ln]
    fp8_dots = [ln for ln in dots if "f8E4M3FN" in ln or "f8E5M2" in ln]
    layout = "scanned" if spec.scan_layers else "unrolled"
    grads = spec.gradient_dtype or spec.linear_dtype
    print(f"{spec.model}: {model_cfg.num_hidden_layers} layers {layout}, {bodies} layer bodies")
    print(f"  in the program; block linears {spec.linear_dtype}, their gradients {grads},")
    print(f"  {spec.fp8_scaling} scaling")
    print(f"lowered program: {len(fp8_dots)} fp8 dot_generals of {len(dots)} (expected >=")
    print(f"  {21 * bodies}: 7 linears x fwd/dgrad/wgrad x {bodies} bodies)")
    ok_lowered = len(fp8_dots) >= 21 * bodies
    if _hlo_dir.value:
        os.makedirs(_hlo_dir.value, exist_ok=True)
        with open(os.path.join(_hlo_dir.value, "lowered.stablehlo.txt"), "w") as f:
            f.write(stablehlo)
    if jax.default_backend() != "gpu":
        print(f"backend {jax.default_backend()}: no cuBLAS here (XLA upcasts fp8 dots off GPU);")
        print("  the optimized-HLO check needs a GPU; not run.")
        if not ok_lowered:
            print("WARNING: the lowered program has fewer fp8 dot_generals than expected")
        return
    text = lowered.compile().as_text()
    if _hlo_dir.value:
        with open(os.path.join(_hlo_dir.value, "optimized.hlo.txt"), "w") as f:
            f.write(text)
    gemms = hlo_gemms(text)
    by_kind = collections.defaultdict(lambda: [0, 0.0])
    for g in gemms:
        key = f"{g['kind']} ({'fp8' if g['fp8'] else 'not fp8'})"
        by_kind[key][0] += 1
        by_kind[key][1] += g["flops"]
    print(f"optimized HLO ({jax.devices()[0].device_kind}, jax {jax.__version__}): GEMMs per step")
    for key, (n, flops) in sorted(by_kind.items()):
        print(f"  {n:5d}  {flops / 1e12:9.3f} TFLOP (text)  {key}")
    expected = bodies * block_linear_flops(model_cfg, F.batch_size * F.seq_len, F.tensor_parallel)
    fp8_cublas = sum(g["flops"] for g in gemms if g["kind"] == CUBLAS_F8)
    fp8_any = sum(g["flops"] for g in gemms if g["fp8"])
    counted = fp8_any if _allow_triton.value else fp8_cublas
    print(f"block linears: {expected / 1e12:.3f} TFLOP expected in fp8; cuBLASLt fp8 carries")
    print(f"  {fp8_cublas / 1e12:.3f}, all fp8 GEMMs {fp8_any / 1e12:.3f}")
    rest = sorted((g for g in gemms if not g["fp8"]), key=lambda g: -g["flops"])
    print("largest non-fp8 GEMMs (the LM head belongs here):")
    for g in rest[:8]:
        print(f"  {g['kind']:24s} {g['out']:28s} {g['flops'] / 1e9:10.1f} GFLOP")
    quant = quantize_fusions(text)
    print(f"fusions writing fp8 (quantize passes): {quant['fusions']}, {quant['fp8_elements']:,}")
    print(f"  fp8 elements; {quant['multi_output']} of them also write other outputs")
    ok = ok_lowered and counted >= 0.99 * expected
    summary = {"ok": ok, "fp8_scaling": spec.fp8_scaling, "fp8_dot_generals": len(fp8_dots)}
    summary |= {"expected_tflop": expected / 1e12, "quantize_fusions": quant}
    summary |= {"cublaslt_fp8_tflop": fp8_cublas / 1e12, "fp8_tflop": fp8_any / 1e12}
    print(json.dumps(summary))
    if not ok:
        where = "fp8 GEMMs" if _allow_triton.value else "cuBLASLt fp8 GEMMs"
        sys.exit(f"FAIL: the block linears are not all {where}")
    print("OK: every block linear runs as an fp8 GEMM")


if __name__ == "__main__":
    bench_cli.define_flags()
    app.run(main, flags_parser=cli_flags.parse_argv)
