#!/bin/bash
# One torchrun per node of the current SLURM allocation, all joined in one job:
#
#   bash scripts/slurm/torchrun_job.sh scripts/pretrain_gpt.py [Megatron flags...]
#
# Called by the *.sbatch templates; also works inside `salloc`. Environment:
#   GPUS_PER_NODE  processes (GPUs) per node (default: 8)
#   MASTER_ADDR    rendezvous host (default: the allocation's first node)
#   MASTER_PORT    rendezvous port (default: 29500)
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 SCRIPT [ARGS...]" >&2
    exit 2
fi
: "${SLURM_JOB_NODELIST:?run inside a SLURM allocation (sbatch or salloc)}"

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${SLURM_JOB_NUM_NODES:-1}
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
MASTER_PORT=${MASTER_PORT:-29500}

# megatron-core: one hardware queue keeps the kernel order its communication overlap expects.
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# NCCL, to adapt to the cluster's fabric:
# export NCCL_SOCKET_IFNAME=ib0          # interface for NCCL's bootstrap
# export NCCL_IB_HCA=mlx5                # InfiniBand adapters to use
# export NCCL_IB_TIMEOUT=22
# export NCCL_NET_GDR_LEVEL=PHB          # GPUDirect RDMA
# export NCCL_DEBUG=WARN                 # INFO to debug hangs
# export TORCH_NCCL_ASYNC_ERROR_HANDLING=1

echo "torchrun on ${NNODES} node(s) x ${GPUS_PER_NODE} GPU(s), rendezvous ${MASTER_ADDR}:${MASTER_PORT}"
srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
    torchrun \
    --nnodes="$NNODES" \
    --nproc-per-node="$GPUS_PER_NODE" \
    --rdzv-id="${SLURM_JOB_ID:-bitpipe}" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="${MASTER_ADDR}:${MASTER_PORT}" \
    "$@"
