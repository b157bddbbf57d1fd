#!/usr/bin/env bash
# Open MPI: one process per GPU across the hosts in HOSTFILE; jax.distributed reads the rank and
# size from Open MPI's environment (OMPI_COMM_WORLD_*), so no coordinator flags are needed.
#   HOSTFILE=hosts NP=16 launch/mpirun.sh --flagfile=configs/llama-3.2-1b-pretrain.flags
set -euo pipefail
exec mpirun -np "${NP:?set NP, the total number of processes}" --hostfile "${HOSTFILE:?set HOSTFILE}" \
  --bind-to none -x PATH -x PYTHONPATH -x LD_LIBRARY_PATH \
  bash -c 'CUDA_VISIBLE_DEVICES=$OMPI_COMM_WORLD_LOCAL_RANK exec python3 -m jaxllmq.main "$@"' _ "$@"
