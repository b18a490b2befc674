#!/usr/bin/env bash
# Make the cluster in one box (network namespaces node0..nodeN-1 on one bridge; scripts/cluster.py says how):
#   bash scripts/cluster_up.sh [--hosts 3] [--link none|10gbe|1gbe|slow-host|lossy|SPEC]
# Needs root; where it cannot make the hosts it prints why, writes it to $COLLSYNC_CLUSTER_DIR/unavailable (default
# /tmp/collsync-cluster) and exits 1. Idempotent. Undo with scripts/cluster_down.sh.
set -euo pipefail
exec python3 "$(dirname "$0")/cluster.py" up "$@"
