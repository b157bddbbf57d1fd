#!/usr/bin/env bash
# N processes of jaxllmq.main on this host, joined by jax.distributed (process 0 coordinates).
#   launch/local.sh N --flagfile=configs/X.flags [flags...]
# Each process gets one GPU (CUDA_VISIBLE_DEVICES=i). With JAXLLMQ_CPU_DEVICES=K the processes
# run on the CPU with K devices each instead (collectives over gloo): a laptop-sized rehearsal of
# a multi-host run. JAXLLMQ_PORT picks the coordinator's port; PYTHON the interpreter.
set -euo pipefail
n=${1:?usage: launch/local.sh NUM_PROCESSES [jaxllmq.main flags...]}
shift
port=${JAXLLMQ_PORT:-$((20000 + RANDOM % 20000))}
pids=()
for ((i = 0; i < n; i++)); do
  if [[ -n "${JAXLLMQ_CPU_DEVICES:-}" ]]; then
    # After the caller's XLA flags, which it keeps: the last count given wins.
    device_env=(JAX_PLATFORMS=cpu
      "XLA_FLAGS=${XLA_FLAGS:-} --xla_force_host_platform_device_count=$JAXLLMQ_CPU_DEVICES")
  else
    device_env=("CUDA_VISIBLE_DEVICES=$i")
  fi
  env "${device_env[@]}" "${PYTHON:-python3}" -m jaxllmq.main --coordinator_address="localhost:$port" \
    --num_processes="$n" --process_id="$i" "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit "$status"
