"""benchmarks/run.py, the GPU runner, on CPU: its recipes, how it reads a run's output, its table,
and its command line (--dry_run runs nothing); the kernel code reports (spills, serialized
products); and the tools that compile for a GPU without one."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

from benchmarks import flash_attention, kernel_code, run


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_each_recipe_compares_with_a_run_of_its_own(gpus):
    for name, recipe in run.RECIPES.items():
        runs = recipe(gpus)
        labels = [r.label for r in runs]
        assert runs and len(set(labels)) == len(labels), name
        assert {r.base for r in runs if r.base} <= set(labels), name
        assert all(r.gpus <= gpus and r.recipe == name for r in runs), name
    scaling = run.scaling(gpus)
    assert {r.gpus for r in scaling} == {1} | {n for n in (2, 4, 8) if n <= gpus}


def test_a_run_is_its_last_json_line_or_its_error():
    r = run.Run("fp8", "1b e4m3", ("--matmul_dtype=e4m3",))
    got = run.result(r, 'compiling\n{"tokens_per_s": 1}\n{"tokens_per_s": 2.5}\n', "", 0)
    assert got == {"recipe": "fp8", "label": "1b e4m3", "tokens_per_s": 2.5}
    failed = run.result(r, "", "Traceback ...\nRESOURCE_EXHAUSTED: out of memory\n\n", 1)
    assert failed["error"] == "RESOURCE_EXHAUSTED: out of memory"
    assert run.result(r, "", "", -9)["error"] == "exit -9, no output"


def test_the_table_compares_each_run_with_its_base():
    runs = [
        run.Run("scaling", "1 GPU", ()),
        run.Run("scaling", "2 GPUs ZeRO-1", (), gpus=2, base="1 GPU", per_gpu=True),
        run.Run("scaling", "2 GPUs ZeRO-3", (), gpus=2, base="1 GPU", per_gpu=True),
        run.Run("fp8", "e4m3", (), base="bf16"),
    ]
    row = dict(step_ms_median=100.0, compile_s=9.0, peak_memory_gib_per_device=40.0)
    results = [
        {"recipe": "scaling", "label": "1 GPU", "tokens_per_s": 1000.0, "mfu_spec": 0.5, **row},
        {
            "recipe": "scaling",
            "label": "2 GPUs ZeRO-1",
            "tokens_per_s": 1900.0,
            "devices": 2,
            "mfu_spec": 0.475,
            **row,
        },  # fmt: skip
        {"recipe": "scaling", "label": "2 GPUs ZeRO-3", "error": "out of memory"},
        {
            "recipe": "fp8",
            "label": "e4m3",
            "tokens_per_s": 1300.0,
            "mfu_spec": 0.6,
            "mfu_spec_fp8": 0.3,
            "joules_per_step": 61.25,
            "sm_clock_mhz_mean": 1512.4,
            **row,
        },  # fmt: skip
    ]
    lines = run.table(runs, results).splitlines()
    line = lambda label: next(ln for ln in lines if ln.startswith(label))  # noqa: E731
    assert line("2 GPUs ZeRO-1").split()[3:6] == ["1,900", "0.950", "47.5%"]
    assert "out of memory" in line("2 GPUs ZeRO-3")
    assert line("e4m3").split()[1:5] == ["1,300", "-", "60.0%", "30.0%"]  # its base did not run
    assert line("e4m3").split()[-2:] == ["61.2", "1,512"]  # joules a step, the mean SM clock
    assert line("1 GPU").split()[-2:] == ["-", "-"]  # not read (no NVML)


def test_ab_runs_each_run_with_both_packages_b_against_a():
    runs = run.ab_runs(run.scaling(2)[:2], "/a", "/b")
    assert [(r.label, r.package, r.base) for r in runs] == [
        ("1 GPU [A]", "/a", None),
        ("1 GPU [B]", "/b", "1 GPU [A]"),
        ("2 GPUs ZeRO-1 [A]", "/a", None),
        ("2 GPUs ZeRO-1 [B]", "/b", "2 GPUs ZeRO-1 [A]"),
    ]
    assert not any(r.per_gpu for r in runs) and runs[3].gpus == 2


def test_runs_picks_labels_with_their_bases():
    picked = run.selected(
        run.shapes(1) + run.kernels(1), ["llama-3.2-1b 8 x 2048", "lm_head_loss=pallas"]
    )
    assert [(r.recipe, r.label) for r in picked] == [
        ("shapes", "peer llama-3.2-1b 8 x 2048"),
        ("shapes", "llama-3.2-1b 8 x 2048"),
        ("kernels", "auto"),
        ("kernels", "lm_head_loss=pallas"),
    ]
    assert run.selected(run.shapes(1), ["no such run"]) == []


def test_command_line():
    def runner(*args):
        cmd = [sys.executable, "-m", "benchmarks.run", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    out = runner("--recipes=kernels,offload", "--dry_run", "--gpus=1")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == len(run.kernels(1)) + len(run.offload(1))
    assert "-m jaxllmq.bench --json" in lines[0] and "--kernels=auto" in lines[0]
    assert runner("--recipes=fp8", "--ab=/nonexistent,.", "--dry_run").stderr.strip() == (
        "error: --ab takes DIR_A,DIR_B, two directories that each hold a jaxllmq/"
    )
    none = runner("--recipes=shapes", "--runs=gemma-9", "--dry_run")
    assert none.returncode == 1 and none.stderr.strip().startswith("error: --runs matched no run")
    bad = runner("--recipes=speed")
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [
        "error: --recipes takes some of shapes, kernels, scaling, fp8, offload (got speed)"
    ]


PTXAS_REPORT = """\
ptxas info    : Compiling entry function 'flash_attention_forward_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for flash_attention_forward_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem
ptxas warning : Registers are spilled to local memory in function 'flash_attention_dkv_mosaic_gpu\
_kernel', 120 bytes spill stores, 132 bytes spill loads
ptxas info    : Compiling entry function 'flash_attention_dkv_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for flash_attention_dkv_mosaic_gpu_kernel
    120 bytes stack frame, 120 bytes spill stores, 132 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 120 bytes cumulative stack size, 1 bytes smem
"""
# A kernel whose products ptxas serialized, as its report says so (before naming the kernel).
SERIALIZED_REPORT = """ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions reading accumulator registers of  a wgmma between start and end of the pipeline stage in the function 'new_body_mosaic_gpu_kernel'
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'new_body_mosaic_gpu_kernel' for 'sm_90a'
ptxas info    : Function properties for new_body_mosaic_gpu_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
"""


def test_the_spill_report_names_each_kernel_with_its_own_spills():
    """ptxas warns of a kernel's spills before it names the kernel; the warning is not taken for
    the kernel named before it."""
    assert kernel_code.ptxas_spills(PTXAS_REPORT) == {
        "flash_attention_forward": [0, 0],
        "flash_attention_dkv": [120, 132],
    }
    assert kernel_code.ptxas_spills("") == {}


# Too few registers: ptxas words this note "for the function", not "in".
SERIALIZED_FOR_REGISTERS = """ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the function 'flash_attention_dkv_dq_mosaic_gpu_kernel'
ptxas info    : 0 bytes gmem
"""


def test_the_report_names_the_kernels_whose_products_ptxas_serialized():
    assert kernel_code.ptxas_serialized(SERIALIZED_REPORT) == {"new_body": ["C7514"]}
    assert kernel_code.ptxas_serialized(SERIALIZED_FOR_REGISTERS) == {
        "flash_attention_dkv_dq": ["C7512"]
    }
    assert kernel_code.ptxas_spills(SERIALIZED_REPORT) == {"new_body": [0, 0]}
    assert kernel_code.ptxas_serialized(PTXAS_REPORT) == {}


# nvdisasm's listing, cut down: an outer loop (over heads) around two loops of products (masked
# steps, then the rest, with a named barrier and a memory fence, which is none); a barrier
# wait's retry after the last EXIT, which branches back into the second loop and is no loop.
SASS = """\
.text.flash_attention_dkv_mosaic_gpu_kernel:
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_1:
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
.L_x_2:
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT ;
        /*0030*/                   STL [R1+0x10], R3 ;
        /*0040*/                   LDL R4, [R1+0x10] ;
        /*0050*/                   LDL R5, [R1+0x14] ;
        /*0060*/              @P0 BRA `(.L_x_2) ;
.L_x_3:
        /*0070*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R8+URZ], R9 ;
        /*0080*/              @!P1 BRA `(.L_x_9) ;
.L_x_4:
        /*0090*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*00a0*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0 ;
        /*00a8*/                   BAR.SYNC.DEFER_BLOCKING R19, 0x80 ;
        /*00ac*/                   MEMBAR.ALL.CTA ;
        /*00b0*/              @P2 BRA `(.L_x_3) ;
        /*00c0*/              @P3 BRA `(.L_x_1) ;
        /*00d0*/                   LDL R6, [R1+0x18] ;
        /*00e0*/                   EXIT ;
.L_x_9:
        /*00f0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R8+URZ], R9 ;
        /*0100*/              @!P1 BRA `(.L_x_9) ;
        /*0110*/                   BRA `(.L_x_4) ;
"""


def test_the_loops_of_products_and_the_spills_inside_them():
    """The innermost loops that issue wgmma, each with its local stores and loads and its
    named barriers; the outer loop and the wait's retry, which branches back from past the
    EXIT, are not among them."""
    assert kernel_code.product_loops(SASS) == [[5, 1, 1, 2, 0], [7, 2, 0, 0, 1]]
    assert kernel_code.product_loops("") == []


def test_ptxas_version_is_that_of_the_first_on_path_else_jaxs_cuda(monkeypatch, tmp_path):
    from jax._src import lib

    def fake_ptxas(folder, release):
        folder.mkdir(parents=True)
        ptxas = folder / "ptxas"
        ptxas.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}'\n")
        ptxas.chmod(0o755)

    fake_ptxas(tmp_path / "path", "13.0, V13.0.88")
    fake_ptxas(tmp_path / "cuda" / "bin", "13.5, V13.5.37")
    monkeypatch.setattr(lib, "cuda_path", str(tmp_path / "cuda"))
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    assert kernel_code.ptxas_version() == "13.0.88"
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert kernel_code.ptxas_version() == "13.5.37"
    monkeypatch.setattr(lib, "cuda_path", None)
    assert kernel_code.ptxas_version() is None


def test_spills_prints_each_settings_kernels_or_the_error_that_stopped_it(monkeypatch, capsys):
    lowered_for = []

    class Compiled:  # stands in for the jit: its compile dumps ptxas's report, as on a GPU
        def lower(self, *shapes):
            lowered_for.extend(shape.sharding for shape in shapes)
            return self

        def compile(self):
            dump = pathlib.Path(os.environ["MOSAIC_GPU_DUMP_TO"])
            dump.joinpath("flash_attention_dkv_1.ptxas").write_text(PTXAS_REPORT)
            dump.joinpath("new_body_2.ptxas").write_text(SERIALIZED_REPORT)

    monkeypatch.setattr(flash_attention, "_grad_fn", lambda attend: Compiled())
    monkeypatch.setattr(kernel_code, "machine_code", lambda ptx: SASS)
    monkeypatch.setattr(kernel_code, "ptxas_version", lambda: "13.0.88")
    device = jax.devices("cpu")[0]  # stands in for a compile-only GPU
    flash_attention.report_spills(128, ["", "stages=0"], heads=4, kv_heads=2, device=device)
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lowered_for == [jax.sharding.SingleDeviceSharding(device)] * 4  # q, k, v, dO
    assert rows[0] == {
        "head_dim": 128,
        "variant": "mosaic default",
        "ptxas": "13.0.88",
        "spills": {
            "flash_attention_forward": [0, 0],
            "flash_attention_dkv": [120, 132],
            "new_body": [0, 0],
        },
        "wgmma_serialized": {"new_body": ["C7514"]},
        "product_loops": {
            "flash_attention_forward": [[5, 1, 1, 2, 0], [7, 2, 0, 0, 1]],
            "flash_attention_dkv": [[5, 1, 1, 2, 0], [7, 2, 0, 0, 1]],
            "new_body": [[5, 1, 1, 2, 0], [7, 2, 0, 0, 1]],
        },
    }
    assert "MOSAIC_GPU_DUMP_TO" not in os.environ
    assert rows[1]["variant"] == "mosaic stages=0"
    assert rows[1]["error"].startswith("ValueError: flash attention: tiles are positive")
    assert len(rows) == 2


CUDA_PLUGIN = importlib.util.find_spec("jax_cuda13_plugin") is not None


PLUGIN_INSTALL = f'pip install "jax-cuda13-plugin[with-cuda]=={jax.__version__}"'


@pytest.mark.skipif(CUDA_PLUGIN, reason="jax's CUDA plugin is installed: these compile")
@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["benchmarks.flash_attention", "--spills"],
            "--spills: Mosaic GPU compiles its kernels for a GPU; run it on one, or install "
            f"jax's CUDA plugin ({PLUGIN_INSTALL}) to compile for an H200 here",
        ),
        (
            ["benchmarks.step_memory", "--model=tiny"],
            "step_memory: the step is compiled for a compile-only H200; install jax's CUDA "
            f"plugin ({PLUGIN_INSTALL})",
        ),
    ],
    ids=["spills", "step_memory"],
)
def test_compiling_for_an_h200_without_a_gpu_or_the_cuda_plugin_is_a_one_line_exit(args, message):
    out = subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == message


@pytest.mark.skipif(not CUDA_PLUGIN, reason="needs jax's CUDA plugin (a compile-only H200)")
def test_spills_compiles_the_kernels_for_a_compile_only_h200_without_a_gpu():
    """ptxas's reports of the forward and of dK/dV with dQ at head dim 64 (both spill-free in
    their loops of products on the GPU too), from a machine whose jax runs on its CPU."""
    cmd = [sys.executable, "-m", "benchmarks.flash_attention", "--spills", "--head_dims=64"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert row["spills"]["flash_attention_forward"] == [0, 0]
    assert len(row["spills"]) == 2  # the forward, and dK/dV with dQ
    for loops in row.get("product_loops", {}).values():  # with ptxas and nvdisasm on PATH
        assert loops and all(wgmma > 0 and stl == ldl == 0 for _, wgmma, stl, ldl, _ in loops)


def test_pallas_kernels_lower_for_a_gpu_from_a_cpu_only_where_asked():
    from jaxllmq.kernels import _pallas

    assert _pallas.default_interpret()  # these tests' jax runs on the CPU
    with _pallas.lowering_for_gpu():
        assert not _pallas.default_interpret()
    assert _pallas.default_interpret()


@pytest.mark.skipif(not CUDA_PLUGIN, reason="needs jax's CUDA plugin (a compile-only H200)")
def test_step_memory_reads_the_step_s_peak_without_a_gpu():
    """The tiny preset's step: its state and batch (arguments), its temporaries, and a peak of at
    least their sum, under the plan for one H200."""
    cmd = [sys.executable, "-m", "benchmarks.step_memory", "--model=tiny"]
    cmd += ["--batch_size=2", "--seq_len=128"]
    rows = []
    for mesh in ([], ["--gpus=4", "--zero_level=3"]):
        out = subprocess.run(cmd + mesh, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        rows += [json.loads(line) for line in out.stdout.splitlines()]
    one, four = rows
    assert one["attention"] == "cudnn"  # head dim 32: cuDNN's on one H200
    assert one["arguments_gib"] > 0 and one["temporaries_gib"] > 0
    assert one["peak_gib"] >= one["arguments_gib"] + one["temporaries_gib"]
    # Per GPU: ZeRO-3 on four holds a quarter of the state, beside a batch of the same rows.
    assert (four["gpus"], four["zero_level"]) == (4, 3)
    assert four["arguments_gib"] < one["arguments_gib"] / 2
