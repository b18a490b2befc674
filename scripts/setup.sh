#!/usr/bin/env bash
# Set up (or update) the project's virtual environment in .venv: collsync in editable mode, the CPU build of torch
# pinned by constraints.txt, MPI from PyPI (the mpich wheel: mpiexec lands in .venv/bin), the test tools (pytest,
# hypothesis for the config fuzzing, ruff), and Hydra's submitit launcher (the `slurm` extra: Slurm sweeps,
# tests/slurm; a few seconds), and Fashion-MNIST (data=fashion_mnist, examples/mnist.py --data fashion): Debian's
# package dataset-fashion-mnist where apt-get is here and this is root, else one line saying how to get it.
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

# Fashion-MNIST: nothing to do where its four files are there already (a second run costs a few stat calls).
FASHION=/usr/share/datasets/fashion-mnist
fashion_installed() {
    local stem
    for stem in train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte; do
        [ -s "$FASHION/$stem.gz" ] || return 1
    done
}
if ! fashion_installed; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "collsync setup: installing Debian's dataset-fashion-mnist (Fashion-MNIST in $FASHION, 31 MB)"
        LOG=$(mktemp -t collsync-apt.XXXXXX)
        # The package lists are read first as they are, and refreshed only if that install fails (a fresh
        # container's lists are empty).
        if DEBIAN_FRONTEND=noninteractive apt-get install -y -q dataset-fashion-mnist >"$LOG" 2>&1 \
            || { apt-get update -q >>"$LOG" 2>&1 \
                && DEBIAN_FRONTEND=noninteractive apt-get install -y -q dataset-fashion-mnist >>"$LOG" 2>&1; }; then
            rm -f "$LOG"
        else
            echo "collsync setup: apt-get install dataset-fashion-mnist failed (see $LOG); data=fashion_mnist needs it"
        fi
    else
        echo "collsync setup: Fashion-MNIST is not installed: as root, apt-get install dataset-fashion-mnist (a" \
            "Debian package), or give data=fashion_mnist a folder with its four IDX files as data.path=DIR"
    fi
fi
