"""Where a GPU kernel's warps wait, from Nsight Compute's per-instruction report.

ncu's source page (`--page source --csv --print-source sass`) lists each profiled kernel's
machine code with, per instruction, how often warps executed it and in which state the
profiler's periodic samples found them (issuing, or stalled and why). Instructions a loop runs
run equally often, so grouping them by that count splits a kernel into its loops (loops that
ran equally often fall together). One JSON line per profiled launch, in order: the kernel's
samples and executed instructions, its heaviest loops (each loop's instructions, executions,
share of the samples and leading stall reasons) and its hottest instructions.

A profile of the flash attention kernels (`--run_once` runs each variant's forward + backward a
single time; on a GPU machine whose profiler reads the hardware counters):

    ncu --set full --import-source no --clock-control none --kernel-name-base demangled \\
        -k 'regex:mosaic_gpu|flash' -o ours python3 -m benchmarks.flash_attention --run_once \\
        --shapes=2x8192 --head_dims=64 --nocudnn --nodocuments --windows= --noerrors
    ncu -i ours.ncu-rep --page source --csv --print-source sass > ours.csv
    python3 -m benchmarks.ncu_summary ours.csv [--loops=6 --hottest=10]
"""

from __future__ import annotations

import collections
import csv
import json

from absl import app, flags

flags.DEFINE_integer("loops", 6, "Loops listed a kernel (those with the most samples).")
flags.DEFINE_integer("hottest", 10, "Instructions listed a kernel (those with the most samples).")
FLAGS = flags.FLAGS

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
STALL_PREFIX = "stall_"
NOT_ISSUED = "(Not Issued)"


def read_source_page(path: str) -> list[tuple[str, list[dict[str, str]]]]:
    """(kernel name, its instructions' rows) of each profiled launch, in order, from ncu's
    source-page CSV, in which each launch's table follows a "Kernel Name" line and has a header
    row of its own. ncu 2025.3 prints some launches' tables twice in a row (FlashAttention-3's
    kernels, identical); the repeat is dropped."""
    tables, header = [], None
    with open(path, newline="") as f:
        for line in csv.reader(f):
            if line and line[0] == "Kernel Name":
                tables.append((line[1], []))
                header = None
            elif tables and header is None:
                header = line
            elif tables and line:
                tables[-1][1].append(dict(zip(header, line, strict=False)))
    return [table for n, table in enumerate(tables) if n == 0 or table != tables[n - 1]]


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def _stalls(rows, samples: float, top: int) -> dict[str, float]:
    """The `top` states the samples of `rows` found warps in, each as a share of `samples`."""
    states = collections.Counter()
    for row in rows:
        for column, value in row.items():
            if column.startswith(STALL_PREFIX) and not column.endswith(NOT_ISSUED):
                states[column[len(STALL_PREFIX) :]] += _number(value)
    return {state: round(n / samples, 4) for state, n in states.most_common(top) if n}


def summarize(name: str, rows: list[dict[str, str]], loops: int = 6, hottest: int = 10) -> dict:
    """One kernel's summary: its loops (instructions grouped by how often they ran, the
    `loops` with most samples) and its `hottest` instructions by samples."""
    samples = sum(_number(row.get(SAMPLES)) for row in rows) or 1.0
    groups = collections.defaultdict(list)
    for row in rows:
        groups[_number(row.get(EXECUTED))].append(row)

    def samples_of(body):
        return sum(_number(row.get(SAMPLES)) for row in body)

    heaviest = sorted(groups.items(), key=lambda group: samples_of(group[1]), reverse=True)[:loops]
    by_samples = sorted(rows, key=lambda row: _number(row.get(SAMPLES)), reverse=True)
    return {
        "kernel": name,
        "samples": int(samples),
        "executed": int(sum(_number(row.get(EXECUTED)) for row in rows)),
        "loops": [
            {
                "runs": int(runs),
                "instructions": len(body),
                "executed": int(runs * len(body)),
                "samples_share": round(samples_of(body) / samples, 4),
                "stalls": _stalls(body, samples_of(body) or 1.0, 4),
            }
            for runs, body in heaviest
        ],
        "hottest": [
            {
                "sass": " ".join(row.get("Source", "").split()),
                "runs": int(_number(row.get(EXECUTED))),
                "samples_share": round(_number(row.get(SAMPLES)) / samples, 4),
                "stalls": _stalls([row], _number(row.get(SAMPLES)) or 1.0, 2),
            }
            for row in by_samples[:hottest]
        ],
    }


# How to export a report's source page, which is what this reads.
SOURCE_PAGE_COMMAND = "ncu -i REPORT --page source --csv --print-source sass"


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit(
            "usage: python3 -m benchmarks.ncu_summary SOURCE.csv [...], each ncu's source page "
            f"({SOURCE_PAGE_COMMAND})"
        )
    wanted = f"give ncu's source page as CSV ({SOURCE_PAGE_COMMAND})"
    for path in argv[1:]:
        try:
            launches = read_source_page(path)
        except OSError as e:
            raise SystemExit(f"{path}: {e.strerror or e}") from None
        except (UnicodeDecodeError, csv.Error):  # a binary file, such as the .ncu-rep itself
            raise SystemExit(f"{path}: not CSV text; {wanted}") from None
        if not launches:
            raise SystemExit(f"{path}: no kernel in it; {wanted}")
        for launch, (name, rows) in enumerate(launches):
            summary = summarize(name, rows, FLAGS.loops, FLAGS.hottest)
            print(json.dumps({"launch": launch, **summary}))


if __name__ == "__main__":
    app.run(main)
