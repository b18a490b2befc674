#!/usr/bin/env bash
# Install Debian's Slurm daemons and munge where any is missing (what scripts/slurm_up.sh starts), quietly.
#
#   bash scripts/slurm_install.sh [LOG]   # apt-get's output goes to LOG (default: a temporary file)
#
# Needs root and apt-get. Idempotent: where slurmctld, slurmd, sbatch and munged are all there it does nothing.
# On failure it prints one line and exits 1. tests/run.sh runs it in the background while Horovod compiles (the
# downloads then cost no wall time); scripts/slurm_up.sh runs it again, which then finds everything installed.
set -euo pipefail
LOG=${1:-$(mktemp -t collsync-slurm-apt.XXXXXX)}
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null; then
    exit 0
fi
[ "$(id -u)" = 0 ] || { echo "needs root to install the Slurm daemons (uid is $(id -u))"; exit 1; }
command -v apt-get >/dev/null || { echo "Slurm is not installed and there is no apt-get to install it"; exit 1; }
packages=(slurmctld slurmd slurm-client munge)
export DEBIAN_FRONTEND=noninteractive
# A fresh machine may have no package lists yet: update only when the install without them fails.
apt-get install -y -q --no-install-recommends "${packages[@]}" >"$LOG" 2>&1 \
    || { apt-get update -q >>"$LOG" 2>&1 \
        && apt-get install -y -q --no-install-recommends "${packages[@]}" >>"$LOG" 2>&1; } \
    || { echo "apt-get install ${packages[*]} failed (see $LOG)"; exit 1; }
[ $# -gt 0 ] || rm -f "$LOG"  # the temporary one, once nothing in it is needed
