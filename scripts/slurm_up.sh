#!/usr/bin/env bash
# Start a single-node Slurm cluster on this machine for tests/slurm (and for trying slurm/*.sbatch by hand).
#
#   bash scripts/slurm_up.sh [DIR]     # DIR: scratch folder, default $COLLSYNC_SLURM_DIR or /tmp/collsync-slurm
#   source DIR/env.sh                  # SLURM_CONF and the `sacct` stand-in on PATH, for sbatch / srun / submitit
#   bash scripts/slurm_down.sh [DIR]   # stops what this script started, by PID
#
# Needs root and apt-get (installs Debian's slurmctld, slurmd, slurm-client and munge when missing, quietly). Runs
# munged, slurmctld and slurmd in the background without systemd or cgroups, writes slurm.conf, logs, state and
# PIDs under DIR, and waits (at most COLLSYNC_SLURM_WAIT_S, default 60 s) until `sinfo` shows the node idle.
# Idempotent: when DIR's cluster already answers, it only says so. On failure it prints one line, writes the same
# line to DIR/unavailable (tests/slurm skip with it as the reason) and exits 1.
#
# Several nodes: with COLLSYNC_SLURM_HOSTS="node0 node1 node2" (hosts of the cluster in one box that
# scripts/cluster_up.sh made; use another DIR, e.g. /tmp/collsync-slurm-multi), slurmctld runs on the first host and
# one slurmd on each host, inside its namespace and under its name, each node given all of this machine's CPUs (the
# nodes share them: a job asking more tasks than the real CPUs needs --overcommit). Slurm commands then run on a
# host: DIR/bin/on-head sbatch -N 2 ... (it sets SLURM_CONF and enters the first host's namespace).
#
# The cluster: one node named after this host with all its CPUs, one partition, no accounting. Finished jobs stay
# visible to `squeue -t all` and `scontrol show job` for a day (MinJobAge), which the `sacct` stand-in reads:
# submitit asks `sacct` for job states and would poll for ever on a cluster without accounting. MpiDefault=none as
# on most clusters, so the scripts must ask for `--mpi=pmi2` themselves (the mpich wheel speaks PMI-2).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-${COLLSYNC_SLURM_DIR:-/tmp/collsync-slurm}}
WAIT_S=${COLLSYNC_SLURM_WAIT_S:-60}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
rm -f "$DIR/unavailable"

fail() {
    echo "slurm_up: $*" | tee "$DIR/unavailable" >&2
    exit 1
}

# The node answers idle (asked only while our slurmctld runs: sinfo waits 10 s for a controller that is not there).
HOSTS=${COLLSYNC_SLURM_HOSTS:-}
HEAD=${HOSTS%% *}
# A command where the controller is reachable: this host, or the first host of the cluster in one box.
at_head() {
    if [ -n "$HEAD" ]; then ip netns exec "$HEAD" "$@"; else "$@"; fi
}
# Every node answers idle.
up() {
    local pid states
    pid=$(cat "$DIR/slurmctld.pid" 2>/dev/null) || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = slurmctld ] || return 1
    states=$(SLURM_CONF="$DIR/slurm.conf" at_head timeout 10 sinfo -h -N -o '%T' 2>/dev/null | sort -u)
    [ "$states" = idle ]
}

if up; then
    echo "slurm_up: already running ($DIR)"
    exit 0
fi

[ "$(id -u)" = 0 ] || fail "needs root to install and run the Slurm daemons (uid is $(id -u))"
# Installs the daemons where missing (tests/run.sh may have done so already, in the background).
said=$(bash scripts/slurm_install.sh "$DIR/apt.log") || fail "$said"

host=${HEAD:-$(hostname -s)}
for h in $HOSTS; do
    [ -f "/etc/netns/$h/hosts" ] || fail "no host $h in the cluster in one box (bash scripts/cluster_up.sh first)"
done
# nproc alone would count OMP_NUM_THREADS (tests/run.sh exports 1), not the CPUs this process may use.
cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
# A fresh cluster every time: no jobs or node states left from an earlier one.
rm -rf "$DIR/state" "$DIR/spool"
mkdir -p "$DIR/state" "$DIR/spool" "$DIR/bin"
for h in ${HOSTS:-$host}; do mkdir -p "$DIR/spool/$h"; done
# A host's address in the cluster in one box (the daemons do not see its /etc/netns names: see start below).
address() {
    awk -v h="$1" '$2 == h {print $1}' "/etc/netns/$1/hosts"
}
# The NodeName and PartitionName lines: this host, or every host of the cluster in one box at its address.
nodes() {
    local h addr list=""
    for h in ${HOSTS:-$host}; do
        addr=""
        [ -z "$HOSTS" ] || addr=" NodeAddr=$(address "$h")"
        echo "NodeName=$h$addr CPUs=$cpus State=UNKNOWN"
        list=${list:+$list,}$h
    done
    echo "PartitionName=debug Nodes=$list Default=YES MaxTime=INFINITE State=UP"
}
cat >"$DIR/slurm.conf" <<EOF
# Written by scripts/slurm_up.sh: a single-node cluster for tests (no systemd, no cgroups, no accounting).
ClusterName=collsync
SlurmctldHost=$host$([ -z "$HEAD" ] || echo "($(address "$HEAD"))")
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
SlurmctldPort=${COLLSYNC_SLURMCTLD_PORT:-6817}
SlurmdPort=${COLLSYNC_SLURMD_PORT:-6818}
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/state/slurmctld.pid
SlurmdPidFile=$DIR/spool/%n/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
MinJobAge=86400
# Job ids that do not repeat those of an earlier cluster in this folder: MPICH names its shared-memory segments
# after the PMI job id, and one left in /dev/shm by an aborted run would make a new job of that id fail to start.
FirstJobId=$(( $(date +%s) % 1000000 * 10 + 1000 ))
SchedulerParameters=sched_interval=1
# A failed MPI step is killed (SIGKILL) this many seconds after SIGTERM; the default 30 s slows every failing test.
KillWait=5
$(nodes)
EOF

# submitit's job watcher runs `sacct -o JobID,State,NodeList --parsable2 -j ID ...`; without accounting this stand-in
# answers the same columns from the controller's memory of recent jobs.
cat >"$DIR/bin/sacct" <<'EOF'
#!/usr/bin/env bash
# A `sacct` stand-in for a cluster without accounting: JobID|State|NodeList of the jobs the controller still knows.
echo "JobID|State|NodeList"
squeue -t all -h -o '%i|%T|%N'
EOF
chmod +x "$DIR/bin/sacct"
cat >"$DIR/env.sh" <<EOF
export SLURM_CONF=$DIR/slurm.conf
export PATH=$DIR/bin:\$PATH
EOF
UCX_LINE=""
[ -z "${HEAD:-}" ] || UCX_LINE='export UCX_TLS=${UCX_TLS:-tcp,self}'
cat >"$DIR/bin/on-head" <<EOF
#!/bin/sh
# Run a Slurm command (sbatch, srun, squeue, ...) where this cluster's controller answers.
export SLURM_CONF=$DIR/slurm.conf PATH=$DIR/bin:\$PATH
# Jobs inherit this: the MPICH wheel's UCX would otherwise carry messages between hosts (namespaces of one kernel)
# through shared memory, past the links (scripts/cluster.py's mpiexec sets the same).
$UCX_LINE
exec ${HEAD:+ip netns exec $HEAD} "\$@"
EOF
chmod +x "$DIR/bin/on-head"

# munged refuses to run as root; reuse one that already answers (the system's), else start ours.
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    [ -f /etc/munge/munge.key ] || { mungekey --create --keyfile=/etc/munge/munge.key && chown munge:munge /etc/munge/munge.key; }
    runuser -u munge -- munged || fail "munged did not start"
    cp /run/munge/munged.pid "$DIR/munged.pid"
fi

export SLURM_CONF="$DIR/slurm.conf"
# start HOST NAME COMMAND...: a daemon in the background, its PID in DIR/NAME.pid. -D keeps each in the foreground
# of its background job, so the PID recorded is the daemon's own; on a host of the cluster in one box it runs in the
# host's network namespace under the host's name (nsenter, unshare and sh each exec the next). nsenter, not
# `ip netns exec`: that one remounts /sys, without the cgroup mounts slurmd needs to start.
start() {
    local h=$1 name=$2
    shift 2
    if [ -n "$HOSTS" ]; then
        set -- nsenter --net="/run/netns/$h" unshare -u sh -c 'hostname "$0"; exec "$@"' "$h" "$@"
    fi
    setsid "$@" >>"$DIR/$name.out" 2>&1 </dev/null &
    echo $! >"$DIR/$name.pid"
}
start "$host" slurmctld slurmctld -D -i -f "$SLURM_CONF"
if [ -n "$HOSTS" ]; then
    for h in $HOSTS; do start "$h" "slurmd-$h" slurmd -D -N "$h" -f "$SLURM_CONF"; done
else
    start "$host" slurmd slurmd -D -f "$SLURM_CONF"
fi

deadline=$((SECONDS + WAIT_S))
until up; do
    if [ "$SECONDS" -ge "$deadline" ]; then
        state=$(at_head sinfo -h -o '%T' 2>/dev/null | head -1)
        bash scripts/slurm_down.sh "$DIR" >/dev/null 2>&1 || true
        fail "the node was not idle within ${WAIT_S} s (sinfo: ${state:-no answer}; see $DIR/slurmctld.log)"
    fi
    sleep 0.2
done
echo "slurm_up: ${HOSTS:-$host} idle with $cpus CPUs each in $SECONDS s (SLURM_CONF=$DIR/slurm.conf)"
