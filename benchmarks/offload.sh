#!/usr/bin/env bash
# On the GPU machine: host offload of master weights, Adam moments and residuals.
#   1b     cost of each switch on the 1B, B=8 T=2048: tokens/s and peak memory
#   8b     the 8B preset at T=4096, fp32 master + AdamW moments, every offload on (also with 8
#          micro-batches per step); then without offload (expected not to fit: its error is
#          recorded)
#   8b-switches  the 8B at T=4096 with bf16 weights and moments (fits without offload): the cost
#          of each switch against none
#   14b    qwen2.5-14b on every GPU of the machine (two H200s), ZeRO-3, every offload on
# Usage: bash benchmarks/offload.sh [1b] [8b] [8b-switches] [14b]   (default: 1b 8b);
# results in $OUT. Each section runs in under 10 minutes.
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
SECTIONS="${*:-1b 8b}"
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
ALL="--offload_master --offload_opt_m --offload_opt_v --offload_residual"

# bench LABEL FLAGS...: one line "LABEL<TAB>json" in $OUT/offload.tsv (or the error's last line).
bench() {
  local label=$1; shift
  local line
  line=$(timeout 580 python3 -m jaxllmq.bench --measure_matmul_ceiling=false --json "$@" \
    2>"$OUT/err-$label.txt" | tail -1)
  [[ $line == "{"* ]] || line="{\"error\": $(tail -1 "$OUT/err-$label.txt" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read().strip()[:200]))')}"
  printf '%s\t%s\n' "$label" "$line" | tee -a "$OUT/offload.tsv"
}

if want 1b; then
  echo "== 1B, B=8 T=2048: cost of each switch"
  B1="--model=llama-3.2-1b --batch_size=8 --seq_len=2048 --bench_steps=10"
  bench 1b-none $B1
  for s in master opt_m opt_v residual; do bench "1b-$s" $B1 --offload_$s; done
  bench 1b-all $B1 $ALL
fi

if want 8b; then
  echo "== 8B, B=1 T=4096, fp32 master and moments"
  B8="--model=llama-3.1-8b --batch_size=1 --seq_len=4096 --lmhead_chunks=8 --bench_steps=5 --bench_warmup=2"
  bench 8b-all $B8 $ALL
  bench 8b-all-acc8 $B8 $ALL --grad_accumulation=8
  bench 8b-moments $B8 --offload_opt_m --offload_opt_v
  bench 8b-none $B8
fi

if want 8b-switches; then
  echo "== 8B, B=1 T=4096, bf16 weights and moments: cost of each switch"
  B8="--model=llama-3.1-8b --batch_size=1 --seq_len=4096 --lmhead_chunks=8 --bench_steps=5 --bench_warmup=2"
  B8="$B8 --model_dtype=bfloat16 --opt_m_dtype=bfloat16 --opt_v_dtype=bfloat16"
  bench 8bh-none $B8
  for s in master opt_m opt_v residual; do bench "8bh-$s" $B8 --offload_$s; done
fi

if want 14b; then
  echo "== qwen2.5-14b, B=1 T=4096 per GPU, ZeRO-3 over $(nvidia-smi -L | wc -l) GPUs, every offload on"
  bench 14b-all --model=qwen2.5-14b --batch_size=1 --seq_len=4096 --lmhead_chunks=8 --zero_level=3 \
    --bench_steps=3 --bench_warmup=1 $ALL
fi

python3 - "$OUT/offload.tsv" <<'PY'
import json, sys
rows = dict(line.rstrip("\n").split("\t", 1) for line in open(sys.argv[1]) if "\t" in line)
rows = {label: json.loads(text) for label, text in rows.items()}  # the latest run of each
base = {k.split("-")[0]: r["tokens_per_s"] for k, r in rows.items() if k.endswith("-none") and "error" not in r}
print(f"{'run':<14}{'tokens/s':>11}{'vs none':>9}{'peak GiB':>10}{'step ms':>9}{'compile s':>10}")
for label, r in rows.items():
    if "error" in r:
        print(f"{label:<14}  failed: {r['error'][:90]}")
        continue
    b = base.get(label.split("-")[0])
    rel = f"{r['tokens_per_s'] / b:.2f}x" if b else "-"
    print(f"{label:<14}{r['tokens_per_s']:>11,.0f}{rel:>9}{r['peak_memory_gib_per_device'] or 0:>10.1f}"
          f"{r['step_ms_median']:>9.0f}{r['compile_s']:>10.0f}")
PY
