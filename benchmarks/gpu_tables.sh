#!/usr/bin/env bash
# On a machine of two H200s, two independent single-GPU streams side by side:
#   GPU 0: jaxllmq's 1B step with each kernel choice, the peer's shape table (qwen2.5-0.5b,
#          llama-3.2-3b, 1B at T=4096/8192; unrolled, pure bf16), the scanned 1B's compile time,
#          and fp8 (the HLO check, then e4m3 tokens/s on 1B and 3B);
#   GPU 1: the peer (transformers + torch.compile, bf16) on the same shapes.
# JSON lines in $OUT/jax.jsonl and $OUT/peer.jsonl; a table at the end.
# ONLY_SHAPES=1: the shape table alone (auto kernels; no kernel choices, scanned row or fp8).
# SWAP=1: jaxllmq on GPU 1 and the peer on GPU 0 (the GPUs of one host differ by up to 1.5%).
source benchmarks/gpu_env.sh
JG=0 PG=1
[[ ${SWAP:-0} == 1 ]] && JG=1 PG=0
nvidia-smi topo -m | head -4
SHAPES=("llama-3.2-1b 8 2048" "llama-3.2-3b 8 2048" "qwen2.5-0.5b 8 2048" "llama-3.2-1b 4 4096" "llama-3.2-1b 2 8192")
BF16=(--noscan_layers --model_dtype=bfloat16 --opt_m_dtype=bfloat16 --opt_v_dtype=bfloat16 --measure_matmul_ceiling=false --bench_steps=15 --json)

peers() {
  for s in "${SHAPES[@]}"; do
    read -r m b t <<< "$s"
    CUDA_VISIBLE_DEVICES=$PG timeout 200 python3 benchmarks/peer_torch.py --model=$m --batch_size=$b --seq_len=$t \
      2>>"$OUT/err-peer.txt" | grep '^{' | tail -1 >> "$OUT/peer.jsonl"
  done
}
jb() {  # label, bench flags...
  local label=$1; shift
  CUDA_VISIBLE_DEVICES=$JG python3 -m jaxllmq.bench "$@" 2>"$OUT/err-$label.txt" | grep '^{' | tail -1 | \
    with_fields label="$label" >> "$OUT/jax.jsonl" \
    || tail -3 "$OUT/err-$label.txt"
}
peers &
if [[ ${ONLY_SHAPES:-0} == 1 ]]; then
  jb "1b" --model=llama-3.2-1b --batch_size=8 --seq_len=2048 "${BF16[@]}"
else
  for k in pallas xla rms_norm=pallas,lm_head_loss=xla; do
    jb "1b-kernels=$k" --model=llama-3.2-1b --batch_size=8 --seq_len=2048 --kernels=$k "${BF16[@]}"
  done
fi
for s in "${SHAPES[@]:1}"; do
  read -r m b t <<< "$s"
  jb "$m-$b-$t" --model=$m --batch_size=$b --seq_len=$t "${BF16[@]}"
done
if [[ ${ONLY_SHAPES:-0} != 1 ]]; then
  jb "1b-scanned" --model=llama-3.2-1b --batch_size=8 --seq_len=2048 --scan_layers --model_dtype=bfloat16 \
    --opt_m_dtype=bfloat16 --opt_v_dtype=bfloat16 --measure_matmul_ceiling=false --bench_steps=15 --json
  CUDA_VISIBLE_DEVICES=$JG python3 benchmarks/fp8_check.py --model=llama-3.2-1b --matmul_dtype=e4m3 --batch_size=8 \
    --seq_len=2048 --scan_layers=false 2>"$OUT/err-fp8check.txt" | tail -15 | tee "$OUT/fp8_check.txt"
  for m in llama-3.2-1b llama-3.2-3b; do
    jb "$m-e4m3" --model=$m --batch_size=8 --seq_len=2048 --matmul_dtype=e4m3 "${BF16[@]}"
  done
fi
wait
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
rows = lambda f: [json.loads(l) for l in open(f"{out}/{f}") if l.startswith("{")]
peer = {(r["model"], r["batch_size"], r["seq_len"]): r for r in rows("peer.jsonl")}
print(f"{'run':>38} {'tok/s':>9} {'peer':>9} {'ratio':>6} {'MFU':>6} {'GiB':>6} {'step ms':>8} {'sd':>5} {'compile':>7}")
for r in rows("jax.jsonl"):
    p = peer.get((r["model"], r["batch_size"], r["seq_len"]))
    pt = p["tokens_per_s"] if p else float("nan")
    print(f"{r['label']:>38} {r['tokens_per_s']:>9,.0f} {pt:>9,.0f} {r['tokens_per_s'] / pt:>6.3f} "
          f"{100 * r['mfu_spec']:>5.1f}% {r['peak_memory_gib_per_device']:>6.1f} {r['step_ms_median']:>8.1f} "
          f"{r['step_ms_stdev']:>5.2f} {r['compile_s']:>7.1f}")
for k, p in peer.items():
    print("peer", k, f"{p['tokens_per_s']:,.0f} tok/s, {p['peak_memory_gib']:.1f} GiB, compile {p['compile_s']:.0f} s")
PY
