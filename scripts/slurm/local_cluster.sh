#!/bin/bash
# A one-node SLURM cluster on this machine, for trying the sbatch templates and for the tests:
#
#   sudo scripts/slurm/local_cluster.sh up [--cpus N] [--gpus N]   # install, configure, start
#   export SLURM_CONF=/run/bitpipe-slurm/slurm.conf                    # printed by `up`
#   sbatch ...; squeue; scontrol show job ...
#   sudo scripts/slurm/local_cluster.sh down                         # stop what `up` started
#
# Needs root and Debian/Ubuntu (apt-get installs slurm-wlm and munge when slurmctld is
# missing). Runs unattended: no systemd, no prompts. `up` starts munged (as user munge, unless
# one is already running), slurmctld (with a clean state: no jobs of an earlier cluster) and
# slurmd with a private configuration in $CLUSTER_DIR (nothing under /etc/slurm is written),
# waits until the node is idle and exits 0, typically within seconds once the packages are
# there. It refuses to start next to SLURM daemons already running on the machine. On failure
# it exits 1 with the reason on stderr and stops what it started. `down` cancels the
# cluster's jobs still queued or running, then stops exactly the daemons `up` started (their
# pid files), nothing else.
#
# The node advertises --cpus CPUs (default 8; it may exceed the real count:
# SlurmdParameters=config_overrides) and, with --gpus N, N GPUs backed by character devices
# (/dev/null's numbers) so that GPU requests (--gpus-per-node) are accepted; no GPU is real.
# Environment: CLUSTER_DIR (default /run/bitpipe-slurm: config, pid files) and
# CLUSTER_STATE_DIR (default /var/spool/bitpipe-slurm: controller state, slurmd spool, logs).
set -euo pipefail

CLUSTER_DIR=${CLUSTER_DIR:-/run/bitpipe-slurm}
CLUSTER_STATE_DIR=${CLUSTER_STATE_DIR:-/var/spool/bitpipe-slurm}
CONF=$CLUSTER_DIR/slurm.conf

die() {
    echo "local_cluster.sh: $*" >&2
    exit 1
}

usage() {
    echo "usage: $0 up [--cpus N] [--gpus N] | down | status" >&2
    exit 2
}

stop_pidfile() {  # stop_pidfile FILE NAME: TERM the daemon whose pid FILE holds, wait for it
    local file=$1 name=$2 pid
    [[ -f "$file" ]] || return 0
    pid=$(cat "$file")
    if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            kill -KILL "$pid" 2>/dev/null || true
        fi
        echo "stopped $name (pid $pid)"
    fi
    rm -f "$file"
}

down() {
    if [[ -f "$CLUSTER_DIR/slurmctld.pid" ]] && kill -0 "$(cat "$CLUSTER_DIR/slurmctld.pid")" 2>/dev/null; then
        cancel_jobs
    fi
    stop_pidfile "$CLUSTER_DIR/slurmd.pid" slurmd
    stop_pidfile "$CLUSTER_DIR/slurmctld.pid" slurmctld
    stop_pidfile "$CLUSTER_DIR/munged.pid" munged  # only written when `up` started munged
}

cancel_jobs() {  # end the cluster's jobs, so that no job step outlives its daemons
    local jobs
    jobs=$(SLURM_CONF=$CONF squeue -h -o %i 2>/dev/null) || return 0
    [[ -n "$jobs" ]] || return 0
    echo "cancelling jobs: $(echo $jobs)"
    SLURM_CONF=$CONF scancel $jobs || true
    for _ in $(seq 100); do
        [[ -z "$(SLURM_CONF=$CONF squeue -h -o %i 2>/dev/null)" ]] && return 0
        sleep 0.2
    done
    echo "jobs still ending: $(SLURM_CONF=$CONF squeue -h -o '%i %T' | tr '\n' ' ')" >&2
}

install_packages() {
    command -v apt-get >/dev/null || die "slurmctld is not installed and there is no apt-get to install slurm-wlm and munge"
    echo "installing slurm-wlm and munge (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    local log=$CLUSTER_DIR/apt.log
    if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends slurm-wlm munge; } >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        die "apt-get could not install slurm-wlm and munge (log: $log)"
    fi
}

start_munge() {
    if pgrep -x munged >/dev/null; then
        echo "munged is already running: using it"
        return
    fi
    if [[ ! -s /etc/munge/munge.key ]]; then
        install -d -o munge -g munge -m 0700 /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        chown munge:munge /etc/munge/munge.key
        chmod 0400 /etc/munge/munge.key
    fi
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
    runuser -u munge -- munged --pid-file=/run/munge/munged.pid || die "munged did not start (see /var/log/munge/munged.log)"
    cp /run/munge/munged.pid "$CLUSTER_DIR/munged.pid"
}

write_config() {  # write_config CPUS GPUS
    local cpus=$1 gpus=$2 host
    host=$(hostname -s)
    local gres_types="" node_gres=""
    if [[ "$gpus" -gt 0 ]]; then
        gres_types="GresTypes=gpu"
        node_gres="Gres=gpu:$gpus"
        : >"$CLUSTER_DIR/gres.conf"
        for ((i = 0; i < gpus; i++)); do
            local dev=/dev/bitpipe-fake-gpu$i
            [[ -e "$dev" ]] || mknod "$dev" c 1 3
            echo "Name=gpu File=$dev" >>"$CLUSTER_DIR/gres.conf"
        done
    fi
    cat >"$CONF" <<EOF
# one-node cluster written by scripts/slurm/local_cluster.sh
ClusterName=bitpipe-local
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
MinJobAge=3600
KillWait=5
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=$CLUSTER_STATE_DIR/ctld
SlurmdSpoolDir=$CLUSTER_STATE_DIR/slurmd
SlurmctldLogFile=$CLUSTER_STATE_DIR/slurmctld.log
SlurmdLogFile=$CLUSTER_STATE_DIR/slurmd.log
SlurmctldPidFile=$CLUSTER_DIR/slurmctld.pid
SlurmdPidFile=$CLUSTER_DIR/slurmd.pid
$gres_types
NodeName=$host CPUs=$cpus RealMemory=20000 State=UNKNOWN $node_gres
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

wait_idle() {
    local state=""
    for _ in $(seq 150); do
        state=$(SLURM_CONF=$CONF sinfo -h -N -o %T 2>/dev/null | head -n 1)
        [[ "$state" == idle ]] && return 0
        sleep 0.2
    done
    echo "node state: ${state:-unknown}; last lines of the logs:" >&2
    tail -n 5 "$CLUSTER_STATE_DIR/slurmctld.log" "$CLUSTER_STATE_DIR/slurmd.log" >&2 || true
    return 1
}

up() {
    local cpus=8 gpus=0
    while [[ $# -gt 0 ]]; do
        case $1 in
            --cpus) cpus=${2:?--cpus needs a number}; shift 2 ;;
            --gpus) gpus=${2:?--gpus needs a number}; shift 2 ;;
            *) usage ;;
        esac
    done
    [[ $(id -u) -eq 0 ]] || die "needs root (it installs packages and starts daemons)"
    [[ -f "$CLUSTER_DIR/slurmctld.pid" ]] && die "already up ($CLUSTER_DIR/slurmctld.pid exists; run '$0 down' first)"
    local running
    running=$(pgrep -x slurmctld; pgrep -x slurmd) || true
    [[ -z "$running" ]] || die "SLURM daemons are already running here (pids $(echo $running)); not starting a second cluster"
    mkdir -p "$CLUSTER_DIR" "$CLUSTER_STATE_DIR/ctld" "$CLUSTER_STATE_DIR/slurmd"
    command -v slurmctld >/dev/null && command -v munged >/dev/null || install_packages
    trap 'echo "local_cluster.sh: start-up failed; stopping what was started" >&2; down >&2' EXIT
    start_munge
    write_config "$cpus" "$gpus"
    # -c: start with no jobs (none of an earlier run); both daemonize and write pid files
    slurmctld -f "$CONF" -c || die "slurmctld did not start (see $CLUSTER_STATE_DIR/slurmctld.log)"
    slurmd -f "$CONF" || die "slurmd did not start (see $CLUSTER_STATE_DIR/slurmd.log)"
    wait_idle || die "the node did not become idle"
    trap - EXIT
    echo "SLURM is up: node $(hostname -s), $cpus CPUs, $gpus GPUs. Use it with:"
    echo "export SLURM_CONF=$CONF"
}

case ${1:-} in
    up) shift; up "$@" ;;
    down) down ;;
    status) SLURM_CONF=$CONF sinfo -N -l ;;
    *) usage ;;
esac
