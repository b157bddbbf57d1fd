"""Time and TFLOP/s of each GEMM shape in the bench's train step on a GPU: which matmuls fall
short of the matmul ceiling. Runs the bench (`jaxllmq.bench`, same flags) under a trace, with
XLA's command buffers off so that each kernel names its GEMM op, and the compiled step dumped;
then joins the two (`jaxllmq.profile.gemm_table`) and prints one row per shape and kernel.
Command buffers off adds launch gaps to the step, not to the kernels. Not with --profile_steps
(one trace at a time).

    python3 benchmarks/gemm_table.py --model=llama-3.2-1b --batch_size=8 --seq_len=2048 \\
        --noscan_layers --bench_steps=5 --measure_matmul_ceiling=false
"""

import glob
import os
import tempfile

DUMP = tempfile.mkdtemp(prefix="gemm_table_")
os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        f"--xla_dump_to={DUMP}",
        "--xla_dump_hlo_as_text",
        "--xla_dump_hlo_module_re=.*train_step.*",
        "--xla_gpu_enable_command_buffer=",
    ]
)

from absl import app  # noqa: E402  (XLA_FLAGS must be set before jax starts)

from jaxllmq import bench, config, profile  # noqa: E402


def main(argv: list[str]) -> None:
    with tempfile.TemporaryDirectory() as trace:
        with profile.trace_steps(trace):
            bench.main(argv)
        dumps = glob.glob(os.path.join(DUMP, "*train_step*after_optimizations.txt"))
        if not dumps:
            raise SystemExit(f"error: no train step in the XLA dump under {DUMP}")
        with open(max(dumps, key=os.path.getsize)) as f:
            rows = profile.gemm_table(trace, f.read(), module="jit_train_step")
    print(profile.format_gemm_table(rows))


if __name__ == "__main__":
    app.run(main, flags_parser=config.parse_argv)
