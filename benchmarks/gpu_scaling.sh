#!/usr/bin/env bash
# On a machine of two H200s: the 1B train step (unrolled layers, as the pretrain flagfile) on
# 1 GPU, on 2 GPUs in one process at ZeRO-1/2/3 (the 2-GPU ZeRO-1 run also profiled: NCCL time),
# and on 2 processes x 1 GPU (fp32: ZeRO-1 and 3; bf16: ZeRO-1, 2 and 3); fp32 master weights,
# then pure bf16 weights and moments. One JSON line per run in $OUT/scaling.jsonl; a table at the
# end. Efficiency is against one GPU with the same weights and kernels (as auto picks on several
# GPUs: the RMSNorm in XLA, see kernels/), the mean of a run on each GPU alone.
# NCCL settings pass through the environment, e.g. `NCCL_PROTO=Simple bash benchmarks/gpu_scaling.sh`
# (the 04:47 UTC profile showed the per-layer all-reduces running NCCL's ring LL protocol).
# Usage: bash benchmarks/gpu_scaling.sh [fp32] [bf16] [tune] [fp8]   (default: fp32 bf16)
#   tune: bf16 ZeRO-1 and ZeRO-2 on 2 GPUs under each of $TUNE's settings (env assignments,
#         ";"-separated; A=1 is the defaults), with $TUNE_FLAGS added (e.g. --profile_steps=2:
#         the table then shows the NCCL time no other kernel overlapped); COLLECTIVES=1 first
#         measures the links' bus bandwidth alone (benchmarks/collectives.py)
#   fp8:  e4m3 (bf16 weights and moments) on 1 GPU, then on 2 at ZeRO-1 and 3 with the fp8
#         quantize pass in XLA and as the per-device Pallas kernel (shard_map, auto)
source benchmarks/gpu_env.sh
SECTIONS="${*:-fp32 bf16}"
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
env | grep -E "^(NCCL|XLA)_" || true
common=(--model=llama-3.2-1b --batch_size=8 --seq_len=2048 --noscan_layers --bench_steps=12
        --measure_matmul_ceiling=false --json)
tag() { with_fields variant="${VARIANT:-}"; }
# bench FLAGS...: one tagged JSON line in $OUT/scaling.jsonl; $SETTING (one NAME=value) is set for it
bench() { env ${SETTING:+"$SETTING"} python3 -m jaxllmq.bench "${common[@]}" "$@" 2>"$OUT/err.txt" | grep '^{' | tail -1 | tag | tee -a "$OUT/scaling.jsonl" || tail -5 "$OUT/err.txt"; }
# base FLAGS...: the one-GPU base on each GPU in turn (their rates differ by up to 1.5%, and a
# two-GPU step runs at the slower one's pace); efficiency is against their mean
base() { for g in 0 1; do SETTING=CUDA_VISIBLE_DEVICES=$g VARIANT=base bench --gpus=1 "$@"; done; }
two_procs() {  # ZeRO level, extra flags...
  local z=$1; shift; local port=$((20000 + RANDOM % 20000))
  for i in 0 1; do
    CUDA_VISIBLE_DEVICES=$i python3 -m jaxllmq.bench "${common[@]}" --zero_level=$z "$@" \
      --coordinator_address=localhost:$port --num_processes=2 --process_id=$i > "$OUT/proc$i-z$z.txt" 2>&1 &
  done
  wait
  grep '^{' "$OUT/proc0-z$z.txt" | tail -1 | tee -a "$OUT/scaling.jsonl"
}

if want fp32; then
  base --kernels=rms_norm=xla
  bench --gpus=2 --zero_level=1 --profile_steps=2
  grep -A14 "device kernel time" "$OUT/err.txt"
  for z in 2 3; do bench --gpus=2 --zero_level=$z; done
  bench --gpus=2 --zero_level=3 --kernels=lm_head_loss=xla  # XLA's loss, as auto picked before 2026-12-01
  for z in 1 3; do two_procs $z; done
fi
if want bf16; then
  BF16=(--model_dtype=bfloat16 --opt_m_dtype=bfloat16 --opt_v_dtype=bfloat16)
  base --kernels=rms_norm=xla "${BF16[@]}"
  bench --gpus=2 --zero_level=1 --profile_steps=2 "${BF16[@]}"
  grep -A14 "device kernel time" "$OUT/err.txt"
  for z in 2 3; do bench --gpus=2 --zero_level=$z "${BF16[@]}"; done
  for z in 1 2 3; do two_procs $z "${BF16[@]}"; done
fi
TUNE=${TUNE:-"A=1;NCCL_MAX_NCHANNELS=4;NCCL_MAX_NCHANNELS=8"}
if want tune; then
  [[ -n ${COLLECTIVES:-} ]] && python3 benchmarks/collectives.py 2>&1 | tail -13
  BF16=(--model_dtype=bfloat16 --opt_m_dtype=bfloat16 --opt_v_dtype=bfloat16)
  base --kernels=rms_norm=xla "${BF16[@]}"
  IFS=";" read -r -a settings <<< "$TUNE"
  for setting in "${settings[@]}"; do
    for z in 1 2; do SETTING=$setting VARIANT=$setting bench --gpus=2 --zero_level=$z "${BF16[@]}" ${TUNE_FLAGS:-}; done
  done
fi
if want fp8; then
  FP8=(--model_dtype=bfloat16 --opt_m_dtype=bfloat16 --opt_v_dtype=bfloat16 --matmul_dtype=e4m3)
  base --kernels=rms_norm=xla,fp8_quantize=xla "${FP8[@]}"  # the base: XLA's quantize pass
  VARIANT="quantize pallas" bench --gpus=1 --kernels=rms_norm=xla,fp8_quantize=pallas "${FP8[@]}"
  for z in 1 3; do
    VARIANT="quantize xla" bench --gpus=2 --zero_level=$z --kernels=fp8_quantize=xla "${FP8[@]}"
    VARIANT="quantize pallas" bench --gpus=2 --zero_level=$z --kernels=fp8_quantize=pallas "${FP8[@]}"
  done
fi
python3 - "$OUT/scaling.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
key = lambda r: (r["model_dtype"], r.get("linear_dtype"))
runs = {}
for r in rows:
    if r.get("variant") == "base":
        runs.setdefault(key(r), []).append(r["tokens_per_s"])
base = {k: sum(v) / len(v) for k, v in runs.items()}  # the mean over the GPUs
print(f"{'weights':>8} {'kernels':>20} {'gpus':>4} {'procs':>5} {'zero':>4} {'tok/s':>9} {'per-GPU eff':>11} {'MFU':>6} {'GiB/GPU':>8} {'step ms':>8} {'exposed':>7}  setting")
for r in rows:
    eff = r["tokens_per_s"] / (r["devices"] * base[key(r)]) if key(r) in base else float("nan")
    exposed = r.get("profile", {}).get("exposed_nccl_ms_per_step", float("nan"))
    print(f"{r['model_dtype']:>8} {r['kernels']:>20} {r['devices']:>4} {r['processes']:>5} {r['zero_level']:>4} {r['tokens_per_s']:>9,.0f} "
          f"{eff:>11.3f} {100 * r['mfu_spec']:>5.1f}% {r['peak_memory_gib_per_device'] or 0:>8.1f} {r['step_ms_median']:>8.1f} {exposed:>7.1f}  {r.get('variant', '')[:60]}")
PY
