"""What ptxas made of a Mosaic GPU kernel: its register spills, whether they sit in the loops
that issue the matrix products (where they cost time) or outside them, and whether ptxas made
its matrix products wait for each other.

Mosaic GPU writes each kernel's PTX and ptxas's report into the folder that MOSAIC_GPU_DUMP_TO
names, when it compiles the kernel. `compiled_kernels` reads that folder. Where nvdisasm is on
PATH (CUDA's toolkit, or the nvidia-cuda-nvdisasm wheel), it compiles the PTX again with the
ptxas Mosaic GPU used (ptxas_path) and reads the machine code's loops. Neither needs a GPU.

Nor does the compile: with jax's CUDA plugin installed (`pip install
"jax-cuda13-plugin[with-cuda]==<jax's version>"`), `h200_compile_devices` gives compile-only
H200s, and a jit lowered for them compiles Mosaic GPU's kernels as on the GPU. With the GPU
machine's jax (0.11.2, which wants Python 3.12) the PTX is the GPU machine's, instruction for
instruction; an older jax's Mosaic GPU writes somewhat different code.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import tempfile

# ptxas's verbose report: an entry function's name, then its spills (a warning naming the
# function with its spills may come before the name, and is not taken for the function before).
PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+?)(?:_mosaic_gpu_kernel)?'")
PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
# ptxas's note that it made a kernel's wgmma wait for each other, whatever its code (seen so far:
# C7512, too few registers, "for the function"; C7513, an operand's registers written while a
# product is in flight; C7514, an accumulator's read, as with a product in flight across a loop's
# edge; those two "in the function"), which costs every product its overlap.
PTXAS_SERIALIZED = re.compile(
    r"\((C\d+)\) Potential Performance Loss: wgmma\.mma_async instructions are serialized"
    r".*(?:in|for) the function '(\w+?)(?:_mosaic_gpu_kernel)?'"
)
PTX_TARGET = re.compile(r"^\.target\s+(\w+)", re.MULTILINE)
# `ptxas --version`'s last line: "Cuda compilation tools, release 13.0, V13.0.88".
PTXAS_VERSION = re.compile(r"\bV(\d+\.\d+\.\d+)")
# nvdisasm's listing: `/*0a30*/  [@P0] OPCODE operands ;` and labels `.L_x_12:`.
SASS_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", re.MULTILINE)
SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):", re.MULTILINE)
SASS_BRANCH = re.compile(r"\bBRA\s+`?\(?(\.L_x_\d+)")
# An H200 as XLA's GPU compiler describes one (its TargetConfig): compute capability 9.0 for
# Mosaic GPU and ptxas (sm_90a); the rest XLA's own passes read (with only the limits and the
# compute capability given, the compile stopped on a floating point exception).
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  shared_memory_per_block_optin: 232448
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150000000000
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  cuda_compute_capability { major: 9 minor: 0 }
}
platform_name: "CUDA"
device_description_str: "NVIDIA H200"
"""


def ptxas_spills(report: str) -> dict[str, list[int]]:
    """{kernel: [bytes of spill stores, bytes of spill loads] a thread} from ptxas's report."""
    spills, kernel = {}, None
    for line in report.splitlines():
        if entry := PTXAS_ENTRY.search(line):
            kernel = entry.group(1)
        elif kernel and (counts := PTXAS_SPILLS.search(line)):
            spills[kernel] = [int(counts.group(1)), int(counts.group(2))]
            kernel = None
    return spills


def product_loops(sass: str) -> list[list[int]]:
    """[instructions, wgmma, local stores, local loads, named barriers] of each innermost loop
    of one kernel's machine code that issues wgmma (HGMMA), in code order. The named barriers
    (BAR) are those a warpgroup syncs on around its stores to shared memory and those the
    warpgroups take turns by; mbarrier waits (SYNCS) and memory fences are not among them. A
    loop is a backward branch's span; the branches after the last EXIT are the out-of-line
    retries of barrier waits, which jump back into the code and are no loops."""
    events = sorted(
        [(m.start(), "label", m.group(1)) for m in SASS_LABEL.finditer(sass)]
        + [(m.start(), "instruction", m.group(1)) for m in SASS_INSTRUCTION.finditer(sass)]
    )
    code, labels = [], {}
    for _, kind, text in events:
        if kind == "label":
            labels[text] = len(code)
        else:
            code.append(text)
    exits = [i for i, text in enumerate(code) if re.search(r"\bEXIT\b", text)]
    end = exits[-1] if exits else len(code)
    spans = []
    for i, text in enumerate(code[:end]):
        branch = SASS_BRANCH.search(text)
        start = labels.get(branch.group(1), i + 1) if branch else i + 1
        if start <= i and any("HGMMA" in t for t in code[start : i + 1]):
            spans.append((start, i))
    innermost = [
        (a, b)
        for a, b in spans
        if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)
    ]

    def count(body, opcode):
        return sum(1 for t in body if re.search(rf"\b{opcode}\b", t))

    return [
        [b - a + 1] + [count(code[a : b + 1], op) for op in ("HGMMA", "STL", "LDL", "BAR")]
        for a, b in sorted(innermost)
    ]


def ptxas_path() -> str | None:
    """The ptxas Mosaic GPU compiles with: the first on PATH (XLA prefers it), else the one of
    the CUDA jax found (the nvidia-cuda-nvcc wheel's); None where there is neither."""
    found = shutil.which("ptxas")
    if found:
        return found
    from jax._src import lib  # jax's own lookup of its CUDA, which Mosaic GPU is pointed at

    candidate = lib.cuda_path and pathlib.Path(lib.cuda_path, "bin", "ptxas")
    return str(candidate) if candidate and candidate.is_file() else None


def ptxas_version() -> str | None:
    """ptxas_path's version ("13.0.88"): spills differ by version (13.3 on spill 2.5-3x as much
    in the flash attention's dK/dV kernel at head dim 128 as 13.0-13.2), so every report names
    it. None where there is no ptxas or it does not say."""
    path = ptxas_path()
    if path is None:
        return None
    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
    found = PTXAS_VERSION.search(out)
    return found.group(1) if found else None


def machine_code(ptx: pathlib.Path) -> str | None:
    """nvdisasm's listing of the PTX compiled by ptxas_path's ptxas, the one whose spills the
    report gives (None without both tools)."""
    ptxas, nvdisasm = ptxas_path(), shutil.which("nvdisasm")
    if not (ptxas and nvdisasm):
        return None
    target = PTX_TARGET.search(ptx.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        cubin = pathlib.Path(tmp, "kernel.cubin")
        arch = f"-arch={target.group(1)}" if target else "-arch=sm_90a"
        subprocess.run([ptxas, arch, "-o", str(cubin), str(ptx)], check=True)
        listing = subprocess.run(
            [nvdisasm, "-ndf", "-c", str(cubin)], check=True, capture_output=True, text=True
        )
    return listing.stdout


def h200_compile_devices(count: int = 1) -> list | None:
    """`count` compile-only H200s of one machine from jax's CUDA plugin (no GPU needed), or None
    without the plugin. On a machine without a GPU the plugin starts only if its start-up check
    of the CUDA libraries against a driver is skipped (JAX_SKIP_CUDA_CONSTRAINTS_CHECK, read
    when jax first starts its backends)."""
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=H200_TARGET, topology=f"1x1x{count}"
        )
    except (NotImplementedError, RuntimeError):  # no CUDA plugin
        return None
    return list(topology.devices)


def ptxas_serialized(report: str) -> dict[str, list[str]]:
    """{kernel: ptxas's codes for why it serialized the kernel's wgmma} from its report."""
    serialized = {}
    for code, kernel in PTXAS_SERIALIZED.findall(report):
        serialized.setdefault(kernel, []).append(code)
    return serialized


def compiled_kernels(dump: str) -> tuple[dict, dict, dict]:
    """({kernel: spills}, {kernel: serialized}, {kernel: product_loops}) of the kernels Mosaic
    GPU dumped into the folder `dump` (serialized only for kernels whose wgmma ptxas
    serialized; the loops only where machine_code has its tools)."""
    folder = pathlib.Path(dump)
    spills, serialized, loops = {}, {}, {}
    for report in sorted(folder.glob("*.ptxas")):
        text = report.read_text()
        found = ptxas_spills(text)
        spills |= found
        serialized |= ptxas_serialized(text)
        sass = machine_code(report.with_suffix(".ptx"))
        if sass is not None:
            loops |= dict.fromkeys(found, product_loops(sass))
    return spills, serialized, loops
