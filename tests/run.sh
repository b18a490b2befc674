#!/usr/bin/env bash
# The whole test suite: unit, simulator and CLI tests under pytest, then the MPI tests under the venv's own
# mpiexec at 1 and at 4 ranks. Sets up .venv first (scripts/setup.sh is idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
MPIEXEC=.venv/bin/mpiexec
export PYTHONHASHSEED=0 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1

echo "== unit, simulator and CLI tests"
"$PY" -m pytest tests/unit tests/sim tests/integration -q

for n in 1 4; do
    echo "== MPI tests at -n $n ($MPIEXEC)"
    # python -m mpi4py: an exception on one rank aborts the world instead of hanging it.
    "$MPIEXEC" -n "$n" "$PY" -m mpi4py -m pytest tests/mpi -q
done
