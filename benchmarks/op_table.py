"""Where the bench's train step spends its GPU time, op by op: each GEMM shape's ms per step and
TFLOP/s (how far it falls short of the matmul ceiling), or with --table_kind=copy (fusion,
nccl, ...; several comma-separated, one table each from the same run) the ops of that kernel
category with their result types. Runs the bench
(`jaxllmq.bench`, same flags) under a trace, with XLA's command buffers off so that each kernel
names its op, and the compiled step dumped; then joins the two (`jaxllmq.profile.op_table`).
Command buffers off adds launch gaps to the step, not to the kernels. Not with --profile_steps
(one trace at a time).

    python3 -m benchmarks.op_table --model=llama-3.2-1b --batch_size=8 --seq_len=2048 \\
        --noscan_layers --bench_steps=5 --measure_matmul_ceiling=false [--table_kind=copy,nccl]
"""

import glob
import os
import tempfile

DUMP = tempfile.mkdtemp(prefix="op_table_")
os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        f"--xla_dump_to={DUMP}",
        "--xla_dump_hlo_as_text",
        "--xla_dump_hlo_module_re=.*train_step.*",
        "--xla_gpu_enable_command_buffer=",
    ]
)

from absl import app, flags  # noqa: E402  (XLA_FLAGS must be set before jax starts)

from jaxllmq import profile, xla_flags  # noqa: E402
from jaxllmq.cli import bench as bench_cli  # noqa: E402
from jaxllmq.cli import flags as cli_flags  # noqa: E402

_KINDS = [name for name, _ in profile.CATEGORIES]
_kinds = flags.DEFINE_list(
    "table_kind",
    ["gemm"],
    f"Which kernel categories to list op by op, one table each: any of {', '.join(_KINDS)}.",
)
flags.register_validator(
    "table_kind",
    lambda kinds: set(kinds) <= set(_KINDS),
    f"--table_kind takes a comma-separated list of {', '.join(_KINDS)}",
)


def main(argv: list[str]) -> None:
    # The trace starts the backend, which reads XLA_FLAGS then: jaxllmq's defaults (cuBLAS, not
    # Triton, GEMMs) must be in it already, or the profile is of another program than the bench's.
    xla_flags.apply_defaults(deterministic=flags.FLAGS.deterministic)
    with tempfile.TemporaryDirectory() as trace:
        with profile.trace_steps(trace):
            bench_cli.run(argv)
        dumps = glob.glob(os.path.join(DUMP, "*train_step*after_optimizations.txt"))
        if not dumps:
            raise SystemExit(f"error: no train step in the XLA dump under {DUMP}")
        with open(max(dumps, key=os.path.getsize)) as f:
            hlo = f.read()
        for kind in _kinds.value:
            rows = profile.op_table(trace, hlo, module="jit_train_step", kind=kind)
            print(profile.format_op_table(rows, kind))


if __name__ == "__main__":
    bench_cli.define_flags()
    app.run(main, flags_parser=cli_flags.parse_argv)
