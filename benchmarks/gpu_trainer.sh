#!/usr/bin/env bash
# On the GPU machine: the 1B step benchmark (scan and unrolled), and the llama-3.2-1b-pretrain
# flagfile for 300 steps on the quickstart corpus. Logs go to $OUT.
# Usage: bash benchmarks/gpu_trainer.sh [bench] [kernels] [checkpoint] [speed] [profile] [8b] [pretrain]
# (default: bench pretrain)
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import jax, flax, optax, orbax.checkpoint as o; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, jax.devices())'

want() { [[ " $SECTIONS " == *" $1 "* ]]; }
SECTIONS="${*:-bench pretrain}"

if want bench; then
echo "== bench 1B, B=8 T=2048 (scan, then unrolled)"
for scan in true false; do
  python3 -m jaxllmq.bench --model=llama-3.2-1b --batch_size=8 --seq_len=2048 \
    --scan_layers=$scan --bench_steps=20 --json 2>&1 | tail -1 | tee -a "$OUT/bench.jsonl"
done
fi

if want kernels; then
echo "== bench 1B, B=8 T=2048, scanned: XLA kernels vs --kernels=auto (Pallas on one GPU)"
for k in xla auto; do
  python3 -m jaxllmq.bench --model=llama-3.2-1b --batch_size=8 --seq_len=2048 \
    --kernels=$k --bench_steps=20 --json 2>"$OUT/err-$k.txt" | tail -1 | tee -a "$OUT/kernels.jsonl" || tail -5 "$OUT/err-$k.txt"
done
fi

if want checkpoint; then
echo "== async checkpoint overhead, 1B"
python3 benchmarks/checkpoint_overhead.py 2>&1 | tail -16 | tee "$OUT/checkpoint.txt"
echo "== the pretrain flagfile for 300 steps on random tokens: no checkpoints, then one every 100"
mkdir -p /tmp/ckdata && python3 -c 'import numpy as np; from jaxllmq.data.shards import write_shard
write_shard("/tmp/ckdata/train.bin", np.random.default_rng(0).integers(0, 128256, 5_000_000, dtype=np.int32), vocab_size=128256)'
for every in 0 100; do
  rm -rf /tmp/ckrun
  python3 -m jaxllmq.main --flagfile=configs/llama-3.2-1b-pretrain.flags ${CADENCE_FLAGS:-} \
    --train_file=/tmp/ckdata/train.bin --eval_file= --steps=300 --grad_accumulation=1 --warmup=30 --cooldown=100 \
    --out_dir= --checkpoint_dir=/tmp/ckrun --ckpt_interval=$every --log_file="$OUT/cadence-$every.jsonl" \
    > "$OUT/cadence-$every.txt" 2>&1 || { echo "exit $?"; tail -5 "$OUT/cadence-$every.txt"; }
done
python3 - "$OUT"/cadence-0.jsonl "$OUT"/cadence-100.jsonl <<'PY'
import json, sys
for path in sys.argv[1:]:
    recs = [json.loads(line) for line in open(path)]
    steps = [r for r in recs if r["log"] == "step" and r["step"] > 20]
    saves = [r for r in recs if r["log"] == "checkpoint"]
    tps = sum(r["tokens"] for r in steps) / sum(r["duration_ms"] / 1000 for r in steps)
    print(f"{path}: {tps:,.0f} tokens/s over steps 21-{steps[-1]['step']} (wall), {len(saves)} saves")
PY
fi

if want speed; then
echo "== peer (transformers + torch.compile, bf16) and jaxllmq variants, 1B, B=8 T=2048"
timeout 240 python3 benchmarks/peer_torch.py --model=llama-3.2-1b 2>"$OUT/err-peer.txt" | tail -1 | tee -a "$OUT/speed.jsonl" || tail -5 "$OUT/err-peer.txt"
for variant in "--noscan_layers" "--model_dtype=bfloat16 --opt_m_dtype=bfloat16 --opt_v_dtype=bfloat16" \
               "--noscan_layers --model_dtype=bfloat16 --opt_m_dtype=bfloat16 --opt_v_dtype=bfloat16"; do
  python3 -m jaxllmq.bench --model=llama-3.2-1b --batch_size=8 --seq_len=2048 --bench_steps=20 \
    --measure_matmul_ceiling=false --json $variant 2>"$OUT/err-speed.txt" | tail -1 | tee -a "$OUT/speed.jsonl" || tail -5 "$OUT/err-speed.txt"
done
fi

if want profile; then
echo "== where the 1B step's time goes, and variants (B=8 T=2048, unrolled, bf16 weights+moments)"
BASE="--model=llama-3.2-1b --batch_size=8 --seq_len=2048 --noscan_layers --model_dtype=bfloat16 --opt_m_dtype=bfloat16 --opt_v_dtype=bfloat16 --bench_steps=20 --measure_matmul_ceiling=false --json"
run() {  # name, env..., -- bench flags...
  local name=$1; shift; local envs=(); while [[ $1 != -- ]]; do envs+=("$1"); shift; done; shift
  env "${envs[@]}" python3 -m jaxllmq.bench $BASE "$@" 2>"$OUT/prof-$name.txt" | tail -1 | \
    with_fields variant="$name" | tee -a "$OUT/profile.jsonl"
  grep -A30 "device kernel time" "$OUT/prof-$name.txt" | head -30
}
run base A=1 -- --profile_steps=3
run triton_gemm XLA_FLAGS=--xla_gpu_enable_triton_gemm=true --
timeout 240 python3 benchmarks/peer_torch.py --model=llama-3.2-1b 2>"$OUT/err-peer.txt" | tail -1 | tee -a "$OUT/profile.jsonl" || tail -5 "$OUT/err-peer.txt"
python3 - "$OUT/profile.jsonl" <<'PY'
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    name = r.get("variant", "peer")
    print(f"{name:>16} {r['tokens_per_s']:>9,.0f} tok/s  {r.get('step_ms_median', 0):7.1f} ms  "
          f"mem {r.get('peak_memory_gib_per_device') or r.get('peak_memory_gib', 0):5.1f} GiB  compile {r.get('compile_s', 0):5.1f} s")
PY
fi

if want 8b; then
echo "== the 8B preset's largest micro-batch (T=2048, bf16 weights and moments), without and with --recompute_block"
# Largest first; the first that compiles and runs is the answer (an OOM fails the bench fast).
probe() {  # label, batch sizes, flags...
  local label=$1 sizes=$2; shift 2
  for b in $sizes; do
    if python3 -m jaxllmq.bench --model=llama-3.1-8b --batch_size=$b --seq_len=2048 --noscan_layers \
        --model_dtype=bfloat16 --opt_m_dtype=bfloat16 --opt_v_dtype=bfloat16 --bench_steps=5 \
        --bench_warmup=1 --measure_matmul_ceiling=false --json "$@" 2>"$OUT/err-8b.txt" | grep '^{' | tail -1 | \
        with_fields label="$label" >> "$OUT/8b.jsonl"; then
      echo "$label: batch $b fits"; return
    fi
    echo "$label: batch $b does not fit ($(grep -o 'RESOURCE_EXHAUSTED[^.]*' "$OUT/err-8b.txt" | head -1))"
  done
}
probe no-recompute "8 6 4 3 2 1"
probe recompute-block "32 24 16 12 8" --recompute_block
python3 - "$OUT/8b.jsonl" <<'PY'
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    print(f"{r['label']:>16} B={r['batch_size']:>3} {r['tokens_per_s']:>8,.0f} tok/s  MFU {100 * r['mfu_spec']:.1f}%  "
          f"{r['peak_memory_gib_per_device']:.1f} GiB  step {r['step_ms_median']:.0f} ms  compile {r['compile_s']:.0f} s")
PY
fi

if want pretrain; then
echo "== pretrain flagfile, 300 steps on the quickstart corpus"
python3 -m jaxllmq.data.prepare --quickstart --out_dir=/tmp/qs > "$OUT/prepare.txt" 2>&1 || { tail "$OUT/prepare.txt"; exit 1; }
python3 -m jaxllmq.main --flagfile=configs/llama-3.2-1b-pretrain.flags \
  --train_file='/tmp/qs/train-*.bin' --eval_file=/tmp/qs/eval.bin --steps=300 --grad_accumulation=1 \
  --warmup=30 --cooldown=100 --eval_every_n_steps=100 --eval_num_steps=5 \
  --out_dir=/tmp/run/model --log_file="$OUT/pretrain.jsonl" > "$OUT/pretrain.txt" 2>&1
echo "exit $?"; tail -5 "$OUT/pretrain.txt"
python3 - "$OUT/pretrain.jsonl" <<'PY'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1])]
steps = [r for r in recs if r["log"] == "step" and r["step"] > 10]
tps = statistics.median(r["tokens_per_s"] for r in steps)
mfu = statistics.median(r["mfu"] for r in steps)
print(f"pretrain: median {tps:,.0f} tokens/s, MFU {100 * mfu:.1f}% over steps 11-{steps[-1]['step']}")
print("evals:", [(r["step"], round(r["loss"], 3)) for r in recs if r["log"] == "eval"])
PY
fi
