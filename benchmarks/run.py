"""One runner for the GPU measurements: named recipes of benchmark runs, JSON lines, a table.

    python3 -m benchmarks.run --recipes=shapes,kernels [--runs=TEXT] [--out=DIR] [--dry_run]

Each run is `python -m jaxllmq.bench --json ...` (or the peer, benchmarks/peer_torch.py) in a
process of its own. A recipe's one-GPU runs are spread over the machine's GPUs, one queue per
GPU (the GPUs of one host differ by up to 1.5%); its several-GPU runs then take the GPUs they
need one run after another. Every result is printed as one JSON line with its recipe and label
(or the error that ended the run) and appended to DIR/results.jsonl; a table per recipe comes
last, each run against its recipe's base. Recipes:

  shapes   jaxllmq beside the peer (transformers + torch.compile) at the presets' shapes
  kernels  the 1B step with each --kernels choice, against auto
  scaling  the 1B at ZeRO-1/2/3 on 2, 4 and 8 GPUs (as many as there are), in one process and
           in one process per GPU: per-GPU efficiency against one GPU
  fp8      e4m3 with current and delayed scaling against bf16, on the 1B and the 3B
  offload  each host-offload switch on the 1B against none; the 8B on one GPU with all of them

On the GPU machine (no network) the wheels the package lacks there come first, as for tests/gpu:
`pip install --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site:$PWD`.
"""

import dataclasses
import json
import os
import queue
import random
import subprocess
import sys
import threading

from absl import app, flags

from jaxllmq.cli import flags as cli_flags


@dataclasses.dataclass(frozen=True)
class Run:
    """One benchmark process (or `processes` of them, one per GPU, for one run)."""

    recipe: str
    label: str
    flags: tuple[str, ...]
    gpus: int = 1  # 1: queued on any one GPU; more: the first `gpus` GPUs, alone
    processes: int = 1
    peer: bool = False  # benchmarks/peer_torch.py instead of jaxllmq.bench
    base: str | None = None  # the label of the run it is compared with
    per_gpu: bool = False  # compared per GPU: tokens/s / (GPUs x the base's)
    package: str | None = None  # --ab: the directory whose jaxllmq/ the run imports


COMMON = ("--json", "--measure_matmul_ceiling=false", "--bench_steps=15")
# Pure bf16 and unrolled layers, as the peer trains (bf16 weights, no master copy).
BF16 = (
    "--noscan_layers",
    "--model_dtype=bfloat16",
    "--opt_m_dtype=bfloat16",
    "--opt_v_dtype=bfloat16",
)
ONE_B = ("--model=llama-3.2-1b", "--batch_size=8", "--seq_len=2048")
SHAPES = [
    ("llama-3.2-1b", 8, 2048),
    ("llama-3.2-3b", 8, 2048),
    ("qwen2.5-0.5b", 8, 2048),
    ("qwen3-1.7b", 8, 2048),
    ("llama-3.2-1b", 4, 4096),
    ("llama-3.2-1b", 2, 8192),
]
KERNEL_CHOICES = (
    "auto",
    "pallas",
    "xla",
    "rms_norm=pallas,lm_head_loss=xla",
    "lm_head_loss=pallas",
)
OFFLOAD = ("--offload_master", "--offload_opt_m", "--offload_opt_v", "--offload_residual")


def shapes(gpus: int) -> list[Run]:
    out = []
    for model, b, t in SHAPES:
        shape = (f"--model={model}", f"--batch_size={b}", f"--seq_len={t}")
        label = f"{model} {b} x {t}"
        out.append(Run("shapes", f"peer {label}", shape, peer=True))
        out.append(Run("shapes", label, shape + BF16, base=f"peer {label}"))
    return out


def kernels(gpus: int) -> list[Run]:
    return [
        Run("kernels", k, ONE_B + BF16 + (f"--kernels={k}",), base="auto") for k in KERNEL_CHOICES
    ]


def scaling(gpus: int) -> list[Run]:
    # The base runs the kernels auto picks on several GPUs: the RMSNorm in XLA (kernels/).
    one = ONE_B + BF16 + ("--bench_steps=12",)
    out = [Run("scaling", "1 GPU", one + ("--gpus=1", "--kernels=rms_norm=xla"))]
    for n in (g for g in (2, 4, 8) if g <= gpus):
        for z in (1, 2, 3):
            level = (f"--gpus={n}", f"--zero_level={z}")
            kw = dict(gpus=n, base="1 GPU", per_gpu=True)
            out.append(Run("scaling", f"{n} GPUs ZeRO-{z}", one + level, **kw))
            out.append(
                Run("scaling", f"{n} processes ZeRO-{z}", one + level[1:], processes=n, **kw)
            )
    return out


def fp8(gpus: int) -> list[Run]:
    out = []
    for model in ("llama-3.2-1b", "llama-3.2-3b"):
        shape = (f"--model={model}", "--batch_size=8", "--seq_len=2048") + BF16
        out.append(Run("fp8", f"{model} bf16", shape))
        for scaling_ in ("current", "delayed"):
            e4m3 = ("--matmul_dtype=e4m3", f"--fp8_scaling={scaling_}")
            out.append(Run("fp8", f"{model} e4m3 {scaling_}", shape + e4m3, base=f"{model} bf16"))
    return out


def offload(gpus: int) -> list[Run]:
    # fp32 master weights and moments (the default), scanned layers: what offload is for.
    one_b = ONE_B + ("--bench_steps=10",)
    out = [Run("offload", "1B none", one_b)]
    for flag in OFFLOAD:
        out.append(Run("offload", f"1B {flag[2:]}", one_b + (flag,), base="1B none"))
    out.append(Run("offload", "1B all", one_b + OFFLOAD, base="1B none"))
    eight_b = ("--model=llama-3.1-8b", "--batch_size=1", "--seq_len=4096", "--lmhead_chunks=8")
    out.append(Run("offload", "8B T=4096 all", eight_b + OFFLOAD + ("--bench_steps=5",)))
    return out


RECIPES = {"shapes": shapes, "kernels": kernels, "scaling": scaling, "fp8": fp8, "offload": offload}


FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def define_flags() -> None:
    """The runner's flags (defined when it runs, so that importing this module defines none)."""
    flags.DEFINE_list("recipes", None, f"Recipes to run, of {', '.join(RECIPES)}.")
    flags.DEFINE_list(
        "runs",
        None,
        "Only the runs whose label contains one of these texts, with the runs they are compared "
        "with (e.g. --runs='llama-3.2-1b 8 x 2048' for the 1B row of shapes, ours and the peer).",
    )
    flags.DEFINE_string("out", None, "Append the results to DIR/results.jsonl.")
    flags.DEFINE_bool("dry_run", False, "Print each run's command; run nothing.")
    flags.DEFINE_integer("gpus", None, "GPUs to use (default: all, from nvidia-smi -L).")
    flags.DEFINE_integer("run_timeout_s", 580, "Seconds before a run is stopped.")
    flags.DEFINE_list(
        "ab",
        None,
        "DIR_A,DIR_B: each run twice, importing the jaxllmq/ package in DIR_A, then DIR_B's, "
        "compared B against A (e.g. `git archive REV jaxllmq | tar -x -C DIR`). With several "
        "GPUs the two may run on different ones (they differ by up to 1.5%): --gpus=1 for one.",
    )


def selected(runs: list[Run], texts: list[str]) -> list[Run]:
    """The runs whose label contains one of `texts`, and their bases, in the recipes' order."""
    chosen = {(r.recipe, r.label) for r in runs if any(t in r.label for t in texts)}
    chosen |= {(r.recipe, r.base) for r in runs if (r.recipe, r.label) in chosen and r.base}
    return [r for r in runs if (r.recipe, r.label) in chosen]


def ab_runs(runs: list[Run], package_a: str, package_b: str) -> list[Run]:
    """Each run with package A, then with package B against it (the recipes' own bases give way
    to the A/B comparison)."""
    out = []
    for r in runs:
        a = dataclasses.replace(r, label=f"{r.label} [A]", package=package_a, base=None)
        b = dataclasses.replace(r, label=f"{r.label} [B]", package=package_b, base=a.label)
        out += [dataclasses.replace(x, per_gpu=False) for x in (a, b)]
    return out


def command(run: Run, process: int = 0, port: int = 0) -> list[str]:
    if run.peer:
        return [sys.executable, "-m", "benchmarks.peer_torch", *run.flags]
    argv = [sys.executable, "-m", "jaxllmq.bench", *COMMON, *run.flags]
    if run.processes > 1:
        argv += [
            f"--coordinator_address=localhost:{port}",
            f"--num_processes={run.processes}",
            f"--process_id={process}",
        ]
    return argv


def result(run: Run, stdout: str, stderr: str, returncode: int) -> dict:
    """The run's JSON line (its last), with its recipe and label; or the error that ended it."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    out = {"recipe": run.recipe, "label": run.label}
    if returncode == 0 and lines:
        return out | json.loads(lines[-1])
    err = [ln for ln in stderr.splitlines() if ln.strip()]
    return out | {"error": (err[-1] if err else f"exit {returncode}, no output")[:300]}


def execute(run: Run, devices: list[int], timeout_s: int) -> dict:
    """Run it on `devices` (one process per device when run.processes > 1)."""
    port = random.randint(20000, 40000)
    if run.processes == 1:
        groups = [devices]
    else:
        groups = [[d] for d in devices[: run.processes]]
    procs = []
    for i, group in enumerate(groups):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, group))}
        if run.package:  # run from it (-m puts the working directory first), benchmarks/ from here
            path = [run.package, ROOT, os.environ.get("PYTHONPATH", "")]
            env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
        procs.append(
            subprocess.Popen(
                command(run, i, port),
                env=env,
                cwd=run.package,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    outputs = []
    for p in procs:
        try:
            outputs.append((*p.communicate(timeout=timeout_s), p.returncode))
        except subprocess.TimeoutExpired:
            p.kill()
            outputs.append(("", f"stopped after {timeout_s} s", -1))
    return result(run, *outputs[0])


def run_all(runs: list[Run], gpus: int, emit, timeout_s: int) -> None:
    """One-GPU runs spread over the GPUs, one queue each; then the several-GPU runs in turn."""
    pending: queue.Queue[Run] = queue.Queue()
    for r in runs:
        if r.gpus == 1:
            pending.put(r)

    def worker(gpu: int) -> None:
        while True:
            try:
                r = pending.get_nowait()
            except queue.Empty:
                return
            emit(execute(r, [gpu], timeout_s))

    threads = [threading.Thread(target=worker, args=(g,)) for g in range(gpus)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in runs:
        if r.gpus > 1:
            emit(execute(r, list(range(r.gpus)), timeout_s))


def table(runs: list[Run], results: list[dict]) -> str:
    """Per recipe, its runs in order: tokens/s, against the base, MFU, memory, step, compile, and
    on GPUs a step's joules and the mean SM clock while the steps ran ('-' where not read)."""
    by_label = {(r["recipe"], r["label"]): r for r in results}
    lines = []
    for recipe in dict.fromkeys(r.recipe for r in runs):
        lines.append(f"\n== {recipe}")
        lines.append(
            f"{'run':<36}{'tokens/s':>11}{'vs base':>9}{'MFU':>7}{'MFU fp8':>8}{'GiB':>7}"
            f"{'step ms':>9}{'compile s':>10}{'J/step':>8}{'SM MHz':>8}"
        )
        for run in (r for r in runs if r.recipe == recipe):
            got = by_label.get((recipe, run.label))
            if got is None or "error" in got:
                lines.append(f"{run.label:<36}  {'not run' if got is None else got['error'][:90]}")
                continue
            base = by_label.get((recipe, run.base)) if run.base else None
            ratio = "-"
            if base and "tokens_per_s" in base:
                per = got.get("devices", 1) if run.per_gpu else 1
                ratio = f"{got['tokens_per_s'] / (per * base['tokens_per_s']):.3f}"
            pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
            num = lambda x, digits: "-" if x is None else f"{x:,.{digits}f}"  # noqa: E731
            gib = got.get("peak_memory_gib_per_device") or got.get("peak_memory_gib") or 0.0
            lines.append(
                f"{run.label:<36}{got['tokens_per_s']:>11,.0f}{ratio:>9}"
                f"{pct(got.get('mfu_spec')):>7}{pct(got.get('mfu_spec_fp8')):>8}{gib:>7.1f}"
                f"{got.get('step_ms_median', 0):>9.1f}{got.get('compile_s', 0):>10.1f}"
                f"{num(got.get('joules_per_step'), 1):>8}{num(got.get('sm_clock_mhz_mean'), 0):>8}"
            )
    return "\n".join(lines)


def gpu_count() -> int:
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum(1 for ln in listed.stdout.splitlines() if ln.startswith("GPU "))


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    names = FLAGS.recipes or []
    unknown = [n for n in names if n not in RECIPES]
    if not names or unknown:
        sys.exit(f"error: --recipes takes some of {', '.join(RECIPES)} (got {','.join(names)})")
    gpus = FLAGS.gpus if FLAGS.gpus is not None else gpu_count()
    runs = [r for n in names for r in RECIPES[n](max(gpus, 1))]
    if FLAGS.runs:
        runs = selected(runs, FLAGS.runs)
        if not runs:
            sys.exit(
                f"error: --runs matched no run of --recipes={','.join(names)} (--dry_run lists them)"
            )
    if FLAGS.ab:
        if len(FLAGS.ab) != 2 or not all(
            os.path.isdir(os.path.join(d, "jaxllmq")) for d in FLAGS.ab
        ):
            sys.exit("error: --ab takes DIR_A,DIR_B, two directories that each hold a jaxllmq/")
        runs = ab_runs(runs, *map(os.path.abspath, FLAGS.ab))
    if FLAGS.dry_run:
        for r in runs:
            where = f"{r.processes} processes" if r.processes > 1 else f"{r.gpus} GPU(s)"
            print(f"[{r.recipe}] {r.label} ({where}): {' '.join(command(r)[1:])}")
        return
    if gpus < 1:
        sys.exit("error: no GPU found (nvidia-smi -L); give --gpus or run on a GPU machine")
    results, lock = [], threading.Lock()
    path = os.path.join(FLAGS.out, "results.jsonl") if FLAGS.out else None
    if path:
        os.makedirs(FLAGS.out, exist_ok=True)

    def emit(row: dict) -> None:
        with lock:
            results.append(row)
            print(json.dumps(row), flush=True)
            if path:
                with open(path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")

    for name in names:
        run_all([r for r in runs if r.recipe == name], gpus, emit, FLAGS.run_timeout_s)
    print(table(runs, results), flush=True)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=cli_flags.parse_argv)
