#!/usr/bin/env bash
# Remove the cluster in one box: end the processes in its namespaces, remove the namespaces, links and files that
# scripts/cluster_up.sh made. Safe to run when nothing is up.
set -euo pipefail
exec python3 "$(dirname "$0")/cluster.py" down
