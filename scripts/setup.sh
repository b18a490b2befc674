#!/usr/bin/env bash
# Set up (or update) the project's virtual environment in .venv: collsync in editable mode, the CPU build of torch
# pinned by constraints.txt, MPI from PyPI (the mpich wheel: mpiexec lands in .venv/bin), the test tools (pytest,
# hypothesis for the config fuzzing, ruff), and Hydra's submitit launcher (the `slurm` extra: Slurm sweeps,
# tests/slurm; a few seconds).
# Idempotent: a second run only checks what is installed. Pass extra pip arguments after the script name.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    echo "collsync setup: creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
echo "collsync setup: installing collsync[mpich,dev,slurm] (torch pinned by constraints.txt)"
# setuptools prints a boxed note on every editable install (that a folder named like the package in the working
# directory could shadow it: here the package is that folder); it says nothing about this install, so it is muted.
PYTHONWARNINGS="ignore:Editable installation" \
    .venv/bin/python -m pip install -q -c constraints.txt -e ".[mpich,dev,slurm]" "$@"
.venv/bin/python -c "import torch, mpi4py, hypothesis, collsync; print(f'collsync setup: ok (torch {torch.__version__}, mpi4py {mpi4py.__version__})')"
