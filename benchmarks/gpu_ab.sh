#!/usr/bin/env bash
# A/B two versions of the package on one machine's GPUs, each run once on every GPU (the GPUs of
# one host differ by up to 1.5%): round 1 runs A on the even GPUs and B on the odd ones, round 2
# swaps them. Each version is a directory holding a `jaxllmq/` package, e.g. made beside the
# repository before the call (untracked directories travel with the working tree):
#   mkdir -p ab/a ab/b && git archive main jaxllmq | tar -x -C ab/a \
#     && git archive exp/x jaxllmq | tar -x -C ab/b
# Usage: bash benchmarks/gpu_ab.sh DIR_A DIR_B [bench flags...]   (default flags: the 1B step of
# docs/PERFORMANCE.md); one JSON line per run in $OUT/ab.jsonl, a table at the end. A_FLAGS and
# B_FLAGS (space-separated) add flags to one side only, e.g. B_FLAGS=--kernels=lm_head_loss=xla
# (then DIR_A and DIR_B may be the same directory).
source benchmarks/gpu_env.sh
A=$(realpath "${1:?usage: gpu_ab.sh DIR_A DIR_B [bench flags...]}") B=$(realpath "${2:?DIR_B}")
shift 2
FLAGS=("$@")
((${#FLAGS[@]})) || FLAGS=(--model=llama-3.2-1b --batch_size=8 --seq_len=2048 --noscan_layers
  --model_dtype=bfloat16 --opt_m_dtype=bfloat16 --opt_v_dtype=bfloat16 --bench_steps=20)
G=$(nvidia-smi -L | wc -l)
read -r -a SIDE_A <<< "${A_FLAGS:-}"
read -r -a SIDE_B <<< "${B_FLAGS:-}"
run() {  # label dir gpu
  local -n side="SIDE_$1"
  (cd "$2" && CUDA_VISIBLE_DEVICES=$3 PYTHONPATH=/tmp/site:$2 timeout 500 python3 -m jaxllmq.bench \
    --measure_matmul_ceiling=false --json "${FLAGS[@]}" "${side[@]}" 2>"$OUT/err-$1-gpu$3.txt") | grep '^{' |
    with_fields ab="$1" gpu="$3" \
    >> "$OUT/ab.jsonl" || echo "$1 on GPU $3 failed: $(tail -1 "$OUT/err-$1-gpu$3.txt")"
}
for round in 0 1; do
  for ((g = 0; g < G; g++)); do
    if (((g + round) % 2 == 0)); then run A "$A" $g & else run B "$B" $g & fi
  done
  wait
done
python3 - "$OUT/ab.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in sorted(rows, key=lambda r: (r["gpu"], r["ab"])):
    print(f"GPU {r['gpu']} {r['ab']}: {r['tokens_per_s']:>10,.0f} tokens/s  step {r['step_ms_median']:6.1f} ms  peak {r['peak_memory_gib_per_device'] or 0:.1f} GiB")
by = {v: {r["gpu"]: r["tokens_per_s"] for r in rows if r["ab"] == v} for v in "AB"}
both = sorted(set(by["A"]) & set(by["B"]))
if both:
    ratios = [by["B"][g] / by["A"][g] for g in both]
    print(f"B / A per GPU: {', '.join(f'{x:.4f}' for x in ratios)}; mean {statistics.mean(ratios):.4f}")
PY
