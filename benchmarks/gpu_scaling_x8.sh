#!/usr/bin/env bash
# Scaling past two GPUs, on a machine of eight H200s of one host; on fewer GPUs (four) it runs
# what they allow, with G = the number of GPUs. Sections, each under 10 minutes:
#   1b     Llama-3.2-1B shapes, B=8 x 2048 per GPU, unrolled, bf16 weights and moments (as the
#          two-GPU tables): tokens/s per GPU on 1, 2, 4 and 8 GPUs (up to G) at ZeRO-1/2/3,
#          efficiency 1 -> N against one GPU: the mean of a run on each GPU alone, all at once
#          (the GPUs of one host differ by up to 1.5%, and a step runs at the slowest one's pace)
#   8b     Llama-3.1-8B shapes, seq 8192, B=1 per GPU, ZeRO-3 on G GPUs, bf16 and e4m3 (the fp8
#          quantize pass per GPU in Pallas, as auto picks, then in XLA; with --recompute_block
#          only if the plain run does not fit), then TP=2 x ZeRO-3 and TP=G
#   procs  G processes x 1 GPU through launch/local.sh against 1 process x G GPUs: the same
#          20 training steps of the 1B on the quickstart corpus, losses compared step by step
# Usage: bash benchmarks/gpu_scaling_x8.sh [1b] [8b] [procs]   (default: all; JSON in $OUT)
source benchmarks/gpu_env.sh
export NCCL_NVLS_ENABLE=0
nvidia-smi topo -m | head -10
G=$(nvidia-smi -L | wc -l)
SECTIONS="${*:-1b 8b procs}"
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
bench() {  # label, flags... -> one JSON line (with "label") in $OUT/x8.jsonl; returns non-zero on failure
  local label=$1; shift
  python3 -m jaxllmq.bench --measure_matmul_ceiling=false --json "$@" 2>"$OUT/err-$label.txt" | grep '^{' | tail -1 | \
    with_fields label="$label" \
    | tee -a "$OUT/x8.jsonl" || { echo "$label failed: $(grep -m1 -o 'RESOURCE_EXHAUSTED.\{0,80\}\|Error.\{0,120\}' "$OUT/err-$label.txt")"; return 1; }
}

if want 1b; then
  B1=(--model=llama-3.2-1b --batch_size=8 --seq_len=2048 --noscan_layers --bench_steps=12
      --model_dtype=bfloat16 --opt_m_dtype=bfloat16 --opt_v_dtype=bfloat16)
  # The base runs the kernels auto picks on several GPUs: the RMSNorm in XLA (kernels/).
  for ((i = 0; i < G; i++)); do
    CUDA_VISIBLE_DEVICES=$i bench "1b-g1-gpu$i" "${B1[@]}" --gpus=1 --kernels=rms_norm=xla &
  done
  wait
  for g in 2 4 8; do
    ((g > G)) && break
    for z in 1 2 3; do bench "1b-g$g-z$z" "${B1[@]}" --gpus=$g --zero_level=$z; done
  done
fi

if want 8b; then
  B8=(--model=llama-3.1-8b --batch_size=1 --seq_len=8192 --noscan_layers --gpus=$G --bench_steps=8 --bench_warmup=2)
  for mm in bfloat16 e4m3 e4m3-xlaq; do  # e4m3-xlaq: the fp8 quantize pass in XLA
    f=(--matmul_dtype=${mm%-xlaq})
    [[ $mm == *-xlaq ]] && f+=(--kernels=fp8_quantize=xla)
    bench "8b-z3-$mm" "${B8[@]}" --zero_level=3 "${f[@]}" ||
      bench "8b-z3-$mm-recompute" "${B8[@]}" --zero_level=3 "${f[@]}" --recompute_block
  done
  bench 8b-tp2-z3 "${B8[@]}" --zero_level=3 --tensor_parallel=2
  bench "8b-tp$G" "${B8[@]}" --zero_level=1 --tensor_parallel=$G
fi

if want procs; then
  python3 -m jaxllmq.data.prepare --quickstart --out_dir=/tmp/qs > "$OUT/prepare.txt" 2>&1 || { tail -3 "$OUT/prepare.txt"; exit 1; }
  # No eval: the quickstart's eval set (16 windows of 2049 tokens) is smaller than one global batch.
  RUN=(--flagfile=configs/llama-3.2-1b-pretrain.flags --train_file='/tmp/qs/train-*.bin' --eval_file=
       --steps=20 --grad_accumulation=1 --warmup=5 --cooldown=5 --out_dir=)
  python3 -m jaxllmq.main "${RUN[@]}" --name=one --log_file="$OUT/one-process.jsonl" > "$OUT/one.txt" 2>&1
  echo "1 process x $G GPUs: exit $?"
  launch/local.sh "$G" "${RUN[@]}" --name=many --log_file="$OUT/many-processes.jsonl" > "$OUT/many.txt" 2>&1
  echo "$G processes x 1 GPU: exit $?"
  python3 - "$OUT/one-process.jsonl" "$OUT/many-processes.jsonl" <<'PY'
import json, sys
loss = lambda f: {r["step"]: r["loss"] for r in map(json.loads, open(f)) if r.get("log") == "step"}
a, b = loss(sys.argv[1]), loss(sys.argv[2])
diffs = [abs(a[s] - b[s]) / abs(a[s]) for s in sorted(a) if s in b]
print(f"steps compared {len(diffs)}; max relative loss difference {max(diffs):.2e}; "
      f"step 20: {a.get(20)} vs {b.get(20)}")
PY
fi

python3 - "$OUT/x8.jsonl" <<'PY'
import json, os, sys
if not os.path.exists(sys.argv[1]):
    sys.exit()
rows = [json.loads(l) for l in open(sys.argv[1])]
bases = [r["tokens_per_s"] for r in rows if r["label"].startswith("1b-g1-gpu")]
one = sum(bases) / len(bases) if bases else None
print(f"{'run':>22} {'GPUs':>4} {'tok/s':>10} {'tok/s/GPU':>10} {'eff':>6} {'MFU':>6} {'GiB/GPU':>8} {'step ms':>8}")
for r in rows:
    per = r["tokens_per_s"] / r["devices"]
    eff = f"{per / one:.3f}" if one and r["model"] == "llama-3.2-1b" else "-"
    print(f"{r['label']:>22} {r['devices']:>4} {r['tokens_per_s']:>10,.0f} {per:>10,.0f} {eff:>6} "
          f"{100 * r['mfu_spec']:>5.1f}% {r['peak_memory_gib_per_device']:>8.1f} {r['step_ms_median']:>8.1f}")
PY
