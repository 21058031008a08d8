#!/bin/bash
# One torchrun per node of the current SLURM allocation, all joined in one job:
#
#   bash scripts/slurm/torchrun_job.sh scripts/pretrain_gpt.py [Megatron flags...]
#
# The *.sbatch templates `exec` it, so that it is the batch shell: it receives the warning
# signal SLURM sends before the time limit (#SBATCH --signal=B:USR1@SECONDS) and passes it on to
# the training processes (torchrun itself ignores it), which finish their iteration, save a
# checkpoint and exit 0 (--exit-signal-handler --exit-signal SIGUSR1). Then, if training is
# not finished, it requeues the job (scontrol requeue; the job needs --requeue), and the
# requeued job resumes from the latest checkpoint. A run that fails (a rank died or hung: the
# job ends non-zero) after saving a newer checkpoint is requeued the same way, at most
# MAX_REQUEUES times; one that fails without a new checkpoint is not (it would fail again on the
# same step). Also works inside `salloc`.
#
# Environment (all optional):
#   NPROC_PER_NODE  processes per node (default: the GPUs SLURM gave this node, else 1)
#   OMP_NUM_THREADS CPU threads per process (default: the task's CPUs, at most this node's
#                   usable cores, divided by NPROC_PER_NODE; at least 1)
#   MASTER_ADDR     rendezvous host (default: the allocation's first node)
#   MASTER_PORT     rendezvous port (default: 20000 + job id modulo 20000)
#   EXIT_SIGNAL     the warning signal to pass on, without SIG (default: USR1)
#   CKPT_DIR, TRAIN_ITERS
#                   with both set (the templates set them) and REQUEUE=1 (default), a run
#                   whose latest checkpoint in CKPT_DIR (Megatron's
#                   latest_checkpointed_iteration.txt) is newer than at its start and short of
#                   TRAIN_ITERS requeues the job: one that exits 0 (after the warning signal,
#                   --exit-duration-in-mins or --exit-interval alike) each time, one that
#                   fails while the job has been requeued fewer than MAX_REQUEUES times
#   MAX_REQUEUES    requeues after a failure, compared to SLURM_RESTART_COUNT (default 3)
#   NODE_END_WAIT   seconds the other nodes' processes get to end on their own once one node's
#                   have ended, before srun ends them (default: the training's watchdog timeout,
#                   --distributed-timeout-minutes among the arguments, default 10, plus 60 s)
#   NCCL_*, GLOO_SOCKET_IFNAME
#                   the fabric's settings (below): like every variable of the job's environment
#                   they reach every rank on every node (srun passes the environment on); the
#                   job's output lists the NCCL_* and GLOO_* ones set
# Exit status: torchrun's (a failing rank ends the job with its status), also when the job is
# requeued (SLURM then runs it again; the exit status of the ended run is not the job's).
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: $0 SCRIPT [ARGS...]" >&2
    exit 2
fi
: "${SLURM_JOB_NODELIST:?run inside a SLURM allocation (sbatch or salloc)}"

NNODES=${SLURM_JOB_NUM_NODES:-1}
gpus=${SLURM_GPUS_ON_NODE:-0}
NPROC_PER_NODE=${NPROC_PER_NODE:-$((gpus > 0 ? gpus : 1))}
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
EXIT_SIGNAL=${EXIT_SIGNAL:-USR1}
REQUEUE=${REQUEUE:-1}
MAX_REQUEUES=${MAX_REQUEUES:-3}
RESTARTS=${SLURM_RESTART_COUNT:-0}

# Threads: the cores this task may use (SLURM's count, capped by what this node really lets
# it run on) shared by the node's processes; oversubscribed cores slow every rank down.
cores=$(nproc)
task_cpus=${SLURM_CPUS_PER_TASK:-$cores}
threads=$(( (task_cpus < cores ? task_cpus : cores) / NPROC_PER_NODE ))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( threads > 0 ? threads : 1 ))}
# megatron-core: one hardware queue keeps the kernel order its communication overlap expects.
export CUDA_DEVICE_MAX_CONNECTIONS=1
# NCCL and gloo, to adapt to the cluster's fabric (or set them for the job: sbatch --export):
# export NCCL_SOCKET_IFNAME=ib0          # interface for NCCL's bootstrap
# export GLOO_SOCKET_IFNAME=eth0         # interface for gloo (CPU ranks, and torch's CPU-side groups)
# export NCCL_IB_HCA=mlx5                # InfiniBand adapters to use
# export NCCL_IB_TIMEOUT=22
# export NCCL_NET_GDR_LEVEL=PHB          # GPUDirect RDMA
# export NCCL_DEBUG=WARN                 # INFO to debug hangs
# export TORCH_NCCL_ASYNC_ERROR_HANDLING=1

latest_checkpoint() {  # the iteration of CKPT_DIR's latest checkpoint (0: none)
    local tracker=${CKPT_DIR:-}/latest_checkpointed_iteration.txt value=0
    [[ -n "${CKPT_DIR:-}" && -f "$tracker" ]] && value=$(tr -d '[:space:]' <"$tracker")
    [[ "$value" =~ ^[0-9]+$ ]] && echo "$((10#$value))" || echo 0
}

# The warning signal: pass it on to the training processes now and every 30 s until they
# exit (one that arrives while they start, before their handler is installed, is ignored).
warned=0 step="" resender=""
pass_on() {
    ((warned)) && return
    warned=1
    echo "$(date '+%F %T') received SIG${EXIT_SIGNAL}: passing it on to the training processes"
    if [[ -n "$step" ]]; then start_resender; fi
}
start_resender() {  # srun forwards the signal to every process of the step
    (while kill -s "$EXIT_SIGNAL" "$step" 2>/dev/null; do sleep 30; done) &
    resender=$!
}
trap pass_on "$EXIT_SIGNAL"

start_checkpoint=$(latest_checkpoint)
echo "$(date '+%F %T') job ${SLURM_JOB_ID:-?} (restart ${RESTARTS}): torchrun on ${NNODES} node(s) x ${NPROC_PER_NODE}" \
    "process(es), ${OMP_NUM_THREADS} thread(s) each, rendezvous ${MASTER_ADDR}:${MASTER_PORT}," \
    "latest checkpoint: iteration ${start_checkpoint}"
fabric=$(env | grep -E '^(NCCL|GLOO)_' | sort | paste -sd ' ' -) || true
if [[ -n "$fabric" ]]; then echo "fabric settings passed on to every rank: $fabric"; fi
echo "+ $*"

# When one node's processes end (a rank died and its torchrun stopped, or the node died), the
# other nodes' ranks end on their own: their watchdog prints the one line that says which rank
# failed and where the others waited, then they exit. srun must not end them first (as
# --kill-on-bad-exit would, at once), so it waits NODE_END_WAIT seconds, longer than the
# watchdog's timeout and the process group's own (the watchdog's plus at most 13 s), before it
# ends the rest.
timeout_min=10 previous=""
for arg in "$@"; do  # the last --distributed-timeout-minutes wins, as in the training's parser
    if [[ $previous == --distributed-timeout-minutes ]]; then timeout_min=$arg; fi
    if [[ $arg == --distributed-timeout-minutes=* ]]; then timeout_min=${arg#*=}; fi
    previous=$arg
done
NODE_END_WAIT=${NODE_END_WAIT:-$(awk -v minutes="$timeout_min" 'BEGIN { printf "%d", minutes * 60 + 60.5 }')}

# torchrun starts with the warning signal ignored (an ignored signal stays ignored across
# exec, so its workers start that way too, until the training loop installs its handler).
srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=0 --wait="$NODE_END_WAIT" \
    bash -c 'trap "" "$0"; exec "$@"' "$EXIT_SIGNAL" \
    torchrun \
    --nnodes="$NNODES" \
    --nproc-per-node="$NPROC_PER_NODE" \
    --rdzv-id="${SLURM_JOB_ID:-bitpipe}" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="${MASTER_ADDR}:${MASTER_PORT}" \
    "$@" &
step=$!
if ((warned)); then start_resender; fi

# A trapped signal interrupts `wait`; wait again until srun has really ended.
while :; do
    status=0
    wait "$step" || status=$?
    if [[ $status -gt 128 ]] && kill -0 "$step" 2>/dev/null; then
        continue
    fi
    break
done
trap - "$EXIT_SIGNAL"
if [[ -n "$resender" ]]; then kill "$resender" 2>/dev/null || true; fi

end_checkpoint=$(latest_checkpoint)
echo "$(date '+%F %T') training processes exited with status ${status}; latest checkpoint: iteration ${end_checkpoint}"
requeue() {  # requeue WHY: requeue this job to resume from the latest checkpoint
    echo "$1: requeueing job ${SLURM_JOB_ID} to resume from it"
    scontrol requeue "$SLURM_JOB_ID" || {
        echo "could not requeue (submit with --requeue); resubmit the same job to resume" >&2
        exit 1
    }
}
if [[ $REQUEUE == 1 && -n "${CKPT_DIR:-}" && -n "${TRAIN_ITERS:-}" && -n "${SLURM_JOB_ID:-}" ]] &&
    ((end_checkpoint < TRAIN_ITERS)); then
    if ((end_checkpoint > start_checkpoint)); then
        if [[ $status -eq 0 ]]; then
            requeue "training stopped at iteration ${end_checkpoint} of ${TRAIN_ITERS}"
        elif ((RESTARTS < MAX_REQUEUES)); then
            requeue "training failed (status ${status}) after saving iteration ${end_checkpoint} of ${TRAIN_ITERS} (restart ${RESTARTS} of the job, MAX_REQUEUES=${MAX_REQUEUES})"
        else
            echo "training failed (status ${status}) after saving iteration ${end_checkpoint} of ${TRAIN_ITERS}; not requeued: the job has been requeued ${RESTARTS} time(s), MAX_REQUEUES=${MAX_REQUEUES}" >&2
        fi
    elif [[ $status -ne 0 ]]; then
        echo "training failed (status ${status}) with no checkpoint newer than iteration ${start_checkpoint} (the one it started from); not requeued: it would fail again at the same point" >&2
    fi
fi
exit "$status"
