#!/usr/bin/env bash
# Stop the Slurm cluster that scripts/slurm_up.sh started: slurmd, slurmctld and (if it started one) munged, each by
# the PID it recorded under DIR (default $COLLSYNC_SLURM_DIR or /tmp/collsync-slurm). Leaves DIR's logs in place.
# Safe to run when nothing is running.
set -uo pipefail
DIR=${1:-${COLLSYNC_SLURM_DIR:-/tmp/collsync-slurm}}
[ -d "$DIR" ] || exit 0
# slurmd-<host>.pid: the slurmd of each host of a multi-node cluster (scripts/slurm_up.sh, COLLSYNC_SLURM_HOSTS).
for file in "$DIR"/slurmd.pid "$DIR"/slurmd-*.pid "$DIR"/slurmctld.pid "$DIR"/munged.pid; do
    [ -f "$file" ] || continue
    name=$(basename "$file" .pid)
    name=${name%%-*}
    pid=$(cat "$file")
    # Only a process that is still this daemon: a recycled PID must not be killed.
    if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ]; then
        kill "$pid"
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
        echo "slurm_down: stopped $name (pid $pid)"
    fi
    rm -f "$file"
done
