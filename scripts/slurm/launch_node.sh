#!/bin/bash
# One node's part of train.sbatch, which srun runs on every node: torchrun starts NPROC_PER_NODE training processes
# there as node SLURM_NODEID of SLURM_NNODES, with the fixed (static) rendezvous on MASTER_ADDR:MASTER_PORT, so node
# 0 holds ranks 0 to NPROC_PER_NODE - 1, node 1 the next ones, and so on. The flags go to cifar_accel.train.
set -euo pipefail
: "${SLURM_NNODES:?set by srun}" "${SLURM_NODEID:?set by srun}" "${MASTER_ADDR:?set by train.sbatch}"
exec "${PYTHON:-python}" -m torch.distributed.run \
  --nnodes "$SLURM_NNODES" --node_rank "$SLURM_NODEID" --nproc_per_node "${NPROC_PER_NODE:-1}" \
  --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" \
  -m cifar_accel.train "$@"
