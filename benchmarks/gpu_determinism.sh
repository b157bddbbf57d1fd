#!/usr/bin/env bash
# On a GPU machine: are two runs of the same train step bit-identical? Each variant runs the bench
# twice (same seed, same synthetic batch) and compares every loss it logs. By default they are
# not (atomics in XLA's scatter-add and cuDNN attention's backward); XLA's deterministic ops
# (--xla_gpu_deterministic_ops=true) crashed the 1B step in jax 0.11.2 (docs/PERFORMANCE.md, "Run-to-run
# determinism on GPU"), so the variants take its parts away one at a time to find the op.
# Usage: bash benchmarks/gpu_determinism.sh   (one GPU; about 8 minutes)
source benchmarks/gpu_env.sh
# run NAME XLA_FLAGS BENCH_FLAGS...: two runs, then one line: identical or not, tokens/s, or the error
run() {
  local name=$1 xf=$2; shift 2
  for i in 1 2; do
    XLA_FLAGS="$xf" timeout 300 python3 -m jaxllmq.bench --bench_steps=10 --bench_warmup=1 \
      --measure_matmul_ceiling=false --json "$@" 2>"$OUT/det-err-$i.txt" | grep '^{' | tail -1 \
      > "$OUT/det-$i.json"
  done
  python3 - "$name" "$OUT" <<'PY'
import json, sys
name, out = sys.argv[1], sys.argv[2]
runs = []
for i in (1, 2):
    text = open(f"{out}/det-{i}.json").read().strip()
    if not text:
        err = [l for l in open(f"{out}/det-err-{i}.txt").read().splitlines() if l.strip()]
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
run "tiny, defaults" "" "${TINY[@]}"
run "tiny, deterministic ops" "$DET" "${TINY[@]}"
run "tiny, deterministic, XLA kernels and attention" "$DET" "${TINY[@]}" --kernels=xla --attention=xla
run "tiny, deterministic, no command buffers" "$DET --xla_gpu_enable_command_buffer=" "${TINY[@]}"
run "1B, defaults" "" "${ONE_B[@]}"
run "1B, deterministic ops" "$DET" "${ONE_B[@]}"
run "1B, deterministic, XLA kernels" "$DET" "${ONE_B[@]}" --kernels=xla
run "1B, deterministic, XLA attention" "$DET" "${ONE_B[@]}" --attention=xla
