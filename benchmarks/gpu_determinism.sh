#!/usr/bin/env bash
# On a GPU machine: are two runs of the same train step bit-identical? Each variant runs the bench
# twice (same seed, same synthetic batch) and compares every loss it logs. By default they are
# not (atomics in XLA's scatter-add and cuDNN attention's backward). Under XLA's deterministic
# ops (--xla_gpu_deterministic_ops=true) cuDNN's attention crashes the 1B step in jax 0.11.2, so
# --deterministic sets those ops and takes XLA's attention (docs/PERFORMANCE.md, "Run-to-run
# determinism on GPU: the op, and --deterministic"); the variants show each part.
# The variants are spread over the machine's GPUs; both runs of a variant use the same GPU.
# Usage: bash benchmarks/gpu_determinism.sh   (about 8 minutes on one GPU, 4 on two)
source benchmarks/gpu_env.sh
# run K NAME XLA_FLAGS BENCH_FLAGS...: two runs, then one line in $OUT/det-K.txt: identical or
# not, tokens/s, or the error
run() {
  local k=$1 name=$2 xf=$3; shift 3
  for i in 1 2; do
    XLA_FLAGS="$xf" timeout 300 python3 -m jaxllmq.bench --bench_steps=10 --bench_warmup=1 \
      --measure_matmul_ceiling=false --json "$@" 2>"$OUT/det-err-$k-$i.txt" | grep '^{' | tail -1 \
      > "$OUT/det-$k-$i.json"
  done
  python3 - "$name" "$OUT" "$k" > "$OUT/det-$k.txt" <<'PY'
import json, sys
name, out, k = sys.argv[1:]
runs = []
for i in (1, 2):
    text = open(f"{out}/det-{k}-{i}.json").read().strip()
    if not text:
        err = [l for l in open(f"{out}/det-err-{k}-{i}.txt").read().splitlines() if l.strip()]
        print(f"{name:58} FAILED: {err[-1][:100] if err else '(no output)'}")
        sys.exit()
    runs.append(json.loads(text))
a, b = (r["losses"] for r in runs)
same = "bit-identical" if a == b else f"differ from logged step {next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)}"
print(f"{name:58} {same:24} {runs[0]['tokens_per_s']:>9,.0f} tokens/s  losses {a[:3]}")
PY
}
TINY=(--model=tiny --batch_size=8 --seq_len=512)
ONE_B=(--model=llama-3.2-1b --batch_size=8 --seq_len=2048 --noscan_layers --model_dtype=bfloat16
       --opt_m_dtype=bfloat16 --opt_v_dtype=bfloat16)
DET=--xla_gpu_deterministic_ops=true
VARIANTS=(
  '"tiny, defaults" "" "${TINY[@]}"'
  '"tiny, deterministic ops" "$DET" "${TINY[@]}"'
  '"tiny, deterministic, XLA kernels and attention" "$DET" "${TINY[@]}" --kernels=xla --attention=xla'
  '"1B, defaults" "" "${ONE_B[@]}"'
  '"1B, XLA attention (recomputed)" "" "${ONE_B[@]}" --attention=xla --recompute_att'
  '"1B, deterministic ops (cuDNN attention)" "$DET" "${ONE_B[@]}"'
  '"1B, --deterministic (recomputed XLA attention)" "" "${ONE_B[@]}" --deterministic --recompute_att'
)
G=$(nvidia-smi -L | wc -l)
for ((g = 0; g < G; g++)); do
  (for ((k = g; k < ${#VARIANTS[@]}; k += G)); do
    eval "CUDA_VISIBLE_DEVICES=$g run $k ${VARIANTS[k]}"
  done) &
done
wait
for ((k = 0; k < ${#VARIANTS[@]}; k++)); do cat "$OUT/det-$k.txt"; done
