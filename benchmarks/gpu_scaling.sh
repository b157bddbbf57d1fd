#!/usr/bin/env bash
# On an nvidia-h200-x2 machine: the 1B train step on 1 GPU (XLA and auto kernels), on 2 GPUs in
# one process at ZeRO-1/2/3, and on 2 processes x 1 GPU (ZeRO-1, ZeRO-3). One JSON line per
# run in $OUT/scaling.jsonl; a table at the end.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
common=(--model=llama-3.2-1b --batch_size=8 --seq_len=2048 --bench_steps=12 --json)
bench() { python3 -m jaxllmq.bench "${common[@]}" "$@" 2>"$OUT/err.txt" | tail -1 | tee -a "$OUT/scaling.jsonl" || tail -5 "$OUT/err.txt"; }

bench --gpus=1 --kernels=xla
for z in 1 2 3; do bench --gpus=2 --zero_level=$z --measure_matmul_ceiling=false; done
for z in 1 3; do
  port=$((20000 + RANDOM % 20000))
  for i in 0 1; do
    CUDA_VISIBLE_DEVICES=$i python3 -m jaxllmq.bench "${common[@]}" --zero_level=$z \
      --measure_matmul_ceiling=false --coordinator_address=localhost:$port --num_processes=2 \
      --process_id=$i > "$OUT/proc$i.txt" 2>&1 &
  done
  wait
  tail -1 "$OUT/proc0.txt" | tee -a "$OUT/scaling.jsonl"
done
python3 - "$OUT/scaling.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
base = next((r["tokens_per_s"] for r in rows if r["devices"] == 1 and r["kernels"] == "xla"), None)
print(f"{'gpus':>4} {'procs':>5} {'zero':>4} {'kernels':>7} {'tok/s':>9} {'per-GPU eff':>11} {'MFU':>6} {'GiB/GPU':>8} {'compile s':>9}")
for r in rows:
    eff = r["tokens_per_s"] / (r["devices"] * base) if base else float("nan")
    print(f"{r['devices']:>4} {r['processes']:>5} {r['zero_level']:>4} {r['kernels']:>7} {r['tokens_per_s']:>9,.0f} "
          f"{eff:>11.3f} {100 * r['mfu_spec']:>5.1f}% {r['peak_memory_gib_per_device'] or 0:>8.1f} {r['compile_s']:>9.1f}")
PY
