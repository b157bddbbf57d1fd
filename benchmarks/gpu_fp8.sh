#!/usr/bin/env bash
# bf16 vs e4m3 with current vs delayed fp8 scaling (--fp8_scaling), on an H200 machine.
#   speed:  per model of $MODELS (1B, 3B; 8 x 2048, unrolled, bf16 weights and moments as gpu_tables.sh),
#           tokens/s for each of $SPEED (bf16, e4m3-current, e4m3-delayed, and e4m3-delayed-xlanorm:
#           the RMSNorms in XLA, whose fusions can take in the quantize that a Pallas norm's output
#           needs a pass of its own for); the e4m3 runs with --profile_steps=3,
#           their kernel-time breakdown in $OUT/profile-<label>.txt. Before the 1B runs, fp8_check
#           with each scaling (every block linear a cuBLASLt fp8 GEMM; the quantize fusions).
#   curves: the pretrain flagfile for $STEPS (500) steps on the quickstart corpus, the same data
#           for each of $CURVES (bf16 e4m3-current e4m3-delayed): JSONL logs $OUT/curve-<v>.jsonl,
#           final eval losses against bf16, the curves in $OUT/fp8_vs_bf16.png.
# The runs of a section are spread over the machine's GPUs, one queue per GPU. On two H200s:
#   bash benchmarks/gpu_fp8.sh speed    (about 5 min)
#   bash benchmarks/gpu_fp8.sh curves   (about 7 min: two curves side by side, then the third)
source benchmarks/gpu_env.sh
STEPS=${STEPS:-500}
read -r -a CURVES <<< "${CURVES:-bf16 e4m3-current e4m3-delayed}"
read -r -a SPEED <<< "${SPEED:-bf16 e4m3-current e4m3-delayed e4m3-delayed-xlanorm}"
read -r -a MODELS <<< "${MODELS:-llama-3.2-1b llama-3.2-3b}"
SECTIONS="${*:-speed curves}"
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
GPUS=$(nvidia-smi -L | wc -l)
BF16=(--noscan_layers --model_dtype=bfloat16 --opt_m_dtype=bfloat16 --opt_v_dtype=bfloat16
      --measure_matmul_ceiling=false --bench_steps=15 --json)

variant() {  # bf16 | e4m3-<current|delayed>[-xlanorm|-pallasq]: its flags
  # -xlanorm: RMSNorms in XLA; -pallasq: fp8 quantize by the Pallas pass (kernels/fp8_quantize.py)
  case $1 in
    bf16) echo "--matmul_dtype=bfloat16" ;;
    e4m3-*-xlanorm) local s=${1#e4m3-}; echo "--matmul_dtype=e4m3 --fp8_scaling=${s%-xlanorm} --kernels=rms_norm=xla" ;;
    e4m3-*-pallasq) local s=${1#e4m3-}; echo "--matmul_dtype=e4m3 --fp8_scaling=${s%-pallasq} --kernels=fp8_quantize=pallas" ;;
    e4m3-*) echo "--matmul_dtype=e4m3 --fp8_scaling=${1#e4m3-}" ;;
  esac
}

queues() {  # fn, items...: `fn GPU ITEM` for each item, GPU g taking items g, g+GPUS, ...
  local fn=$1; shift
  local items=("$@") g i
  for ((g = 0; g < GPUS && g < ${#items[@]}; g++)); do
    ( for ((i = g; i < ${#items[@]}; i += GPUS)); do $fn $g "${items[i]}"; done ) &
  done
  wait
}

speed_model() {  # gpu, model
  local gpu=$1 m=$2 v label batch=8
  [[ $m == llama-3.1-8b ]] && batch=4  # as the 8B rows of docs/PERFORMANCE.md (fits e4m3, bf16)
  if [[ $m == llama-3.2-1b ]]; then
    for s in current delayed; do
      CUDA_VISIBLE_DEVICES=$gpu timeout 240 python3 benchmarks/fp8_check.py --model=$m \
        --matmul_dtype=e4m3 --fp8_scaling=$s --batch_size=8 --seq_len=2048 --scan_layers=false \
        >"$OUT/fp8_check-$s.txt" 2>"$OUT/err-fp8check-$s.txt"
    done
  fi
  for v in "${SPEED[@]}"; do
    label=$m-$v
    local prof=()
    [[ $v == e4m3-* ]] && prof=(--profile_steps=3)
    # shellcheck disable=SC2046
    CUDA_VISIBLE_DEVICES=$gpu timeout 240 python3 -m jaxllmq.bench --model=$m --batch_size=$batch \
      --seq_len=2048 $(variant $v) "${prof[@]}" "${BF16[@]}" 2>"$OUT/err-$label.txt" | grep '^{' | \
      tail -1 | with_fields label="$label" >> "$OUT/fp8_speed.jsonl" || tail -3 "$OUT/err-$label.txt"
    grep -A24 "device kernel time" "$OUT/err-$label.txt" > "$OUT/profile-$label.txt"
  done
}

curve() {  # gpu, variant
  # shellcheck disable=SC2046
  CUDA_VISIBLE_DEVICES=$1 timeout 540 python3 -m jaxllmq.main \
    --flagfile=configs/llama-3.2-1b-pretrain.flags --train_file='/tmp/qs/train-*.bin' \
    --eval_file=/tmp/qs/eval.bin --steps="$STEPS" --grad_accumulation=1 --warmup=50 \
    --cooldown=100 --eval_every_n_steps=100 --eval_num_steps=5 --name="curve-$2" \
    --out_dir="/tmp/run-$2" --log_file="$OUT/curve-$2.jsonl" $(variant "$2") \
    >"$OUT/curve-$2.txt" 2>&1
  echo "curve $2: exit $?"; tail -2 "$OUT/curve-$2.txt"
}

if want speed; then
  echo "== speed: ${SPEED[*]}; ${MODELS[*]}; 8 x 2048 ($GPUS GPUs)"
  queues speed_model "${MODELS[@]}"
  for s in current delayed; do echo "-- fp8_check --fp8_scaling=$s"; tail -14 "$OUT/fp8_check-$s.txt"; done
  python3 - "$OUT/fp8_speed.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
base = {r["model"]: r["tokens_per_s"] for r in rows if r["label"].endswith("-bf16")}
print(f"{'run':>26} {'tok/s':>9} {'x bf16':>7} {'MFU':>6} {'GiB':>6} {'step ms':>8} {'sd':>5} {'compile':>7} {'kernel ms':>9}")
for r in sorted(rows, key=lambda r: r["label"]):
    k = r.get("profile", {}).get("device_ms_per_step", float("nan"))
    print(f"{r['label']:>26} {r['tokens_per_s']:>9,.0f} {r['tokens_per_s'] / base.get(r['model'], float('nan')):>7.3f} "
          f"{100 * r['mfu_spec']:>5.1f}% {r['peak_memory_gib_per_device']:>6.1f} {r['step_ms_median']:>8.1f} "
          f"{r['step_ms_stdev']:>5.2f} {r['compile_s']:>7.1f} {k:>9.1f}")
PY
  for f in "$OUT"/profile-*e4m3*.txt; do echo "-- $f"; head -12 "$f"; done
fi

if want curves; then
  echo "== curves: ${CURVES[*]}, $STEPS steps of the 1B pretrain flagfile on the quickstart corpus"
  python3 -m jaxllmq.data.prepare --quickstart --out_dir=/tmp/qs >"$OUT/prepare.txt" 2>&1 \
    || { tail "$OUT/prepare.txt"; exit 1; }
  queues curve "${CURVES[@]}"
  logs=("${CURVES[@]/#/$OUT/curve-}"); logs=("${logs[@]/%/.jsonl}")
  python3 - "${logs[@]}" <<'PY'
import json, statistics, sys
final = {}
for path in sys.argv[1:]:
    recs = [json.loads(l) for l in open(path)]
    evals = [r for r in recs if r["log"] == "eval"]
    steps = [r for r in recs if r["log"] == "step" and r["step"] > 10]
    name = path.rsplit("curve-", 1)[1].removesuffix(".jsonl")
    final[name] = evals[-1]["loss"] if evals else float("nan")
    tps = statistics.median(r["tokens_per_s"] for r in steps) if steps else float("nan")
    print(f"{name:>14}: evals {[(r['step'], round(r['loss'], 4)) for r in evals]}, median {tps:,.0f} tok/s")
ref = final.get("bf16")
for name, loss in final.items():
    if ref and name != "bf16":
        print(f"{name:>14}: final eval loss {loss:.4f} vs bf16 {ref:.4f}: {100 * (loss - ref) / ref:+.2f}%")
PY
  names=$(IFS=,; echo "${CURVES[*]}")
  python3 -m jaxllmq.plot "${logs[@]}" --names="$names" --out="$OUT/fp8_vs_bf16.png" \
    || echo "no plot here; locally: python -m jaxllmq.plot ${logs[*]} --names=$names --out=docs/fp8_vs_bf16.png"
fi
