#!/bin/bash
# A SLURM cluster on this machine, for trying the sbatch templates and for the tests:
#
#   sudo scripts/slurm/local_cluster.sh up [--nodes N] [--cpus N] [--gpus N]   # install, configure, start
#   export SLURM_CONF=...                                                       # printed by `up`
#   sbatch ...; squeue; scontrol show job ...
#   sudo scripts/slurm/local_cluster.sh down [--nodes N]                        # remove what `up` made
#
# Needs root and Debian/Ubuntu (apt-get installs slurm-wlm and munge when slurmctld is
# missing). Runs unattended: no systemd, no prompts, nothing under /etc/slurm written; the
# configuration, pid files and a private copy of the daemons live in $CLUSTER_DIR, the
# controller's state, the slurmd spools and the logs in $CLUSTER_STATE_DIR. `up` starts
# slurmctld with a clean state (no jobs of an earlier cluster), waits until every node is
# idle and exits 0, typically within seconds once the packages are there. On failure it exits 1
# with the reason on stderr and removes what it made. `down` cancels the cluster's jobs still
# queued or running, then stops exactly what `up` started (their pid files) and removes
# exactly what it made, nothing else.
#
# --nodes 1 (the default): one node, this host. munged as user munge (unless one is already
# running), slurmctld and slurmd on this host's network; it refuses to start next to SLURM
# daemons already running on the machine.
#
# --nodes N >= 2: N nodes node1..nodeN and a controller, each in its own network namespace
# (bitpipe-controller, bitpipe-node1, ...: its own interface eth0 with one address of
# 10.46.0.0/24, no default route) with its own hostname (a UTS namespace) and its own
# /etc/hosts naming all of them (a mount namespace, /etc/hosts bind-mounted). The namespaces
# are joined by the bridge bp-br in this host's namespace, which has no address: nothing
# leaves them and nothing outside reaches them. munged (with its own key and socket),
# slurmctld and one slurmd per node run as copies named bitpipe-munged, bitpipe-slurmctld
# (shown as bitpipe-slurmct) and bitpipe-slurmd, so `pgrep -x slurmd` and friends do not see
# them and a one-node cluster (its own CLUSTER_DIR) can run beside this one. SLURM's commands
# reach it from the controller's network namespace:
#   sudo nsenter --net=/run/netns/bitpipe-controller sbatch -N 2 ...
# (inside a job they already run in a node's namespaces). Needs CAP_NET_ADMIN and CAP_SYS_ADMIN
# (network namespaces, a bridge, bind mounts); refuses clearly without them.
#
# Every node advertises --cpus CPUs (default 8; it may exceed the real count:
# SlurmdParameters=config_overrides) and, with --gpus N, N GPUs backed by character devices
# (/dev/null's numbers) so that GPU requests (--gpus-per-node) are accepted; no GPU is real.
# Environment: CLUSTER_DIR (default /run/bitpipe-slurm, with --nodes N >= 2
# /run/bitpipe-slurm-nodes) and CLUSTER_STATE_DIR (default /var/spool/bitpipe-slurm, resp.
# /var/spool/bitpipe-slurm-nodes).
set -euo pipefail

#: the namespaced cluster's names and addresses (fixed: one such cluster per machine)
NS_PREFIX=bitpipe-    # network namespaces: bitpipe-controller, bitpipe-node1, ...
LINK_PREFIX=bp-       # links in this host's namespace: bp-br, bp-controller, bp-node1, ...
BRIDGE=${LINK_PREFIX}br
SUBNET=10.46.0        # controller .1, nodeK .(10+K); a /24 of its own in every namespace
IFACE=eth0            # each namespace's interface on the bridge
CTLD_PORT=6917        # private ports (the one-node cluster uses SLURM's 6817 and 6818)
SLURMD_PORT=6918

die() {
    echo "local_cluster.sh: $*" >&2
    exit 1
}

usage() {
    echo "usage: $0 up [--nodes N] [--cpus N] [--gpus N] | down [--nodes N] | status [--nodes N]" >&2
    exit 2
}

# ---------------------------------------------------------------- settings from the arguments
NODES=1 CPUS=8 GPUS=0
parse_args() {  # parse_args [ARGS...]: set NODES, CPUS, GPUS and the directories
    while [[ $# -gt 0 ]]; do
        case $1 in
            --nodes) NODES=${2:?--nodes needs a number}; shift 2 ;;
            --cpus) CPUS=${2:?--cpus needs a number}; shift 2 ;;
            --gpus) GPUS=${2:?--gpus needs a number}; shift 2 ;;
            *) usage ;;
        esac
    done
    [[ "$NODES" =~ ^[0-9]+$ && "$NODES" -ge 1 && "$NODES" -le 200 ]] || die "--nodes takes 1 to 200 (got $NODES)"
    local suffix=""
    ((NODES > 1)) && suffix=-nodes
    CLUSTER_DIR=${CLUSTER_DIR:-/run/bitpipe-slurm$suffix}
    CLUSTER_STATE_DIR=${CLUSTER_STATE_DIR:-/var/spool/bitpipe-slurm$suffix}
    CONF=$CLUSTER_DIR/slurm.conf
    BIN=$CLUSTER_DIR/bin  # the namespaced cluster's copies of the daemons
    MUNGE_DIR=$CLUSTER_DIR/munge
    CONTROLLER_NS=/run/netns/${NS_PREFIX}controller
}

namespaced() { [[ -f "$CLUSTER_DIR/namespaces" ]] || ((NODES > 1)); }

client() {  # client COMMAND...: a SLURM command, in the controller's network where there is one
    if [[ -f "$CLUSTER_DIR/namespaces" ]]; then
        SLURM_CONF=$CONF nsenter --net="$CONTROLLER_NS" "$@"
    else
        SLURM_CONF=$CONF "$@"
    fi
}

# ---------------------------------------------------------------- down
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

cancel_jobs() {  # end the cluster's jobs, so that no job step outlives its daemons
    local jobs
    jobs=$(client squeue -h -o %i 2>/dev/null) || return 0
    [[ -n "$jobs" ]] || return 0
    echo "cancelling jobs: $(echo $jobs)"
    client scancel $jobs || true
    for _ in $(seq 100); do
        [[ -z "$(client squeue -h -o %i 2>/dev/null)" ]] && return 0
        sleep 0.2
    done
    echo "jobs still ending: $(client squeue -h -o '%i %T' | tr '\n' ' ')" >&2
}

remove_namespaces() {  # every namespace, link and mount `up` recorded, and what still runs in them
    local ns pids
    [[ -f "$CLUSTER_DIR/namespaces" ]] || return 0
    while read -r ns; do
        [[ -e /run/netns/$ns ]] || continue
        # The daemons are stopped; anything left (a job step the cancel missed) dies with the node.
        pids=$(ip netns pids "$ns" 2>/dev/null) || true
        if [[ -n "$pids" ]]; then
            echo "killing what still runs in $ns: pids $(echo $pids)"
            kill -KILL $pids 2>/dev/null || true
            for _ in $(seq 50); do
                [[ -z "$(ip netns pids "$ns" 2>/dev/null)" ]] && break
                sleep 0.1
            done
        fi
        # The pair goes with the namespace only once the kernel has freed it (later, in the
        # background); deleting our end removes both ends now.
        ip link del "$LINK_PREFIX${ns#"$NS_PREFIX"}" 2>/dev/null || true
        ip netns del "$ns"
        echo "removed network namespace $ns"
    done <"$CLUSTER_DIR/namespaces"
    # The mount and UTS namespaces went with their last process.
    ip link del "$BRIDGE" 2>/dev/null && echo "removed bridge $BRIDGE"
    # `ip netns add` bind-mounts /run/netns onto itself the first time; undo it if `up` caused it.
    if [[ -f "$CLUSTER_DIR/netns-mount-made" ]] && [[ -z "$(ip netns list)" ]] && mountpoint -q /run/netns; then
        umount /run/netns && echo "unmounted /run/netns"
    fi
    rm -f "$CLUSTER_DIR/namespaces" "$CLUSTER_DIR/netns-mount-made"
}

down() {
    local pidfile
    if [[ -f "$CLUSTER_DIR/slurmctld.pid" ]] && kill -0 "$(cat "$CLUSTER_DIR/slurmctld.pid")" 2>/dev/null; then
        cancel_jobs
    fi
    for pidfile in "$CLUSTER_DIR"/slurmd*.pid; do
        [[ -e "$pidfile" ]] && stop_pidfile "$pidfile" "$(basename "$pidfile" .pid)"
    done
    stop_pidfile "$CLUSTER_DIR/slurmctld.pid" slurmctld
    stop_pidfile "$CLUSTER_DIR/munged.pid" munged  # only written when `up` started munged
    remove_namespaces
    rm -rf "$BIN"
}

# ---------------------------------------------------------------- up
install_packages() {  # slurm-wlm and munge, and iproute2 (ip) for the namespaced cluster
    local packages="slurm-wlm munge"
    namespaced && packages="$packages iproute2"
    command -v apt-get >/dev/null || die "SLURM, munge or ip is not installed and there is no apt-get to install $packages"
    echo "installing $packages (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    local log=$CLUSTER_DIR/apt.log
    if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends $packages; } >"$log" 2>&1; then
        tail -n 20 "$log" >&2
        die "apt-get could not install $packages (log: $log)"
    fi
}

start_munge() {  # the one-node cluster: the machine's munged, started if none runs
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

start_private_munge() {  # the namespaced cluster: its own munged, key and socket in MUNGE_DIR
    install -d -o munge -g munge -m 0755 "$MUNGE_DIR"
    dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1024 count=1 status=none
    chown munge:munge "$MUNGE_DIR/munge.key"
    chmod 0400 "$MUNGE_DIR/munge.key"
    runuser -u munge -- "$BIN/bitpipe-munged" --socket="$MUNGE_DIR/munge.socket" --key-file="$MUNGE_DIR/munge.key" \
        --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed" ||
        die "munged did not start (see $MUNGE_DIR/munged.log)"
    cp "$MUNGE_DIR/munged.pid" "$CLUSTER_DIR/munged.pid"
}

node_names() {  # the nodes' names, one a line
    if namespaced; then
        seq -f 'node%g' "$NODES"
    else
        hostname -s
    fi
}

write_config() {
    local controller gres_types="" node_gres="" node names
    names=$(node_names | paste -sd, -)
    if [[ "$GPUS" -gt 0 ]]; then
        gres_types="GresTypes=gpu"
        node_gres="Gres=gpu:$GPUS"
        : >"$CLUSTER_DIR/gres.conf"
        for ((i = 0; i < GPUS; i++)); do
            local dev=/dev/bitpipe-fake-gpu$i
            [[ -e "$dev" ]] || mknod "$dev" c 1 3
            echo "Name=gpu File=$dev" >>"$CLUSTER_DIR/gres.conf"
        done
    fi
    {
        if namespaced; then
            echo "# $NODES-node cluster in network namespaces, written by scripts/slurm/local_cluster.sh"
            echo "ClusterName=bitpipe-nodes"
            echo "SlurmctldHost=controller($SUBNET.1)"
            echo "SlurmctldPort=$CTLD_PORT"
            echo "SlurmdPort=$SLURMD_PORT"
            echo "AuthInfo=socket=$MUNGE_DIR/munge.socket"
            echo "SlurmdSpoolDir=$CLUSTER_STATE_DIR/slurmd-%n"
            echo "SlurmdLogFile=$CLUSTER_STATE_DIR/slurmd-%n.log"
            echo "SlurmdPidFile=$CLUSTER_DIR/slurmd-%n.pid"
        else
            echo "# one-node cluster written by scripts/slurm/local_cluster.sh"
            echo "ClusterName=bitpipe-local"
            echo "SlurmctldHost=$(hostname -s)"
            echo "SlurmdSpoolDir=$CLUSTER_STATE_DIR/slurmd"
            echo "SlurmdLogFile=$CLUSTER_STATE_DIR/slurmd.log"
            echo "SlurmdPidFile=$CLUSTER_DIR/slurmd.pid"
        fi
        cat <<CONF
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
SlurmctldLogFile=$CLUSTER_STATE_DIR/slurmctld.log
SlurmctldPidFile=$CLUSTER_DIR/slurmctld.pid
$gres_types
CONF
        local k=0
        while read -r node; do
            k=$((k + 1))
            if namespaced; then
                echo "NodeName=$node NodeAddr=$SUBNET.$((10 + k)) CPUs=$CPUS RealMemory=20000 State=UNKNOWN $node_gres"
            else
                echo "NodeName=$node CPUs=$CPUS RealMemory=20000 State=UNKNOWN $node_gres"
            fi
        done < <(node_names)
        echo "PartitionName=debug Nodes=$names Default=YES MaxTime=INFINITE State=UP"
    } >"$CONF"
}

check_namespace_rights() {  # refuse, saying why, where the namespaced cluster cannot be made
    local caps
    caps=$(awk '/^CapEff:/ {print $2}' /proc/self/status)
    # CAP_NET_ADMIN (bit 12): namespaces' links and addresses; CAP_SYS_ADMIN (bit 21): namespaces, mounts
    (((16#$caps >> 12) & 1)) || die "--nodes $NODES needs CAP_NET_ADMIN (network namespaces, a bridge); this process lacks it (CapEff=$caps)"
    (((16#$caps >> 21) & 1)) || die "--nodes $NODES needs CAP_SYS_ADMIN (namespaces, bind mounts); this process lacks it (CapEff=$caps)"
    command -v nsenter >/dev/null && command -v unshare >/dev/null || die "--nodes $NODES needs nsenter and unshare (util-linux)"
    command -v ip >/dev/null || return 0  # none of ours can exist; iproute2 is installed below
    local name
    for name in controller $(node_names); do
        [[ ! -e /run/netns/$NS_PREFIX$name ]] || die "network namespace $NS_PREFIX$name exists: a namespaced cluster is up already (run '$0 down --nodes $NODES' for the one of $CLUSTER_DIR)"
    done
    ! ip link show "$BRIDGE" >/dev/null 2>&1 || die "link $BRIDGE exists: a namespaced cluster is up already"
}

make_namespace() {  # make_namespace NAME ADDRESS: a network namespace on the bridge
    local name=$1 address=$2 ns=$NS_PREFIX$1 link=$LINK_PREFIX$1
    echo "$ns" >>"$CLUSTER_DIR/namespaces"  # recorded first: `down` removes a half-made one too
    ip netns add "$ns" || die "could not make network namespace $ns"
    ip link add "$link" type veth peer name "$IFACE" netns "$ns" || die "could not make the link $link into $ns"
    ip link set "$link" master "$BRIDGE" up
    nsenter --net="/run/netns/$ns" sh -euc "ip link set lo up; ip addr add $address/24 dev $IFACE; ip link set $IFACE up" ||
        die "could not give $ns its address $address"
}

in_node() {  # in_node NAME COMMAND...: start COMMAND in NAME's network, with its hostname and /etc/hosts
    local name=$1
    shift
    # unshare makes a UTS and a mount namespace (private propagation: the bind mount stays
    # inside) that last as long as COMMAND or what it starts (the daemon it forks) runs.
    nsenter --net="/run/netns/$NS_PREFIX$name" unshare --uts --mount -- \
        sh -euc 'hostname "$1"; mount --bind "$2" /etc/hosts; shift 2; exec "$@"' sh "$name" "$CLUSTER_DIR/hosts" "$@"
}

make_network() {  # the bridge, a namespace per host, the hosts file they all share
    mountpoint -q /run/netns 2>/dev/null || touch "$CLUSTER_DIR/netns-mount-made"
    : >"$CLUSTER_DIR/namespaces"
    ip link add "$BRIDGE" type bridge || die "could not make the bridge $BRIDGE"
    ip link set "$BRIDGE" up
    {
        echo "127.0.0.1 localhost"
        echo "$SUBNET.1 controller"
    } >"$CLUSTER_DIR/hosts"
    make_namespace controller "$SUBNET.1"
    local k=0 node
    while read -r node; do
        k=$((k + 1))
        make_namespace "$node" "$SUBNET.$((10 + k))"
        echo "$SUBNET.$((10 + k)) $node" >>"$CLUSTER_DIR/hosts"
    done < <(node_names)
}

wait_idle() {
    local states=""
    for _ in $(seq 150); do
        states=$(client sinfo -h -N -o %T 2>/dev/null | sort | uniq -c | xargs) || true
        [[ "$states" == "$NODES idle" ]] && return 0
        sleep 0.2
    done
    echo "node states: ${states:-unknown}; last lines of the logs:" >&2
    tail -n 5 "$CLUSTER_STATE_DIR"/slurm*.log >&2 || true
    return 1
}

up() {
    [[ $(id -u) -eq 0 ]] || die "needs root (it installs packages and starts daemons)"
    [[ -f "$CLUSTER_DIR/slurmctld.pid" ]] && die "already up ($CLUSTER_DIR/slurmctld.pid exists; run '$0 down$( ((NODES > 1)) && echo " --nodes $NODES")' first)"
    if namespaced; then
        check_namespace_rights
    else
        local running
        running=$(pgrep -x slurmctld; pgrep -x slurmd) || true
        [[ -z "$running" ]] || die "SLURM daemons are already running here (pids $(echo $running)); not starting a second cluster"
    fi
    mkdir -p "$CLUSTER_DIR" "$CLUSTER_STATE_DIR/ctld"
    chmod 0755 "$CLUSTER_DIR"
    command -v slurmctld >/dev/null && command -v munged >/dev/null && { ! namespaced || command -v ip >/dev/null; } ||
        install_packages
    trap 'echo "local_cluster.sh: start-up failed; removing what was made" >&2; down >&2' EXIT
    write_config
    if ! namespaced; then
        mkdir -p "$CLUSTER_STATE_DIR/slurmd"
        start_munge
        # -c: start with no jobs (none of an earlier run); both daemonize and write pid files
        slurmctld -f "$CONF" -c || die "slurmctld did not start (see $CLUSTER_STATE_DIR/slurmctld.log)"
        slurmd -f "$CONF" || die "slurmd did not start (see $CLUSTER_STATE_DIR/slurmd.log)"
        wait_idle || die "the node did not become idle"
        trap - EXIT
        echo "SLURM is up: node $(hostname -s), $CPUS CPUs, $GPUS GPUs. Use it with:"
        echo "export SLURM_CONF=$CONF"
        return
    fi
    install -d -m 0755 "$BIN"
    # Copies under other names: `pgrep -x slurmd` (the one-node cluster's check) does not see them.
    cp "$(command -v munged)" "$BIN/bitpipe-munged"
    cp "$(readlink -f "$(command -v slurmctld)")" "$BIN/bitpipe-slurmctld"
    cp "$(readlink -f "$(command -v slurmd)")" "$BIN/bitpipe-slurmd"
    make_network
    start_private_munge
    # -c: start with no jobs (none of an earlier run); the daemons fork and write their pid files.
    in_node controller "$BIN/bitpipe-slurmctld" -f "$CONF" -c || die "slurmctld did not start (see $CLUSTER_STATE_DIR/slurmctld.log)"
    local node
    while read -r node; do
        mkdir -p "$CLUSTER_STATE_DIR/slurmd-$node"
        in_node "$node" "$BIN/bitpipe-slurmd" -f "$CONF" -N "$node" || die "slurmd of $node did not start (see $CLUSTER_STATE_DIR/slurmd-$node.log)"
    done < <(node_names)
    wait_idle || die "the nodes did not become idle"
    trap - EXIT
    echo "SLURM is up: $NODES nodes ($(node_names | paste -sd' ' -)), $CPUS CPUs and $GPUS GPUs each, in network namespaces."
    echo "SLURM's commands reach it from the controller's network namespace: nsenter --net=$CONTROLLER_NS sbatch|srun|squeue|scontrol ..."
    echo "export SLURM_CONF=$CONF"
}

command=${1:-}
[[ $# -gt 0 ]] && shift
case $command in
    up) parse_args "$@"; up ;;
    down) parse_args "$@"; down ;;
    status) parse_args "$@"; client sinfo -N -l ;;
    *) usage ;;
esac
