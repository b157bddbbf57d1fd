"""Where a step's device time goes: GPU kernel time from a jax.profiler trace, by category.

    with trace_steps(tmpdir): run a few steps
    breakdown(tmpdir, steps) -> {"categories": {...ms/step}, "kernels": [(name, ms/step, count)]}
    op_table(tmpdir, hlo_text, kind="gemm") -> [{"shape", "kernel", "ms", "ops", "tflops"}]
        (one kernel category's ops by shape; TFLOP/s for GEMMs)

Reads the XSpace file jax.profiler writes (jax.profiler.ProfileData, no TensorBoard needed) and
sums the kernels on each GPU stream line. Categories are told apart by kernel name; the mapping is
heuristic, so the top kernels are printed with it to check it by eye.
"""

import collections
import contextlib
import glob
import json
import math
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.profiler import ProfileData

# First match wins; matched against the lower-cased kernel name.
CATEGORIES = (
    ("nccl", ("nccl",)),
    ("attention", ("cudnn", "fmha", "flash", "sdpa", "attention")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul")),
    ("pallas", ("pallas", "triton", "mosaic", "_kernel")),
    ("copy", ("memcpy", "memset", "copy")),
    ("fusion", ("fusion", "reduce", "convert", "transpose", "broadcast", "concatenate")),
)


def category(kernel: str) -> str:
    """The category of a GPU kernel name ('other' when no pattern matches)."""
    low = kernel.lower()
    for name, patterns in CATEGORIES:
        if any(p in low for p in patterns):
            return name
    return "other"


@contextlib.contextmanager
def trace_steps(log_dir: str) -> Iterator[None]:
    """Trace what runs inside the block into log_dir (call block_until_ready before leaving)."""
    jax.profiler.start_trace(log_dir)
    try:
        yield
    finally:
        jax.profiler.stop_trace()


def _gpu_planes(profile: ProfileData) -> list:
    return [p for p in profile.planes if p.name.startswith("/device:GPU")]


def _kernels(plane) -> Iterator:
    """One GPU's kernel events: its stream lines ("XLA Ops"/"XLA Modules" lines repeat them as
    ops)."""
    for line in plane.lines:
        if line.name.startswith("Stream"):
            yield from line.events


def kernel_times(profile: ProfileData) -> dict[str, tuple[float, int]]:
    """Total ns and launch count per kernel name over every GPU stream of the trace."""
    out: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for plane in _gpu_planes(profile):
        for event in _kernels(plane):
            out[event.name][0] += event.duration_ns
            out[event.name][1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _uncovered(span: tuple[float, float], busy: list[tuple[float, float]]) -> float:
    """Length of `span` outside the sorted, disjoint intervals `busy`."""
    start, end = span
    covered = sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy if a < end and b > start)
    return end - start - covered


def timeline(profile: ProfileData) -> dict:
    """What the GPUs' timelines show beyond kernel sums, in ns averaged over the trace's GPUs:

    exposed: NCCL kernel time during which no other kernel runs on the same GPU (communication
      the schedule failed to hide behind compute), and the same by kernel name, with the HLO op
      that launched it in brackets where the trace records one (its `hlo_op` stat);
    idle: time between the first and last kernel with no kernel at all running on the GPU
      (launch gaps, streams waiting on each other), by the name of the kernel that ends the gap.
    """
    exposed, idle = 0.0, 0.0
    exposed_by, idle_by = collections.defaultdict(float), collections.defaultdict(float)
    gpus = _gpu_planes(profile)
    for plane in gpus:
        comm, compute = [], []
        for event in _kernels(plane):
            span = (event.start_ns, event.start_ns + event.duration_ns)
            if category(event.name) == "nccl":
                op = dict(event.stats).get("hlo_op")
                comm.append((span, f"{event.name} [{op}]" if op else event.name))
            else:
                compute.append((span, event.name))
        busy = _union([span for span, _ in compute])
        exposed += sum(_uncovered(span, busy) for span in _union([span for span, _ in comm]))
        for span, name in comm:
            exposed_by[name] += _uncovered(span, busy)
        end = None
        for (start, stop), name in sorted(comm + compute):
            if end is not None and start > end:
                idle += start - end
                idle_by[name] += start - end
            end = stop if end is None else max(end, stop)
    n = max(len(gpus), 1)
    top = lambda d: {k: v / n for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:5] if v > 0}
    return {
        "exposed_nccl": exposed / n,
        "exposed_nccl_by_kernel": top(exposed_by),
        "idle": idle / n,
        "idle_before_kernel": top(idle_by),
    }


def _newest_trace(log_dir: str) -> ProfileData:
    files = sorted(glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no *.xplane.pb trace under {log_dir}")
    return ProfileData.from_file(files[-1])


def breakdown(log_dir: str, steps: int, top: int = 15) -> dict:
    """Per-step ms by category and the `top` kernels, from the newest trace under log_dir."""
    trace = _newest_trace(log_dir)
    times = kernel_times(trace)
    lines = timeline(trace)
    per_step = lambda ns: ns / 1e6 / steps
    cats: dict[str, float] = collections.defaultdict(float)
    for name, (ns, _) in times.items():
        cats[category(name)] += per_step(ns)
    ranked = sorted(times.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
        "device_ms_per_step": sum(cats.values()),
        "exposed_nccl_ms_per_step": per_step(lines["exposed_nccl"]),
        "exposed_nccl_kernels": [
            (k, per_step(v)) for k, v in lines["exposed_nccl_by_kernel"].items()
        ],
        "idle_ms_per_step": per_step(lines["idle"]),
        "idle_before_kernels": [(k, per_step(v)) for k, v in lines["idle_before_kernel"].items()],
        "kernels": [(name, per_step(ns), count // steps) for name, (ns, count) in ranked],
    }


def breakdown_of(run: Callable[[], Any], steps: int, top: int = 15) -> dict:
    """breakdown of the `steps` steps that run() issues, traced into a temporary directory (run's
    result is waited on before the trace stops)."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with trace_steps(trace_dir):
            jax.block_until_ready(run())
        return breakdown(trace_dir, steps, top)


def format_breakdown(result: dict) -> str:
    """The breakdown as a short table for the console."""
    lines = [f"device kernel time {result['device_ms_per_step']:.1f} ms/step (all streams)"]
    lines += [f"  {cat:>10} {ms:8.2f} ms" for cat, ms in result["categories"].items()]
    lines.append(
        f"  NCCL with no other kernel running: {result['exposed_nccl_ms_per_step']:.2f} ms"
    )
    lines += [f"  {ms:8.2f}  exposed  {name[:90]}" for name, ms in result["exposed_nccl_kernels"]]
    lines.append(f"  no kernel running: {result['idle_ms_per_step']:.2f} ms, ended by:")
    lines += [f"  {ms:8.2f}  idle     {name[:90]}" for name, ms in result["idle_before_kernels"]]
    lines.append("  top kernels (ms/step, launches/step, category):")
    for name, ms, count in result["kernels"]:
        lines.append(f"  {ms:8.2f} {count:5d}  {category(name):>9}  {name[:90]}")
    return "\n".join(lines)


def _dims(hlo_type: str) -> list[int]:
    found = re.search(r"\[([0-9,]*)\]", hlo_type)
    return [int(d) for d in found.group(1).split(",") if d] if found else []


def op_table(
    log_dir: str, hlo_text: str, module: str | None = None, kind: str = "gemm"
) -> list[dict]:
    """Per step, the time of each op whose kernels fall in category `kind` ("gemm", "copy",
    "fusion", ...), from the newest trace under log_dir joined to the compiled module's text
    (`hlo_text`, e.g. from --xla_dump_to), grouped by shape and kernel, slowest first:
    {"shape", "kernel", "ms", "ops", "tflops"}. A GEMM's shape is "lhs x rhs -> out" and it has
    TFLOP/s; any other op shows its result type and opcode, tflops None.

    A kernel's `hlo_op` stat names its op only with XLA's command buffers off
    (--xla_gpu_enable_command_buffer=); otherwise it names the buffer and nothing joins. The
    trace may hold any number of steps: the fewest launches of any listed op is taken as the
    step count (an op in a loop launches more than once a step). `module` (e.g.
    "jit_train_step") keeps only kernels whose `hlo_module` stat names it: op names repeat
    across the modules of one trace."""
    types, bodies = {}, {}
    for m in re.finditer(r"^\s*(?:ROOT )?%(\S+) = (\([^)]*\)|\S+) (.*)$", hlo_text, re.M):
        types[m.group(1)], bodies[m.group(1)] = m.group(2), m.group(3)

    def operand(name: str) -> list[int]:  # "fusion.1#0": element 0 of a tuple
        base, _, index = name.strip().lstrip("%").partition("#")
        parts = re.findall(r"\w+\[[0-9,]*\]", types.get(base, ""))
        return _dims(parts[int(index or 0)]) if parts else []

    per_op: dict[str, list] = collections.defaultdict(lambda: [0.0, 0, ""])
    for plane in _gpu_planes(_newest_trace(log_dir)):
        for event in _kernels(plane):
            stats = dict(event.stats)
            op = stats.get("hlo_op")
            if module is not None and stats.get("hlo_module", module) != module:
                continue
            if category(event.name) == kind and op in bodies:
                row = per_op[op]
                row[0], row[1], row[2] = row[0] + event.duration_ns, row[1] + 1, event.name
    steps = min((launches for _, launches, _ in per_op.values()), default=1)
    groups: dict[tuple, list] = collections.defaultdict(lambda: [0.0, 0, 0.0])
    for op, (ns, launches, kernel) in per_op.items():
        body = bodies[op]
        args = re.search(r"custom-call\(([^)]*)\)", body)
        contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', body)
        flops = 0.0
        if args and contracting:
            lhs, rhs = (operand(a) for a in args.group(1).split(",")[:2])
            out = _dims(types[op])
            k = 1
            for d in json.loads(f"[{contracting.group(1)}]"):
                k *= lhs[int(d)] if int(d) < len(lhs) else 0
            shape = f"{lhs} x {rhs} -> {out}"
            flops = 2.0 * k * math.prod(out) * launches / steps
        else:
            shape = f"{types[op]} {body.split('(', 1)[0]}"
        row = groups[(shape, kernel)]
        row[0] += ns / steps / 1e6
        row[1] += 1
        row[2] += flops
    rows = [
        {
            "shape": shape,
            "kernel": kernel,
            "ms": ms,
            "ops": ops,
            "tflops": flops / ms / 1e9 if flops else None,
        }
        for (shape, kernel), (ms, ops, flops) in groups.items()
    ]
    return sorted(rows, key=lambda r: -r["ms"])


def format_op_table(rows: list[dict], kind: str = "gemm") -> str:
    ms = sum(r["ms"] for r in rows)
    tflop = sum((r["tflops"] or 0) * r["ms"] / 1e3 for r in rows)
    head = f"{kind}: {ms:.1f} ms per step over {sum(r['ops'] for r in rows)} ops"
    if tflop:
        head += f", {tflop:.1f} TFLOP at {tflop / ms * 1e3:.0f} TFLOP/s"
    lines = [head, f"{'ms':>8} {'ops':>4} {'TFLOP/s':>8}  shape, kernel"]
    for r in rows:
        tf = f"{r['tflops']:8.0f}" if r["tflops"] else f"{'-':>8}"
        lines.append(f"{r['ms']:8.2f} {r['ops']:4d} {tf}  {r['shape'][:70]}  {r['kernel'][:50]}")
    return "\n".join(lines)
